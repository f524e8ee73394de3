"""The planner's DeepSpeed JSON for other trainers: the Hugging Face Trainer and Lightning take it unchanged (CPU).

Each configuration is written to a file and handed to each trainer the way a user would
(``TrainingArguments(deepspeed=path)``, ``Trainer(strategy=DeepSpeedStrategy(config=path))``); then the
trainer's own config processing runs as far as it can without a GPU, and DeepSpeed's config parser (the batch
rule it asserts in ``deepspeed.initialize``) reads the result. Mismatched trainer arguments must be refused.
"""

from __future__ import annotations

import copy
import json
import math
import types
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

from zerotrain.config import OptimizerConfig, StrategyConfig, TrainerConfig
from zerotrain.config.ds_config import (
    DS_TOP_LEVEL_KEYS,
    hf_training_arguments,
    lightning_trainer_arguments,
    make_ds_config,
    portable_ds_config,
)
from zerotrain.tasks.toy import ToyConfig

CLIP = 0.5


def make_cfg(micro: int, gas: int, **strategy: Any) -> ToyConfig:
    return ToyConfig(
        optimizer=OptimizerConfig(lr=3e-4, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.05),
        strategy=StrategyConfig(gradient_accumulation_steps=gas, gradient_clipping=CLIP, **strategy),
        trainer=TrainerConfig(micro_batch_size=micro, max_steps=10),
    )


# (id, micro-batch, accumulation, world size, precision, strategy fields)
CASES = [
    ("zero0-bf16-fast-path", 8, 1, 1, "bf16", {"zero_stage": 0}),
    ("zero0-bf16-accum4", 8, 4, 1, "bf16", {"zero_stage": 0}),
    ("zero2-bf16", 4, 1, 1, "bf16", {"zero_stage": 2}),
    ("zero3-cpu-offload", 2, 1, 1, "bf16", {"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"}),
    ("zero1-fp32", 4, 1, 1, "fp32", {"zero_stage": 1}),
    ("zero2-fp16", 4, 1, 1, "fp16", {"zero_stage": 2}),
    ("zero2-bf16-accum4", 4, 4, 1, "bf16", {"zero_stage": 2}),
    ("zero2-bf16-2gpus-accum2", 4, 2, 2, "bf16", {"zero_stage": 2}),
]
IDS = [c[0] for c in CASES]


def case_cfg(case) -> tuple[ToyConfig, int, str]:
    _, micro, gas, world, precision, strategy = case
    return make_cfg(micro, gas, **strategy), world, precision


