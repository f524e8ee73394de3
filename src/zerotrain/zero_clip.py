"""ZeRO-1/2 gradient clipping without a host-device synchronisation.

DeepSpeed (0.19.8) clips the fp32 gradient partition in ``unscale_and_clip_grads``, and first asks
``if is_invalid_grad_norm(norm)``: a Python ``bool`` of a GPU tensor, so the host waits there for the
whole backward and the reduction to finish, every step, before it may queue the optimizer's kernels.
On one H200 the GPU sat idle 8.2 ms of the compiled BERT-base step under ZeRO-1, part of it behind
this wait (BENCHMARKS.md, session 13). :func:`clip_without_sync` gives one optimizer instance the same
arithmetic with that choice made on the device by ``torch.where``: a norm that is not finite or is
negative (DeepSpeed's -1 sentinel) still clips with an infinite norm, which zeroes the gradient.
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
    if self.clip_grad > 0.0:
        valid = torch.isfinite(total_norm) & (total_norm >= 0)
        clip_norm = torch.where(valid, total_norm, torch.full_like(total_norm, float("inf")))
        clip = ((clip_norm / self.loss_scale) + 1e-6) / self.clip_grad  # the norm is norm * loss scale
        combined_scale = torch.clamp(clip, min=1.0) * self.loss_scale
    for grad in grad_groups_flat:
        for g in grad if isinstance(grad, list) else [grad]:
            g.data.mul_(1.0 / combined_scale)
    return None
