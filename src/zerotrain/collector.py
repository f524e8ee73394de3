"""Python's garbage collector during training: collections at the same step on every rank, not at random.

CPython collects when its allocation counters say so, which is at a different moment in every process.
A collection pauses that process's host thread for as long as it takes to walk the tracked objects (many
after ``torch.compile`` and DeepSpeed have built theirs); in a multi-rank step the other ranks then wait for
it at the next collective, so each rank's pauses are paid by all of them. With ``--trainer.gc_every_steps N``
(N > 0) the loop instead takes everything built before training out of the collector's sight
(``gc.freeze``: it lives as long as the run), turns automatic collection off, and collects the young
generations every N steps, at the same step on every rank. The pause is then paid once for all ranks and
is short (only what training itself allocated since the last collection). torchtitan (``gc_freq``) and
Megatron-LM (``--manual-gc``) do the same for the same reason. 0 leaves Python's collector as it is.

The collector is restored when the loop ends, however it ends: automatic collection as it was, the frozen
objects handed back to it.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Callable, Iterator


@contextlib.contextmanager
def collections_every(steps: int) -> Iterator[Callable[[int], None]]:
    """Within the context, the collector as described above; yields the per-step call (``collect(step)``)
    that collects on every ``steps``-th step. With ``steps`` 0 the call does nothing and nothing changes."""
    if steps <= 0:
        yield lambda step: None
        return
    was_enabled = gc.isenabled()
    gc.collect()  # what set-up left as garbage goes now, not into the frozen generation
    gc.freeze()
    gc.disable()

    def collect(step: int) -> None:
        if step % steps == 0:
            gc.collect(1)

    try:
        yield collect
    finally:
        gc.unfreeze()
        if was_enabled:
            gc.enable()
