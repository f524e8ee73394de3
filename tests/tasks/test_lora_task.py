"""LoRATask end to end on CPU: a tiny random Llama, a few AdamW steps, export, reload with peft."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import REPO

from zerotrain.config import TrainerConfig, from_dict
from zerotrain.errors import ConfigError, UserError
from zerotrain.tasks.lora import LoRAConfig, LoRADataConfig, LoRAModelConfig, LoRATask

RECORDS = [
    {"input": "the movie was", "target": "very good"},
    {"input": "i hated the plot", "target": "bad"},
    {"input": "the acting was", "target": "really wonderful and fun"},
    {"input": "this story is", "target": "boring"},
    {"input": "i loved it", "target": "great"},
    {"input": "the actor was not", "target": "good but awful"},
]


@pytest.fixture
def workdir(tmp_path, tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir)))
    cfg = {
        "model_type": "llama", "vocab_size": vocab, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
        "max_position_embeddings": 64,
        # larger than Llama's 0.02 so that the frozen random head can express confident predictions
        # and a few LoRA steps visibly lower the loss
        "initializer_range": 0.1, "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1,
    }
    (tmp_path / "llama.json").write_text(json.dumps(cfg))
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in RECORDS))
    return tmp_path


def make_task(workdir, tok_dir, **model_kw) -> LoRATask:
    model = dict(name_or_path="unused", init="random", config=str(workdir / "llama.json"),
                 tokenizer=str(tok_dir), lora_dropout=0.0)
    model.update(model_kw)
    cfg = LoRAConfig(model=LoRAModelConfig(**model),
                     data=LoRADataConfig(train_path=str(workdir / "train.jsonl"), val_path=str(workdir / "train.jsonl"),
                                         max_length=32),
                     trainer=TrainerConfig(max_steps=5, micro_batch_size=6))
    cfg.precision.dtype = "fp32"
    return LoRATask(cfg.validate())


def fresh_base(workdir, seed=0):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(workdir / "llama.json")), dtype=torch.float32)


def test_train_export_reload(workdir, tiny_tokenizer_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    task = make_task(workdir, tiny_tokenizer_dir, merge_on_export=True)
    torch.manual_seed(0)
    model = task.build_model()
    summary = task.trainable_summary()
    assert 0 < summary["trainable"] < summary["total"]
    assert summary["trainable"] == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    assert task.flops_per_token(model) == 4 * (summary["total"] - summary["trainable"]) + 6 * summary["trainable"]

    splits = task.build_datasets()
    assert len(splits.train) == len(RECORDS)
    batch = task.collator()(splits.train)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    losses = []
    for _ in range(8):
        out = task.training_step(model, batch)
        assert out.samples == 6 and out.tokens == batch["input_ids"].numel()
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    assert losses[-1] < 0.6 * losses[0], losses

    model.eval()
    sums = task.eval_step(model, batch)
    n_target = int((batch["labels"][:, 1:] != -100).sum())
    assert sums["tokens"] == n_target
    with torch.no_grad():
        hf_loss = model(**batch).loss.item()  # HF's mean over target tokens of the whole batch
    metrics = task.eval_metrics(sums)
    assert metrics["loss"] == pytest.approx(hf_loss, rel=1e-4)
    assert metrics["ppl"] == pytest.approx(math.exp(hf_loss), rel=1e-4)

    with torch.no_grad():
        expected = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    out_dir = tmp_path / "export"
    task.export(model, model.state_dict(), out_dir)
    assert (out_dir / "adapter" / "adapter_config.json").is_file()
    assert (out_dir / "adapter" / "adapter_model.safetensors").is_file()
    assert (out_dir / "adapter" / "tokenizer.json").is_file()

    reloaded = PeftModel.from_pretrained(fresh_base(workdir), str(out_dir / "adapter")).eval()
    with torch.no_grad():
        got = reloaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # a base with another init must differ, or the comparison above proves nothing
    other = PeftModel.from_pretrained(fresh_base(workdir, seed=1), str(out_dir / "adapter")).eval()
    with torch.no_grad():
        assert not torch.allclose(other(input_ids=batch["input_ids"]).logits, expected, atol=1e-3)

    merged = AutoModelForCausalLM.from_pretrained(str(out_dir / "merged")).eval()
    with torch.no_grad():
        got = merged(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_export_refuses_empty_adapter(workdir, tiny_tokenizer_dir, tmp_path):
    task = make_task(workdir, tiny_tokenizer_dir)
    model = task.build_model()
    # what a ZeRO-3 partitioned parameter looks like from outside: a tensor of 0 elements
    partitioned = {k: (torch.empty(0) if "lora_" in k else v) for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match="empty LoRA adapter"):
        task.export(model, partitioned, tmp_path / "out")
    base_only = {k: v for k, v in model.state_dict().items() if "lora_" not in k}
    with pytest.raises(RuntimeError, match="empty LoRA adapter"):
        task.export(model, base_only, tmp_path / "out")
    assert not (tmp_path / "out" / "adapter" / "adapter_model.safetensors").exists()


def test_activation_checkpointing_gives_lora_grads(workdir, tiny_tokenizer_dir):
    task = make_task(workdir, tiny_tokenizer_dir)
    task.cfg.activation_checkpointing.enabled = True
    model = task.build_model()
    base = model.base_model.model
    assert getattr(base, "is_activation_checkpointing", None) or base.is_gradient_checkpointing
    model.train()
    batch = task.collator()(task.build_datasets().train)
    loss = task.training_step(model, batch).loss
    assert torch.isfinite(loss)
    loss.backward()
    lora = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert lora and all(p.grad is not None for p in lora.values())
    # lora_B starts at zero, so only its gradient is non-zero on the first step
    lora_b = [p for n, p in lora.items() if "lora_B" in n]
    assert lora_b and all(p.grad.abs().sum() > 0 for p in lora_b)


def test_offline_hub_name_is_a_user_error(workdir, tiny_tokenizer_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    task = make_task(workdir, tiny_tokenizer_dir, init="pretrained", name_or_path="zerotrain-test/no-such-model-xyz")
    with pytest.raises(UserError, match="--model.name_or_path"):
        task.build_model()


def test_config_validation_names_flags():
    with pytest.raises(ConfigError, match="--model.config"):
        LoRAModelConfig(init="random").validate()
    with pytest.raises(ConfigError, match="--model.lora_r"):
        LoRAModelConfig(lora_r=0).validate()
    with pytest.raises(ConfigError, match="--data.train_path"):
        LoRADataConfig().validate()
    with pytest.raises(ConfigError, match="--data.template"):
        LoRADataConfig(train_path="x.jsonl", template="{input} only").validate()
    with pytest.raises(ConfigError, match="--data.pad_to_multiple_of"):
        LoRADataConfig(train_path="x.jsonl", pad_to_multiple_of=0).validate()


def test_batches_pad_to_the_configured_multiple(tiny_tokenizer_dir):
    cfg = LoRAConfig(model=LoRAModelConfig(tokenizer=str(tiny_tokenizer_dir)),
                     data=LoRADataConfig(train_path="x.jsonl", pad_to_multiple_of=64))
    rows = [{"input_ids": [5] * 70, "labels": [5] * 70}, {"input_ids": [5] * 3, "labels": [5] * 3}]
    batch = LoRATask(cfg).collator()(rows)
    assert batch["input_ids"].shape == (2, 128) and int(batch["attention_mask"].sum()) == 73


def test_shipped_yaml_and_presets_parse(monkeypatch):
    import hjson
    import yaml

    monkeypatch.chdir(REPO)
    cfg = from_dict(LoRAConfig, yaml.safe_load((REPO / "configs" / "lora_tiny.yaml").read_text())).validate()
    assert cfg.model.init == "random" and cfg.strategy.zero_stage == 2 and cfg.trainer.micro_batch_size == 4
    assert json.loads((REPO / cfg.model.config).read_text())["model_type"] == "llama"
    assert len((REPO / cfg.data.train_path).read_text().splitlines()) == 64

    presets = REPO / "src" / "zerotrain" / "presets"
    stages = {}
    for name in ("ds_zero2_offload.json", "ds_zero3.json", "ds_zero3_offload.json"):
        text = (presets / name).read_text()
        assert text.startswith("#")
        ds = hjson.loads(text)
        assert ds["optimizer"]["params"]["lr"] == "auto" and ds["train_micro_batch_size_per_gpu"] == "auto"
        stages[name] = ds["zero_optimization"]
    assert stages["ds_zero2_offload.json"]["stage"] == 2
    assert stages["ds_zero2_offload.json"]["offload_optimizer"]["device"] == "cpu"
    assert "offload_param" not in stages["ds_zero3.json"]
    assert stages["ds_zero3_offload.json"]["offload_param"]["device"] == "cpu"
    assert stages["ds_zero3_offload.json"]["stage3_gather_16bit_weights_on_model_save"] is True


@pytest.mark.data
def test_example_data_with_roberta_tokenizer(shared_data):
    task = LoRATask(LoRAConfig(
        model=LoRAModelConfig(tokenizer=str(shared_data / "roberta-tokenizer")),
        data=LoRADataConfig(train_path=str(REPO / "configs" / "data" / "sft_example.jsonl"), max_length=64),
    ))
    examples = task.build_datasets().train
    assert len(examples) == 64
    assert all(max(e["input_ids"]) < 50265 and e["labels"][-1] == task.tokenizer.eos_token_id for e in examples)


@pytest.fixture
def group_of_one(monkeypatch):
    """A one-process gloo group for the test, destroyed after it, with the launcher variables it needs restored:
    a group (or RANK) left behind would be the next in-process fit's."""
    from zerotrain.runtime.distributed import free_port, init_process_group

    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(key, value)
    init_process_group("gloo", use_deepspeed=False)
    yield
    torch.distributed.destroy_process_group()


