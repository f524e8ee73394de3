from __future__ import annotations

import pytest
import torch

from zerotrain.models.roberta_mlm import LayerNorm, RobertaMLM, aligned_linear

V, L, H, C, F, T, PAD = 50, 2, 4, 16, 32, 12, 1


def _model(dropout: float = 0.0, ckpt: bool = False, seed: int = 0) -> RobertaMLM:
    torch.manual_seed(seed)
    return RobertaMLM(vocab_size=V, num_layers=L, num_heads=H, h_dim=C, ff_dim=F, dropout=dropout,
                      max_seq_length=T, pad_token_id=PAD, activation_checkpointing=ckpt)


def test_forward_shapes_and_tied_decoder():
    m = _model()
    ids = torch.randint(4, V, (3, T))
    out = m(ids, torch.ones_like(ids))
    assert out["logits"].shape == (3, T, V)
    assert out["loss"] is None
    assert m.lm_head.decoder.weight is m.encoder.token_embedding.weight
    assert set(m.encoder.state_dict()) >= {"token_embedding.weight", "position_embedding.weight"}


def test_each_weight_is_initialised_once_as_bert_does(monkeypatch):
    """The model is laid out on the meta device and initialised by _init_weights alone: nn.Linear's Kaiming
    init, which it overwrites, cost 3/4 of a 1.4B build on a CPU. Weights N(0, 0.02), biases 0, LayerNorms the
    identity, the <pad> row 0, the decoder tied; under an outer meta device (zerotrain estimate) it stays there."""
    from torch import nn

    touched = []
    real = nn.init.kaiming_uniform_

    def kaiming_uniform_(*args, **kwargs):  # nn.Linear.reset_parameters' init, watched
        touched.append((args[0] if args else kwargs["tensor"]).device.type)
        return real(*args, **kwargs)

    monkeypatch.setattr(nn.init, "kaiming_uniform_", kaiming_uniform_)
    torch.manual_seed(0)
    m = RobertaMLM(vocab_size=500, num_layers=2, num_heads=4, h_dim=64, ff_dim=256, dropout=0.0,
                   max_seq_length=32, pad_token_id=PAD)
    assert set(touched) <= {"meta"}, "a default init ran on real memory"
    assert m.lm_head.decoder.weight is m.encoder.token_embedding.weight
    for name, p in m.named_parameters():
        p = p.detach()
        assert p.device.type == "cpu", name
        if name.endswith("bias"):
            assert not p.any(), name
        elif "ln" in name:
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            rows = p[torch.arange(p.shape[0]) != PAD] if "token_embedding" in name else p
            assert abs(float(rows.std()) - 0.02) < 0.002 and abs(float(rows.mean())) < 0.002, name
    assert not m.encoder.token_embedding.weight[PAD].any()
    with torch.device("meta"):
        assert {p.device.type for p in RobertaMLM(V, L, H, C, F, 0.0, T, PAD).parameters()} == {"meta"}


def test_loss_ignores_minus_100():
    m = _model().eval()
    ids = torch.randint(4, V, (2, T))
    labels = torch.full_like(ids, -100)
    labels[0, 3], labels[1, 5] = 7, 9
    out = m(ids, torch.ones_like(ids), labels=labels)
    full = m(ids, torch.ones_like(ids))["logits"]  # (B, T, V): every position
    # With labels the head runs on the labelled positions only, in row-major order.
    torch.testing.assert_close(out["logits"], torch.stack([full[0, 3], full[1, 5]]))
    expected = torch.nn.functional.cross_entropy(torch.stack([full[0, 3], full[1, 5]]), torch.tensor([7, 9]))
    torch.testing.assert_close(out["loss"], expected)
    # Nothing to predict: a zero loss, not NaN.
    assert m(ids, torch.ones_like(ids), labels=torch.full_like(ids, -100))["loss"].item() == 0.0


def test_padding_mask_hides_padded_keys():
    m = _model().eval()
    ids = torch.randint(4, V, (1, 7))
    short = m(ids, torch.ones_like(ids))["logits"]  # (1, 7, V)
    padded_ids = torch.cat([ids, torch.full((1, 5), PAD)], dim=1)
    mask = torch.cat([torch.ones(1, 7, dtype=torch.long), torch.zeros(1, 5, dtype=torch.long)], dim=1)
    padded = m(padded_ids, mask)["logits"]  # (1, 12, V)
    torch.testing.assert_close(padded[:, :7], short, rtol=1e-5, atol=1e-5)


