"""--compile.enabled: blocks are found through wrappers, one compile serves every block, and a compiled
run learns what the eager run learns."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import LLAMA, lora_fit_args, zerotrain_cmd
from torch import nn

from zerotrain.engines.compiling import compile_model, repeated_blocks
from zerotrain.models.roberta_mlm import EncoderLayer, RobertaMLM
from zerotrain.models.sentiment import SentimentClassifier


def _peft_llama(layers: int) -> nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**dict(LLAMA, num_hidden_layers=layers, vocab_size=64))
    lora = LoraConfig(task_type="CAUSAL_LM", r=4, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    return get_peft_model(LlamaForCausalLM(config), lora)


def test_blocks_are_found_through_wrappers():
    llama = _peft_llama(3)  # peft puts the layers four modules down: base_model.model.model.layers
    assert [type(b).__name__ for b in repeated_blocks(llama)] == ["LlamaDecoderLayer"] * 3

    mlm = RobertaMLM(vocab_size=50, num_layers=2, num_heads=2, h_dim=16, ff_dim=32, dropout=0.0,
                     max_seq_length=16, pad_token_id=1)
    assert [type(b) for b in repeated_blocks(mlm)] == [EncoderLayer] * 2

    imdb = SentimentClassifier(vocab_size=50, embed_dim=16, hidden_dim=32, num_heads=2, num_layers=2, max_len=16,
                               dropout=0.0, pad_token_id=1)
    assert [type(b) for b in repeated_blocks(imdb)] == [nn.TransformerEncoderLayer] * 2


def _graph_counter() -> tuple[list[int], object]:
    graphs: list[int] = []

    def backend(gm, example_inputs):  # records each graph dynamo captured, runs it as traced
        graphs.append(len(gm.graph.nodes))
        return gm.forward

    return graphs, backend


def test_a_model_without_blocks_is_compiled_whole():
    torch._dynamo.reset()
    graphs, backend = _graph_counter()
    mixed = nn.Sequential(nn.Linear(4, 4), nn.ModuleList([nn.Linear(4, 4), nn.ReLU()]))  # a list of two classes
    assert repeated_blocks(mixed) == []
    plain = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    assert compile_model(plain, backend=backend) == "compiled the whole Sequential"
    plain(torch.randn(2, 4))
    assert graphs  # traced, not run eager


def test_our_own_blocks_are_compiled_with_module_compile():
    torch._dynamo.reset()
    graphs, backend = _graph_counter()
    mlm = RobertaMLM(vocab_size=50, num_layers=2, num_heads=2, h_dim=16, ff_dim=32, dropout=0.0,
                     max_seq_length=16, pad_token_id=1)
    assert compile_model(mlm, backend=backend) == ("compiled 2 EncoderLayer blocks one by one, "
                                                   "and MaskedLMLoss on its own")
    assert all(block._compiled_call_impl is not None for block in mlm.encoder.layers)
    assert mlm.loss._compiled_call_impl is not None
    mlm(torch.randint(2, 50, (2, 8)))
    assert graphs
    torch._dynamo.reset()


def test_the_mlm_loss_compiles_once_for_every_count_of_masked_positions_and_matches_eager():
    """Inductor's fused cross-entropy (one dynamic graph) gives eager's loss and gradient for any M."""
    from zerotrain.models.roberta_mlm import MaskedLMLoss

    torch._dynamo.reset()
    graphs, counting = _graph_counter()
    compiled = MaskedLMLoss()
    compiled.compile(backend=counting, dynamic=True)
    for m in (7, 13, 29):
        compiled(torch.randn(m, 40, dtype=torch.bfloat16), torch.randint(0, 40, (m,)))
    assert len(graphs) == 1  # one graph serves every count
    torch._dynamo.reset()

    eager, fused = MaskedLMLoss(), MaskedLMLoss()
    fused.compile(dynamic=True)  # inductor
    g = torch.Generator().manual_seed(0)
    for m in (5, 11):
        logits = (4 * torch.randn(m, 96, generator=g)).to(torch.bfloat16)
        targets = torch.randint(0, 96, (m,), generator=g)
        a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        loss_eager, loss_fused = eager(a, targets), fused(b, targets)
        loss_eager.backward()
        loss_fused.backward()
        assert loss_fused.dtype == torch.float32 and torch.allclose(loss_fused, loss_eager, rtol=1e-6)
        assert b.grad.dtype == torch.bfloat16 and torch.allclose(b.grad.float(), a.grad.float(), atol=2 ** -9)
    torch._dynamo.reset()


def test_a_subclass_that_keeps_torchs_forward_is_really_compiled():
    torch._dynamo.reset()
    graphs, backend = _graph_counter()

    class Layer(nn.TransformerEncoderLayer):  # a user's class, torch's forward
        pass

    blocks = nn.Sequential(nn.ModuleList([Layer(16, 2, 32, 0.0, batch_first=True) for _ in range(2)]))
    assert compile_model(blocks, backend=backend) == "compiled 2 Layer blocks one by one"
    blocks[0][0](torch.randn(2, 5, 16))
    assert graphs
    torch._dynamo.reset()


def _classifier_pair(num_layers: int) -> tuple[SentimentClassifier, SentimentClassifier]:
    """Two tiny IMDB classifiers with the same weights: one to stay eager, one to compile."""
    torch.manual_seed(0)
    kw = dict(vocab_size=50, embed_dim=16, hidden_dim=32, num_heads=2, num_layers=num_layers, max_len=16,
              dropout=0.0, pad_token_id=1)
    eager, compiled = SentimentClassifier(**kw), SentimentClassifier(**kw)
    compiled.load_state_dict(eager.state_dict())
    return eager, compiled


def _one_backward(*models: nn.Module) -> list[torch.Tensor]:
    """Each model's loss on one batch with padding, its backward run; the losses."""
    ids = torch.randint(2, 50, (3, 10))
    mask = torch.ones_like(ids)
    mask[0, 6:] = 0
    labels = torch.tensor([0, 1, 1])
    losses = [m(ids, mask, labels=labels)["loss"] for m in models]
    for loss in losses:
        loss.backward()
    return losses


