"""zerotrain.zero_clip: ZeRO-1/2's clip with DeepSpeed's arithmetic and no read of the norm to the host."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from zerotrain.zero_clip import _unscale_and_clip_grads


class CountReads(TorchDispatchMode):
    """Counts reads of a tensor's value to Python (``.item()``, ``bool()``): each one waits for a GPU."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def _clip(method, clip_grad: float, loss_scale: float, norm: torch.Tensor) -> tuple[list[torch.Tensor], int]:
    opt = SimpleNamespace(clip_grad=clip_grad, loss_scale=loss_scale, device="cpu")
    grads = [torch.linspace(-3, 3, 7), [torch.full((3,), 0.5), torch.arange(4.0)]]
    with CountReads() as counter:
        method(opt, grads, norm)
    return [grads[0], *grads[1]], counter.reads


@pytest.mark.parametrize("clip_grad", [0.0, 0.05, 1.0, 100.0])
@pytest.mark.parametrize("loss_scale", [1.0, 1024.0])
@pytest.mark.parametrize("norm", [0.01, 3.0, 5e4, float("inf"), float("nan"), -1.0])
def test_same_gradients_as_deepspeed_and_no_read(clip_grad, loss_scale, norm):
    """Bitwise DeepSpeed's result for a clip that bites, one that does not, no clipping, a loss scale,
    and the norms it treats as invalid (inf, NaN, its -1 sentinel), which zero the gradient."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    theirs, their_reads = _clip(DeepSpeedZeroOptimizer.unscale_and_clip_grads, clip_grad, loss_scale,
                                torch.tensor(norm))
    ours, our_reads = _clip(_unscale_and_clip_grads, clip_grad, loss_scale, torch.tensor(norm))
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b), (a, b)
    assert our_reads == 0
    assert their_reads == (1 if clip_grad > 0 else 0)  # the wait that is gone


def test_only_deepspeeds_zero12_optimizer_is_changed():
    from zerotrain.zero_clip import clip_without_sync

    other = SimpleNamespace(unscale_and_clip_grads=None)
    assert clip_without_sync(other) is False and other.unscale_and_clip_grads is None
