"""Who am I in the job, and how do the processes start.

zerotrain reads the environment the usual launchers write (torchrun, the ``deepspeed`` launcher,
SLURM's ``srun``) and, when started alone with ``--launch.nproc_per_node N``, starts the N
processes itself through torchrun's own library (``torch.distributed.run``). Nothing here
re-implements a rendezvous.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from zerotrain.config import LaunchConfig, RunConfig
from zerotrain.ds_config import ResolvedPrecision, resolve_precision
from zerotrain.errors import UserError
from zerotrain.tracking import setup_logging


def slurm_task_per_gpu(launch: LaunchConfig) -> bool:
    """Whether ``srun`` started one task per GPU (each task is a rank), rather than one launcher task per node.

    Several tasks on a node mean one per GPU. One task per node is a rank only when the user did
    not ask zerotrain to start more (``--launch.nproc_per_node 1``); otherwise it is a launcher.
    """
    if "SLURM_PROCID" not in os.environ:
        return False
    ntasks, nnodes = int(os.environ.get("SLURM_NTASKS", "1")), int(os.environ.get("SLURM_NNODES", "1"))
    return ntasks > 1 and (ntasks > nnodes or launch.nproc_per_node == 1)


def launched_by_a_launcher(launch: LaunchConfig) -> bool:
    """True inside a process started by torchrun/deepspeed (RANK set) or by srun as one task per GPU."""
    return "RANK" in os.environ or slurm_task_per_gpu(launch)


def adopt_slurm_env(launch: LaunchConfig) -> None:
    """Map SLURM's per-task variables onto torchrun's (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*).

    Used when ``srun`` starts one task per GPU. The rendezvous address comes from
    ``--launch.rdzv_endpoint`` (set it to the first node of the allocation).
    """
    if "RANK" in os.environ or not slurm_task_per_gpu(launch):
        return
    host, _, port = launch.rdzv_endpoint.rpartition(":")
    os.environ.update(
        RANK=os.environ["SLURM_PROCID"],
        WORLD_SIZE=os.environ.get("SLURM_NTASKS", "1"),
        LOCAL_RANK=os.environ.get("SLURM_LOCALID", "0"),
        MASTER_ADDR=os.environ.get("MASTER_ADDR", host),
        MASTER_PORT=os.environ.get("MASTER_PORT", port),
    )


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
    # The whole environment: besides the launcher variables set here, importing DeepSpeed sets some of its own.
    saved_env = dict(os.environ)
    saved_tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    owns_group = not torch.distributed.is_initialized()
    restore_logging = None
    undo_group_timeout = None
    finished = False
    from zerotrain.preemption import Preemption

    preemption = Preemption()
    _PROGRESS.update(step=None, run_dir=None)  # an earlier fit in this process does not speak for this one
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
        os.environ.clear()
        os.environ.update(saved_env)
        if restore_logging is not None:
            restore_logging()


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


def _comm_device(device: torch.device) -> torch.device:
    """NCCL reduces tensors on the GPU; Gloo on the CPU."""
    return device if torch.distributed.get_backend() == "nccl" else torch.device("cpu")


PREEMPTION_SAVE_TIMEOUT_S = 600
"""How long the launcher waits, after forwarding a stop signal, for its workers to save and exit."""


def spawn_local_workers(launch: LaunchConfig, argv: list[str]) -> int:
    """Re-run this command in ``nproc_per_node`` processes on this node through torchrun's library.

    Single node: torchrun's standalone mode picks a free port. Several nodes: a static rendezvous at
    ``rdzv_endpoint`` with this node's ``node_rank``, exactly as ``torchrun --nnodes --node-rank
    --master-addr --master-port`` would do.

    Returns 0, or the exit status of the first worker that failed (2 for a :class:`UserError`, whose
    one line a worker has printed already). A failure is reported in one line of our own: torchelastic's
    warnings and its failure banner are silenced for this call.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = [f"--nproc-per-node={launch.nproc_per_node}"]
    if launch.nnodes == 1 and launch.rdzv_endpoint == LaunchConfig.rdzv_endpoint:
        args.append("--standalone")
    else:
        host, _, port = launch.rdzv_endpoint.rpartition(":")
        args += [f"--nnodes={launch.nnodes}", f"--node-rank={launch.node_rank}",
                 f"--master-addr={host}", f"--master-port={port}",
                 # The static rendezvous' TCPStore waits this long for every node (torchrun's default: 600 s).
                 f"--rdzv-conf=timeout={max(1, round(launch.rdzv_timeout_minutes * 60))}"]
    parser = get_args_parser()
    known = {opt for action in parser._actions for opt in action.option_strings}
    if "--signals-to-handle" in known:  # torch >= 2.8
        # Forward SLURM's --signal=USR1 too (by default it would kill this launcher and orphan the workers),
        # and give the workers time to save their pre-emption checkpoint before torchelastic's SIGKILL.
        args += ["--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
                 f"--shutdown-timeout={PREEMPTION_SAVE_TIMEOUT_S}"]
    args += ["-m", "zerotrain", *argv]
    if launch.nnodes > 1:
        print(f"zerotrain: node {launch.node_rank} of {launch.nnodes}: waiting up to {launch.rdzv_timeout_minutes:g} min "
              f"(--launch.rdzv_timeout_minutes) for all {launch.nnodes} nodes to join at {launch.rdzv_endpoint} "
              "(Ctrl-C stops)", file=sys.stderr, flush=True)
    saved_levels = _silence_torchelastic()
    # Until the workers start, the launcher sits in TCPStore's C++ wait, where Python's KeyboardInterrupt is
    # never delivered: Ctrl-C must end the process at once. torchelastic installs its own SIGINT handler
    # (stop the workers, then raise) when it starts them.
    saved_sigint = _default_sigint()
    heartbeats, own_heartbeats = _heartbeat_dir()
    stopped: set[int] = set()
    undo_close = _continue_stopped_workers(stopped)
    try:
        run(parser.parse_args(args))
    except ChildFailedError as exc:  # lists every failed rank of this node, the ones torchelastic stopped too
        return _report_worker_failure(exc.failures, read_heartbeats(heartbeats), launch.timeout_minutes, stopped)
    except SignalException as exc:  # Ctrl-C or a scheduler's SIGTERM; torchelastic has stopped the workers
        from zerotrain.preemption import PREEMPTED_EXIT, SIGNALS

        progress = read_heartbeats(heartbeats)
        if exc.sigval in SIGNALS and _saved_at_last_step(progress):
            # Forwarded to the workers, which saved a checkpoint at the step they stopped and exited
            # (zerotrain.preemption): requeue. Without that checkpoint a requeue would not resume where it stopped.
            print(f"zerotrain: stopped by {exc.sigval.name}; the workers saved a checkpoint (exit status "
                  f"{PREEMPTED_EXIT}: requeue). {_last_checkpoint_hint(progress)}", file=sys.stderr)
            return PREEMPTED_EXIT
        if exc.sigval in SIGNALS:
            print(f"zerotrain: stopped by {exc.sigval.name} before the workers saved a checkpoint at their last step. "
                  f"{_last_checkpoint_hint(progress)}", file=sys.stderr)
            return 128 + int(exc.sigval)
        print(f"zerotrain: interrupted ({exc.sigval.name})", file=sys.stderr)
        return 128 + int(exc.sigval)
    except Exception as exc:  # no worker ran: the rendezvous or the start failed
        if launch.nnodes > 1:
            print(f"zerotrain: node {launch.node_rank}: not all {launch.nnodes} nodes joined at {launch.rdzv_endpoint} "
                  f"within {launch.rdzv_timeout_minutes:g} min (--launch.rdzv_timeout_minutes): start the same command "
                  f"with --launch.node_rank 0..{launch.nnodes - 1} on every node, and check that this node reaches "
                  f"that address ({type(exc).__name__})", file=sys.stderr)
        else:
            print(f"zerotrain: could not start the worker processes: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    finally:
        undo_close()
        _restore_sigint(saved_sigint)
        _restore_levels(saved_levels)
        if own_heartbeats:
            import shutil

            os.environ.pop(HEARTBEAT_ENV, None)
            shutil.rmtree(heartbeats, ignore_errors=True)
    return 0


def _default_sigint():
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGINT, signal.SIG_DFL)