def _weighing_setup(workdir, tok):
    """The LoRA task, its model and a plain engine (in the test's group of one), and two micro-batches with
    different target counts (1 and 5 examples)."""
    from zerotrain.engines.plain import TorchEngine

    task = make_task(workdir, tok)
    torch.manual_seed(0)
    model = task.build_model().eval()
    examples = task.build_datasets().train
    small, large = task.collator()(examples[:1]), task.collator()(examples[1:6])
    engine = TorchEngine(model, task.cfg, torch.device("cpu"), "fp32", total_steps=1, steps_per_epoch=1)
    return task, model, engine, small, large


@pytest.mark.usefixtures("group_of_one")
def test_accumulated_loss_weights_every_target_token_once(workdir, tiny_tokenizer_dir):
    """Two micro-batches with different target counts: the weighted losses add up to the one-batch loss."""
    task, model, engine, small, large = _weighing_setup(workdir, tiny_tokenizer_dir)
    factors = engine._loss_factors([small, large], task.loss_weight)
    w = [task.loss_weight(small), task.loss_weight(large)]
    assert w[0] != w[1] and factors == pytest.approx([2 * w[0] / sum(w), 2 * w[1] / sum(w)])

    def token_loss_sum(batch):
        return task.eval_step(model, batch)["loss_sum"]

    with torch.no_grad():
        means = [task.training_step(model, b).loss.item() for b in (small, large)]
    # What the engine back-propagates (each factor x mean loss, averaged over micro-batches) is the
    # mean over all target tokens of both micro-batches, as if they had been one batch.
    combined = sum(f * m for f, m in zip(factors, means)) / 2
    assert combined == pytest.approx((token_loss_sum(small) + token_loss_sum(large)) / sum(w), rel=1e-5)
    assert combined != pytest.approx(sum(means) / 2, rel=1e-3)  # the plain mean of means differs