def test_activation_checkpointing_gives_the_same_gradients():
    ids = torch.randint(4, V, (2, T))
    labels = torch.where(torch.rand(2, T) < 0.3, ids, torch.full_like(ids, -100))
    labels[0, 0] = ids[0, 0]
    grads = []
    for ckpt in (False, True):
        m = _model(ckpt=ckpt).train()
        m(ids, torch.ones_like(ids), labels=labels)["loss"].backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], msg=name)


def test_activation_checkpointing_with_dropout_matches_too():
    # Non-reentrant checkpointing restores the RNG, so the recomputed dropout masks match.
    ids = torch.randint(4, V, (2, T))
    labels = ids.clone()
    grads = []
    for ckpt in (False, True):
        m = _model(dropout=0.2, ckpt=ckpt).train()
        torch.manual_seed(123)
        m(ids, torch.ones_like(ids), labels=labels)["loss"].backward()
        grads.append(m.encoder.layers[0].ff_in.weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1])


def test_flops_formula_matches_a_hand_count():
    m = _model()
    layer = 4 * (C * C + C) + (C * F + F) + (F * C + C) + 2 * (2 * C)  # qkv+out, ffn, two LayerNorms
    head = (C * C + C) + 2 * C + V  # dense, LayerNorm, decoder bias
    non_embedding = L * layer + 2 * C + head  # + the embedding LayerNorm
    assert m.num_params(non_embedding=True) == non_embedding
    assert m.num_params(non_embedding=False) == non_embedding + V * C + T * C
    assert m.flops_per_token(T) == 6 * non_embedding + 12 * L * C * T + 6 * C * V
    # the head (its own parameters and the tied decoder) runs on the predicted positions only
    assert m.flops_per_token(T, predicted_fraction=0.15) == pytest.approx(
        6 * (non_embedding - head) + 12 * L * C * T + 6 * (head + C * V) * 0.15)


def test_no_mask_is_the_same_as_a_mask_of_ones():
    """Packed blocks pass no mask (SDPA may then take its flash kernel): the same function as an all-ones mask."""
    torch.manual_seed(0)
    model = RobertaMLM(vocab_size=50, num_layers=2, num_heads=2, h_dim=16, ff_dim=32, dropout=0.0,
                       max_seq_length=12, pad_token_id=1).eval()
    ids = torch.randint(3, 50, (3, 12))
    with torch.no_grad():
        masked = model(ids, torch.ones_like(ids))["logits"]
        unmasked = model(ids, None)["logits"]
    torch.testing.assert_close(unmasked, masked)


def test_the_aligned_decoder_gives_the_plain_linears_logits_and_gradients():
    """The decoder's output padded to a multiple of 64 and cut back (the GPU path): same values, same gradients,
    and the parameter keeps its shape."""
    torch.manual_seed(0)
    x = torch.randn(5, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)  # 50 outputs: 14 rows of padding
    bias = torch.randn(50, requires_grad=True)
    out = aligned_linear(x, weight, bias, multiple=64)
    ref = torch.nn.functional.linear(x, weight, bias)
    assert out.shape == (5, 50)
    torch.testing.assert_close(out, ref)
    grads = torch.autograd.grad((out * ref.detach()).sum(), (x, weight, bias))
    ref_grads = torch.autograd.grad((ref * ref.detach()).sum(), (x, weight, bias))
    for g, r in zip(grads, ref_grads):
        assert g.shape == r.shape
        torch.testing.assert_close(g, r)


def test_layernorm_is_torchs_without_autocast_and_returns_bf16_under_bf16_autocast():
    ln = LayerNorm(16)
    with torch.no_grad():
        ln.weight.uniform_(0.5, 1.5)
        ln.bias.uniform_(-0.5, 0.5)
    ref = torch.nn.LayerNorm(16)
    ref.load_state_dict(ln.state_dict())  # same parameter names: checkpoints and exports are unchanged
    x = torch.randn(4, 16)
    assert torch.equal(ln(x), ref(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch_out, y = ref(x), ln(x)
    assert torch_out.dtype == torch.float32  # autocast's: a float32 residual stream
    assert y.dtype == torch.bfloat16 and torch.equal(y, torch_out.bfloat16())  # normalised in float32, rounded once
    with torch.autocast("cpu", dtype=torch.float16):
        assert ln(x).dtype == torch.float32  # fp16 keeps autocast's float32


def test_the_residual_stream_is_bf16_under_bf16_autocast():
    model = _model().train()
    norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert len(norms) == 2 * L + 2 and all(type(m) is LayerNorm for m in norms)  # embeddings, layers, head
    seen = []
    for layer in model.encoder.layers:
        layer.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randint(4, V, (2, T)))["logits"].float().sum().backward()
    assert seen == [torch.bfloat16] * L
    assert all(p.grad.dtype == torch.float32 for p in model.parameters() if p.grad is not None)