def _restore_sigint(saved) -> None:
    import signal

    if saved is not None:
        signal.signal(signal.SIGINT, saved)


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


_ARCH = re.compile(r"^(\d+\.\d+)[a-z]?(\+PTX)?$")


def sanitize_cuda_arch_list() -> str | None:
    """Make ``TORCH_CUDA_ARCH_LIST`` parseable by DeepSpeed's op builder; return the old value if changed.

    Hopper images set ``9.0a``; DeepSpeed parses each entry as ``int(major)``/``int(minor)`` and fails
    with ``invalid literal for int() with base 10: '0a'`` when it JIT-builds FusedAdam or CPUAdam.
    Its kernels need nothing from the arch-specific ``a`` variant, so ``9.0`` builds the same ops.
    """
    value = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if not value:
        return None
    entries = re.split(r"[;\s]+", value.strip())
    fixed = []
    for entry in entries:
        m = _ARCH.match(entry)
        fixed.append(m.group(1) + (m.group(2) or "") if m else entry)
    new = ";".join(dict.fromkeys(fixed))
    if new == value:
        return None
    os.environ["TORCH_CUDA_ARCH_LIST"] = new
    return value


# --- an error on one rank ends every rank the same way -----------------------------------------------
#
# A rank that stops alone leaves the others waiting in their next collective until the launcher kills
# them, each printing a traceback of its own that hides the cause. A section run on rank 0 first (or
# only) through the helpers below passes its error to every rank, which raises it too: a UserError
# then ends every rank with exit status 2 and one line, printed by rank 0 (see zerotrain.cli).

