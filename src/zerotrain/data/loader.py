"""DataLoaders over a batch plan, and the endless stream of training micro-batches."""

from __future__ import annotations

import signal
import threading
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset

from zerotrain.data.sampling import EpochBatches
from zerotrain.data.streaming import Drawn


def make_loader(dataset: Dataset, batch_sampler: Iterable[list[int]], collate: Callable[[list[Any]], Any],
                workers: int, seed: int, persistent: bool = False) -> "_StopSignalSafeLoader":
    """``persistent``: the worker processes live as long as the loader, not one pass over it. The training
    stream sets it: each new pass would fork them again, 80-190 ms of the main thread with a trainer's
    memory mapped (measured on a CPU), which every rank then waits for. On 4 GPUs, where BERT-base's
    Gutenberg set turns an epoch every 74 steps, it was a 5% data wait (1 and 2 GPUs: 0.5%). A dataset
    with ``set_epoch`` reaches such workers through :class:`EpochSynced`."""
    persistent = persistent and workers > 0
    if persistent and hasattr(dataset, "set_epoch"):
        dataset = EpochSynced(dataset)
    return _StopSignalSafeLoader(
        dataset, batch_sampler=batch_sampler, collate_fn=collate, num_workers=workers,
        pin_memory=torch.cuda.is_available(), persistent_workers=persistent,
        # A private generator: worker seeds must not draw from the global RNG that resume restores.
        generator=torch.Generator().manual_seed(seed),
        worker_init_fn=_ignore_stop_signals if workers > 0 else None,
    )


class EpochSynced(Dataset):
    """A dataset whose ``set_epoch`` reaches persistent loader workers (MLM's masks are drawn per epoch).

    Each worker reads its own copy of the dataset, made when it started. The epoch travels in a
    shared-memory tensor, and a worker hands a new one to its copy's ``set_epoch`` before the next read.
    A pass's indices go out only from its ``iter()`` on, after :func:`micro_batch_stream` set the epoch;
    what a worker still reads of an earlier pass then (the batches of ``start_workers``) is dropped.
    """

    def __init__(self, dataset: Dataset):
        self.dataset = dataset
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()
        self._applied: int | None = None  # the epoch this process's copy was last given

    def set_epoch(self, epoch: int) -> None:
        self._epoch.fill_(epoch)
        self._sync(epoch)

    def _sync(self, epoch: int) -> None:
        if epoch != self._applied:
            self.dataset.set_epoch(epoch)  # type: ignore[attr-defined]
            self._applied = epoch

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        self._sync(int(self._epoch))
        return self.dataset[index]


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def _ignore_stop_signals(worker_id: int) -> None:
    """A loader worker leaves stop signals to the training process (zerotrain.runtime.preemption).

    SLURM and torchrun signal the whole process group: a worker killed by that SIGTERM makes the
    training process raise "DataLoader worker ... is killed by signal" in the middle of its
    pre-emption checkpoint. The worker ends with its parent anyway (PyTorch's worker watchdog).
    It starts with these signals blocked (:class:`_StopSignalSafeLoader`), so one sent before this
    runs waits, and is then dropped.
    """
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def _keeping_cpu_threads(batches: Iterator[Any], threads: int) -> Iterator[Any]:
    """``batches``, with PyTorch's CPU thread count set back to ``threads`` once the first has arrived.

    A loader that pins memory with worker processes starts a thread whose first act is
    ``torch.set_num_threads(1)``, before it hands over any batch. PyTorch keeps that number process-wide, as
    the count of every thread that has not yet run a parallel host op: a training thread whose first such op
    came later, autograd's threads, any thread started later. DeepSpeed's CPU Adam, stepped by the training
    thread under optimizer offload, would then run on one core. ``threads`` is the training thread's count,
    read before the pin thread started."""
    for batch in batches:
        torch.set_num_threads(threads)
        yield batch
        break
    yield from batches


class _StopSignalSafeLoader(DataLoader):
    """A DataLoader whose worker processes start with the stop signals blocked: a SIGTERM to the
    process group in the moment between a worker's fork and its :func:`_ignore_stop_signals` would
    otherwise kill it (seen on a loaded 2-core machine). The training process gets its own copy of
    the signal as soon as the workers are started."""

    def __iter__(self) -> Iterator[Any]:
        if not (self.pin_memory and self.num_workers > 0):
            return self._start()
        threads = torch.get_num_threads()  # before the pin-memory thread starts
        return _keeping_cpu_threads(self._start(), threads)

    def _start(self) -> Iterator[Any]:
        if self.num_workers == 0 or threading.current_thread() is not threading.main_thread():
            return super().__iter__()
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            return super().__iter__()  # starts the workers
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)

    def start_workers(self) -> None:
        """Forks persistent workers now, while this process is small. Forked after the engine, a worker would
        share every host page the engine allocated until then, and each page the training process writes later
        (a CPU-offloaded optimizer rewrites its master weights and gradients each step) is copied on write: a
        5.5B model's ZeRO-2 offload, unpinned, outgrew a 125 GiB host that way (measured on one H100). The
        few batches the workers load meanwhile are dropped when the first pass starts (``DataLoader`` resets
        persistent workers and drains what they had queued); a dataset that draws from a worker's global RNG
        has drawn for them too."""
        if self.persistent_workers and self._iterator is None:
            iter(self)

    def close(self) -> None:
        """Ends persistent workers now, not whenever the loader is collected: ``fit`` may run again in this
        process. The loader keeps their iterator, whose deletion shuts them down (DataLoader has no public call)."""
        self._iterator = None


def micro_batch_stream(loader: DataLoader, sampler: EpochBatches, epoch: int,
                       skip: int) -> Iterator[Drawn]:
    """Micro-batches forever from (epoch, skip), as :class:`Drawn` (epoch, batches consumed in it with this one,
    batch).

    A position at the very end of an epoch is reported as (next epoch, 0), so a checkpoint taken
    there resumes at the start of the next epoch.
    """
    while True:
        sampler.set_epoch(epoch, skip)
        if hasattr(loader.dataset, "set_epoch"):  # a dataset that draws per epoch (MLM's masks)
            loader.dataset.set_epoch(epoch)
        for i, batch in enumerate(loader, start=skip + 1):
            if i == sampler.batches_per_epoch:
                yield Drawn(epoch + 1, 0, batch)
            else:
                yield Drawn(epoch, i, batch)
        epoch, skip = epoch + 1, 0
