"""ZeRO's gradient norm and clipping without a host-device synchronisation.

DeepSpeed (0.19.8) makes the host wait for the GPU three times a step in ZeRO-1/2's clip path, each
time for the whole backward and the gradient reduction to finish before it may queue the optimizer's
kernels. On one H200 the GPU sat idle 8.2 ms of the compiled BERT-base step under ZeRO-1 (BENCHMARKS.md,
session 13), and on two GPUs ``benchmarks/sync_sites.py`` found these waits left in the step (session 14):

* ``unscale_and_clip_grads`` asks ``if is_invalid_grad_norm(norm)``, a Python ``bool`` of a GPU tensor.
  :func:`clip_without_sync` gives one optimizer instance the same arithmetic with that choice made on
  the device by ``torch.where``: a norm that is not finite or is negative (DeepSpeed's -1 sentinel)
  still clips with an infinite norm, which zeroes the gradient.
* ``mask_nan_or_inf_with_val_inplace``, which turns an inf/NaN norm into -1, builds its -1 with
  ``torch.tensor(-1.0, device=...)`` (a copy from pageable host memory, which waits) and fills with that
  tensor (``masked_fill_`` reads a tensor value with ``.item()``, which waits again).
  :func:`mask_norms_without_sync` has ZeRO's optimizers fill with the number instead.
"""

from __future__ import annotations

import types
from typing import Any

import torch


def clip_without_sync(optimizer: Any) -> bool:
    """Give a ZeRO-1/2 ``optimizer`` the sync-free clip; False (nothing changed) for any other."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if not isinstance(optimizer, DeepSpeedZeroOptimizer):
        return False
    optimizer.unscale_and_clip_grads = types.MethodType(_unscale_and_clip_grads, optimizer)
    return True


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


def mask_norms_without_sync(on: bool = True) -> None:
    """Make DeepSpeed's ZeRO-1/2 and ZeRO-3 optimizers mask an invalid norm without a wait (``on``), or
    with DeepSpeed's own function again.

    They call ``mask_nan_or_inf_with_val_inplace`` as a global of their own modules, from inside their
    norm methods, so the name is set there. The setting is process-wide, so every engine sets it: one
    built with ``--strategy.fast_path false`` gets DeepSpeed's. The values left are bitwise the same
    either way.
    """
    from deepspeed.runtime import utils
    from deepspeed.runtime.zero import stage3, stage_1_and_2

    for module in (stage_1_and_2, stage3):
        module.mask_nan_or_inf_with_val_inplace = _mask_nan_or_inf if on else utils.mask_nan_or_inf_with_val_inplace


def _mask_nan_or_inf(input: torch.Tensor, device: Any = None, val: float = -1.0) -> None:
    """DeepSpeed's ``mask_nan_or_inf_with_val_inplace``: an inf or NaN entry becomes -1 in place. Like
    DeepSpeed's, it fills -1 whatever ``val`` is (its callers all pass the default)."""
    input.masked_fill_(input.isnan().logical_or(input.isinf()), -1.0)