USER_ERROR_EXIT = 2
"""Exit status of a process stopped by a :class:`UserError` (the CLI's)."""

ERROR_FILE_KEY = "zerotrain_user_error"
"""Key of the record the CLI leaves in torchelastic's error file of a worker stopped by a UserError."""


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
        failed, result = _share_from_main(None)
        if failed is not None:
            raise _rebuild_error(failed)
        return result
    try:
        result = fn()
        _check_picklable(result)
    except Exception as exc:
        _share_from_main((_describe_error(exc), None))
        raise
    _share_from_main((None, result))
    return result


class _MainProcessFirst:
    def __init__(self, is_main: bool):
        self.is_main = is_main
        self.synced = False

    def __enter__(self) -> None:
        self.synced = _collectives_needed()
        if self.synced and not self.is_main:
            failed = _share_from_main(None)  # wait for rank 0's block
            if failed is not None:
                raise _rebuild_error(failed)

    def __exit__(self, exc_type, exc, tb) -> bool:
        if not self.synced or (exc is not None and not isinstance(exc, Exception)):
            return False  # alone, or Ctrl-C (which reaches every rank anyway): nothing to share
        mine = _describe_error(exc) if exc is not None else None
        if self.is_main:
            _share_from_main(mine)
            if mine is not None:
                return False  # rank 0 raises its own error; the others raise it from __enter__
        failures = [d for d in _gather(None if self.is_main else mine) if d is not None]
        if exc is None and failures:
            raise _rebuild_error(failures[0])
        return False


def _collectives_needed() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _share_from_main(obj):
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _gather(obj) -> list:
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


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


# --- what spawn_local_workers says when a worker fails -----------------------------------------------

_TORCHELASTIC_LOGGERS = ("torch.distributed.run", "torch.distributed.elastic", "torch.distributed.launcher")


def _silence_torchelastic() -> dict:
    """Mute torchrun's own loggers (the OMP_NUM_THREADS notice, SIGTERM notices, failure banner); return their levels."""
    import importlib
    import logging

    for module in ("torch.distributed.elastic.rendezvous.c10d_rendezvous_backend",
                   "torch.distributed.elastic.rendezvous.static_tcp_rendezvous"):
        try:  # imported during the run otherwise, and their loggers made after these are muted
            importlib.import_module(module)
        except Exception:
            pass
    names = set(_TORCHELASTIC_LOGGERS)
    names.update(name for name, logger in list(logging.Logger.manager.loggerDict.items())
                 if isinstance(logger, logging.Logger)
                 and any(name.startswith(prefix + ".") for prefix in _TORCHELASTIC_LOGGERS))
    saved = {}
    for name in names:
        logger = logging.getLogger(name)
        saved[name] = logger.level
        logger.setLevel(logging.CRITICAL + 1)
    return saved


def _restore_levels(saved: dict) -> None:
    import logging

    for name, level in saved.items():
        logging.getLogger(name).setLevel(level)


