"""Collectives every rank calls the same way: objects and numbers across ranks, and a block rank 0 runs
first whose errors reach every rank. Plain torch.distributed, no zerotrain state: any module may use them."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from zerotrain.errors import RunStopped, UserError


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


def run_on_main(fn, serve: Optional[Callable[[Any], Any]] = None):
    """Call ``fn()`` on rank 0 only and return its result on every rank (it must pickle).

    If ``fn`` raises, every rank raises the same error, as in :func:`main_process_first`. Use it for
    checks only rank 0 makes, e.g. ``run_on_main(lambda: rundir.check_writable(tr.output_dir))``.
    ``serve``: for an ``fn`` that needs the other ranks in collectives of its own (gathering a partitioned
    model's weights), the other ranks call ``serve(request)`` for each :func:`ask_others` ``fn`` makes,
    in order, while they wait (a ``serve`` that raises leaves rank 0 in that collective until its timeout). Without
    torch.distributed, or in a group of one, it is ``fn()``.
    """
    if not _collectives_needed():
        return fn()
    if torch.distributed.get_rank() != 0:
        while (message := broadcast_object(None))[0] == _ASKED:
            if serve is None:
                raise RuntimeError("rank 0 asked for a collective that this rank's run_on_main was given no serve for")
            serve(message[1])
        _, failed, result = message
        if failed is not None:
            raise _rebuild_error(failed)
        return result
    try:
        result = fn()
        _check_picklable(result)
    except Exception as exc:
        broadcast_object((_DONE, _describe_error(exc), None))
        raise
    broadcast_object((_DONE, None, result))
    return result


_ASKED, _DONE = "asked", "done"


def ask_others(request: Any) -> None:
    """From inside :func:`run_on_main`'s ``fn`` on rank 0: every other rank calls its ``serve(request)`` now, so
    that a collective ``fn`` starts next has them all in. Alone, nothing."""
    if _collectives_needed():
        broadcast_object((_ASKED, request))


def raise_any_rank_error(exc: Optional[Exception]) -> None:
    """Called by every rank at the same point with the error its own part raised (None: it succeeded); returns
    only when no rank failed. A rank that failed raises its own error, the others the lowest failing rank's, as
    in :func:`main_process_first`, and a :class:`RunStopped` is then said once, by rank 0, since every rank
    raises it (``said_by_each_rank`` is cleared). Alone, it raises ``exc`` if given."""
    if not _collectives_needed():
        if exc is not None:
            raise exc
        return
    failures = [d for d in all_gather_object(None if exc is None else _describe_error(exc)) if d is not None]
    if not failures:
        return
    raised = exc if exc is not None else _rebuild_error(failures[0])
    if isinstance(raised, RunStopped):
        raised.said_by_each_rank = False
    raise raised


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
