"""How the processes of a job start, and what the user hears when one of them fails.

zerotrain reads the environment the usual launchers write (torchrun, the ``deepspeed`` launcher,
SLURM's ``srun``) and, when started alone with ``--launch.nproc_per_node N``, starts the N
processes itself: it builds torchrun's arguments with torchrun's own parser and calls
``torch.distributed.run.run``. The workers record how they ended in torchelastic's error file
(:class:`ErrorFile`, through ``record``); when one fails, the ``ChildFailedError`` that ``run``
raises lists every failed rank with its exit status and that record, and :func:`describe_failure`
turns it into one line: the worker's own line, or which rank died or hung, its last step (from a
per-rank progress file, :class:`Progress`) and the last complete checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Iterator, Optional

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from zerotrain.checkpoint.layout import complete_checkpoints, read_marker
from zerotrain.config import LaunchConfig
from zerotrain.data.io import atomic_write_text
from zerotrain.errors import (
    DIVERGED_EXIT,
    ConfigError,
    OOM_EXIT,
    RANK_LOST_EXIT,
    USER_ERROR_EXIT,
    RankLost,
    RunStopped,
    UserError,
)
from zerotrain.runtime.preemption import PREEMPTED_EXIT, SIGNALS, Preempted
from zerotrain.runtime.restarts import PROGRESS_ENV, attempt, ended_for_good

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                      "MASTER_ADDR", "MASTER_PORT")
"""The variables a process joins a torchrun job by."""


def environment_alone() -> dict[str, str]:
    """This process's environment without what would make a child join this job (torchrun's and
    SLURM's variables): for a helper process that must run on its own, such as the memory probe."""
    return {k: v for k, v in os.environ.items()
            if k not in TORCHRUN_VARIABLES and not k.startswith(("SLURM_", "TORCHELASTIC_"))}


class RankOutsideJob(UserError):
    """This process's RANK is not a rank of the job: only it is wrong (the others may be fine), so it says so."""

    said_by_each_rank = True


def check_launcher_env() -> None:
    """One line naming the variable when the launcher's environment cannot describe a job: ``RANK`` without
    ``WORLD_SIZE``, a value that is not a whole number (``WORLD_SIZE=two``), a rank outside the job, a
    ``MASTER_PORT`` outside 1-65535, or SLURM's task variables that are not numbers.

    torch reads these variables deep inside its rendezvous and fails there with a traceback (or, for a port, an
    overflow in C++); checked first, a job whose ranks share one environment ends every rank with the same line."""
    env = os.environ

    def whole(name: str, low: int, high: Optional[int] = None,
              fix: str = "set it as a launcher (torchrun, srun) would, or unset it to run one process") -> Optional[int]:
        if name not in env:
            return None
        text = env[name].strip()
        value = int(text) if re.fullmatch(r"[0-9]+", text) else None
        if value is None or value < low or (high is not None and value > high):
            span = f"from {low} to {high}" if high is not None else f">= {low}"
            raise UserError(f"{name}={env[name]!r} in the environment must be a whole number {span}: {fix}")
        return value

    for name in ("SLURM_PROCID", "SLURM_LOCALID"):
        whole(name, 0)
    for name in ("SLURM_NTASKS", "SLURM_NNODES"):
        whole(name, 1)
    if "RANK" not in env:
        return
    rank = whole("RANK", 0)
    if "WORLD_SIZE" not in env:
        raise UserError(f"RANK={env['RANK']} is set in the environment but WORLD_SIZE is not: set WORLD_SIZE to the "
                        "number of processes in the job (a launcher such as torchrun sets both), or unset RANK to run "
                        "one process")
    world_size = whole("WORLD_SIZE", 1)
    if rank >= world_size:
        raise RankOutsideJob(f"RANK={rank} is outside a job of WORLD_SIZE={world_size} processes (ranks 0 to "
                        f"{world_size - 1}): set RANK and WORLD_SIZE for the same job")
    whole("LOCAL_RANK", 0)
    whole("MASTER_PORT", 1, 65535, fix="set it to a free port of the node of rank 0 (e.g. 29500)")


def slurm_task_per_gpu(launch: LaunchConfig) -> bool:
    """Whether ``srun`` started one task per GPU (each task is a rank), rather than one launcher task per node.

    Several tasks on a node mean one per GPU. One task per node is a rank only when the user did
    not ask zerotrain to start more (``--launch.nproc_per_node 1``); otherwise it is a launcher.
    """
    if "SLURM_PROCID" not in os.environ:
        return False
    check_launcher_env()
    ntasks, nnodes = int(os.environ.get("SLURM_NTASKS", "1")), int(os.environ.get("SLURM_NNODES", "1"))
    return ntasks > 1 and (ntasks > nnodes or launch.nproc_per_node == 1)


def launched_by_a_launcher(launch: LaunchConfig) -> bool:
    """True inside a process started by torchrun/deepspeed (RANK set) or by srun as one task per GPU."""
    check_launcher_env()
    return "RANK" in os.environ or slurm_task_per_gpu(launch)


def adopt_slurm_env(launch: LaunchConfig) -> None:
    """Map SLURM's per-task variables onto torchrun's (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*).

    Used when ``srun`` starts one task per GPU. The rendezvous address comes from
    ``--launch.rdzv_endpoint`` (set it to the first node of the allocation).
    """
    check_launcher_env()
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


PREEMPTION_SAVE_TIMEOUT_S = 600
"""How long the launcher waits, after forwarding a stop signal, for its workers to save and exit."""