def _report_worker_failure(failures: dict, progress: Optional[dict[int, dict]] = None,
                           timeout_minutes: Optional[float] = None, stopped: frozenset[int] | set[int] = frozenset()) -> int:
    """Say (at most) one line about the worker that ended the job; return the launcher's exit status.

    ``failures`` is torchelastic's ``ChildFailedError.failures``: global rank -> ``ProcessFailure``
    (``exitcode``, ``local_rank``, ``pid``, ``timestamp``, ``message``, ``error_file_data``). It also lists the
    workers torchelastic stopped (SIGTERM, then SIGKILL after 30 s) once the first had failed; those are
    not the cause. ``progress`` is what :func:`read_heartbeats` found (rank -> step, pid, run folder),
    ``stopped`` the pids found stopped (SIGSTOP) when torchelastic began to stop the workers.

    In order: an error a worker printed already (a UserError, a diverged loss) adds nothing; all workers
    pre-empted; a worker that crashed (its traceback is above); a worker killed by a signal before any
    collective failed (128 + signal); a rank that stopped responding, or the others lost it on another
    node (:data:`RANK_LOST_EXIT`). Each line names the rank, its last finished step (heartbeat) and the
    run's last complete checkpoint.
    """
    from zerotrain.errors import DIVERGED_EXIT

    progress = progress or {}

    def record(failure, key: str = ERROR_FILE_KEY) -> dict | None:  # left by zerotrain.cli in the worker's error file
        data = failure.error_file_data
        found = data.get(key) if isinstance(data, dict) else None
        return found if isinstance(found, dict) else None

    announced = {r: f for r, f in failures.items()
                 if f.exitcode in (USER_ERROR_EXIT, DIVERGED_EXIT) or record(f) is not None}
    if announced:
        code = next((f.exitcode for f in announced.values() if f.exitcode in (USER_ERROR_EXIT, DIVERGED_EXIT)),
                    None) or next(int(record(f).get("exit", USER_ERROR_EXIT)) for f in announced.values())
        printed = any((record(f) or {}).get("printed") or (r == 0 and f.exitcode == code)
                      for r, f in announced.items())
        if not printed:  # rank 0 runs on another node (or was stopped before it could print): say it here
            rank = min(announced, key=lambda r: (record(announced[r]) is None, r))
            print(announced[rank].message if record(announced[rank]) else
                  f"zerotrain: rank {rank} stopped on an error (exit status {code})", file=sys.stderr)
        return code
    from zerotrain.preemption import PREEMPTED_EXIT

    if all(f.exitcode == PREEMPTED_EXIT for f in failures.values()):
        # Every worker got the stop signal itself (SLURM signals every process) and saved: not a failure.
        print(f"zerotrain: pre-empted; the workers saved a checkpoint (exit status {PREEMPTED_EXIT}: "
              "requeue with --checkpoint.resume auto)", file=sys.stderr)
        return PREEMPTED_EXIT

    def after(rank: int) -> str:
        step = progress.get(rank, {}).get("step")
        return "before its first step" if step is None else f"after step {step}"

    lost = {r: record(f, LOST_FILE_KEY) for r, f in failures.items()
            if f.exitcode == RANK_LOST_EXIT and record(f, LOST_FILE_KEY) is not None}
    crashed = {r: f for r, f in failures.items() if f.exitcode > 0 and r not in lost}
    if crashed:
        rank, failure = min(crashed.items(), key=lambda item: (item[1].timestamp, item[0]))
        print(f"zerotrain: rank {rank} (local rank {failure.local_rank}) failed with exit status {failure.exitcode} "
              f"{after(rank)}; its traceback, if any, is above", file=sys.stderr)
        return failure.exitcode
    checkpoint = _last_checkpoint_hint(progress)
    stopped_ranks = sorted(r for r, p in progress.items() if p.get("pid") in stopped)
    killed = {r: f for r, f in failures.items() if f.exitcode < 0 and -f.exitcode not in _STOP_SIGNALS}
    if lost:
        # A kill that came after a rank had reported a failed collective is torchelastic's own SIGKILL of a
        # worker that ignored its SIGTERM (a hung one), not the cause. Failure timestamps are whole seconds.
        first_report = min(float(rec.get("time", 0)) for rec in lost.values())
        killed = {r: f for r, f in killed.items() if f.timestamp <= first_report + 1}
    if killed and not stopped_ranks:
        rank, failure = min(killed.items(), key=lambda item: (item[1].timestamp, item[0]))
        hint = " (out of memory?)" if failure.exitcode == -9 else ""
        print(f"zerotrain: rank {rank} (local rank {failure.local_rank}) was killed by {failure.signal_name()} "
              f"{after(rank)}{hint}; the job stopped. {checkpoint}", file=sys.stderr)
        return 128 - failure.exitcode
    if lost or stopped_ranks:
        # Which rank the others waited for: one found stopped (SIGSTOP) when torchelastic began to stop the
        # workers, else one of this node that reported nothing (stuck, then killed). What each survivor's
        # error says cannot tell: Gloo says "timed out" on the late rank too, once it runs again.
        silent = sorted((set(progress) | set(failures)) - set(lost),
                        key=lambda r: (progress.get(r, {}).get("step") or 0, r))
        timeout = "" if timeout_minutes is None else f" {timeout_minutes:g}"
        stopped_after = f"the job stopped after --launch.timeout_minutes{timeout}"
        if stopped_ranks or silent:
            rank = (stopped_ranks or silent)[0]
            print(f"zerotrain: rank {rank} stopped responding {after(rank)}; {stopped_after}. {checkpoint}",
                  file=sys.stderr)
        elif any(rec.get("timed_out") for rec in lost.values()):
            rank = min(lost)
            print(f"zerotrain: a rank on another node stopped responding (rank {rank} waited for it {after(rank)}; "
                  f"see that node's output); {stopped_after}. {checkpoint}", file=sys.stderr)
        else:
            rank = min(lost)
            print(f"zerotrain: rank {rank} lost its connection to another rank {after(rank)} (a process on another "
                  f"node ended: see that node's output); the job stopped. {checkpoint}", file=sys.stderr)
        return RANK_LOST_EXIT
    rank, failure = min(failures.items(), key=lambda item: (item[1].timestamp, item[0]))
    print(f"zerotrain: rank {rank} (local rank {failure.local_rank}) was killed by {failure.signal_name()} "
          f"{after(rank)}", file=sys.stderr)
    return 128 - failure.exitcode


