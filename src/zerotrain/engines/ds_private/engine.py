"""Private reads of DeepSpeed's engine that zerotrain's engine needs and the public API does not offer."""

from __future__ import annotations

from typing import Any

import torch


def zero3_consolidated_state_dict(engine: Any) -> dict[str, torch.Tensor]:
    """The full 16-bit state dict of a ZeRO-3 ``engine``, gathered from every rank (a collective: every rank
    calls it; rank 0's result holds the tensors). DeepSpeed's ``save_16bit_model`` writes the same dict to a
    file; zerotrain writes safetensors itself."""
    return engine._zero3_consolidated_16bit_state_dict()
