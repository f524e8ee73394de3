"""The activation formula (zerotrain.plan.activations) against what the probe measures on the CPU, its terms, and
``zerotrain estimate`` for the Hugging Face recipes with activations from their configs."""

from __future__ import annotations

import json

import pytest
import torch

from zerotrain.models.shape import transformer_shape
from zerotrain.plan.activations import activation_bytes
from zerotrain.plan.probe import _peak_activation_bytes

LLAMA = dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
GPT2 = dict(model_type="gpt2", vocab_size=512, n_embd=64, n_layer=3, n_head=4, n_positions=512, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0)
BERT = dict(model_type="bert", vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=3,
            num_attention_heads=4, max_position_embeddings=512, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0)


def _model(config: dict, attention: str, dtype: torch.dtype, checkpointing: bool):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM

    from zerotrain.models.hf import enable_activation_checkpointing

    auto = AutoModelForMaskedLM if config["model_type"] == "bert" else AutoModelForCausalLM
    torch.manual_seed(0)
    model = auto.from_config(AutoConfig.for_model(**config), attn_implementation=attention).to(dtype).train()
    if checkpointing:
        enable_activation_checkpointing(model)
    return model


@pytest.mark.parametrize("config,attention,dtype,checkpointing,packed", [
    (LLAMA, "sdpa", torch.bfloat16, False, True),
    (LLAMA, "sdpa", torch.float32, True, False),
    (LLAMA, "eager", torch.bfloat16, False, False),
    (GPT2, "sdpa", torch.bfloat16, False, False),
    (BERT, "sdpa", torch.bfloat16, False, False),
], ids=["llama-sdpa-bf16-packed", "llama-sdpa-fp32-ckpt", "llama-eager-bf16", "gpt2-sdpa-bf16", "bert-sdpa-bf16"])
def test_the_formula_is_within_a_fifth_of_the_probes_measurement(config, attention, dtype, checkpointing, packed):
    """The probe's CPU measurement (PyTorch's MemTracker: live tensor storages at the peak of a forward and
    backward pass, over weights and gradients) is what the formula models."""
    b, s = 2, 128
    model = _model(config, attention, dtype, checkpointing)
    ids = torch.randint(3, 500, (b, s))
    kwargs = dict(input_ids=ids, labels=ids)
    if packed:  # two documents a row: positions restart, transformers builds the block mask
        positions = torch.arange(s).repeat(b, 1)
        positions[:, s // 2:] -= s // 2
        kwargs.update(position_ids=positions, use_cache=False)

    def step():
        loss = model(**kwargs).loss
        loss.backward()

    step()  # the gradients exist before the measured step, as in the probe
    measured, _ = _peak_activation_bytes(step, model, torch.device("cpu"))
    causal = config["model_type"] != "bert"
    shape = transformer_shape(model, s, s, dense_mask=causal)
    predicted = activation_bytes(shape, b, 4 if dtype == torch.float32 else 2, checkpointing).peak_bytes
    assert 0.8 * measured <= predicted <= 1.25 * measured, (predicted, measured)


def _llama_on_meta(**overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(**{**LLAMA, **overrides}))


def test_terms_scale_as_the_formula_says():
    model = _llama_on_meta()
    shape = transformer_shape(model, 1024, 1024, dense_mask=True)
    assert (shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.intermediate, shape.mlp_tensors) == (
        3, 64, 4, 2, 176, 4)
    assert shape.rms_norm and shape.fp32_loss and shape.fp32_softmax
    one, two = (activation_bytes(shape, b, 2, False) for b in (1, 2))
    assert two.peak_bytes == pytest.approx(2 * one.peak_bytes)  # every term grows with the micro-batch
    # The fp32 logits and loss: 12 bytes per position and vocabulary entry at the backward pass's start.
    assert one.head_bytes == 12 * 1024 * 512
    assert one.mask_bytes == 1024 * 1024
    # Checkpointing keeps each layer's input instead of its activations.
    assert activation_bytes(shape, 1, 2, True).peak_bytes < one.peak_bytes
    # Eager attention stores the seq x seq probabilities (fp32 and 16-bit) in every layer: 4 heads x 6 bytes.
    eager = transformer_shape(_llama_on_meta(attn_implementation="eager"), 1024, 1024, dense_mask=True)
    assert eager.attention == "eager"
    assert activation_bytes(eager, 1, 2, False).layer_bytes - one.layer_bytes == pytest.approx(
        4 * 6 * 1024 * 1024, rel=0.01)


def test_lora_keeps_no_input_of_a_frozen_linear():
    from zerotrain.models.hf import LoRASettings, add_lora

    base = _llama_on_meta()
    full = transformer_shape(base, 256, 256, dense_mask=True)
    lora = add_lora(_llama_on_meta(), LoRASettings(8, 16, 0.05, ["q_proj", "v_proj"]), "CAUSAL_LM", False)
    shape = transformer_shape(lora, 256, 256, dense_mask=True)
    assert shape.frozen_base and shape.adapted_projections == 2 and shape.layers == full.layers
    assert activation_bytes(shape, 1, 2, False).layer_bytes < activation_bytes(full, 1, 2, False).layer_bytes


@pytest.fixture()
def hf_configs(tmp_path, tiny_tokenizer_dir):
    (tmp_path / "llama.json").write_text(json.dumps(dict(LLAMA, bos_token_id=0, pad_token_id=1, eos_token_id=2)))
    (tmp_path / "bert.json").write_text(json.dumps(dict(BERT, pad_token_id=1)))
    (tmp_path / "train.txt").write_text("the movie was good\nthe film was bad\n" * 8)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in
                                                  [("good film", "pos"), ("bad movie", "neg")] * 4))
    (tmp_path / "sft.jsonl").write_text((json.dumps({"input": "the movie", "target": "was good"}) + "\n") * 8)
    return tmp_path, tiny_tokenizer_dir