_STOP_SIGNALS = (15, 2)
"""SIGTERM and SIGINT: what torchelastic (or a user's Ctrl-C) sends to stop the workers, not a cause."""


def _saved_at_last_step(progress: dict[int, dict]) -> bool:
    """Whether the run's newest complete checkpoint is at the step the workers last finished."""
    run_dir = next((p["run_dir"] for p in progress.values() if p.get("run_dir")), None)
    if run_dir is None:
        return False
    from zerotrain.checkpoint import complete_checkpoints, read_marker

    folders = complete_checkpoints(Path(run_dir) / "checkpoints")
    last = max(p["step"] for p in progress.values())
    return bool(folders) and read_marker(folders[-1]).get("step") == last


def _last_checkpoint_hint(progress: dict[int, dict]) -> str:
    """'Last complete checkpoint: FOLDER (resume with ...)' for the run the workers wrote into."""
    run_dir = next((p["run_dir"] for p in progress.values() if p.get("run_dir")), None)
    if run_dir is None:
        return "No checkpoint: the workers had not started training"
    from zerotrain.checkpoint import complete_checkpoints

    folders = complete_checkpoints(Path(run_dir) / "checkpoints")
    if not folders:
        return (f"No complete checkpoint in {run_dir} yet (--checkpoint.every_steps N saves one every N steps)")
    return (f"Last complete checkpoint: {folders[-1]} (resume with --checkpoint.resume auto "
            f"--trainer.run_name {Path(run_dir).name})")


# --- how the launcher learns where each worker stands: a heartbeat file per rank ---------------------
#
# A worker started by spawn_local_workers writes, at every optimizer step, the step it finished into
# HEARTBEAT_ENV/rank<R> (one pwrite of a few bytes into a file on the node's local disk: no host-device
# sync, no collective). When the job fails, the launcher reads them to name the step of the rank that
# died or hung and the run folder whose checkpoints are listed; the workers themselves may be gone.

HEARTBEAT_ENV = "ZEROTRAIN_HEARTBEAT_DIR"
"""Folder of the per-rank heartbeat files; spawn_local_workers makes a temporary one unless it is set."""

RANK_LOST_EXIT = 4
"""Exit status of a job ended because a rank stopped responding (the others' collectives timed out after
``--launch.timeout_minutes``), and of each worker that saw a collective fail. A worker killed by a signal
ends the job with 128 + signal instead (137: SIGKILL, often the out-of-memory killer)."""

LOST_FILE_KEY = "zerotrain_rank_lost"
"""Key of the record the CLI leaves in torchelastic's error file of a worker whose collective failed."""

_STEP_WIDTH = 12
_PROGRESS: dict[str, Any] = {"step": None, "run_dir": None}
"""This process's last finished step and run folder, for the CLI's line when a collective fails."""