def write(tmp_path: Path, ds: dict, name: str = "ds_config.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(ds, indent=2))
    return path


def deepspeed_parse(config: dict, world: int):
    """DeepSpeed's own config object for ``world`` data-parallel ranks: what ``deepspeed.initialize`` builds,
    including the batch assertion train_batch_size == micro x accumulation x world. torch.distributed is not
    started on CPU, so DeepSpeed's rank/world-size queries are answered here."""
    import deepspeed.runtime.config as ds_runtime_config

    fake_dist = types.SimpleNamespace(get_rank=lambda: 0, get_world_size=lambda *a, **k: world)
    with mock.patch.object(ds_runtime_config, "dist", fake_dist):
        return ds_runtime_config.DeepSpeedConfig(copy.deepcopy(config))


# --- the file itself ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_same_as_the_engine_config_except_what_another_trainer_needs(case):
    cfg, world, precision = case_cfg(case)
    engine = make_ds_config(cfg, world, "cuda", precision)
    portable = portable_ds_config(cfg, world, precision)
    assert portable["gradient_clipping"] == CLIP  # also where the fast path wrote 0 (the engine clips there)
    assert set(portable) <= DS_TOP_LEVEL_KEYS
    assert '"auto"' not in json.dumps(portable)
    gas = cfg.strategy.gradient_accumulation_steps
    assert ("gradient_accumulation_steps" in portable) == (gas > 1)
    assert "gradient_accumulation_steps" not in portable_ds_config(cfg, world, precision, for_lightning=True)
    expected = {k: v for k, v in engine.items() if k != "gradient_accumulation_steps" or gas > 1}
    expected["gradient_clipping"] = CLIP
    if cfg.strategy.zero_stage == 3:
        expected["zero_allow_untested_optimizer"] = False
    assert portable == expected
    parsed = deepspeed_parse(portable, world)
    assert (parsed.train_batch_size, parsed.gradient_accumulation_steps) == (engine["train_batch_size"], gas)
    assert parsed.gradient_clipping == CLIP


def test_zero0_bf16_keeps_the_measured_autocast_and_restores_clipping():
    cfg = make_cfg(8, 1, zero_stage=0)
    engine, portable = make_ds_config(cfg, 1, "cuda", "bf16"), portable_ds_config(cfg, 1, "bf16")
    assert engine["gradient_clipping"] == 0.0  # zerotrain's engine clips; a Trainer/Lightning run would not
    assert portable["gradient_clipping"] == CLIP
    assert portable["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"}
    assert portable["bf16"] == {"enabled": False}
    assert hf_training_arguments(cfg, 1, "bf16")["bf16"] is False
    assert lightning_trainer_arguments(cfg, 1, "bf16") == {"accumulate_grad_batches": 1, "precision": "32-true"}


def test_fp16_at_zero0_keeps_deepspeeds_clipping():
    cfg = make_cfg(8, 1, zero_stage=0)
    assert portable_ds_config(cfg, 1, "fp16")["gradient_clipping"] == CLIP == make_ds_config(cfg, 1, "cuda", "fp16")[
        "gradient_clipping"]


def test_user_file_comments_dropped_and_defaults_written(tmp_path):
    user = {"_comment": "mine", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "zero_optimization": {"stage": 2, "_note": "bucket sizes from the plan"}}
    cfg = make_cfg(4, 1, zero_stage=2)
    cfg.strategy.gradient_clipping = type(cfg.strategy)().gradient_clipping  # the file leaves clipping to DeepSpeed
    cfg.strategy.deepspeed_config = str(write(tmp_path, user, "user.json"))
    ds = portable_ds_config(cfg, 1, "bf16")
    assert "_comment" not in ds and "_note" not in ds["zero_optimization"]
    # DeepSpeed's defaults, written so that neither Lightning nor accelerate fills them from their own arguments.
    assert ds["gradient_clipping"] == 0.0
    assert ds["fp16"] == ds["bf16"] == {"enabled": False}


def test_training_argument_values():
    cfg = make_cfg(4, 4, zero_stage=2)
    assert hf_training_arguments(cfg, 2, "fp16") == {
        "per_device_train_batch_size": 4, "gradient_accumulation_steps": 4, "bf16": False, "fp16": True,
        "learning_rate": 3e-4, "weight_decay": 0.05, "adam_epsilon": 1e-7, "adam_beta1": 0.8, "adam_beta2": 0.95,
        "max_grad_norm": CLIP}
    assert lightning_trainer_arguments(cfg, 2, "fp16") == {"accumulate_grad_batches": 4, "precision": "16-mixed"}
    assert lightning_trainer_arguments(cfg, 2, "bf16")["precision"] == "bf16-mixed"


# --- the Hugging Face Trainer --------------------------------------------------------------------------------------

@pytest.fixture
def hf(monkeypatch):
    """``make(path, world, **kwargs)`` -> ``TrainingArguments(deepspeed=path, ...)`` as on ``world`` GPUs."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState
    from transformers import training_args
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    # TrainingArguments refuses bf16 on a machine without a bf16 GPU (use_cpu would change its device set-up).
    monkeypatch.setattr(training_args, "is_torch_bf16_gpu_available", lambda: True)

    def make(path: Path, world: int = 1, **kwargs: Any):
        if world != 1:  # what torch.distributed reports under a launcher of `world` processes
            monkeypatch.setattr(transformers.TrainingArguments, "world_size", property(lambda self: world))
        return transformers.TrainingArguments(output_dir=str(path.parent / "hf_out"), deepspeed=str(path),
                                              report_to="none", **kwargs)

    yield make
    # TrainingArguments leaves a global DeepSpeed config (is_deepspeed_zero3_enabled) and accelerate's state.
    unset_hf_deepspeed_config()
    AcceleratorState._reset_state(reset_partial_state=True)


def hf_finalize(args) -> dict:
    """What the HF Trainer does with the file on its way to ``deepspeed.initialize``, as far as it runs on CPU.
    Raises where the Trainer would refuse it."""
    # Trainer.train -> deepspeed_init: fills the model-dependent "auto" values and raises on every mismatch
    # trainer_config_process (run by TrainingArguments) recorded between the file and the arguments.
    args.hf_deepspeed_config.trainer_config_finalize(args, torch.nn.Linear(2, 2), num_training_steps=100)
    plugin = args.deepspeed_plugin
    # Accelerator(...) -> AcceleratorState: the precision blocks from the arguments (raises on fp16 with bf16).
    plugin.set_mixed_precision(args.mixed_precision)
    # Accelerator._prepare_deepspeed: where the file's accumulation differs from the Trainer's, accelerate warns
    # and uses the file's. Not run on CPU: Accelerator(...) with DeepSpeed, deepspeed.initialize.
    assert plugin.get_value("gradient_accumulation_steps") == args.gradient_accumulation_steps
    return plugin.deepspeed_config


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_hf_trainer_takes_the_file_unchanged(case, tmp_path, hf):
    cfg, world, precision = case_cfg(case)
    ds = portable_ds_config(cfg, world, precision)
    args = hf(write(tmp_path, ds), world, **hf_training_arguments(cfg, world, precision))
    config = hf_finalize(args)
    # accelerate's DeepSpeedPlugin always sets steps_per_print (to inf, as quiet as ours), and writes
    # gradient_accumulation_steps 1 where the file leaves it out (only at 1); nothing else changes.
    expected = {**ds, "steps_per_print": math.inf,
                "gradient_accumulation_steps": cfg.strategy.gradient_accumulation_steps}
    assert config == expected
    parsed = deepspeed_parse(config, world)
    assert parsed.gradient_accumulation_steps == cfg.strategy.gradient_accumulation_steps


@pytest.mark.parametrize("change", [
    {"per_device_train_batch_size": 3},
    {"gradient_accumulation_steps": 2},
    {"max_grad_norm": 1.0},
    {"learning_rate": 1e-3},
    {"bf16": False},
])
def test_hf_trainer_refuses_mismatched_arguments(change, tmp_path, hf):
    cfg = make_cfg(4, 4, zero_stage=2)
    path = write(tmp_path, portable_ds_config(cfg, 1, "bf16"))
    args = hf(path, **{**hf_training_arguments(cfg, 1, "bf16"), **change})
    with pytest.raises(ValueError, match="mismatch TrainingArguments"):
        hf_finalize(args)


def test_hf_trainer_refuses_the_engine_config_at_zero0(tmp_path, hf):
    """Why the portable file differs: the engine's ZeRO-0 file says gradient_clipping 0 (the engine clips)."""
    cfg = make_cfg(8, 1, zero_stage=0)
    args = hf(write(tmp_path, make_ds_config(cfg, 1, "cuda", "bf16")), **hf_training_arguments(cfg, 1, "bf16"))
    with pytest.raises(ValueError, match="gradient_clipping=0.0 vs hf max_grad_norm=0.5"):
        hf_finalize(args)


def test_hf_trainer_needs_the_accumulation_key(tmp_path, hf):
    """Why the HF file keeps gradient_accumulation_steps above 1: without it accelerate writes 1, and DeepSpeed
    then refuses the batch (or, without train_batch_size, would step every micro-batch)."""
    cfg = make_cfg(4, 4, zero_stage=2)
    args = hf(write(tmp_path, portable_ds_config(cfg, 1, "bf16", for_lightning=True)),
              **hf_training_arguments(cfg, 1, "bf16"))
    assert args.deepspeed_plugin.get_value("gradient_accumulation_steps") == 1
    with pytest.raises(AssertionError, match="Check batch related parameters"):
        deepspeed_parse(args.deepspeed_plugin.deepspeed_config, 1)


# --- Lightning ---------------------------------------------------------------------------------------------------

def lightning_config(path: Path, **trainer_kwargs: Any) -> dict:
    """The config Lightning's DeepSpeedStrategy hands to ``deepspeed.initialize`` for a ``Trainer(**trainer_kwargs)``.

    Runs what ``Trainer.fit`` does to the config before it needs a GPU: ``strategy.setup`` ->
    ``_init_config_if_needed`` -> ``_format_config`` (``_format_batch_size_and_grad_accum_config`` and
    ``_format_precision_config``). Not run on CPU: ``setup_environment`` (refuses a non-CUDA accelerator), the
    process launch for several devices, and ``deepspeed.initialize`` (here DeepSpeed's config parser stands in).
    """
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.strategies import DeepSpeedStrategy

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 2)

    strategy = DeepSpeedStrategy(config=str(path))
    assert strategy.config == json.loads(path.read_text())
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, **trainer_kwargs)
    assert trainer.strategy is strategy and strategy.precision_plugin.precision == trainer_kwargs["precision"]
    module = Module()
    strategy.connect(module)
    module.trainer = trainer
    strategy._init_config_if_needed()
    return strategy.config


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_lightning_takes_the_file_unchanged(case, tmp_path):
    pytest.importorskip("lightning")
    cfg, world, precision = case_cfg(case)
    ds = portable_ds_config(cfg, world, precision, for_lightning=True)
    config = lightning_config(write(tmp_path, ds), **lightning_trainer_arguments(cfg, world, precision))
    # Lightning adds gradient_accumulation_steps from accumulate_grad_batches, and nothing else.
    assert config == {**ds, "gradient_accumulation_steps": cfg.strategy.gradient_accumulation_steps}
    parsed = deepspeed_parse(config, world)
    assert parsed.gradient_clipping == CLIP
    if cfg.strategy.gradient_accumulation_steps == 1:  # then one file serves both trainers
        assert portable_ds_config(cfg, world, precision) == ds


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_lightning_keeps_zero0_autocast_whatever_its_precision(precision, tmp_path):
    pytest.importorskip("lightning")
    cfg = make_cfg(8, 1, zero_stage=0)
    ds = portable_ds_config(cfg, 1, "bf16", for_lightning=True)
    config = lightning_config(write(tmp_path, ds), accumulate_grad_batches=1, precision=precision)
    assert config["bf16"] == {"enabled": False} and config["torch_autocast"]["enabled"] is True


def test_lightning_refuses_the_hf_file_when_accumulating(tmp_path):
    pytest.importorskip("lightning")
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    cfg = make_cfg(4, 4, zero_stage=2)
    path = write(tmp_path, portable_ds_config(cfg, 1, "bf16"))
    with pytest.raises(MisconfigurationException, match="gradient_accumulation_steps"):
        lightning_config(path, **lightning_trainer_arguments(cfg, 1, "bf16"))


def test_deepspeed_refuses_lightning_with_other_accumulation(tmp_path):
    pytest.importorskip("lightning")
    cfg = make_cfg(4, 4, zero_stage=2)
    path = write(tmp_path, portable_ds_config(cfg, 1, "bf16", for_lightning=True))
    config = lightning_config(path, accumulate_grad_batches=1, precision="bf16-mixed")
    with pytest.raises(AssertionError, match="Check batch related parameters"):
        deepspeed_parse(config, 1)
