"""``zerotrain`` command line: one module per subcommand, each mapping its arguments onto a library call.

A :class:`~zerotrain.errors.UserError` raised anywhere below is printed as one line naming the
flag or file, and the command exits with status 2: no traceback for mistakes a user can fix.
A run whose loss diverged ends in one line and status 3 (:data:`~zerotrain.errors.DIVERGED_EXIT`); one
that ran out of GPU memory, in one line with what to try and status 5 (:data:`~zerotrain.errors.OOM_EXIT`); a
collective that failed because another rank died or hung, in status 4
(:data:`~zerotrain.runtime.launcher.RANK_LOST_EXIT`), with the line said by the launcher when there is one.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

from zerotrain.errors import (
    DIVERGED_EXIT,
    OOM_EXIT,
    OutOfMemory,
    TrainingDiverged,
    UserError,
)

SUBCOMMANDS = {
    "fit": "train a recipe (zerotrain fit RECIPE --help)",
    "benchmark": "sweep ZeRO stages / offload / DDP and tabulate speed and memory",
    "plan": "measure, predict and try configurations: the fastest that fits this machine",
    "estimate": "memory of every strategy (activations with --measure), and the first that fits",
    "predict": "predict with a finished run: IMDB labels, MLM fill-mask, LoRA generation",
    "export": "write a checkpoint as safetensors (any ZeRO stage, on CPU) or a Hugging Face folder (mlm)",
    "doctor": "report versions, GPUs, compilers and DeepSpeed op readiness",
}


def _usage() -> str:
    lines = ["usage: zerotrain SUBCOMMAND ...", "", "subcommands:"]
    lines += [f"  {name:<11}{desc}" for name, desc in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"zerotrain: error: unknown subcommand {name!r}: choose one of {', '.join(SUBCOMMANDS)} "
              "(zerotrain --help describes them)", file=sys.stderr)
        return 2
    import importlib

    module = importlib.import_module(f"zerotrain.cli.{name}")
    from zerotrain.runtime.preemption import PREEMPTED_EXIT, Preempted

    try:
        return module.run(rest) or 0
    except Preempted as exc:  # SIGTERM/SIGINT/SIGUSR1: the checkpoint is written; ask the scheduler to requeue
        if _rank() == 0:
            print(f"zerotrain {name}: {exc} (exit status {PREEMPTED_EXIT})", file=sys.stderr, flush=True)
        _end_process_group()
        if "TORCHELASTIC_RUN_ID" in os.environ:  # a worker: no interpreter teardown to abort the exit status
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(PREEMPTED_EXIT)
        return PREEMPTED_EXIT
    except UserError as exc:
        # In a job every rank stops on the error (zerotrain.runtime.collectives.main_process_first shares one
        # found on a single rank); rank 0 says it once, and all ranks exit 2.
        origin = getattr(exc, "zerotrain_origin_rank", None)
        line = f"zerotrain {name}: error: {exc}" + (f" (on rank {origin})" if origin not in (None, 0) else "")
        if _rank() == 0:
            print(line, file=sys.stderr, flush=True)
        _tell_launcher(line, printed=_rank() == 0)
        _end_process_group()
        return 2
    except TrainingDiverged as exc:
        # Every rank raises it at the same log step (it is decided on all-reduced values): rank 0 says it.
        line = f"zerotrain {name}: error: {exc}"
        if _rank() == 0:
            print(line, file=sys.stderr, flush=True)
        _tell_launcher(line, printed=_rank() == 0, code=DIVERGED_EXIT)
        _end_process_group()
        return DIVERGED_EXIT
    except OutOfMemory as exc:
        # Raised by the rank(s) that ran out, maybe not rank 0. Under zerotrain's own launcher the workers
        # leave the line in their error file and the launcher prints the lowest rank's, once, however many
        # ran out at the same step; started otherwise (alone, torchrun, srun) the rank that ran out says it.
        line = f"zerotrain {name}: error: {exc}"
        error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
        to_launcher = bool(error_file) and not os.path.exists(error_file) and _under_own_launcher()
        if not to_launcher:
            print(line, file=sys.stderr, flush=True)
        _tell_launcher(line, printed=not to_launcher, code=OOM_EXIT)
        _end_process_group()
        if "TORCHELASTIC_RUN_ID" in os.environ:  # a worker: the other ranks' broken collectives must not hang it
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(OOM_EXIT)
        return OOM_EXIT
    except KeyboardInterrupt:
        print("zerotrain: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        from zerotrain.runtime.launcher import collective_failure

        timed_out = collective_failure(exc)
        if timed_out is not None:  # another rank died or hung: not this rank's bug, no traceback
            return _rank_lost(name, timed_out)
        # Another rank's error, raised here too so that every rank stops: its traceback is that
        # rank's (and rank 0's) to print, not this one's.
        origin = getattr(exc, "zerotrain_origin_rank", None)
        if origin is None or origin == _rank() or _rank() == 0:
            raise
        _end_process_group()
        return 1


def _rank() -> int:
    """This process's rank in the job, from the launcher's ``RANK`` (0 when started alone).

    ``srun`` sets only ``SLURM_PROCID`` (zerotrain maps it onto ``RANK`` for the length of a fit): a
    task per GPU is that rank, and a launcher task per node prints only on node 0.
    """
    try:
        return int(os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or 0)
    except ValueError:
        return 0


def _under_own_launcher() -> bool:
    """Whether this process is a worker of ``spawn_local_workers`` (which reads the workers' error files)."""
    from zerotrain.runtime.launcher import HEARTBEAT_ENV

    return HEARTBEAT_ENV in os.environ


def _rank_lost(name: str, timed_out: bool) -> int:
    """A collective failed because another rank is gone (``timed_out``: it stopped responding).

    Under zerotrain's own launcher (``spawn_local_workers``) the worker says nothing: it leaves what it
    saw in its error file, and the launcher, which knows which worker died or was stopped and where
    each stood (heartbeat files), prints the one line. Under another launcher each surviving rank
    says it in one line. Either way the status is ``RANK_LOST_EXIT``.
    """
    import time

    from zerotrain.runtime.launcher import (
        HEARTBEAT_ENV,
        LOST_FILE_KEY,
        RANK_LOST_EXIT,
        progress,
    )

    where = progress()
    step = "before its first step" if where["step"] is None else f"after step {where['step']}"
    why = ("timed out (--launch.timeout_minutes): another rank stopped responding" if timed_out else
           "lost its connection: another rank ended (see its output)")
    line = f"zerotrain {name}: rank {_rank()}: a collective {why}, {step}; the job stopped"
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path and HEARTBEAT_ENV in os.environ:
        _write_error_file(path, {"message": line, "timestamp": int(time.time()),
                                 LOST_FILE_KEY: {"timed_out": timed_out, "step": where["step"], "time": time.time()}})
    else:
        from zerotrain.runtime.launcher import _last_checkpoint_hint

        print(f"{line}. {_last_checkpoint_hint({0: where})}", file=sys.stderr, flush=True)
    _end_process_group()
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a worker: the teardown of a broken group must not hang or abort
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(RANK_LOST_EXIT)
    return RANK_LOST_EXIT


def _tell_launcher(line: str, printed: bool, code: int = 2) -> None:
    """Leave the error in torchelastic's error file of this worker, for ``spawn_local_workers`` to find.

    A node whose workers do not include rank 0 then still prints the line. The key is
    ``zerotrain.errors.ERROR_FILE_KEY``; the format is the one torchelastic reads (a ``message``
    string and a ``timestamp``).
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    import time

    _write_error_file(path, {"message": line, "timestamp": int(time.time()),
                             "zerotrain_user_error": {"printed": printed, "exit": code}})


def _write_error_file(path: str, record: dict) -> None:
    """Write a worker's torchelastic error file whole or not at all (beside it, then renamed).

    Once one worker has failed, torchelastic stops the others and parses every failed worker's file; a file it
    finds cut short, by a worker stopped while it wrote, fails that parse, and the launcher could then only
    report "could not start the worker processes" (seen in CI: rank 0 lost its all-reduce to rank 1's OOM and was
    killed while it wrote). A file never written is read as a worker that left no reply, which the launcher
    reports as it should."""
    import json

    from zerotrain.data.io import atomic_write_text

    try:
        # ASCII (json's default): torchelastic reads the file in the locale's encoding, which may not be UTF-8
        atomic_write_text(path, json.dumps(record) + "\n")
    except OSError:
        pass


def _end_process_group() -> None:
    """Destroy the process group on the way out, so NCCL/Gloo add no warnings after the error line."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
