"""DeepSpeed's checkpoint files, read without running code: the DeepSpeed classes they hold, by dotted name."""

from __future__ import annotations

DS_SAFE_GLOBALS = ("deepspeed.runtime.fp16.loss_scaler.LossScaler", "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
                   "deepspeed.runtime.zero.config.ZeroStageEnum", "deepspeed.utils.tensor_fragment.fragment_address")
"""The classes DeepSpeed's checkpoint files hold besides tensors and containers (found by
``torch.serialization.get_unsafe_globals_in_checkpoint`` on ZeRO-0..3 checkpoints): plain records,
rebuilt by the weights-only unpickler without calling any of their code."""


def ds_safe_globals() -> list[type]:
    import importlib

    out = []
    for dotted in DS_SAFE_GLOBALS:
        module, _, name = dotted.rpartition(".")
        try:
            out.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):  # another DeepSpeed version: a file that needs it is refused
            pass
    return out