class Heartbeat:
    """This rank's progress, in a file the launcher reads when the job fails (a no-op without a launcher)."""

    def __init__(self, rank: int, run_dir: Path, step: int):
        _PROGRESS.update(step=step, run_dir=str(run_dir))
        self._fd: Optional[int] = None
        folder = os.environ.get(HEARTBEAT_ENV)
        if not folder:
            return
        try:
            # Fixed-width step first, so that beat() rewrites a few bytes in place (no rename per step).
            text = f"{step:>{_STEP_WIDTH}d}\n{os.getpid()}\n{run_dir}\n"
            self._fd = os.open(os.path.join(folder, f"rank{rank}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.write(self._fd, text.encode())
        except OSError:  # the launcher's folder is gone: its report loses the step, not the run
            self.close()

    def beat(self, step: int) -> None:
        _PROGRESS["step"] = step
        if self._fd is not None:
            os.pwrite(self._fd, f"{step:>{_STEP_WIDTH}d}".encode(), 0)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_heartbeats(folder: Optional[str]) -> dict[int, dict]:
    """rank -> {"step", "pid", "run_dir"} from the heartbeat files in ``folder`` (what can be parsed)."""
    out: dict[int, dict] = {}
    if not folder or not os.path.isdir(folder):
        return out
    for name in os.listdir(folder):
        if not re.fullmatch(r"rank\d+", name):
            continue
        try:
            step, pid, run_dir = Path(folder, name).read_text().split("\n")[:3]
            out[int(name[4:])] = {"step": int(step), "pid": int(pid), "run_dir": run_dir or None}
        except (OSError, ValueError):
            continue
    return out


def _heartbeat_dir() -> tuple[str, bool]:
    """The folder the workers write their heartbeats into (inherited through the environment); whether we made it."""
    folder = os.environ.get(HEARTBEAT_ENV)
    if folder:
        os.makedirs(folder, exist_ok=True)
        return folder, False
    import tempfile

    folder = tempfile.mkdtemp(prefix="zerotrain-heartbeat-")
    os.environ[HEARTBEAT_ENV] = folder
    return folder, True


def _continue_stopped_workers(stopped: set[int]):
    """Make torchelastic's stop signal reach a stopped (SIGSTOP) worker at once; return the undo.

    torchelastic stops the other workers of a failed job with SIGTERM and sends SIGKILL 30 s later.
    A stopped process keeps SIGTERM pending until it is continued, so the job waited those 30 s: send
    SIGCONT right after the stop signal, as shells do. The pids found stopped are added to ``stopped``
    (the report names such a rank as the one that stopped responding).
    """
    import signal

    try:
        from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import SubprocessHandler
    except ImportError:
        return lambda: None
    original = SubprocessHandler.close

    def close(self, death_sig=None):
        pid = self.proc.pid
        if _process_state(pid) in ("T", "t"):
            stopped.add(pid)
        original(self, death_sig)
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGCONT)

    SubprocessHandler.close = close

    def undo() -> None:
        SubprocessHandler.close = original

    return undo


def _process_state(pid: int) -> str:
    """The state letter of /proc/PID/stat (R, S, D, T for stopped, ...); '' where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


_COLLECTIVE_FAILURE = re.compile(
    r"Timed out waiting|Connection (reset|closed) by peer|Application timeout caused pair closure|Broken pipe"
    r"|NCCL communicator was aborted|collective operation timeout", re.IGNORECASE)
"""What Gloo and NCCL say when the rank at the other end of a collective is gone or silent."""

_TIMED_OUT = re.compile(r"Timed out waiting|collective operation timeout", re.IGNORECASE)
"""Of those, what a rank says that waited for another one in vain. Gloo's "Application timeout caused pair
closure" is the opposite: the other end timed out and closed the connection (this rank was the late one)."""


def collective_failure(exc: BaseException) -> Optional[bool]:
    """Whether ``exc`` is a collective that failed because another rank is gone: True when it timed out
    (that rank stopped responding), False when the connection dropped (it ended); None: not one."""
    text = str(exc)
    if not isinstance(exc, RuntimeError) or not _COLLECTIVE_FAILURE.search(text):  # DistError is a RuntimeError
        return None
    return bool(_TIMED_OUT.search(text))


def progress() -> dict[str, Any]:
    """This process's last finished step and run folder (None before training started)."""
    return dict(_PROGRESS)
