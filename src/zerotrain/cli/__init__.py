"""``zerotrain`` command line: one module per subcommand, each mapping its arguments onto a library call.

An error that ends a run (:class:`~zerotrain.errors.RunStopped`: a user error, a diverged loss, out of GPU
memory, a rank lost, a pre-emption) is said in one line, and the command exits with the status its class
carries (2, 3, 5, 4, 75): no traceback for what the message already explains. :func:`main` maps them in one
place. A worker started by zerotrain's own launcher says nothing itself: its entry point is wrapped in
torchelastic's ``record``, which leaves the line in the worker's error file, and the launcher prints it once.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

from zerotrain.errors import RankLost, RunStopped, UserError
from zerotrain.runtime import restarts  # torch-free: a restarted worker that only replays an ending imports no more

SUBCOMMANDS = {
    "fit": "train a recipe (zerotrain fit RECIPE --help)",
    "benchmark": "sweep ZeRO stages / offload / DDP and tabulate speed and memory",
    "plan": "measure, predict and try configurations: the fastest that fits this machine",
    "estimate": "memory of every strategy (activations with --measure), and the first that fits",
    "predict": "predict with a finished run: IMDB labels, MLM fill-mask, LoRA generation",
    "export": "write a checkpoint as safetensors (any ZeRO stage, on CPU) or a Hugging Face folder (mlm)",
    "doctor": "report versions, GPUs, compilers and DeepSpeed op readiness",
    "launch": "write a SLURM, Kubernetes (PyTorchJob) or SkyPilot job for a fit command, requeue on pre-emption",
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
    if restarts.attempt() > 0:  # a restarted worker of zerotrain's launcher: not when the job ended for good
        replayed = restarts.replay_final()
        if replayed is not None:
            return replayed
        restarts.forget_step()
    import importlib

    module = importlib.import_module(f"zerotrain.cli.{name}")
    # Deferred here and below: the launcher imports torch's elastic package (3 s), and `zerotrain --help` or a
    # mistyped subcommand answers without it.
    from zerotrain.runtime.launcher import ErrorFile, error_record, remove_orphaned_progress_dir, under_own_launcher

    run = _collective_failures_as_rank_lost(module.run)
    worker = under_own_launcher()
    if worker:
        from torch.distributed.elastic.multiprocessing.errors import record

        run = record(run, error_handler=ErrorFile(name))
    try:
        return run(rest) or 0
    except KeyboardInterrupt:
        print("zerotrain: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        code = _stopped(name, exc, said_by_launcher=worker)
        if code is None:
            raise
        if worker:  # a restart cannot fix it: the restarted workers end the same way (see zerotrain.runtime.restarts)
            restarts.keep_final(code, error_record(name, exc))
        return code
    finally:
        if worker:  # a launcher killed (SIGKILL) could not remove its progress folder: the workers that outlive it do
            remove_orphaned_progress_dir()


def _stopped(name: str, exc: Exception, said_by_launcher: bool) -> Optional[int]:
    """Say how ``exc`` ended the command and return its exit status; None: a bug, whose traceback is due.

    A :class:`RunStopped` is said in one line, by rank 0 when every rank raised it, else by each rank that did
    (nothing is said in a worker of zerotrain's launcher, which says it once); its class carries the status.
    Another rank's error, raised here too so that every rank stops, ends this one with status 1: its
    traceback is that rank's (and rank 0's) to print, not this one's.
    """
    from zerotrain.runtime.launcher import last_checkpoint_hint, progress, stop_line

    if isinstance(exc, RunStopped):
        if not said_by_launcher and (exc.said_by_each_rank or _rank() == 0):
            line = stop_line(name, exc)
            if isinstance(exc, RankLost):
                line += f". {last_checkpoint_hint({0: progress()})}"
            print(line, file=sys.stderr, flush=True)
        _end_process_group()
        return exc.exit_status
    origin = getattr(exc, "zerotrain_origin_rank", None)
    if origin is None or origin == _rank() or _rank() == 0:
        return None
    _end_process_group()
    return 1


def _collective_failures_as_rank_lost(run):
    """``run`` raising :class:`RankLost` for a collective that failed because another rank died or hung."""

    def run_or_rank_lost(argv: list[str]) -> int:
        from zerotrain.runtime.launcher import rank_lost

        try:
            return run(argv)
        except RuntimeError as exc:
            lost = rank_lost(exc, _rank())
            if lost is None:
                raise
            raise lost from None
        except Exception as exc:
            denied = permission_denied(exc)
            if denied is None:
                raise
            raise denied from None

    return run_or_rank_lost


def permission_denied(exc: BaseException) -> Optional[UserError]:
    """One line for a file or folder this user may not read or write, wherever it was met (a data folder, a
    tokenizer, a checkpoint), when ``exc`` is, or was raised from, a PermissionError that names it."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, PermissionError) and exc.filename:
            return UserError(f"{exc.filename}: permission denied: give this user access to it (chmod), or pass "
                             "another path")
        exc = exc.__cause__ or exc.__context__
    return None


def _rank() -> int:
    """This process's rank in the job, from the launcher's ``RANK`` (0 when started alone).

    ``srun`` sets only ``SLURM_PROCID`` (zerotrain maps it onto ``RANK`` for the length of a fit): a
    task per GPU is that rank, and a launcher task per node prints only on node 0.
    """
    try:
        return int(os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or 0)
    except ValueError:
        return 0


def _end_process_group() -> None:
    """Destroy the process group on the way out, so NCCL/Gloo add no warnings after the error line.

    DeepSpeed's cached groups go with it (see ``destroy_process_groups``): ``main`` called in-process, in a
    group the fit did not make, is followed by other fits in the same process.
    """
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            # Deferred: torch is loaded by now, and the CLI's start (--help, a mistyped subcommand) goes without it.
            from zerotrain.engines.ds_private.groups import destroy_process_groups

            destroy_process_groups()
    except Exception:
        pass
