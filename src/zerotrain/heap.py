"""Python's heap after the warm-up: collected once on every rank, then left out of later collections.

``torch.compile``, CUDA-graph recording and DeepSpeed's set-up leave a great many long-lived Python objects
behind (graphs, guards, generated code). Each full pass of the garbage collector walks all of them, and it
runs when the count of surviving objects has grown by a quarter, which falls on a different step on each
rank (rank 0 logs and so allocates more). On several ranks one rank's pause holds every other rank at the
step's next collective. :class:`FrozenHeap` collects once, at the same step on every rank (the warm-up's
last), and moves what survives into the permanent generation (``gc.freeze``): later passes walk only what
training has allocated since. Nothing is lost: the collection just before the freeze frees the garbage,
and objects freed by their reference counts are freed as before.
"""

from __future__ import annotations

import gc
import time
from typing import Optional


class FrozenHeap:
    """Call :meth:`step` after each optimizer step; :meth:`close` when training ends (the process's
    collector is as it was)."""

    def __init__(self, enabled: bool, after_steps: int):
        self._at = max(1, after_steps) if enabled else None
        self._steps = 0
        self._frozen = False

    def step(self) -> Optional[float]:
        """Seconds the collection took, on the step that froze the heap; None on every other step."""
        self._steps += 1
        if self._steps != self._at:
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
