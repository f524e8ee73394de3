"""Python's heap after the warm-up: collected once on every rank, then left out of later collections.

``torch.compile``, CUDA-graph recording and DeepSpeed's set-up leave a great many long-lived Python objects
behind (graphs, guards, generated code). Each full pass of the garbage collector walks all of them, and
a pass runs once the surviving objects have grown by a quarter, at a step that differs from rank to rank
(each rank allocates a little differently). On several ranks, a rank in a long pass holds every other rank
at the step's next collective: on 4 x H200 the ranks' full passes took 0.3-0.7 s added together, in the
last 10 steps of every unfrozen 4-GPU run (measured on 4 GPUs). :class:`FrozenHeap` collects once,
at the same step on every rank (the warm-up's last), and moves what survives into the permanent generation
(``gc.freeze``): later passes walk only what training has allocated since (and what is compiled later:
new shapes, evaluation). The garbage at that step is freed by the collection first; an object that was
alive then and becomes cyclic garbage later stays until the heap is thawed (:meth:`FrozenHeap.close`).
"""

from __future__ import annotations

import gc
import time
from typing import Optional


class FrozenHeap:
    """Call :meth:`step` after each optimizer step; :meth:`close` when training ends, however it ends.

    ``after_steps``: the steps this process runs before freezing (at least 1: the first step compiles).
    No freeze when the run has no step left after that one (a collection for nothing), or when something
    else in the process froze the heap already (it manages the collector; thawing would undo its work)."""

    def __init__(self, enabled: bool, after_steps: int, steps_to_run: int):
        at = max(1, after_steps)
        self._at = at if enabled and at < steps_to_run else None
        self._steps = 0
        self._frozen = False

    def step(self) -> Optional[float]:
        """Seconds the collection took, on the step that froze the heap; None on every other step."""
        self._steps += 1
        if self._steps != self._at or gc.get_freeze_count():
            return None
        start = time.perf_counter()
        gc.collect()
        gc.freeze()
        self._frozen = True
        return time.perf_counter() - start

    def close(self) -> None:
        if self._frozen:
            gc.unfreeze()  # back into the oldest generation, where the next full pass finds them
            self._frozen = False