FORWARDED_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1")
"""The signals torchelastic forwards to the workers for this launcher (``--signals-to-handle``)."""


PROGRESS_OWNER_ENV = "ZEROTRAIN_PROGRESS_OWNER"
"""The pid of the launcher that made the progress folder (unset when the folder was given): the folder is removed
by whoever outlives that launcher (see :func:`remove_orphaned_progress_dir`, :func:`remove_stale_progress_dirs`)."""

_OWN_FOLDER = re.compile(r"zerotrain-progress-(\d+)-[^/]*")
"""The name of a progress folder a launcher made: ``zerotrain-progress-<its pid>-<random>``."""


def under_own_launcher() -> bool:
    """Whether this process is a worker started by :func:`spawn_local_workers`."""
    return bool(os.environ.get(PROGRESS_ENV)) and bool(os.environ.get("TORCHELASTIC_ERROR_FILE"))


def torchrun_arguments(launch: LaunchConfig, argv: list[str], log_dir: Optional[str] = None):
    """torchrun's parsed arguments for ``python -m zerotrain ARGV`` in ``nproc_per_node`` processes.

    Single node: torchrun's standalone mode picks a free port. Several nodes: a static rendezvous at
    ``rdzv_endpoint`` with this node's ``node_rank``, exactly as ``torchrun --nnodes --node-rank
    --master-addr --master-port`` would do. Parsed by torchrun's own parser; a flag this torch's
    torchrun does not have yet is left out (torch 2.11 has ``--signals-to-handle``, not
    ``--shutdown-timeout``): both only help, neither is needed to run. ``log_dir``: where torchelastic keeps its
    per-worker files (error files, redirected output); by default a temporary folder it never removes.
    """
    from torch.distributed.run import get_args_parser

    args = [f"--nproc-per-node={launch.nproc_per_node}"]
    if launch.nnodes == 1 and launch.rdzv_endpoint == LaunchConfig.rdzv_endpoint:
        args.append("--standalone")
    else:
        host, _, port = launch.rdzv_endpoint.rpartition(":")
        args += [f"--nnodes={launch.nnodes}", f"--node-rank={launch.node_rank}",
                 f"--master-addr={host}", f"--master-port={port}",
                 # The static rendezvous' TCPStore waits this long for every node (torchrun's default: 600 s).
                 f"--rdzv-conf=timeout={max(1, round(launch.rdzv_timeout_minutes * 60))}"]
    if log_dir is not None:
        args.append(f"--log-dir={log_dir}")
    if launch.max_restarts:
        args.append(f"--max-restarts={launch.max_restarts}")
    # Forward SLURM's --signal=USR1 too (by default it would kill this launcher and orphan the workers), and
    # give the workers time to save their pre-emption checkpoint before torchelastic's SIGKILL.
    optional = [f"--signals-to-handle={','.join(FORWARDED_SIGNALS)}",
                f"--shutdown-timeout={PREEMPTION_SAVE_TIMEOUT_S}"]
    parsed, _lacking = get_args_parser().parse_known_args([*args, *optional, "-m", "zerotrain", *argv])
    return parsed


def restart_flags(cfg, run_name: str) -> list[str]:
    """Flags the launcher adds to the workers' command when it may restart them (``--launch.max_restarts``):
    ``run_name`` when the command names no run, so that every attempt writes into, and resumes from, one folder."""
    if not cfg.launch.max_restarts or cfg.trainer.run_name:
        return []
    return ["--trainer.run_name", run_name]


def resume_after_restart(cfg) -> list[str]:
    """In a worker zerotrain's launcher restarted: ``--checkpoint.resume auto`` when the run folder holds a complete
    checkpoint (an earlier attempt saved it), else nothing (the attempt starts as the first one did).

    Refused in one line naming the flag: ``--launch.max_restarts`` in a worker another launcher started (torchrun,
    srun), which restarts nothing itself; that launcher's own restart setting is the one that counts."""
    if cfg.launch.max_restarts and not under_own_launcher() and launched_by_a_launcher(cfg.launch):
        raise ConfigError("--launch.max_restarts", "restarts the workers zerotrain's launcher starts, and another "
                          "launcher (torchrun, srun) started this one: give that launcher its restarts (torchrun "
                          "--max-restarts N) and leave this flag out, or start the job with zerotrain itself")
    if not under_own_launcher() or attempt() == 0 or not cfg.trainer.run_name:
        return []
    run_dir = Path(cfg.trainer.output_dir).expanduser() / cfg.trainer.run_name
    return ["--checkpoint.resume", "auto"] if complete_checkpoints(run_dir / "checkpoints") else []


