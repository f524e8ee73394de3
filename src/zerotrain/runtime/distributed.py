"""This process's place in the job: the process group, its device and precision, and every collective.

:func:`setup` joins the job for the length of a ``with`` block and leaves the process as it found
it; the collectives the loop needs (sums, maxima, objects from rank 0) and the helpers that make an
error on one rank end every rank the same way (:func:`main_process_first`, :func:`run_on_main`) are
here too. How the processes are started, and what the launcher reports when one fails, is
:mod:`zerotrain.runtime.launcher`.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import logging
import os
import socket
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

from zerotrain.config import RunConfig
from zerotrain.config.ds_config import ResolvedPrecision, resolve_precision
from zerotrain.engines.ds_private.groups import destroy_process_groups, groups_time_out_after
from zerotrain.errors import UserError
from zerotrain.metrics.tracking import setup_logging
from zerotrain.runtime.doctor import prepare_ops
from zerotrain.runtime.launcher import (
    adopt_slurm_env,
    forget_progress,
    sanitize_cuda_arch_list,
)
from zerotrain.runtime.preemption import Preemption

log = logging.getLogger("zerotrain")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def comm_backend(requested: str, device: str) -> str:
    if requested == "auto":
        return "nccl" if device == "cuda" else "gloo"
    if requested == "nccl" and device != "cuda":
        raise UserError("--launch.comm_backend nccl needs GPUs; on CPU use gloo (or auto)")
    if requested == "mpi" and not torch.distributed.is_mpi_available():
        raise UserError("--launch.comm_backend mpi: this PyTorch build has no MPI support; use auto")
    return requested


def init_process_group(backend: str, use_deepspeed: bool, device: str = "cpu", timeout_minutes: float = 60) -> None:
    """Initialise torch.distributed for this process (a group of one when started alone)."""
    if "RANK" not in os.environ:
        # A single process still gets a process group, so the engine code has one path.
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if not torch.distributed.is_initialized():
        if use_deepspeed:
            # DeepSpeed picks its accelerator by itself (cuda when one is visible); a CPU run must say so
            # before deepspeed is imported, or the engine moves the model to the GPU behind our back.
            if backend == "gloo" and device == "cpu":
                os.environ.setdefault("DS_ACCELERATOR", "cpu")
            import deepspeed


            if device == "cpu":
                prepare_ops(["ShareMemCommBuilder"])
            # On CPU it builds its shared-memory op and prints "... built successfully" on stdout, which is
            # where a user reads the run's own output (the run directory line).
            with contextlib.redirect_stdout(io.StringIO()):
                deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=backend == "mpi", verbose=False,
                                           timeout=timeout)
        else:
            torch.distributed.init_process_group(backend=backend, timeout=timeout)


@dataclass(frozen=True)
class Runtime:
    """Where this process trains: its place in the job, its device and the precision it computes in."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    precision: ResolvedPrecision
    preemption: Any = None
    """The :class:`~zerotrain.runtime.preemption.Preemption` whose handlers setup() installed for the block."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


class RendezvousUnreachable(UserError):
    """This rank cannot reach the rendezvous: each rank that meets it says so (the others may never have started)."""

    said_by_each_rank = True


def wait_for_rendezvous(timeout_minutes: float) -> None:
    """Before the process group: make sure rank 0's rendezvous at MASTER_ADDR:MASTER_PORT can be reached, waiting
    for it at most ``timeout_minutes`` (``--launch.rdzv_timeout_minutes``), in one line when it cannot.

    torch's store retries its connection inside C++ for the whole collective timeout (an hour by default), where no
    Python signal handler runs: a wrong MASTER_ADDR hung for that long and ignored SIGTERM. Here rank 0 checks that
    the address is one of this machine's (it serves the store there), and the other ranks try to connect once a
    second in Python, so a stop signal ends the wait at once, as it would without zerotrain."""
    import time

    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    if not addr or not port.isdigit():
        return  # torch's own message names what is missing
    rank = os.environ.get("RANK", "0")
    where = f"MASTER_ADDR:MASTER_PORT {addr}:{port}"
    try:
        infos = socket.getaddrinfo(addr, int(port), type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError, ValueError):
        raise RendezvousUnreachable(f"rank {rank}: {where}: {addr!r} is not a host name or address this machine can resolve. Set "
                        "MASTER_ADDR (or --launch.rdzv_endpoint) to the address of the node of rank 0") from None
    if rank == "0":
        for family, kind, proto, _, sockaddr in infos:
            with socket.socket(family, kind, proto) as probe:
                try:
                    probe.bind((sockaddr[0], 0))
                    return
                except OSError:
                    continue
        raise RendezvousUnreachable(f"rank 0: {where}: {addr} is not an address of this machine, and rank 0 serves the "
                        "rendezvous there. Set MASTER_ADDR (or --launch.rdzv_endpoint) to this node's address")
    deadline, said = time.monotonic() + timeout_minutes * 60, False
    while True:
        try:
            socket.create_connection((addr, int(port)), timeout=2).close()
            return
        except OSError:
            pass
        if time.monotonic() >= deadline:
            raise RendezvousUnreachable(f"rank {rank}: nothing answers at {where} after {timeout_minutes:g} minutes "
                            "(--launch.rdzv_timeout_minutes): start rank 0, or set MASTER_ADDR (or "
                            "--launch.rdzv_endpoint) to the address of its node")
        if not said:
            log.warning("rank %s: waiting up to %g minutes for rank 0's rendezvous at %s", rank, timeout_minutes, where)
            said = True
        time.sleep(1)


@contextlib.contextmanager
def setup(cfg: RunConfig) -> Iterator[Runtime]:
    """Join the job for the length of a ``with`` block, and leave the process as it was found.

    Inside: the launcher's variables adopted (SLURM mapped onto torchrun's), a process group (a group
    of one when started alone, so the engines have one code path), this rank's device, the resolved
    precision and the backend flags it needs, and rank-aware logging. On exit, however the block
    ends: the process group this call created is destroyed after a last barrier, and the environment,
    the TF32 flags and the logging handlers are restored.
    """
    before = dict(os.environ)
    saved_matmul_precision = torch.get_float32_matmul_precision()
    owns_group = not torch.distributed.is_initialized()
    restore_logging = None
    undo_group_timeout = None
    finished = False
    quiet = warnings.catch_warnings()  # restores the warning filters on exit
    quiet.__enter__()
    # DeepSpeed 0.19 calls collectives that torch deprecates, once per call site: noise for a user,
    # and nothing a user could change.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)

    preemption = Preemption()
    forget_progress()  # an earlier fit in this process does not speak for this one
    saved_death_signal = _die_with_launcher()
    try:
        # Before the first collective: a SIGTERM during the rendezvous is the same request as later.
        preemption.install()
        sanitize_cuda_arch_list()
        adopt_slurm_env(cfg.launch)
        device_type = _device_type(cfg.trainer.device)
        backend = comm_backend(cfg.launch.comm_backend, device_type)
        # Before the process group: a first run builds DeepSpeed's CPU communication op there, and says so.
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else int(os.environ.get("RANK", 0))
        restore_logging = setup_logging(rank == 0)
        if "RANK" in os.environ and not torch.distributed.is_initialized():
            wait_for_rendezvous(cfg.launch.rdzv_timeout_minutes)
        try:
            init_process_group(backend, use_deepspeed=cfg.strategy.backend == "deepspeed", device=device_type,
                               timeout_minutes=cfg.launch.timeout_minutes)
        except torch.distributed.DistStoreError as exc:
            raise _ranks_missing(exc, before, cfg.launch.timeout_minutes) from None
        if cfg.strategy.backend == "deepspeed":
            undo_group_timeout = groups_time_out_after(cfg.launch.timeout_minutes)
        rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cpu")
        if device_type == "cuda":
            torch.cuda.set_device(local_rank)
            device = torch.device("cuda", local_rank)
            cap_gpu_memory(device, cfg.trainer.gpu_memory_gib)
        precision = resolve_precision(cfg.precision.dtype, device.type,
                                      device.type == "cuda" and torch.cuda.is_bf16_supported())
        if device.type == "cuda" and precision == "fp32":
            # fp32 matmuls on tensor cores (TF32), as MFU's fp32 peak assumes; IEEE fp32 runs ~7x slower on Hopper.
            # (cuDNN's convolutions use TF32 by default already.)
            torch.set_float32_matmul_precision("high")
        yield Runtime(rank, world_size, local_rank, device, precision, preemption)
        finished = True
    finally:
        preemption.restore()
        _set_death_signal(saved_death_signal)
        if owns_group and torch.distributed.is_initialized():
            if finished and torch.distributed.get_world_size() > 1:
                torch.distributed.barrier()  # nobody tears down while another rank still talks
            destroy_process_groups()  # DeepSpeed's cached groups too: a later fit here makes its own
        if undo_group_timeout is not None:
            undo_group_timeout()
        torch.set_float32_matmul_precision(saved_matmul_precision)
        # Only the variables that changed: the launcher variables of a group of one or SLURM's, DeepSpeed's
        # accelerator choice, a fixed arch list, and what the libraries set on the way (DeepSpeed's import sets
        # PYTORCH_NVML_BASED_CUDA_CHECK, its engine TORCHINDUCTOR_CACHE_DIR).
        for key, value in _changed_since(before).items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if restore_logging is not None:
            restore_logging()
        quiet.__exit__(None, None, None)


def _ranks_missing(exc: Exception, env: dict[str, str], timeout_minutes: float) -> Exception:
    """Rank 0's store timed out waiting for the other ranks: one line naming the variable that promised them
    (WORLD_SIZE, or SLURM_NTASKS when srun's variables were adopted) and the flag that bounded the wait."""
    import re

    joined = re.search(r"(\d+)/(\d+) clients joined", str(exc))
    if not joined:
        return exc
    source = "WORLD_SIZE" if "WORLD_SIZE" in env else "SLURM_NTASKS"
    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    return UserError(f"rank 0: only {joined.group(1)} of the {joined.group(2)} processes that {source}="
                     f"{os.environ.get('WORLD_SIZE')} promises joined the rendezvous at {where} within "
                     f"{timeout_minutes:g} minutes (--launch.timeout_minutes): start the other ranks, or set "
                     f"{source} to the number of processes started")


def _changed_since(before: dict[str, str]) -> dict[str, Optional[str]]:
    """The environment variables that differ from ``before``, with their value there (None: absent)."""
    return {k: before.get(k) for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k)}


