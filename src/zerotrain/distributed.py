"""This process's place in the job: the process group, its device and precision, and every collective.

:func:`setup` joins the job for the length of a ``with`` block and leaves the process as it found
it; the collectives the loop needs (sums, maxima, objects from rank 0) and the helpers that make an
error on one rank end every rank the same way (:func:`main_process_first`, :func:`run_on_main`) are
here too. How the processes are started, and what the launcher reports when one fails, is
:mod:`zerotrain.launcher`.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import socket
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

from zerotrain.config import RunConfig
from zerotrain.ds_config import ResolvedPrecision, resolve_precision
from zerotrain.errors import UserError
from zerotrain.launcher import adopt_slurm_env, forget_progress, sanitize_cuda_arch_list
from zerotrain.tracking import setup_logging


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
    """The :class:`~zerotrain.preemption.Preemption` whose handlers setup() installed for the block."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


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
    saved_tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    owns_group = not torch.distributed.is_initialized()
    restore_logging = None
    undo_group_timeout = None
    finished = False
    quiet = warnings.catch_warnings()  # restores the warning filters on exit
    quiet.__enter__()
    # DeepSpeed 0.19 calls collectives that torch deprecates, once per call site: noise for a user,
    # and nothing a user could change.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    from zerotrain.preemption import Preemption

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
        undo_group_timeout = inherit_group_timeout(cfg.launch.timeout_minutes)
        init_process_group(backend, use_deepspeed=cfg.strategy.backend == "deepspeed", device=device_type,
                           timeout_minutes=cfg.launch.timeout_minutes)
        rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        restore_logging = setup_logging(rank == 0)
        device = torch.device("cpu")
        if device_type == "cuda":
            torch.cuda.set_device(local_rank)
            device = torch.device("cuda", local_rank)
            cap_gpu_memory(device, cfg.trainer.gpu_memory_gib)
        precision = resolve_precision(cfg.strategy.precision, device.type,
                                      device.type == "cuda" and torch.cuda.is_bf16_supported())
        if device.type == "cuda" and precision == "fp32":
            # fp32 matmuls on tensor cores (TF32), as MFU's fp32 peak assumes; IEEE fp32 runs ~7x slower on Hopper.
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        yield Runtime(rank, world_size, local_rank, device, precision, preemption)
        finished = True
    finally:
        preemption.restore()
        _set_death_signal(saved_death_signal)
        if owns_group and torch.distributed.is_initialized():
            if finished and torch.distributed.get_world_size() > 1:
                torch.distributed.barrier()  # nobody tears down while another rank still talks
            _destroy_process_group()
        if undo_group_timeout is not None:
            undo_group_timeout()
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved_tf32
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


def _destroy_process_group() -> None:
    ds_comm = sys.modules.get("deepspeed.comm.comm")  # where DeepSpeed keeps its backend (cdb)
    if ds_comm is not None and getattr(ds_comm, "cdb", None) is not None:
        # DeepSpeed caches its process groups in module globals; its own teardown drops them too,
        # so a later fit in this process starts from a clean slate.
        ds_comm.destroy_process_group()
    else:
        torch.distributed.destroy_process_group()


