"""zerotrain: train transformer models on DeepSpeed ZeRO with one command and no hand-written JSON."""

from __future__ import annotations

__version__ = "0.1.0"


def fit(task):
    """Train ``task`` (a :class:`zerotrain.tasks.base.Task`); see :func:`zerotrain.train.loop.fit`."""
    from zerotrain.train.loop import (
        fit as _fit,  # deferred: `import zerotrain` stays free of torch and DeepSpeed
    )

    return _fit(task)


__all__ = ["fit", "__version__"]
