"""Models built partitioned under ZeRO-3: the block the training loop builds the recipe's model in.

Under ZeRO-3 each rank keeps only its part of every parameter. A model built whole first, on every rank, costs
each process the whole model in host memory before DeepSpeed partitions it. Inside
:func:`partitioned_construction` a model loader that knows how (:mod:`zerotrain.models.hf`) builds the model
inside DeepSpeed's ``zero.Init`` instead, reading :func:`zero3_config` for the DeepSpeed JSON; code that does not
ask builds whole models as before.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator, Optional

_ZERO3: contextvars.ContextVar[Optional[dict[str, Any]]] = contextvars.ContextVar("zerotrain_zero3", default=None)


@contextlib.contextmanager
def partitioned_construction(ds: dict[str, Any]) -> Iterator[bool]:
    """Models built in this block may be built partitioned as ``ds`` (a ZeRO-3 DeepSpeed JSON) partitions them:
    :func:`zero3_config` returns ``ds`` inside. Yields True."""
    token = _ZERO3.set(ds)
    try:
        with _freed_blocks_returned():
            yield True
    finally:
        _ZERO3.reset(token)


def zero3_config() -> Optional[dict[str, Any]]:
    """The DeepSpeed JSON models are built partitioned for here, or None: build the whole model."""
    return _ZERO3.get()


# glibc's mallopt parameter, and the threshold its dynamic rule rises to at most on 64-bit hosts.
_M_MMAP_THRESHOLD, _GLIBC_MMAP_THRESHOLD_MAX = -3, 32 * 2**20


@contextlib.contextmanager
def _freed_blocks_returned(threshold: int = 2**20) -> Iterator[None]:
    """Blocks of ``threshold`` bytes or more freed in this block go back to the operating system at once.

    Building partitioned allocates each parameter whole, copies this rank's part out and frees the whole one.
    glibc's malloc serves blocks below its mmap threshold from its heap, which keeps freed blocks for reuse, and it
    raises that threshold to the largest block freed so far: measured on a 47M-parameter Llama built on one rank,
    the freed tensors stayed in the process, 0.9x the model on top of its partition. With a fixed threshold of 1
    MiB they are unmapped as they are freed. Afterwards the threshold is glibc's own ceiling, where its dynamic
    rule ends once a block that large was freed; glibc has no way back to the dynamic rule itself, so this stays
    for the rest of the process (blocks under 32 MiB then come from the heap). Elsewhere than glibc, nothing
    changes.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        yield
        return
    pinned = bool(mallopt(_M_MMAP_THRESHOLD, threshold))
    try:
        yield
    finally:
        if pinned:
            mallopt(_M_MMAP_THRESHOLD, _GLIBC_MMAP_THRESHOLD_MAX)


