"""DeepSpeed's ZeRO-to-fp32 consolidation, the internal module zerotrain's export reads ZeRO-1/2/3 weights with."""

from __future__ import annotations

from typing import Any


def fp32_state_dict_lazy(checkpoint_dir: str, tag: str) -> dict[str, Any]:
    """name -> lazy tensor of the full fp32 weights of ZeRO checkpoint ``checkpoint_dir/tag`` (DeepSpeed's
    ``get_fp32_state_dict_from_zero_checkpoint`` in lazy mode: a tensor is read when materialised)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=tag, lazy_mode=True)


def import_consolidator() -> None:
    """Import the consolidation module (its import guesses DeepSpeed's accelerator, which callers may want done
    under a set environment)."""
    import deepspeed.utils.zero_to_fp32  # noqa: F401
