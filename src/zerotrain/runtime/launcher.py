"""How the processes of a job start, and what the user hears when one of them fails.

zerotrain reads the environment the usual launchers write (torchrun, the ``deepspeed`` launcher,
SLURM's ``srun``) and, when started alone with ``--launch.nproc_per_node N``, starts the N
processes itself through torchrun's own library (``torch.distributed.run``). Nothing here
re-implements a rendezvous. When a worker fails, the launcher reports it in one line: which rank,
its last step (from a per-rank heartbeat file) and the last complete checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from pathlib import Path
from typing import Any, Optional

from zerotrain.config import LaunchConfig
from zerotrain.errors import ERROR_FILE_KEY, USER_ERROR_EXIT

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                      "MASTER_ADDR", "MASTER_PORT")
"""The variables a process joins a torchrun job by."""


def environment_alone() -> dict[str, str]:
    """This process's environment without what would make a child join this job (torchrun's and
    SLURM's variables): for a helper process that must run on its own, such as the memory probe."""
    return {k: v for k, v in os.environ.items()
            if k not in TORCHRUN_VARIABLES and not k.startswith(("SLURM_", "TORCHELASTIC_"))}


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
    # Each flag only where this torch's torchrun has it (torch 2.11 has the first, not the second):
    # forward SLURM's --signal=USR1 too (by default it would kill this launcher and orphan the workers),
    # and give the workers time to save their pre-emption checkpoint before torchelastic's SIGKILL.
    if "--signals-to-handle" in known:
        args.append("--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")
    if "--shutdown-timeout" in known:
        args.append(f"--shutdown-timeout={PREEMPTION_SAVE_TIMEOUT_S}")
    args += ["-m", "zerotrain", *argv]
    # Until the workers start, the launcher sits in TCPStore's C++ wait, where Python's KeyboardInterrupt is
    # never delivered: Ctrl-C must end the process at once. torchelastic installs its own SIGINT handler
    # (stop the workers, then raise) when it starts them. Set before the line that promises "Ctrl-C stops":
    # a process started with SIGINT ignored (inherited from its parent) would otherwise lose an early Ctrl-C.
    saved_sigint = _default_sigint()
    if launch.nnodes > 1:
        print(f"zerotrain: node {launch.node_rank} of {launch.nnodes}: waiting up to {launch.rdzv_timeout_minutes:g} min "
              f"(--launch.rdzv_timeout_minutes) for all {launch.nnodes} nodes to join at {launch.rdzv_endpoint} "
              "(Ctrl-C stops)", file=sys.stderr, flush=True)
    saved_levels = _silence_torchelastic()
    heartbeats, own_heartbeats = _heartbeat_dir()
    stopped: set[int] = set()
    undo_close = _continue_stopped_workers(stopped)
    undo_parse = _unparsable_error_files_read_as_none()
    try:
        run(parser.parse_args(args))
    except ChildFailedError as exc:  # lists every failed rank of this node, the ones torchelastic stopped too
        return _report_worker_failure(exc.failures, read_heartbeats(heartbeats), launch.timeout_minutes, stopped)
    except SignalException as exc:  # Ctrl-C or a scheduler's SIGTERM; torchelastic has stopped the workers
        from zerotrain.runtime.preemption import PREEMPTED_EXIT, SIGNALS

        progress = read_heartbeats(heartbeats)
        if exc.sigval in SIGNALS and _saved_at_last_step(progress):
            # Forwarded to the workers, which saved a checkpoint at the step they stopped and exited
            # (zerotrain.runtime.preemption): requeue. Without that checkpoint a requeue would not resume where it stopped.
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
            print(f"zerotrain: could not start the worker processes: {type(exc).__name__}: {' '.join(str(exc).split())}",
                  file=sys.stderr)
        return 1
    finally:
        undo_close()
        undo_parse()
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

    In order: an error a worker printed already (a UserError, a diverged loss) adds nothing, and one it left
    in its error file for this launcher to print (out of GPU memory: the lowest rank's line) is printed; all workers
    pre-empted; a worker that crashed (its traceback is above); a worker killed by a signal before any
    collective failed (128 + signal); a rank that stopped responding, or the others lost it on another
    node (:data:`RANK_LOST_EXIT`). Each line names the rank, its last finished step (heartbeat) and the
    run's last complete checkpoint.
    """
    from zerotrain.errors import DIVERGED_EXIT, OOM_EXIT

    progress = progress or {}

    def record(failure, key: str = ERROR_FILE_KEY) -> dict | None:  # left by zerotrain.cli in the worker's error file
        data = failure.error_file_data
        found = data.get(key) if isinstance(data, dict) else None
        return found if isinstance(found, dict) else None

    own_line = (USER_ERROR_EXIT, DIVERGED_EXIT, OOM_EXIT)  # the CLI's exit statuses of an error said in one line
    announced = {r: f for r, f in failures.items() if f.exitcode in own_line or record(f) is not None}
    if announced:
        code = next((f.exitcode for f in announced.values() if f.exitcode in own_line),
                    None) or next(int(record(f).get("exit", USER_ERROR_EXIT)) for f in announced.values())
        # Rank 0 prints a user error or a diverged loss itself; an out-of-memory line is left to this launcher.
        printed = any((record(f) or {}).get("printed") or (r == 0 and f.exitcode == code and code != OOM_EXIT)
                      for r, f in announced.items())
        if not printed:  # rank 0 runs on another node (or was stopped before it could print): say it here
            rank = min(announced, key=lambda r: (record(announced[r]) is None, r))
            print(announced[rank].message if record(announced[rank]) else
                  f"zerotrain: rank {rank} stopped on an error (exit status {code})", file=sys.stderr)
        return code
    from zerotrain.runtime.preemption import PREEMPTED_EXIT

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
    from zerotrain.checkpoint.layout import complete_checkpoints, read_marker

    folders = complete_checkpoints(Path(run_dir) / "checkpoints")
    last = max(p["step"] for p in progress.values())
    return bool(folders) and read_marker(folders[-1]).get("step") == last


def _last_checkpoint_hint(progress: dict[int, dict]) -> str:
    """'Last complete checkpoint: FOLDER (resume with ...)' for the run the workers wrote into."""
    run_dir = next((p["run_dir"] for p in progress.values() if p.get("run_dir")), None)
    if run_dir is None:
        return "No checkpoint: the workers had not started training"
    from zerotrain.checkpoint.layout import complete_checkpoints

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


def forget_progress() -> None:
    _PROGRESS.update(step=None, run_dir=None)


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


def _unparsable_error_files_read_as_none():
    """Have torchelastic read a worker's error file that it cannot parse as no file at all; return the undo.

    torchelastic's ``ProcessFailure`` re-raises such a parse error, which escapes its ``run`` and hides every
    failure of the job (an out-of-memory line and its status included) behind "could not start the worker
    processes". zerotrain's workers write their files whole or not at all (``zerotrain.cli``), but a worker
    killed while torchelastic's own error handler wrote one (a user's ``@record``) leaves it cut short."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    parse = ProcessFailure.__post_init__

    def parse_or_none(failure) -> None:
        try:
            parse(failure)
        except Exception:  # empty, cut short, not JSON, no "message", not decodable
            failure.error_file = ""  # not a file: torchelastic's reading of a worker that left no reply
            parse(failure)

    ProcessFailure.__post_init__ = parse_or_none
    return lambda: setattr(ProcessFailure, "__post_init__", parse)


def _continue_stopped_workers(stopped: set[int]):
    """Make torchelastic's stop signal reach a stopped (SIGSTOP) worker at once; return the undo.

    torchelastic stops the other workers of a failed job with SIGTERM and sends SIGKILL 30 s later.
    A stopped process keeps SIGTERM pending until it is continued, so the job waited those 30 s: send
    SIGCONT right after the stop signal, as shells do. The pids found stopped are added to ``stopped``
    (the report names such a rank as the one that stopped responding).
    """
    import signal

    try:
        from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import (
            SubprocessHandler,
        )
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
