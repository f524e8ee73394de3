"""A random Hugging Face model (``--model.init random``) is laid out on the meta device and initialised once by
transformers; it must come out as ``from_config`` builds it: the same parameters, buffers and ties, each weight
drawn from the same distribution. Weights redrawn from the seed later (a random LoRA base) keep ``from_config``'s
own draw."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from zerotrain.models import hf

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "vocab_size": 1000, "max_position_embeddings": 128}
CASES = [
    ("causal-lm", {"model_type": "llama", "num_key_value_heads": 2, **SMALL}),
    ("causal-lm", {"model_type": "qwen2", "num_key_value_heads": 2, **SMALL}),
    ("causal-lm", {"model_type": "mistral", "num_key_value_heads": 2, **SMALL}),
    ("causal-lm", {"model_type": "gpt_neox", **SMALL}),
    ("causal-lm", {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 1000,
                   "n_positions": 128, "bos_token_id": 1, "eos_token_id": 2}),
    ("causal-lm", {"model_type": "llama", "tie_word_embeddings": True, **SMALL}),
    ("classify", {"model_type": "bert", **SMALL}),
    ("classify", {"model_type": "distilbert", "dim": 64, "hidden_dim": 128, "n_layers": 2, "n_heads": 4,
                  "vocab_size": 1000}),
    ("masked-lm", {"model_type": "roberta", "pad_token_id": 1, "max_position_embeddings": 130,
                   **{k: v for k, v in SMALL.items() if k != "max_position_embeddings"}}),
]


def _source(tmp_path: Path, config: dict) -> hf.ModelSource:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return hf.ModelSource("unused", init="random", config=str(path))


@pytest.fixture()
def poisoned(monkeypatch):
    """Memory given to a meta-built model starts as NaN, so a tensor the initialisation skips cannot pass as the
    zeros fresh pages often hold; and the calls of the one-pass build are counted."""
    calls = []
    to_empty = nn.Module.to_empty

    def filled(self, *, device, recurse=True):
        out = to_empty(self, device=device, recurse=recurse)
        with torch.no_grad():
            for t in [*out.parameters(), *out.buffers()]:
                if t.is_floating_point():
                    t.fill_(float("nan"))
        return out

    real = hf._built_then_initialised

    def counted(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    if not hf._init_weights_sets_buffers():
        pytest.skip("this transformers builds random models with from_config (the one-pass build is checked from 5.24)")
    monkeypatch.setattr(nn.Module, "to_empty", filled)
    monkeypatch.setattr(hf, "_built_then_initialised", counted)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind, config", CASES, ids=[f"{c['model_type']}-{k}" + ("-tied" if c.get("tie_word_embeddings")
                                                                               else "") for k, c in CASES])
def test_a_random_model_is_built_as_from_config_builds_it(tmp_path, poisoned, kind, config, dtype):
    source = _source(tmp_path, config)
    torch.manual_seed(0)
    model = hf.load_model(kind, source, dtype)
    assert len(poisoned) == 1  # built on the meta device and initialised once
    torch.manual_seed(1)
    direct = hf.auto_class(kind).from_config(hf.read_config(source), dtype=dtype)

    params, expected = dict(model.named_parameters()), dict(direct.named_parameters())
    assert {k: (p.shape, p.dtype) for k, p in params.items()} == {k: (p.shape, p.dtype) for k, p in expected.items()}
    buffers = dict(model.named_buffers())
    for name, b in direct.named_buffers():
        assert buffers[name].dtype == b.dtype and torch.equal(buffers[name], b), name
    out, ref = model.get_output_embeddings(), direct.get_output_embeddings()
    if ref is not None:
        tied = ref.weight is direct.get_input_embeddings().weight
        assert (out.weight is model.get_input_embeddings().weight) == tied
    for name, p in params.items():
        p, q = p.detach().float(), expected[name].detach().float()
        assert torch.isfinite(p).all(), f"{name} was not initialised"
        if float(q.std()) == 0.0 or q.numel() == 1:  # a constant start: biases 0, norm weights 1
            assert torch.equal(p, q), name
        elif q.numel() >= 1000:  # the same distribution: a mean of ~0 and the same spread
            assert abs(float(p.std()) / float(q.std()) - 1) < 0.1, name
            assert abs(float(p.mean()) - float(q.mean())) < 0.1 * float(q.std()) + 1e-3, name


def test_on_the_meta_device_nothing_is_allocated(tmp_path, poisoned):
    source = _source(tmp_path, CASES[0][1])
    with torch.device("meta"):
        model = hf.load_model("causal-lm", source, torch.float32, pretrained=False)
    assert poisoned
    assert all(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()])


def test_the_same_seed_draws_the_same_model(tmp_path):
    source = _source(tmp_path, CASES[0][1])
    torch.manual_seed(3)
    a = hf.load_model("causal-lm", source, torch.float32)
    torch.manual_seed(3)
    b = hf.load_model("causal-lm", source, torch.float32)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_weights_redrawn_from_the_seed_keep_from_configs_draw(tmp_path, poisoned):
    """A random LoRA base is never saved: export and predict redraw it from the seed, also for runs trained before
    the one-pass build existed, so it is ``from_config``'s draw, value for value."""
    source = _source(tmp_path, CASES[0][1])
    torch.manual_seed(5)
    redrawn = hf.load_model("causal-lm", source, torch.float32, redrawn=True)
    torch.manual_seed(5)
    direct = hf.auto_class("causal-lm").from_config(hf.read_config(source), dtype=torch.float32)
    assert not poisoned
    assert all(torch.equal(x, y) for x, y in zip(redrawn.state_dict().values(), direct.state_dict().values()))
