"""zerotrain.models.embedding: the index_add backward gives torch's gradient; the CPU keeps torch's path."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zerotrain.models.embedding import TokenEmbedding, _IndexAddEmbedding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_index_add_backward_is_torchs_gradient_with_the_padding_row_left_out(dtype):
    torch.manual_seed(0)
    layer = nn.Embedding(50, 8, padding_idx=1).to(dtype)
    ids = torch.randint(0, 50, (4, 300))
    ids[:, :5] = 1  # padding, and every other id repeated many times
    grad_out = torch.randn(4, 300, 8, dtype=dtype)
    layer(ids).backward(grad_out)
    weight = layer.weight.detach().clone().requires_grad_()
    out = _IndexAddEmbedding.apply(ids, weight, 1)
    assert torch.equal(out, layer(ids))
    out.backward(grad_out)
    assert weight.grad.dtype == dtype
    assert torch.all(weight.grad[1] == 0)
    # each id's gradients summed exactly (float64, as a one-hot product), then rounded once to the weight's
    # dtype: float32 sums agree with that to float32 rounding, and the bf16 table gets the rounded exact sum
    # (torch's CPU kernel adds in bf16 and is further off: 0.125 here)
    exact = torch.nn.functional.one_hot(ids.reshape(-1), 50).double().T @ grad_out.reshape(-1, 8).double()
    exact[1] = 0
    if dtype == torch.float32:
        torch.testing.assert_close(weight.grad.double(), exact, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(weight.grad, layer.weight.grad, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(weight.grad, exact.to(dtype))

def test_on_a_cpu_the_token_embedding_is_nn_embedding_bit_for_bit():
    torch.manual_seed(0)
    ours = TokenEmbedding(30, 4, padding_idx=0)
    theirs = nn.Embedding(30, 4, padding_idx=0)
    theirs.load_state_dict(ours.state_dict())
    ids = torch.randint(0, 30, (3, 7))
    for layer in (ours, theirs):
        layer(ids).pow(2).sum().backward()
    assert torch.equal(ours.weight.grad, theirs.weight.grad)
    assert list(ours.state_dict()) == ["weight"]  # same keys: checkpoints and exports unchanged
