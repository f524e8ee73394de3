"""ZeRO-1/2's gradient clipping and norm mask without a host-device synchronisation (DeepSpeed 0.19.8).

DeepSpeed makes the host wait for the GPU in ZeRO-1/2's clip path, each time for the whole backward
and the gradient reduction to finish before it may queue the optimizer's kernels:

* ``unscale_and_clip_grads`` asks ``if is_invalid_grad_norm(norm)``, a Python ``bool`` of a GPU tensor.
  :func:`clip_without_sync` gives one optimizer instance the same arithmetic with that choice made on
  the device by ``torch.where``: a norm that is not finite or is negative (DeepSpeed's -1 sentinel)
  still clips with an infinite norm, which zeroes the gradient.
* ``mask_nan_or_inf_with_val_inplace``, which turns an inf/NaN norm into -1, builds its -1 with
  ``torch.tensor(-1.0, device=...)`` (a copy from pageable host memory, which waits) and fills with that
  tensor (``masked_fill_`` reads a tensor value with ``.item()``, which waits again).
  :func:`mask_nan_or_inf` fills with the number; zerotrain's one-launch norm
  (:func:`zerotrain.engines.ds_private.zero_host.norm_in_one_launch`) calls it.
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch


def is_zero12(optimizer: Any) -> bool:
    """Whether ``optimizer`` is DeepSpeed's ZeRO-1/2 optimizer."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return isinstance(optimizer, DeepSpeedZeroOptimizer)


def clip_without_sync(optimizer: Any) -> Callable[[], None]:
    """Give a ZeRO-1/2 ``optimizer`` the sync-free clip; returns the undo (DeepSpeed's method again)."""
    optimizer.unscale_and_clip_grads = types.MethodType(_unscale_and_clip_grads, optimizer)

    def undo() -> None:
        del optimizer.unscale_and_clip_grads
    return undo


def _unscale_and_clip_grads(self: Any, grad_groups_flat: list, total_norm: Any) -> None:
    """``DeepSpeedZeroOptimizer.unscale_and_clip_grads``, the same operations in the same order on a valid
    norm (so bitwise the same gradients), with the invalid-norm branch computed on the device."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if not torch.is_tensor(total_norm):  # a Python float costs no wait: DeepSpeed's own code
        return DeepSpeedZeroOptimizer.unscale_and_clip_grads(self, grad_groups_flat, total_norm)
    if self.clip_grad == 0.0 and self.loss_scale == 1.0:
        return None
    combined_scale = self.loss_scale
    # Only a Python 1.0 is skipped: comparing a tensor scale (override_loss_scale) would read it to the host
    unit_scale = isinstance(self.loss_scale, (int, float)) and self.loss_scale == 1.0
    if self.clip_grad > 0.0:
        # Invalid (not finite, or DeepSpeed's -1) becomes inf: a NaN and the -1 fail ">= 0", inf stays inf.
        clip_norm = torch.where(total_norm >= 0, total_norm, float("inf"))
        if not unit_scale:  # bf16 and fp32 train at 1.0, where both operations return x exactly
            clip_norm = clip_norm / self.loss_scale  # the norm is norm * loss scale
        clip = (clip_norm + 1e-6) / self.clip_grad
        combined_scale = torch.clamp(clip, min=1.0)
        if not unit_scale:
            combined_scale = combined_scale * self.loss_scale
    for grad in grad_groups_flat:
        for g in grad if isinstance(grad, list) else [grad]:
            g.data.mul_(1.0 / combined_scale)
    return None


def mask_nan_or_inf(input: torch.Tensor, device: Any = None, val: float = -1.0) -> None:
    """DeepSpeed's ``mask_nan_or_inf_with_val_inplace``: an inf or NaN entry becomes -1 in place, filled with the
    number (no wait). Like DeepSpeed's, it fills -1 whatever ``val`` is (its callers all pass the default)."""
    input.masked_fill_(input.isnan().logical_or(input.isinf()), -1.0)