def _recipe_flags(recipe: str, tmp_path, tok) -> list[str]:
    model = str(tmp_path / ("bert.json" if recipe in ("classify", "mlm") else "llama.json"))
    flags = ["--model.init", "random", "--model.config", model]
    if recipe == "mlm":
        return flags + ["--data.tokenizer", str(tok), "--data.train_path", str(tmp_path / "train.txt"),
                        "--model.max_seq_length", "128"]
    flags += ["--model.tokenizer", str(tok)]
    if recipe == "lora":
        return flags + ["--data.train_path", str(tmp_path / "sft.jsonl"), "--data.max_length", "128"]
    if recipe == "classify":
        return flags + ["--data.train_path", str(tmp_path / "train.jsonl"), "--data.max_length", "128"]
    return flags + ["--data.train_path", str(tmp_path / "train.txt"), "--data.seq_len", "128"]


@pytest.mark.parametrize("recipe", ["causal-lm", "lora", "classify", "mlm"])
def test_estimate_adds_the_activations_of_each_hugging_face_recipe(hf_configs, recipe):
    from zerotrain.config.flags import parse_config
    from zerotrain.plan.estimate import estimate, format_report

    tmp_path, tok = hf_configs
    cfg = parse_config(recipe, _recipe_flags(recipe, tmp_path, tok) + ["--trainer.micro_batch_size", "4"])
    report = estimate(recipe, cfg, gpu_memory_gib=80, host_memory_gib=64)
    assert report.modelled is not None and report.modelled.peak_bytes > 0
    for row in report.rows:
        assert report.modelled_gpu_bytes[row.name] >= report.modelled.peak_bytes
    text = format_report(report)
    assert "peak GPU with activations" in text and "modelled from the config" in text
    assert "| zero3_offload_param |" in text


def test_long_context_logits_decide_what_fits(hf_configs):
    """A small model with a big vocabulary at long context: the fp32 logits and loss alone outgrow the GPU, which
    the model states would leave almost empty."""
    from zerotrain.config.flags import parse_config
    from zerotrain.plan.estimate import estimate

    tmp_path, tok = hf_configs
    (tmp_path / "wide.json").write_text(json.dumps(dict(LLAMA, vocab_size=152_064, bos_token_id=0, pad_token_id=1,
                                                        eos_token_id=2)))
    flags = ["--model.init", "random", "--model.config", str(tmp_path / "wide.json"), "--model.tokenizer", str(tok),
             "--data.train_path", str(tmp_path / "train.txt"), "--trainer.micro_batch_size", "1"]
    short = estimate("causal-lm", parse_config("causal-lm", flags + ["--data.seq_len", "1024"]), gpu_memory_gib=8)
    long = estimate("causal-lm", parse_config("causal-lm", flags + ["--data.seq_len", "8192"]), gpu_memory_gib=8)
    assert short.pick == "ddp"
    assert long.pick is None and long.modelled.head_bytes == 12 * 8192 * 152_064
    assert all(row.memory.gpu_bytes < 2 * 2**30 for row in long.rows)


@pytest.mark.slow
def test_auto_plans_and_trains_a_lora_run_with_modelled_activations(hf_configs, tmp_path):
    """--strategy.auto on the CPU for a LoRA run: the probe cannot measure a frozen base there, so the plan's
    activations are the formula's, and the planned fit trains."""
    from conftest import zerotrain_cmd

    tmp, tok = hf_configs
    args = ["fit", "lora", *_recipe_flags("lora", tmp, tok), "--trainer.max_steps", "2", "--trainer.num_workers", "0",
            "--trainer.micro_batch_size", "2", "--strategy.auto", "true", "--trainer.output_dir", str(tmp_path / "runs"),
            "--trainer.run_name", "a", "--logging.tensorboard", "false", "--logging.progress_bar", "false"]
    run = zerotrain_cmd(args, tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    plan = json.loads(next((tmp_path / "runs" / ".plans").glob("*/plan.json")).read_text())
    assert plan["probe"]["method"].startswith("modelled from the model's config")
    assert plan["probe"]["activations"]["off"]["per_sample"] > 0