def test_torch_own_blocks_are_really_compiled():
    """The IMDB recipe's blocks are torch's nn.TransformerEncoderLayer, whose Module.compile() dynamo skips
    without a word: each block's forward must come out as a captured graph, and train as eager does."""
    torch._dynamo.reset()
    graphs, backend = _graph_counter()
    eager, compiled = _classifier_pair(num_layers=2)
    assert compile_model(compiled, backend=backend) == "compiled 2 TransformerEncoderLayer blocks one by one"
    losses = _one_backward(eager, compiled)
    assert graphs and all(n > 10 for n in graphs)  # whole attention/feed-forward blocks, not single ops
    torch.testing.assert_close(losses[1], losses[0])
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name)
    assert sorted(eager.state_dict()) == sorted(compiled.state_dict())  # checkpoints and exports unchanged
    torch._dynamo.reset()


def test_the_stack_of_torch_blocks_compiles_into_one_graph_that_trains_as_eager():
    """--compile.scope stack: the TransformerEncoder that holds the blocks is one captured graph (its
    forward is torch's, so it must really be traced, not run eager), and the gradients are eager's."""
    torch._dynamo.reset()
    graphs, backend = _graph_counter()
    eager, compiled = _classifier_pair(num_layers=3)
    assert compile_model(compiled, "stack", backend) == "compiled TransformerEncoder (3 blocks) as one graph"
    losses = _one_backward(eager, compiled)
    per_block = 20  # a TransformerEncoderLayer's forward traces to well over this many nodes
    assert len(graphs) == 1 and graphs[0] > 3 * per_block  # the three blocks in one graph
    torch.testing.assert_close(losses[1], losses[0])
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name)
    assert sorted(eager.state_dict()) == sorted(compiled.state_dict())
    torch._dynamo.reset()


def test_one_compile_serves_every_block():
    """Six layers compile two graphs: the first layer's (its input, from the frozen embedding, needs no
    gradient) and one that every later layer reuses. Six graphs would mean a compile per layer."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = _peft_llama(6)
    assert compile_model(model) == "compiled 6 LlamaDecoderLayer blocks one by one"
    ids = torch.randint(3, 64, (2, 12))
    loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids, use_cache=False).loss
    loss.backward()
    assert counters["stats"]["unique_graphs"] == 2
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)
    torch._dynamo.reset()


def _losses(run_dir) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["train_loss"] for r in rows if "train_loss" in r]


@pytest.mark.slow
def test_a_compiled_run_matches_the_eager_run(lora_files):
    """ZeRO-2 on one process with LoRA, no dropout: the compiled blocks give eager's loss curve, and the
    log says which blocks were compiled."""
    tmp_path, tok = lora_files
    curves = {}
    for compiled in ("false", "true"):
        args = lora_fit_args(tmp_path, tok, 2, 1) + ["--model.lora_dropout", "0", "--compile.enabled", compiled,
                                             "--trainer.run_name", f"compile_{compiled}"]
        out = zerotrain_cmd(args, cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
        curves[compiled] = _losses(tmp_path / f"compile_{compiled}")
        if compiled == "true":
            assert "torch.compile: compiled 2 LlamaDecoderLayer blocks one by one" in out.stderr + out.stdout
    assert len(curves["true"]) == len(curves["false"]) == 4
    assert curves["false"][0] != curves["false"][-1]  # it trained
    torch.testing.assert_close(curves["true"], curves["false"], rtol=1e-4, atol=1e-5)


def test_compile_mode_reaches_torch_compile_for_each_unit(monkeypatch):
    """--compile.mode reduce-overhead (CUDA graphs) is inductor's mode on every compiled unit, whether
    compiled through ``Module.compile`` or, for torch's own blocks, through their ``forward``."""
    calls = []

    def fake_compile(fn, **kwargs):
        calls.append(kwargs)
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    _, model = _classifier_pair(num_layers=2)  # torch's TransformerEncoderLayer: its forward is compiled
    compile_model(model, "blocks", mode="reduce-overhead")
    assert calls == [{"backend": "inductor", "mode": "reduce-overhead"}] * 2
    calls.clear()
    compile_model(_peft_llama(2), "blocks", mode="reduce-overhead")  # Llama's blocks: Module.compile
    assert calls == [{"backend": "inductor", "mode": "reduce-overhead"}] * 2
    calls.clear()
    compile_model(model, "stack", backend="eager", mode="reduce-overhead")  # only inductor takes a mode
    assert calls == [{"backend": "eager"}]
