"""What DeepSpeed's own config classes know, read for zerotrain's validation of a user's JSON."""

from __future__ import annotations

from typing import Optional


def zero_optimization_keys() -> Optional[frozenset[str]]:
    """zero_optimization's keys from DeepSpeed's own config model (field names and their stage3_ aliases); None
    where this DeepSpeed's layout differs."""
    try:
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

        fields = DeepSpeedZeroConfig.model_fields
        return frozenset(list(fields) + [f.alias for f in fields.values() if f.alias])
    except Exception:
        return None


def builtin_optimizer_names() -> Optional[frozenset[str]]:
    """The optimizer types DeepSpeed builds itself (lower case); None where this DeepSpeed's layout differs."""
    try:
        from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

        return frozenset(DEEPSPEED_OPTIMIZERS)
    except Exception:
        return None
