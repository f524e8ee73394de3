"""DataLoaders over a batch plan, and the endless stream of training micro-batches."""

from __future__ import annotations

import signal
import threading
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset

from zerotrain.data.sampling import EpochBatches


def make_loader(dataset: Dataset, batch_sampler: Iterable[list[int]], collate: Callable[[list[Any]], Any],
                workers: int, seed: int) -> DataLoader:
    return _StopSignalSafeLoader(
        dataset, batch_sampler=batch_sampler, collate_fn=collate, num_workers=workers,
        pin_memory=torch.cuda.is_available(), persistent_workers=False,
        # A private generator: worker seeds must not draw from the global RNG that resume restores.
        generator=torch.Generator().manual_seed(seed),
        worker_init_fn=_ignore_stop_signals if workers > 0 else None,
    )


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def _ignore_stop_signals(worker_id: int) -> None:
    """A loader worker leaves stop signals to the training process (zerotrain.preemption).

    SLURM and torchrun signal the whole process group: a worker killed by that SIGTERM makes the
    training process raise "DataLoader worker ... is killed by signal" in the middle of its
    pre-emption checkpoint. The worker ends with its parent anyway (PyTorch's worker watchdog).
    It starts with these signals blocked (:class:`_StopSignalSafeLoader`), so one sent before this
    runs waits, and is then dropped.
    """
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


class _StopSignalSafeLoader(DataLoader):
    """A DataLoader whose worker processes start with the stop signals blocked: a SIGTERM to the
    process group in the moment between a worker's fork and its :func:`_ignore_stop_signals` would
    otherwise kill it (seen on a loaded 2-core machine). The training process gets its own copy of
    the signal as soon as the workers are started."""

    def __iter__(self) -> Iterator[Any]:
        if self.num_workers == 0 or threading.current_thread() is not threading.main_thread():
            return super().__iter__()
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            return super().__iter__()  # starts the workers
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def micro_batch_stream(loader: DataLoader, sampler: EpochBatches, epoch: int,
                       skip: int) -> Iterator[tuple[int, int, Any]]:
    """Micro-batches forever from (epoch, skip), as (epoch, batches consumed in it with this one, batch).

    A position at the very end of an epoch is reported as (next epoch, 0), so a checkpoint taken
    there resumes at the start of the next epoch.
    """
    while True:
        sampler.set_epoch(epoch, skip)
        if hasattr(loader.dataset, "set_epoch"):  # a dataset that draws per epoch (MLM's masks)
            loader.dataset.set_epoch(epoch)
        for i, batch in enumerate(loader, start=skip + 1):
            if i == sampler.batches_per_epoch:
                yield epoch + 1, 0, batch
            else:
                yield epoch, i, batch
        epoch, skip = epoch + 1, 0