def _device_type(requested: str) -> str:
    """``--trainer.device`` resolved: auto is cuda when a GPU is visible."""
    if requested == "cuda" and not torch.cuda.is_available():
        raise UserError("--trainer.device cuda: no CUDA GPU is visible. Use --trainer.device cpu (or auto)")
    return "cuda" if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()) else "cpu"


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank."""
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def barrier() -> None:
    if torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()


def all_reduce_sum(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """Each value summed over ranks (float64), sent in one all-reduce."""
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=_comm_device(device))
    if torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(t)
    return dict(zip(keys, t.tolist()))


def all_reduce_max(value: float, device: torch.device) -> float:
    t = torch.tensor([float(value)], dtype=torch.float64, device=_comm_device(device))
    if torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return float(t.item())


def sum_on_device(value: float, device: torch.device) -> torch.Tensor:
    """``value`` summed over ranks, left on the device as a 0-d float64 tensor.

    :func:`all_reduce_sum` reads its result, and on a GPU that read waits for all the work queued
    before the all-reduce. Inside a training step that drains the queue once a step; a tensor the
    step multiplies by keeps the GPU fed. ``torch.full`` fills on the device: no host-to-device copy.
    """
    t = torch.full((), float(value), dtype=torch.float64, device=_comm_device(device))
    if torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(t)
    return t


def _comm_device(device: torch.device) -> torch.device:
    """NCCL reduces tensors on the GPU; Gloo on the CPU."""
    return device if torch.distributed.get_backend() == "nccl" else torch.device("cpu")


def inherit_group_timeout(minutes: float):
    """Make process groups created without a timeout use ``minutes``; return the undo.

    DeepSpeed builds its own groups (ZeRO's data-parallel and sequence groups) with
    ``torch.distributed.new_group(ranks)`` and no timeout, so they take torch's default (30 min for
    Gloo, 10 for NCCL), not ``--launch.timeout_minutes``: a stopped rank held the job 400+ s with a
    1-minute timeout. The world group already has the timeout (``init_process_group``).
    """
    import functools

    import torch.distributed.distributed_c10d as c10d

    original = c10d.new_group
    timeout = datetime.timedelta(minutes=minutes)

    @functools.wraps(original)
    def new_group(*args, **kwargs):
        if len(args) < 2 and kwargs.get("timeout") is None:
            kwargs["timeout"] = timeout
        return original(*args, **kwargs)

    c10d.new_group = torch.distributed.new_group = new_group

    def undo() -> None:
        c10d.new_group = torch.distributed.new_group = original

    return undo


# --- an error on one rank ends every rank the same way -----------------------------------------------
#
# A rank that stops alone leaves the others waiting in their next collective until the launcher kills
# them, each printing a traceback of its own that hides the cause. A section run on rank 0 first (or
# only) through the helpers below passes its error to every rank, which raises it too: a UserError
# then ends every rank with exit status 2 and one line, printed by rank 0 (see zerotrain.cli).

def main_process_first(is_main: bool):
    """A ``with`` block that rank 0 runs first while the other ranks wait; then the others run it.

    Typical use: rank 0 fills a cache (tokenised data) that the others then read::

        with main_process_first(info.is_main):
            splits = task.build_datasets()

    If rank 0's block raises, every other rank raises the same error (same class, message and
    attributes) without running the block. If a block fails on another rank, rank 0 and the ranks
    whose block succeeded raise the lowest failing rank's error. So every rank leaves the block the
    same way, and a :class:`UserError` ends them all with the one line rank 0 prints. An exception
    received from another rank carries ``zerotrain_origin_rank``. ``is_main`` must be true on global
    rank 0 only. Without torch.distributed, or in a group of one, it is just the block.
    """
    return _MainProcessFirst(is_main)


def run_on_main(fn):
    """Call ``fn()`` on rank 0 only and return its result on every rank (it must pickle).

    If ``fn`` raises, every rank raises the same error, as in :func:`main_process_first`. Use it for
    checks only rank 0 makes, e.g. ``run_on_main(lambda: rundir.check_writable(tr.output_dir))``.
    Without torch.distributed, or in a group of one, it is ``fn()``.
    """
    if not _collectives_needed():
        return fn()
    if torch.distributed.get_rank() != 0:
        failed, result = broadcast_object(None)
        if failed is not None:
            raise _rebuild_error(failed)
        return result
    try:
        result = fn()
        _check_picklable(result)
    except Exception as exc:
        broadcast_object((_describe_error(exc), None))
        raise
    broadcast_object((None, result))
    return result


class _MainProcessFirst:
    def __init__(self, is_main: bool):
        self.is_main = is_main
        self.synced = False

    def __enter__(self) -> None:
        self.synced = _collectives_needed()
        if self.synced and not self.is_main:
            failed = broadcast_object(None)  # wait for rank 0's block
            if failed is not None:
                raise _rebuild_error(failed)

    def __exit__(self, exc_type, exc, tb) -> bool:
        if not self.synced or (exc is not None and not isinstance(exc, Exception)):
            return False  # alone, or Ctrl-C (which reaches every rank anyway): nothing to share
        mine = _describe_error(exc) if exc is not None else None
        if self.is_main:
            broadcast_object(mine)
            if mine is not None:
                return False  # rank 0 raises its own error; the others raise it from __enter__
        failures = [d for d in all_gather_object(None if self.is_main else mine) if d is not None]
        if exc is None and failures:
            raise _rebuild_error(failures[0])
        return False


def _collectives_needed() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _check_picklable(value) -> None:
    import pickle

    try:
        pickle.dumps(value)
    except Exception as exc:
        raise TypeError(f"cannot send {type(value).__name__} to the other ranks: {exc}") from None


def _picklable(value) -> bool:
    try:
        _check_picklable(value)
        return True
    except TypeError:
        return False


def _describe_error(exc: BaseException) -> dict:
    """What :func:`_rebuild_error` needs to make ``exc`` again on another rank (it pickles)."""
    origin = getattr(exc, "zerotrain_origin_rank", None)
    try:
        return {
            "module": type(exc).__module__, "qualname": type(exc).__qualname__,
            "args": tuple(exc.args) if _picklable(tuple(exc.args)) else (str(exc),),
            "state": {k: v for k, v in vars(exc).items() if k != "__notes__" and _picklable(v)},
            "text": str(exc), "user_error": isinstance(exc, UserError),
            "rank": torch.distributed.get_rank() if origin is None else origin,
        }
    except Exception:  # never leave the other ranks waiting for a description that failed
        return {"module": "builtins", "qualname": "RuntimeError", "args": (repr(exc),), "state": {},
                "text": repr(exc), "user_error": isinstance(exc, UserError), "rank": origin or 0}


def _rebuild_error(desc: dict) -> Exception:
    """The exception ``desc`` describes: its own class when importable here, else UserError/RuntimeError."""
    import importlib

    exc = None
    try:
        cls = importlib.import_module(desc["module"])
        for part in desc["qualname"].split("."):
            cls = getattr(cls, part)
        if isinstance(cls, type) and issubclass(cls, Exception):
            # As unpickling does, without calling __init__ (ConfigError's takes other arguments than its args).
            candidate = cls.__new__(cls, *desc["args"])
            candidate.args = tuple(desc["args"])
            candidate.__dict__.update(desc["state"])
            if str(candidate) == desc["text"]:
                exc = candidate
    except Exception:
        exc = None
    if exc is None:
        exc = (UserError(desc["text"]) if desc["user_error"]
               else RuntimeError(f"{desc['qualname']} on rank {desc['rank']}: {desc['text']}"))
    exc.zerotrain_origin_rank = desc["rank"]
    if hasattr(exc, "add_note"):  # Python 3.11+
        exc.add_note(f"(raised on rank {desc['rank']}; every rank stops with it)")
    return exc