def cap_gpu_memory(device: torch.device, gib: Optional[float]) -> Optional[float]:
    """Limit this process's caching allocator on ``device`` to ``gib`` GiB (``--trainer.gpu_memory_gib``);
    returns the cap in bytes (None: no cap). The CUDA context is outside the allocator and the cap."""
    if gib is None or device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()  # the call wants an index
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, gib * 2**30 / total), index)
    return min(float(total), gib * 2**30)


_PR_SET_PDEATHSIG, _PR_GET_PDEATHSIG = 1, 2


def _die_with_launcher() -> Optional[int]:
    """In a worker started by torchrun's agent (ours or the user's): get SIGTERM when the launcher dies.

    Without it a kill -9 of the launcher leaves its workers training and pruning checkpoints, and a
    restarted job races with them. SIGTERM, not SIGKILL: the orphan then saves a checkpoint and exits
    like a pre-empted run. Linux only (prctl); returns the previous setting for :func:`_set_death_signal`,
    None where nothing was changed.
    """
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        old = ctypes.c_int(0)
        if libc.prctl(_PR_GET_PDEATHSIG, ctypes.byref(old), 0, 0, 0) != 0:
            return None
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            return None
    except (OSError, AttributeError):
        return None
    if os.getppid() == 1:  # the launcher died before prctl: the signal will never come
        os.kill(os.getpid(), signal.SIGTERM)
    return old.value


def _set_death_signal(value: Optional[int]) -> None:
    if value is None:
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, value, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _device_type(requested: str) -> str:
    """``--trainer.device`` resolved: auto is cuda when a GPU is visible."""
    if requested == "cuda" and not torch.cuda.is_available():
        raise UserError("--trainer.device cuda: no CUDA GPU is visible. Use --trainer.device cpu (or auto)")
    return "cuda" if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()) else "cpu"