@pytest.mark.usefixtures("group_of_one")
def test_across_ranks_the_loss_factors_stay_on_the_device_and_match_the_host_formula(workdir, tiny_tokenizer_dir):
    """With several ranks the factors are tensors (no read of the summed weight), equal bitwise to the
    float32 rounding of the host formula, and the weighted loss is bitwise the same."""
    task, model, engine, *batches = _weighing_setup(workdir, tiny_tokenizer_dir)
    engine.world_size = 2  # as the second rank would see it; the one-process group sums this rank alone
    factors = engine._loss_factors(batches, task.loss_weight)
    w = [task.loss_weight(b) for b in batches]
    host = [x * 2 * 2 / sum(w) for x in w]
    assert all(isinstance(f, torch.Tensor) and f.dtype == torch.float32 and f.dim() == 0 for f in factors)
    assert [f.item() for f in factors] == [torch.tensor(h, dtype=torch.float32).item() for h in host]
    with torch.no_grad():
        loss = task.training_step(model, batches[1]).loss
    assert torch.equal(loss * factors[1], loss * host[1])
    for half in (torch.bfloat16, torch.float16):  # the step keeps a half-precision loss in its dtype
        assert torch.equal((loss.to(half) * factors[1]).to(half), loss.to(half) * host[1])

    # A step whose batches carry no weight on any rank keeps factor 1
    assert [f.item() for f in engine._loss_factors(batches, lambda b: 0.0)] == [1.0, 1.0]