def threads_per_worker(nproc: int) -> int:
    """The CPU threads each of ``nproc`` workers on this node gets: the physical cores this process may run on,
    shared out evenly (at least 1). torchrun gives every worker 1 when ``OMP_NUM_THREADS`` is unset, which leaves
    DeepSpeed's CPU Adam (OpenMP) on one core per GPU under optimizer offload, the step's longest part there; one
    process alone gets PyTorch's default, the physical cores, and this keeps that share per worker."""
    import psutil

    logical = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads, cores = psutil.cpu_count(logical=True), psutil.cpu_count(logical=False)  # either may be None
    per_core = max(1, threads // cores) if threads and cores else 1
    return max(1, logical // per_core // max(1, nproc))


def few_threads_line(host_optimizer: bool) -> Optional[str]:
    """A warning where the optimizer steps on the host (offload) with one CPU thread in this process while this
    node has cores to spare for each of its processes: another launcher (torchrun, Ray) set ``OMP_NUM_THREADS``
    to 1. The processes on this node: torchrun's ``LOCAL_WORLD_SIZE``, else one per visible GPU. None otherwise."""
    import torch

    if not host_optimizer or torch.get_num_threads() > 1:
        return None
    local = os.environ.get("LOCAL_WORLD_SIZE")
    share = threads_per_worker(int(local) if local and local.isdigit() else max(1, torch.cuda.device_count()))
    if share <= 1:
        return None
    return (f"the optimizer steps on the host with 1 CPU thread in each process (OMP_NUM_THREADS="
            f"{os.environ.get('OMP_NUM_THREADS', 'unset')}), and this node has {share} cores for each: set "
            f"OMP_NUM_THREADS={share} in the launcher's environment (Ray: resources_per_worker CPU)")


def spawn_local_workers(launch: LaunchConfig, argv: list[str]) -> int:
    """Re-run this command in ``nproc_per_node`` processes on this node through ``torch.distributed.run``.

    Returns 0, or the job's exit status after one line on stderr (see :func:`describe_failure`).
    torchelastic's own warnings and failure banner are muted for this call.

    The status is decided once the workers have exited, and a scheduler's later signal must not change it (a
    second SIGTERM during the teardown would otherwise end this process by that signal, not with the 75 that
    asks for a requeue): from then on this process ignores the stop signals (SIGTERM, SIGINT, SIGHUP, SIGQUIT,
    SIGUSR1), and leaves them ignored on return, for the process to exit with that status. Ignored, not
    handled: Python puts its own handlers back to the default while the interpreter shuts down.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    # Until the workers start, the launcher sits in TCPStore's C++ wait, where Python's KeyboardInterrupt is
    # never delivered: Ctrl-C must end the process at once. torchelastic installs its own SIGINT handler
    # (stop the workers, then raise) when it starts them. Set before the line that promises "Ctrl-C stops":
    # a process started with SIGINT ignored (inherited from its parent) would otherwise lose an early Ctrl-C.
    _default_sigint()
    if launch.nnodes > 1:
        print(f"zerotrain: node {launch.node_rank} of {launch.nnodes}: waiting up to {launch.rdzv_timeout_minutes:g} min "
              f"(--launch.rdzv_timeout_minutes) for all {launch.nnodes} nodes to join at {launch.rdzv_endpoint} "
              "(Ctrl-C stops)", file=sys.stderr, flush=True)
    saved_levels = _silence_torchelastic()
    folder, own_folder = _progress_dir()
    # torchelastic's own files go into the same folder, removed with it (by default they stay in the temp folder).
    args = torchrun_arguments(launch, argv, log_dir=os.path.join(folder, "torchelastic") if own_folder else None)
    # torch's c10d rendezvous hands its own store to the workers and keeps it across restarts, so restarted workers
    # would read the addresses the attempt before them published, and fail to connect. torch's opt-out gives each
    # attempt a store of its own (hosted by its rank 0). Set for this call only.
    shared_store = os.environ.get(_OWN_STORE_ENV)
    if launch.max_restarts:
        os.environ[_OWN_STORE_ENV] = "1"
    watcher = StoppedWorkers().start()
    restarts = RestartReport(launch, folder, watcher).start()
    own_threads = "OMP_NUM_THREADS" not in os.environ and launch.nproc_per_node > 1  # a user's value is kept
    if own_threads:
        os.environ["OMP_NUM_THREADS"] = str(threads_per_worker(launch.nproc_per_node))
    code = 0
    try:
        try:
            run(args)
        finally:
            _ignore_stop_signals()  # the workers have exited: what they did decides the status
    except ChildFailedError as exc:  # lists every failed rank of this node, the ones torchelastic stopped too
        line, code = describe_failure(exc.failures, read_progress(folder), launch.timeout_minutes, watcher.stopped)
        if line:
            print(line, file=sys.stderr)
    except SignalException as exc:  # Ctrl-C or a scheduler's SIGTERM; torchelastic has stopped the workers
        line, code = _describe_signal(exc.sigval, read_progress(folder))
        print(line, file=sys.stderr)
    except Exception as exc:  # no worker ran: the rendezvous or the start failed
        if launch.nnodes > 1:
            print(f"zerotrain: node {launch.node_rank}: not all {launch.nnodes} nodes joined at {launch.rdzv_endpoint} "
                  f"within {launch.rdzv_timeout_minutes:g} min (--launch.rdzv_timeout_minutes): start the same command "
                  f"with --launch.node_rank 0..{launch.nnodes - 1} on every node, and check that this node reaches "
                  f"that address ({type(exc).__name__})", file=sys.stderr)
        else:
            print(f"zerotrain: could not start the worker processes: {type(exc).__name__}: {' '.join(str(exc).split())}",
                  file=sys.stderr)
        code = 1
    finally:
        watcher.stop()
        restarts.stop()
        if own_threads:
            os.environ.pop("OMP_NUM_THREADS", None)
        if shared_store is None:
            os.environ.pop(_OWN_STORE_ENV, None)
        else:
            os.environ[_OWN_STORE_ENV] = shared_store
        _restore_levels(saved_levels)
        if own_folder:
            import shutil

            os.environ.pop(PROGRESS_ENV, None)
            os.environ.pop(PROGRESS_OWNER_ENV, None)
            shutil.rmtree(folder, ignore_errors=True)
    return code


_OWN_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
"""torch's switch (read by its c10d rendezvous) that gives each attempt of the workers a store of its own."""


def _describe_signal(sig: signal.Signals, progress: dict[int, dict]) -> tuple[str, int]:
    """The launcher itself got a stop signal; torchelastic forwarded it and waited for the workers."""

    if sig in SIGNALS and _saved_at_last_step(progress):
        # The workers saved a checkpoint at the step they stopped and exited (zerotrain.runtime.preemption): requeue.
        # Without that checkpoint a requeue would not resume where it stopped.
        return (f"zerotrain: stopped by {sig.name}; the workers saved a checkpoint (exit status {PREEMPTED_EXIT}: "
                f"requeue). {last_checkpoint_hint(progress)}", PREEMPTED_EXIT)
    if sig in SIGNALS:
        return (f"zerotrain: stopped by {sig.name} before the workers saved a checkpoint at their last step. "
                f"{last_checkpoint_hint(progress)}", 128 + int(sig))
    return f"zerotrain: interrupted ({sig.name})", 128 + int(sig)


def _default_sigint():
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGINT, signal.SIG_DFL)


def _ignore_stop_signals() -> None:
    """Ignore the stop signals from now on (main thread only: elsewhere Python cannot set a handler)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for name in FORWARDED_SIGNALS:
        signal.signal(getattr(signal, name), signal.SIG_IGN)


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


# --- what a worker leaves for the launcher: torchelastic's error file ---------------------------------


class ErrorFile(ErrorHandler):
    """The error handler a worker gives torchelastic's ``record``: how the worker ended, in its error file.

    A :class:`~zerotrain.errors.RunStopped` (a user error, a diverged loss, out of memory, a lost rank,
    a pre-emption) is recorded as its one line (``message``), its exit status (``errorCode``) and, for a
    lost rank, whether the collective timed out (``extraInfo``); any other exception as torchelastic's
    handler records it (its type, message and traceback). The file is written whole or not at all (beside
    it, then renamed): once one worker has failed, torchelastic stops the others and parses every failed
    worker's file, and a file cut short by that stop fails the parse and hides every failure of the job.
    ``record_exception`` is ``ErrorHandler``'s documented extension point.
    """

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def record_exception(self, e: BaseException) -> None:
        path = self._get_error_file_path()
        if path:
            _write_error_file(path, error_record(self.name, e))


def error_record(name: str, exc: BaseException) -> dict:
    """What :class:`ErrorFile` writes for ``exc`` raised by subcommand ``name`` (torchelastic's format)."""
    info: dict[str, Any] = {"timestamp": str(int(time.time()))}
    if isinstance(exc, RunStopped):
        message: dict[str, Any] = {"message": stop_line(name, exc), "errorCode": exc.exit_status}
        if isinstance(exc, RankLost):
            info["timed_out"] = exc.timed_out
    else:
        message = {"message": f"{type(exc).__name__}: {exc}"}
        info["py_callstack"] = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    message["extraInfo"] = info
    return {"message": message}


def stop_line(name: str, exc: RunStopped) -> str:
    """The one line that says ``exc`` (raised by subcommand ``name``), the same from any rank or launcher."""

    if isinstance(exc, Preempted):
        return f"zerotrain {name}: {exc} (exit status {exc.exit_status})"
    if isinstance(exc, RankLost):
        return f"zerotrain {name}: {exc}"
    origin = getattr(exc, "zerotrain_origin_rank", None)
    return f"zerotrain {name}: error: {exc}" + (f" (on rank {origin})" if origin not in (None, 0) else "")


def _write_error_file(path: str, record: dict) -> None:

    try:
        # ASCII (json's default): torchelastic reads the file in the locale's encoding, which may not be UTF-8
        atomic_write_text(path, json.dumps(record) + "\n")
    except OSError:
        pass


def _said(failure) -> Optional[dict]:
    """A worker's own record of a :class:`~zerotrain.errors.RunStopped` (line, status, ...), if it left one."""
    message = failure.message
    if not isinstance(message, dict) or not isinstance(message.get("message"), str):
        return None
    status = message.get("errorCode")
    if not isinstance(status, int):
        return None
    # The status it exited with, or torchelastic's stop signal: a worker still exiting after writing its record
    # (its process group closed, so the others fail at once) is stopped with the job, and its record is the cause.
    stopped_while_exiting = failure.exitcode < 0 and -failure.exitcode in _STOP_SIGNALS
    if status != failure.exitcode and not stopped_while_exiting:  # a record of an earlier attempt
        return None
    extra = message.get("extraInfo") if isinstance(message.get("extraInfo"), dict) else {}
    return {"line": message["message"], "status": status, "timed_out": bool(extra.get("timed_out"))}


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


def describe_failure(failures: dict, progress: Optional[dict[int, dict]] = None,
                     timeout_minutes: Optional[float] = None,
                     stopped: frozenset[int] | set[int] = frozenset()) -> tuple[str, int]:
    """One line about the worker that ended the job, and the launcher's exit status.

    ``failures`` is torchelastic's ``ChildFailedError.failures``: global rank -> ``ProcessFailure``
    (``exitcode``, ``local_rank``, ``pid``, ``timestamp``, ``message``: what the worker recorded, see
    :class:`ErrorFile`). It also lists the workers torchelastic stopped (SIGTERM, then SIGKILL after 30 s)
    once the first had failed; those are not the cause. ``progress`` is what :func:`read_progress` found
    (rank -> step, run folder), ``stopped`` the pids found stopped (SIGSTOP) when torchelastic began to stop
    the workers (:class:`StoppedWorkers`).

    In order: a worker's own line (a user error, a diverged loss, out of memory, a pre-emption: the lowest
    rank's); a worker that crashed (its traceback is above); a worker killed by a signal before any
    collective failed (128 + signal); a rank that stopped responding, or the others lost it on another
    node (:data:`~zerotrain.errors.RANK_LOST_EXIT`). Each names the rank, its last finished step (from its
    progress file) and the run's last complete checkpoint.
    """
    progress = progress or {}
    said = {r: rec for r, rec in ((r, _said(f)) for r, f in failures.items()) if rec is not None}
    lines = {r: rec for r, rec in said.items() if rec["status"] != RANK_LOST_EXIT}
    if lines:
        return lines[min(lines)]["line"], lines[min(lines)]["status"]

    unsaid = {r: f for r, f in failures.items() if f.exitcode in (USER_ERROR_EXIT, DIVERGED_EXIT, OOM_EXIT, PREEMPTED_EXIT)}
    if unsaid:  # stopped before it could leave its line
        rank = min(unsaid)
        return f"zerotrain: rank {rank} stopped on an error (exit status {unsaid[rank].exitcode})", unsaid[rank].exitcode

    def after(rank: int) -> str:
        step = progress.get(rank, {}).get("step")
        return "before its first step" if step is None else f"after step {step}"

    lost = {r: rec for r, rec in said.items() if rec["status"] == RANK_LOST_EXIT}
    stopped_ranks = sorted(r for r, f in failures.items() if f.pid in stopped)
    # A worker that left on torchelastic's SIGTERM outside the training loop (status 128 + 15) once another had
    # failed, or after being found stopped, is no cause either.
    crashed = {r: f for r, f in failures.items() if f.exitcode > 0 and r not in lost
               and not (f.exitcode - 128 in _STOP_SIGNALS and (lost or r in stopped_ranks))}
    if crashed:
        rank, failure = min(crashed.items(), key=lambda item: (item[1].timestamp, item[0]))
        return (f"zerotrain: rank {rank} (local rank {failure.local_rank}) failed with exit status {failure.exitcode} "
                f"{after(rank)}; its traceback, if any, is above", failure.exitcode)
    checkpoint = last_checkpoint_hint(progress)
    killed = {r: f for r, f in failures.items() if f.exitcode < 0 and -f.exitcode not in _STOP_SIGNALS}
    if lost:
        # A kill that came after a rank had reported a failed collective is torchelastic's own SIGKILL of a
        # worker that ignored its SIGTERM (a hung one), not the cause. Failure timestamps are whole seconds.
        first_report = min(failures[r].timestamp for r in lost)
        killed = {r: f for r, f in killed.items() if f.timestamp <= first_report + 1}
    if killed and not stopped_ranks:
        rank, failure = min(killed.items(), key=lambda item: (item[1].timestamp, item[0]))
        hint = " (out of memory?)" if failure.exitcode == -9 else ""
        return (f"zerotrain: rank {rank} (local rank {failure.local_rank}) was killed by {failure.signal_name()} "
                f"{after(rank)}{hint}; the job stopped. {checkpoint}", 128 - failure.exitcode)
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
            return f"zerotrain: rank {rank} stopped responding {after(rank)}; {stopped_after}. {checkpoint}", RANK_LOST_EXIT
        rank = min(lost)
        if any(rec["timed_out"] for rec in lost.values()):
            return (f"zerotrain: a rank on another node stopped responding (rank {rank} waited for it {after(rank)}; "
                    f"see that node's output); {stopped_after}. {checkpoint}", RANK_LOST_EXIT)
        return (f"zerotrain: rank {rank} lost its connection to another rank {after(rank)} (a process on another "
                f"node ended: see that node's output); the job stopped. {checkpoint}", RANK_LOST_EXIT)
    rank, failure = min(failures.items(), key=lambda item: (item[1].timestamp, item[0]))
    return (f"zerotrain: rank {rank} (local rank {failure.local_rank}) was killed by {failure.signal_name()} "
            f"{after(rank)}", 128 - failure.exitcode)


_STOP_SIGNALS = (15, 2)
"""SIGTERM and SIGINT: what torchelastic (or a user's Ctrl-C) sends to stop the workers, not a cause."""


def _saved_at_last_step(progress: dict[int, dict]) -> bool:
    """Whether the run's newest complete checkpoint is at the step the workers last finished."""
    run_dir = next((p["run_dir"] for p in progress.values() if p.get("run_dir")), None)
    if run_dir is None:
        return False

    folders = complete_checkpoints(Path(run_dir) / "checkpoints")
    steps = [p["step"] for p in progress.values() if p["step"] is not None]
    return bool(folders) and bool(steps) and read_marker(folders[-1]).get("step") == max(steps)


def last_checkpoint_hint(progress: dict[int, dict]) -> str:
    """'Last complete checkpoint: FOLDER (resume with ...)' for the run the workers wrote into."""
    run_dir = next((p["run_dir"] for p in progress.values() if p.get("run_dir")), None)
    if run_dir is None:
        return "No checkpoint: the workers had not started training"

    folders = complete_checkpoints(Path(run_dir) / "checkpoints")
    if not folders:
        return (f"No complete checkpoint in {run_dir} yet (--checkpoint.every_steps N saves one every N steps)")
    return (f"Last complete checkpoint: {folders[-1]} (resume with --checkpoint.resume auto "
            f"--trainer.run_name {Path(run_dir).name})")


# --- where each worker stands: a progress file per rank ------------------------------------------------

_STEP_WIDTH = 12
_PROGRESS: dict[str, Any] = {"step": None, "run_dir": None}
"""This process's last finished step and run folder, for the line of a collective that failed."""


def forget_progress() -> None:
    _PROGRESS.update(step=None, run_dir=None)


def progress() -> dict[str, Any]:
    """This process's last finished step and run folder (None before training started)."""
    return dict(_PROGRESS)


class Progress:
    """This rank's last finished step and run folder, in a file :func:`spawn_local_workers` reads when the job fails.

    torchelastic reports how each worker ended, not where it stood: a worker killed by a signal (SIGKILL, the
    out-of-memory killer) or stopped leaves no error file, yet the launcher's line names the step it had
    finished and the run whose checkpoints to resume from. So each worker writes them in
    ``$ZEROTRAIN_PROGRESS_DIR/rank<R>`` (the launcher's temporary folder on the node's local disk): the step
    rewritten in place at every optimizer step (one ``pwrite`` of a few bytes: no host-device sync, no
    collective), the run folder once. Without that variable (not this launcher's worker) no file is written.
    """

    def __init__(self, rank: int, run_dir: Path, step: int):
        _PROGRESS.update(step=step, run_dir=str(run_dir))
        self._fd: Optional[int] = None
        folder = os.environ.get(PROGRESS_ENV)
        if not folder:
            return
        try:
            self._fd = os.open(os.path.join(folder, f"rank{rank}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.write(self._fd, f"{step:>{_STEP_WIDTH}d}\n{run_dir}\n".encode())
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


def read_progress(folder: Optional[str]) -> dict[int, dict]:
    """rank -> {"step", "run_dir"} from the progress files in ``folder`` (what can be parsed; step None: not yet)."""
    out: dict[int, dict] = {}
    if not folder or not os.path.isdir(folder):
        return out
    for name in os.listdir(folder):
        if not re.fullmatch(r"rank\d+", name):
            continue
        try:
            step, run_dir = Path(folder, name).read_text().split("\n")[:2]
            # A blank step: a restarted worker that has not trained yet (see zerotrain.runtime.restarts.forget_step)
            out[int(name[4:])] = {"step": int(step) if step.strip() else None, "run_dir": run_dir or None}
        except (OSError, ValueError):
            continue
    return out


def _progress_dir() -> tuple[str, bool]:
    """The folder the workers write their progress into (inherited through the environment); whether we made it.

    A folder this launcher makes is named after its pid (``zerotrain-progress-<pid>-*``) and removed when it
    returns; a launcher killed (SIGKILL) cannot, so its workers remove it when they exit
    (:func:`remove_orphaned_progress_dir`), and the next launcher removes any whose launcher is gone.

    A folder named by the caller (one per node, as ours) may hold the records of an earlier job (progress files, the endings a restart
    replays): they are removed first, so this job's restarts and its failure line read only its own workers.
    """
    folder = os.environ.get(PROGRESS_ENV)
    if folder:
        os.makedirs(folder, exist_ok=True)
        for name in os.listdir(folder):
            if re.fullmatch(r"(final-)?rank\d+", name):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(folder, name))
        return folder, False
    import tempfile

    remove_stale_progress_dirs(tempfile.gettempdir())
    folder = tempfile.mkdtemp(prefix=f"zerotrain-progress-{os.getpid()}-")
    os.environ.update({PROGRESS_ENV: folder, PROGRESS_OWNER_ENV: str(os.getpid())})
    return folder, True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def remove_stale_progress_dirs(parent: str) -> list[str]:
    """Remove the progress folders in ``parent`` whose launcher is gone (no process with its pid); return them.

    Only this user's folders, named as :func:`_progress_dir` names them. A pid reused since by another process
    keeps its folder (a few bytes) until that process is gone too: never a live launcher's folder.
    """
    import shutil

    removed = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        m = _OWN_FOLDER.fullmatch(entry.name)
        try:
            if not m or not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
        except OSError:
            continue
        if not _alive(int(m.group(1))):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed


def _exiting(pid: int) -> bool:
    """Whether process ``pid`` is on its way out: a zombie, or a SIGKILL delivered (Linux's /proc)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return False
    if fields.get("State", "").strip().startswith(("Z", "X")):
        return True
    pending = int(fields.get("ShdPnd", "0").strip() or "0", 16) | int(fields.get("SigPnd", "0").strip() or "0", 16)
    return bool(pending & (1 << (signal.SIGKILL - 1)))


def remove_orphaned_progress_dir() -> bool:
    """In a worker about to exit: remove its launcher's progress folder when that launcher is gone (killed), as
    the launcher would have on its way out. True when it was removed. The launcher is gone once this process is
    no longer its child (re-parented), not when its pid is free, which another process may have taken since."""
    folder, owner = os.environ.get(PROGRESS_ENV), os.environ.get(PROGRESS_OWNER_ENV)
    if not folder or not owner or not owner.isdigit():
        return False
    m = _OWN_FOLDER.fullmatch(os.path.basename(folder.rstrip(os.sep)))
    if not m or m.group(1) != owner:
        return False
    if os.getppid() == int(owner):
        # A launcher being killed is this process's parent until its last thread has exited, which can take
        # longer than this worker's checkpoint (freeing a large address space): wait for that, not longer.
        deadline = time.monotonic() + 10
        while _exiting(int(owner)) and os.getppid() == int(owner) and time.monotonic() < deadline:
            time.sleep(0.02)
        if os.getppid() == int(owner):
            return False
    import shutil

    shutil.rmtree(folder, ignore_errors=True)
    return not os.path.exists(folder)


# --- a stopped worker -------------------------------------------------------------------------------------

def _children_every(period_s: float, done: threading.Event) -> Iterator[list]:
    """This process's children (``psutil.Process`` objects), every ``period_s`` until ``done`` is set: what the
    launcher's watching threads look at."""
    import psutil

    me = psutil.Process()
    while not done.wait(period_s):
        try:
            children = me.children()
        except psutil.Error:
            continue
        yield children


class StoppedWorkers:
    """Continue a stopped (SIGSTOP) worker as soon as torchelastic asks it to stop, and remember its pid.

    Once one worker has failed, torchelastic sends the others SIGTERM and SIGKILL 30 s later. A stopped
    process keeps the SIGTERM pending until it is continued, so the job would wait those 30 s; and the
    launcher's line names a rank found stopped as the one that stopped responding (once continued it only
    reports a lost connection, like every other rank). A thread of the launcher looks at its child processes
    every :attr:`PERIOD_S` and sends SIGCONT to one that is stopped with a stop signal pending, as a shell
    does after ``kill``. Linux only (``/proc``); elsewhere torchelastic's SIGKILL ends such a worker.
    """

    PERIOD_S = 0.2
    _PENDING = (1 << (signal.SIGTERM - 1)) | (1 << (signal.SIGINT - 1))

    def __init__(self) -> None:
        self.stopped: set[int] = set()
        self._done = threading.Event()

    def start(self) -> "StoppedWorkers":
        if sys.platform.startswith("linux"):
            threading.Thread(target=self._watch, name="zerotrain-stopped-workers", daemon=True).start()
        return self

    def stop(self) -> None:
        self._done.set()

    def _watch(self) -> None:
        for children in _children_every(self.PERIOD_S, self._done):
            for child in children:
                if child.pid not in self.stopped and self._asked_to_stop_while_stopped(child.pid):
                    self.stopped.add(child.pid)
                    try:
                        os.killpg(child.pid, signal.SIGCONT)  # torchelastic starts each worker with setsid(), in a process group of its own
                    except OSError:
                        pass

    def _asked_to_stop_while_stopped(self, pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            return False
        if not fields.get("State", "").strip().startswith(("T", "t")):
            return False
        pending = int(fields.get("ShdPnd", "0").strip() or "0", 16) | int(fields.get("SigPnd", "0").strip() or "0", 16)
        return bool(pending & self._PENDING)


# --- a restart of the workers ---------------------------------------------------------------------------

def restart_cause(failures: dict, progress: dict[int, dict], timeout_minutes: Optional[float] = None,
                  stopped: frozenset[int] | set[int] = frozenset()) -> str:
    """What ended an attempt of the workers, for the line of a restart: :func:`describe_failure`'s line without the
    prefix and what it says of the job's end (the job goes on)."""
    line, _ = describe_failure(failures, progress, timeout_minutes, stopped)
    return re.split(r"; the job stopped|; its traceback", line.removeprefix("zerotrain: "))[0]


def resume_point(progress: dict[int, dict]) -> str:
    """Where restarted workers resume: 'step S (FOLDER)' for the run's newest complete checkpoint, or the start."""
    run_dir = next((p["run_dir"] for p in progress.values() if p.get("run_dir")), None)
    folders = complete_checkpoints(Path(run_dir) / "checkpoints") if run_dir else []
    if not folders:
        return "the start (no complete checkpoint yet)"
    return f"step {read_marker(folders[-1]).get('step')} ({folders[-1]})"


class RestartReport:
    """One line on stderr per restart of the workers (``--launch.max_restarts``): restart k of N, which rank ended
    the attempt before it and how, and the step the workers resume from.

    torchelastic restarts the workers without saying why, and reaps each worker (taking its exit status) inside
    its monitor loop. A thread of the launcher waits for any child to end with ``waitid(WNOWAIT)``, which reads a
    worker's exit status (or killing signal) the moment it ends without reaping it, so torchelastic still gets it;
    another notes each worker's rank and attempt from its environment once it runs. When a worker of a new attempt
    appears, the failures of the attempt before it go through :func:`describe_failure`'s reasoning
    (:func:`restart_cause`). Linux only (``waitid``, ``/proc``); elsewhere the restarts happen without the line.
    """

    PERIOD_S = 0.05

    def __init__(self, launch: LaunchConfig, folder: str, stopped: "StoppedWorkers") -> None:
        self.launch, self.folder, self.stopped = launch, folder, stopped
        self.workers: dict[int, tuple[int, int, int, str]] = {}  # pid -> (rank, local rank, attempt, error file)
        self.ended: dict[int, Any] = {}  # pid -> its ProcessFailure (exit status 0 included)
        self.when: dict[int, float] = {}  # pid -> when it was seen to end (monotonic), its status seen or not
        self.progress: dict[int, dict[int, dict]] = {}  # attempt -> the progress files when its workers ended
        self.lines: list[str] = []
        self._said = 0
        self._done = threading.Event()

    def start(self) -> "RestartReport":
        if self.launch.max_restarts and sys.platform.startswith("linux"):
            threading.Thread(target=self._note_workers, name="zerotrain-restarts", daemon=True).start()
            threading.Thread(target=self._note_ends, name="zerotrain-worker-ends", daemon=True).start()
        return self

    def stop(self) -> None:
        self._done.set()

    def _note_workers(self) -> None:
        import psutil

        for children in _children_every(self.PERIOD_S, self._done):
            for child in children:
                if child.pid in self.workers:
                    continue
                try:
                    env = child.environ()
                except psutil.Error:
                    continue
                if "RANK" in env and env.get("TORCHELASTIC_RESTART_COUNT", "").isdigit():  # else not exec'd yet
                    self.workers[child.pid] = (int(env["RANK"]), int(env.get("LOCAL_RANK", "0")),
                                               int(env["TORCHELASTIC_RESTART_COUNT"]),
                                               env.get("TORCHELASTIC_ERROR_FILE", ""))
            alive = {child.pid for child in children}
            for pid in list(self.workers):
                if pid not in alive:
                    self.when.setdefault(pid, time.monotonic())
            newest = max((w[2] for w in self.workers.values()), default=0)
            if newest > self._said:
                self._said = newest
                self._say(newest)

    def _note_ends(self) -> None:
        from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

        while not self._done.is_set():
            try:
                found = [os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)]  # blocks until a child has ended
            except ChildProcessError:  # no child (yet, or any more)
                self._done.wait(self.PERIOD_S)
                continue
            except InterruptedError:
                continue
            for pid in list(self.workers):  # others that ended at the same moment, hidden behind the first
                if pid not in self.ended:
                    try:
                        found.append(os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT))
                    except ChildProcessError:  # reaped already, its status unseen: it ended before those found now
                        self.when.setdefault(pid, time.monotonic())
            for info in found:
                if info is None or info.si_pid in self.ended or info.si_pid not in self.workers:
                    continue
                _, local_rank, tried, error_file = self.workers[info.si_pid]
                exitcode = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
                self.when.setdefault(info.si_pid, time.monotonic())
                try:
                    self.ended[info.si_pid] = ProcessFailure(local_rank, info.si_pid, exitcode, error_file)
                except Exception:  # an error file torchelastic cannot parse either
                    continue
                self.progress[tried] = read_progress(self.folder)
            self._done.wait(0.01)  # until torchelastic has reaped it: waitid would return it again

    def _say(self, tried: int) -> None:
        if ended_for_good(self.folder):  # these workers only end as the attempt before did (not a restart)
            return
        before = tried - 1
        ended, workers = dict(self.ended), dict(self.workers)  # the watching thread adds to both meanwhile
        failures = {rank: ended[pid] for pid, (rank, _, k, _) in workers.items()
                    if k == before and pid in ended and ended[pid].exitcode != 0}
        progress = self.progress.get(before, {})
        cause = (restart_cause(failures, progress, self.launch.timeout_minutes, self.stopped.stopped) if failures
                 else "a worker ended")
        # On a loaded machine torchelastic may reap a worker before this thread runs: its status is lost. When such a
        # worker ended before any whose status was seen, it is the one that ended the attempt.
        unseen = {pid: w for pid, w in workers.items() if w[2] == before and pid not in ended}
        first_seen = min((self.when.get(pid, float("inf")) for pid in ended
                          if workers[pid][2] == before), default=float("inf"))
        early = [pid for pid in unseen if self.when.get(pid, float("inf")) < first_seen]
        if early:
            pid = min(early, key=lambda p: self.when[p])
            rank, local_rank = unseen[pid][0], unseen[pid][1]
            step = progress.get(rank, {}).get("step")
            cause = (f"rank {rank} (local rank {local_rank}) ended first, "
                     f"{'before its first step' if step is None else f'after step {step}'} (killed or crashed: its "
                     "exit status was taken before the launcher saw it)")
        line = (f"zerotrain: restart {tried} of {self.launch.max_restarts} (--launch.max_restarts): {cause}; "
                f"all workers restart and resume from {resume_point(progress)}")
        self.lines.append(line)
        print(line, file=sys.stderr, flush=True)


# --- a collective that failed because another rank is gone --------------------------------------------

_COLLECTIVE_FAILURE = re.compile(
    r"Timed out waiting|Connection (reset|closed) by peer|Application timeout caused pair closure|Broken pipe"
    r"|NCCL communicator was aborted|collective operation timeout", re.IGNORECASE)
"""What Gloo and NCCL say when the rank at the other end of a collective is gone or silent. Both raise a plain
RuntimeError (DistBackendError for some of NCCL's), so the text is all there is to tell it from a bug."""

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


def rank_lost(exc: BaseException, rank: int) -> Optional[RunStopped]:
    """``exc`` as a :class:`~zerotrain.errors.RankLost` naming ``rank`` and its last step, if it is a collective
    that failed because another rank is gone (None otherwise)."""
    timed_out = collective_failure(exc)
    if timed_out is None:
        return None
    step = _PROGRESS["step"]
    why = ("timed out (--launch.timeout_minutes): another rank stopped responding" if timed_out else
           "lost its connection: another rank ended (see its output)")
    where = "before its first step" if step is None else f"after step {step}"
    return RankLost(f"rank {rank}: a collective {why}, {where}; the job stopped", timed_out)
