"""zerotrain.engines.ds_private.zero_clip: ZeRO-1/2's clip with DeepSpeed's arithmetic and no read of the norm to the host."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers import RecordOps
from torch.utils._python_dispatch import TorchDispatchMode

from zerotrain.engines.ds_private.zero_clip import _unscale_and_clip_grads
from zerotrain.engines.ds_private import patches

# DeepSpeed's own methods are the reference: the patches' versions only (elsewhere they do not apply)
pytestmark = pytest.mark.skipif(not patches.patches_for(patches.installed_version()),
                                reason="zerotrain's DeepSpeed patches apply only to the versions they were verified on")


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
@pytest.mark.parametrize("loss_scale", [1.0, 1, 1024.0])
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


def test_only_deepspeeds_zero12_optimizer_is_a_target():
    from zerotrain.engines.ds_private.zero_clip import is_zero12

    assert not is_zero12(SimpleNamespace(unscale_and_clip_grads=None))


@pytest.mark.parametrize("values", [[2.5], [float("inf")], [float("-inf")], [float("nan")], [0.0], [-1.0],
                                    [1.0, float("nan"), -3.0, float("inf")]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_norm_mask_is_deepspeeds_without_a_read(values, dtype):
    """inf and NaN become -1, anything else stays: bitwise DeepSpeed's. DeepSpeed fills with a tensor,
    whose value masked_fill_ reads to the host (on a GPU, a wait); ours fills with the number."""
    from deepspeed.runtime.utils import mask_nan_or_inf_with_val_inplace

    from zerotrain.engines.ds_private.zero_clip import mask_nan_or_inf

    theirs, ours = (torch.tensor(values if len(values) > 1 else values[0], dtype=dtype) for _ in range(2))
    with RecordOps() as their_ops:
        mask_nan_or_inf_with_val_inplace(theirs, device="cpu")
    with RecordOps() as our_ops:
        mask_nan_or_inf(ours, device="cpu")
    assert torch.equal(ours, theirs)  # no NaN is left to compare unequal
    assert torch.ops.aten.masked_fill_.Tensor in their_ops.ops  # the wait that is gone
    assert torch.ops.aten.masked_fill_.Tensor not in our_ops.ops and torch.ops.aten.masked_fill_.Scalar in our_ops.ops
    assert not any(op._overloadpacket in (torch.ops.aten._to_copy, torch.ops.aten.copy_) for op in our_ops.ops)
