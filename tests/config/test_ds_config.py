"""The DeepSpeed JSON: generated per ZeRO stage, offload and precision; user files read, resolved, validated."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import zerotrain
from zerotrain.config import CompileConfig, OptimizerConfig, PrecisionConfig, StrategyConfig, TrainerConfig
from zerotrain.config.ds_config import (
    batch_shape,
    build_ds_config,
    check_nvme_io,
    engine_clips,
    load_user_config,
    make_ds_config,
    precision_of,
    resolve_auto,
    resolve_precision,
    validate_ds_config,
)
from helpers import REPO
from zerotrain.engines.ds_private.config import zero_default
from zerotrain.errors import ConfigError, UserError
from zerotrain.runtime.doctor import LIBAIO_INSTALL
from zerotrain.tasks.toy import ToyConfig

PRESETS = sorted((Path(zerotrain.__file__).parent / "presets").glob("*.json"))


def make_cfg(micro: int = 4, gas: int = 2, **strategy: Any) -> ToyConfig:
    """A config whose flags all differ from their defaults; beside a user's DeepSpeed file (``deepspeed_config``), only
    the batch and the flags named, as a flag the file leaves to DeepSpeed's default is refused."""
    if "deepspeed_config" in strategy:
        return ToyConfig(strategy=StrategyConfig(gradient_accumulation_steps=gas, **strategy),
                         trainer=TrainerConfig(micro_batch_size=micro, max_steps=10))
    return ToyConfig(
        optimizer=OptimizerConfig(lr=3e-4, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.05),
        strategy=StrategyConfig(gradient_accumulation_steps=gas, gradient_clipping=0.5, **strategy),
        trainer=TrainerConfig(micro_batch_size=micro, max_steps=10),
    )


def write(tmp_path: Path, text: str, name: str = "ds.json") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def find_auto(node: Any, path: str = "") -> list[str]:
    """Dotted paths of every "auto" string left in a nested dict/list."""
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in find_auto(v, f"{path}.{k}" if path else k)]
    if isinstance(node, list):
        return [p for i, v in enumerate(node) for p in find_auto(v, f"{path}[{i}]")]
    return [path] if node == "auto" else []


# --- build_ds_config -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stage(stage):
    ds = build_ds_config(make_cfg(zero_stage=stage), world_size=2, device="cuda", precision="bf16")
    zero = ds["zero_optimization"]
    assert zero["stage"] == stage
    assert ("allgather_bucket_size" in zero) == (stage in (1, 2))
    # Only stage 3 has the key, and there it is on (the export needs the gathered 16-bit weights).
    assert zero.get("stage3_gather_16bit_weights_on_model_save") is (True if stage == 3 else None)
    assert "offload_optimizer" not in zero and "offload_param" not in zero
    assert zero["reduce_bucket_size"] == StrategyConfig().reduce_bucket_size
    validate_ds_config(ds, world_size=2)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("device, pinned", [("cuda", True), ("cpu", False)])
def test_cpu_optimizer_offload(stage, device, pinned):
    ds = build_ds_config(make_cfg(zero_stage=stage, offload_optimizer="cpu"), 1, device, "fp32")
    zero = ds["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": pinned}
    assert "offload_param" not in zero
    # DeepSpeedCPUAdam runs the step under offload, never torch's Adam.
    assert ds["optimizer"]["params"]["torch_adam"] is False
    validate_ds_config(ds, 1)


@pytest.mark.parametrize("pin", [True, False])
def test_offload_pin_memory_overrides_the_device_default(pin):
    cfg = make_cfg(zero_stage=3, offload_optimizer="cpu", offload_param="cpu", offload_pin_memory=pin)
    cfg.validate()
    zero = build_ds_config(cfg, 1, "cuda", "bf16")["zero_optimization"]
    assert zero["offload_optimizer"]["pin_memory"] is pin and zero["offload_param"]["pin_memory"] is pin


def test_cpu_param_and_optimizer_offload_stage3():
    ds = build_ds_config(make_cfg(zero_stage=3, offload_optimizer="cpu", offload_param="cpu"), 2, "cuda", "bf16")
    zero = ds["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert zero["offload_param"] == {"device": "cpu", "pin_memory": True}
    validate_ds_config(ds, 2)


def test_nvme_offload_carries_the_path():
    cfg = make_cfg(zero_stage=3, offload_optimizer="nvme", offload_param="nvme", nvme_path="/local_nvme")
    cfg.validate()
    zero = build_ds_config(cfg, 1, "cuda", "fp16")["zero_optimization"]
    for key in ("offload_optimizer", "offload_param"):
        assert zero[key] == {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True}



class _AsyncIO:
    """Stands for DeepSpeed's accelerator: its AsyncIOBuilder buildable or not, and which builders were asked."""

    def __init__(self, buildable: bool):
        self.buildable, self.asked = buildable, []

    def create_op_builder(self, name):
        self.asked.append(name)
        return SimpleNamespace(is_compatible=lambda verbose=False: self.buildable)


@pytest.mark.parametrize("buildable", [True, False])
def test_nvme_offload_is_refused_in_one_line_where_its_io_op_cannot_be_built(tmp_path, monkeypatch, buildable):
    """Flags or a DeepSpeed file asking for NVMe: refused naming the flag (or the file and its key) and libaio where
    the async I/O op cannot be built, passed where it can; no NVMe, or the plain engine: the op is not asked for."""
    import deepspeed.accelerator

    accelerator = _AsyncIO(buildable)
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: accelerator)
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}))
    asking = {"--strategy.offload_optimizer nvme": make_cfg(zero_stage=3, offload_optimizer="nvme", nvme_path="/n"),
              "--strategy.offload_param nvme": make_cfg(zero_stage=3, offload_optimizer="cpu", offload_param="nvme",
                                                        nvme_path="/n"),
              f"--strategy.deepspeed_config {user} (zero_optimization.offload_param.device nvme)":
                  make_cfg(deepspeed_config=str(user))}
    for start, cfg in asking.items():
        if buildable:
            check_nvme_io(cfg)
        else:
            with pytest.raises(ConfigError) as refused:
                check_nvme_io(cfg)
            assert str(refused.value).startswith(start + ": DeepSpeed's async I/O op") and "libaio" in str(refused.value)
            assert LIBAIO_INSTALL in str(refused.value) and "offload to cpu" in str(refused.value)
    assert accelerator.asked == ["AsyncIOBuilder"] * 3
    for cfg in (make_cfg(zero_stage=3, offload_optimizer="cpu", offload_param="cpu"),
                make_cfg(backend="ddp", offload_optimizer="nvme")):
        check_nvme_io(cfg)
    assert len(accelerator.asked) == 3

@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_precision_blocks(precision):
    ds = build_ds_config(make_cfg(fast_path=False), 1, "cuda", precision)
    assert ds["fp16"]["enabled"] is (precision == "fp16")
    assert ds["bf16"]["enabled"] is (precision == "bf16")
    assert precision_of(ds) == precision
    # Off, the fp16 block is the bare switch; on, it carries the loss-scale settings too.
    assert (ds["fp16"] == {"enabled": False}) is (precision != "fp16")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_fast_path_rewrites(stage, precision):
    """What the fast path changes against DeepSpeed's defaults, per stage and precision (ds_config.fast_path)."""
    cfg, slow_cfg = make_cfg(zero_stage=stage), make_cfg(zero_stage=stage, fast_path=False)
    fast, slow = build_ds_config(cfg, 1, "cuda", precision), build_ds_config(slow_cfg, 1, "cuda", precision)
    assert fast["timers"] == {"throughput": {"enabled": False}} and "timers" not in slow
    assert precision_of(fast) == precision_of(slow) == precision
    autocast = stage == 0 and precision == "bf16"
    assert ("torch_autocast" in fast) is autocast
    assert fast["bf16"]["enabled"] is (precision == "bf16" and not autocast)
    assert fast["bf16"].get("check_grad_overflow", True) is not (precision == "bf16" and stage in (1, 2))
    clips = stage == 0 and precision != "fp16"
    assert engine_clips(cfg, fast) is clips and not engine_clips(slow_cfg, slow)
    assert fast["gradient_clipping"] == (0.0 if clips else 0.5) and slow["gradient_clipping"] == 0.5
    # ZeRO-1/2 flatten the gradients for their all-reduce instead of copying each into a bucket and a partition.
    assert fast["zero_optimization"] == {**slow["zero_optimization"],
                                         **({"contiguous_gradients": False} if stage in (1, 2) else {})}
    assert fast["fp16"] == slow["fp16"]


@pytest.mark.parametrize("stage", [1, 2])
def test_fast_path_keeps_contiguous_gradients_under_optimizer_offload(stage):
    """DeepSpeed turns them back on there: the JSON says what runs."""
    ds = build_ds_config(make_cfg(zero_stage=stage, offload_optimizer="cpu"), 1, "cuda", "bf16")
    assert ds["zero_optimization"]["contiguous_gradients"] is True


def test_fast_path_leaves_a_user_file_alone(tmp_path):
    path = write(tmp_path, json.dumps({"train_micro_batch_size_per_gpu": "auto", "gradient_clipping": 2.0,
                                       "bf16": {"enabled": True}, "zero_optimization": {"stage": 0}}))
    cfg = make_cfg(deepspeed_config=str(path))
    cfg.strategy.gradient_clipping = StrategyConfig().gradient_clipping  # no clipping flag: the file decides
    ds = make_ds_config(cfg, 1, "cuda", "bf16")
    assert ds["gradient_clipping"] == 2.0 and ds["bf16"] == {"enabled": True} and "torch_autocast" not in ds
    assert not engine_clips(cfg, ds)


def test_fp16_block_follows_the_config():
    cfg = make_cfg()
    cfg.precision = PrecisionConfig(initial_scale_power=12, loss_scale_window=250, hysteresis=3, min_loss_scale=0.5)
    fp16 = build_ds_config(cfg, 1, "cuda", "fp16")["fp16"]
    assert fp16 == {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 250,
                    "hysteresis": 3, "min_loss_scale": 0.5}


@pytest.mark.parametrize("micro, gas, world", [(1, 1, 1), (4, 2, 1), (3, 5, 4), (8, 1, 16)])
def test_batch_rule(micro, gas, world):
    ds = build_ds_config(make_cfg(micro=micro, gas=gas), world, "cuda", "bf16")
    assert ds["train_micro_batch_size_per_gpu"] == micro
    assert ds["gradient_accumulation_steps"] == gas
    assert ds["train_batch_size"] == micro * gas * world
    validate_ds_config(ds, world)


def test_optimizer_and_clipping_from_config():
    ds = build_ds_config(make_cfg(zero_stage=2), 1, "cuda", "bf16")
    assert ds["optimizer"]["type"] == "AdamW"
    assert ds["optimizer"]["params"] == {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-7, "weight_decay": 0.05,
                                         "torch_adam": False, "adam_w_mode": True}
    assert ds["gradient_clipping"] == 0.5
    cfg = make_cfg()
    cfg.optimizer.name = "adam"
    ds = build_ds_config(cfg, 1, "cuda", "bf16")
    assert ds["optimizer"]["type"] == "Adam" and ds["optimizer"]["params"]["adam_w_mode"] is False
    json.dumps(ds)  # it is written to the run directory as JSON


@pytest.mark.parametrize("device, offload, expected", [
    ("cpu", "none", True), ("cpu", "cpu", False), ("cuda", "none", False), ("cuda", "cpu", False),
])
def test_torch_adam_only_on_cpu_without_offload(device, offload, expected):
    ds = build_ds_config(make_cfg(zero_stage=2, offload_optimizer=offload), 1, device, "fp32")
    assert ds["optimizer"]["params"]["torch_adam"] is expected


def test_build_is_pure():
    cfg = make_cfg(zero_stage=3, offload_optimizer="cpu", offload_param="cpu")
    before = copy.deepcopy(cfg)
    a = build_ds_config(cfg, 4, "cuda", "fp16")
    b = build_ds_config(cfg, 4, "cuda", "fp16")
    assert a == b and a is not b
    assert cfg == before
    a["optimizer"]["params"]["betas"].append(0.0)  # no list shared with the config
    assert cfg.optimizer.betas == (0.8, 0.95)
    assert build_ds_config(cfg, 4, "cuda", "fp16") == b


# --- resolve_precision -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("requested, device, bf16_ok, expected", [
    ("auto", "cuda", True, "bf16"),
    ("auto", "cuda", False, "fp16"),
    ("auto", "cpu", False, "fp32"),
    ("auto", "cpu", True, "fp32"),
    ("fp32", "cuda", True, "fp32"),
    ("fp16", "cuda", True, "fp16"),
    ("bf16", "cuda", True, "bf16"),
    ("bf16", "cpu", False, "bf16"),
])
def test_resolve_precision(requested, device, bf16_ok, expected):
    assert resolve_precision(requested, device, bf16_ok) == expected


@pytest.mark.parametrize("requested, device, bf16_ok", [("fp16", "cpu", False), ("bf16", "cuda", False)])
def test_resolve_precision_rejects(requested, device, bf16_ok):
    with pytest.raises(ConfigError, match=r"^--precision\.dtype "):
        resolve_precision(requested, device, bf16_ok)


# --- load_user_config ------------------------------------------------------------------------------------------

def test_load_hjson_with_comments(tmp_path):
    path = write(tmp_path, """# a leading comment line, as in the shipped presets
{
    // DeepSpeed allows these comments too
    "train_micro_batch_size_per_gpu": 2,  // trailing comment
    "zero_optimization": {"stage": 2},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}
}
""")
    assert load_user_config(path) == {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
                                      "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}
    assert load_user_config(str(path)) == load_user_config(path)


def test_load_missing_file(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(UserError) as err:
        load_user_config(missing)
    assert "--strategy.deepspeed_config" in str(err.value) and "nope.json" in str(err.value)


@pytest.mark.parametrize("text", ['{"zero_optimization": {"stage": 2}', '{"a": }', "[1, 2]"])
def test_load_malformed(tmp_path, text):
    path = write(tmp_path, text)
    with pytest.raises(UserError) as err:
        load_user_config(path)
    assert "--strategy.deepspeed_config" in str(err.value) and str(path) in str(err.value)


@pytest.mark.parametrize("preset", PRESETS, ids=[p.name for p in PRESETS])
def test_presets_load(preset):
    loaded = load_user_config(preset)
    assert find_auto(loaded), "a preset is expected to hold \"auto\" values"
    assert loaded["zero_optimization"]["stage"] in (2, 3)


# --- resolve_auto ----------------------------------------------------------------------------------------------

def test_presets_shipped():
    assert {p.name for p in PRESETS} >= {"ds_zero2_offload.json", "ds_zero3.json", "ds_zero3_offload.json"}


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("preset", PRESETS, ids=[p.name for p in PRESETS])
def test_resolve_auto_presets(preset, precision):
    user = load_user_config(preset)
    stage = user["zero_optimization"]["stage"]
    cfg = make_cfg(micro=3, gas=2, zero_stage=stage)
    generated = build_ds_config(cfg, 2, "cuda", precision)
    user_before = copy.deepcopy(user)
    ds = resolve_auto(user, generated, {"total_num_steps": 100, "warmup_num_steps": 10})
    assert user == user_before
    assert find_auto(ds) == []
    params = ds["optimizer"]["params"]
    assert params["lr"] == 3e-4
    assert params["betas"] == [0.8, 0.95]
    assert params["eps"] == 1e-7
    assert params["weight_decay"] == 0.05
    assert ds["train_micro_batch_size_per_gpu"] == 3
    assert ds["gradient_accumulation_steps"] == 2
    assert ds["train_batch_size"] == 3 * 2 * 2
    assert ds["gradient_clipping"] == 0.5
    assert ds["fp16"]["enabled"] is (precision == "fp16")
    assert ds["bf16"]["enabled"] is (precision == "bf16")
    # Explicit values in the file win over the generated ones; the ZeRO-3 presets leave the reuse distance "auto"
    # (DeepSpeed's 1e9 here; 0 where the weights go to NVMe)
    explicit = {k: v for k, v in user["zero_optimization"].items() if v != "auto"}
    assert {k: ds["zero_optimization"][k] for k in explicit} == explicit
    assert set(ds["zero_optimization"]) == set(user["zero_optimization"])
    if stage == 3:
        assert ds["zero_optimization"]["stage3_max_reuse_distance"] == 1_000_000_000
    assert ds["fp16"]["loss_scale_window"] == user["fp16"]["loss_scale_window"]
    assert ds["optimizer"]["type"] == "AdamW"
    validate_ds_config(ds, 2)
    assert precision_of(ds) == precision


def test_resolve_auto_keeps_explicit_values():
    generated = build_ds_config(make_cfg(micro=4, gas=2), 1, "cuda", "bf16")
    user = {"optimizer": {"type": "Adam", "params": {"lr": 1e-2, "betas": [0.5, 0.6], "eps": "auto"}},
            "gradient_clipping": 2.0, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
            "train_batch_size": 8, "zero_optimization": {"stage": 1, "reduce_bucket_size": 1234}}
    ds = resolve_auto(user, generated)
    assert ds["optimizer"] == {"type": "Adam", "params": {"lr": 1e-2, "betas": [0.5, 0.6], "eps": 1e-7}}
    assert ds["gradient_clipping"] == 2.0
    assert ds["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 1234}


def test_resolve_auto_fills_missing_loop_keys_and_optimizer():
    generated = build_ds_config(make_cfg(micro=4, gas=2), 2, "cuda", "bf16")
    ds = resolve_auto({"zero_optimization": {"stage": 2}}, generated)
    assert ds["train_micro_batch_size_per_gpu"] == 4
    assert ds["gradient_accumulation_steps"] == 2
    assert ds["train_batch_size"] == 16
    assert ds["optimizer"] == generated["optimizer"]
    assert ds["optimizer"] is not generated["optimizer"]
    validate_ds_config(ds, 2)


@pytest.mark.parametrize("user", [
    {"train_micro_batch_size_per_gpu": 2, "train_batch_size": "auto"},
    {"train_micro_batch_size_per_gpu": 2},
    {"gradient_accumulation_steps": 5, "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"},
])
def test_auto_train_batch_size_follows_explicit_micro_and_accumulation(user):
    world = 2
    generated = build_ds_config(make_cfg(micro=4, gas=1), world, "cuda", "bf16")
    ds = resolve_auto(user, generated)
    assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * world
    validate_ds_config(ds, world)


@pytest.mark.parametrize("user, key", [
    ({"foo": {"bar": "auto"}}, "foo.bar"),
    ({"zero_optimization": {"stage": 2, "no_such_knob": "auto"}}, "zero_optimization.no_such_knob"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}},
     "scheduler.params.total_num_steps"),  # no `extra` given: nothing to fill it from
])
def test_resolve_auto_unknown_key(user, key):
    generated = build_ds_config(make_cfg(), 1, "cuda", "bf16")
    with pytest.raises(ConfigError) as err:
        resolve_auto(user, generated)
    assert err.value.flag == key
    assert str(err.value).startswith(key + " ") and "--strategy.deepspeed_config" in str(err.value)


def test_resolve_auto_scheduler_from_extra():
    generated = build_ds_config(make_cfg(), 1, "cuda", "bf16")
    user = {"scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_num_steps": "auto", "total_num_steps": "auto", "warmup_max_lr": "auto", "warmup_min_lr": "auto"}}}
    ds = resolve_auto(user, generated, {"total_num_steps": 500, "warmup_num_steps": 25, "min_lr_ratio": 0.1})
    assert ds["scheduler"] == {"type": "WarmupDecayLR", "params": {
        "warmup_num_steps": 25, "total_num_steps": 500, "warmup_max_lr": 3e-4, "warmup_min_lr": 0.0}}


def test_resolve_auto_hidden_size_buckets():
    generated = build_ds_config(make_cfg(zero_stage=3), 1, "cuda", "bf16")
    user = {"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                  "stage3_param_persistence_threshold": "auto"}}
    zero = resolve_auto(user, generated, {"hidden_size": 100})["zero_optimization"]
    # reduce_bucket_size is a typed flag (--strategy.reduce_bucket_size): the generated value fills it;
    # the stage-3 knobs have no flag and follow the hidden size.
    assert zero == {"stage": 3, "reduce_bucket_size": StrategyConfig().reduce_bucket_size,
                    "stage3_prefetch_bucket_size": 9_000, "stage3_param_persistence_threshold": 1_000}


# --- validate_ds_config ----------------------------------------------------------------------------------------

def _valid() -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "train_batch_size": 8,
            "zero_optimization": {"stage": 2}}


def test_validate_batch_rule_shows_the_numbers():
    ds = _valid()
    ds["train_batch_size"] = 100
    with pytest.raises(ConfigError) as err:
        validate_ds_config(ds, world_size=3)
    message = str(err.value)
    assert err.value.flag == "train_batch_size"
    assert "= 100" in message and "4 x 2 x 3 = 24" in message


@pytest.mark.parametrize("key, value", [
    ("train_micro_batch_size_per_gpu", 0), ("gradient_accumulation_steps", "auto"), ("train_batch_size", None),
])
def test_validate_batch_values_are_positive_ints(key, value):
    ds = _valid()
    ds[key] = value
    with pytest.raises(ConfigError) as err:
        validate_ds_config(ds, 1)
    assert err.value.flag == key


def test_validate_fp16_and_bf16():
    ds = {**_valid(), "fp16": {"enabled": True}, "bf16": {"enabled": True}}
    with pytest.raises(ConfigError) as err:
        validate_ds_config(ds, 1)
    assert str(err.value).startswith("fp16.enabled ") and "bf16.enabled" in str(err.value)
    ds["bf16"]["enabled"] = False
    validate_ds_config(ds, 1)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_validate_param_offload_needs_stage3(stage):
    ds = {**_valid(), "zero_optimization": {"stage": stage, "offload_param": {"device": "cpu"}}}
    with pytest.raises(ConfigError) as err:
        validate_ds_config(ds, 1)
    assert err.value.flag == "zero_optimization.offload_param" and f"stage is {stage}" in str(err.value)


def test_validate_optimizer_offload_needs_a_stage():
    ds = {**_valid(), "zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}
    with pytest.raises(ConfigError) as err:
        validate_ds_config(ds, 1)
    assert err.value.flag == "zero_optimization.offload_optimizer"
    ds["zero_optimization"]["offload_optimizer"] = {"device": "none"}
    validate_ds_config(ds, 1)


def test_validate_bad_stage():
    with pytest.raises(ConfigError, match=r"^zero_optimization\.stage "):
        validate_ds_config({**_valid(), "zero_optimization": {"stage": 4}}, 1)


# --- make_ds_config and batch_shape ----------------------------------------------------------------------------

def test_make_ds_config_from_shipped_preset():
    preset = next(p for p in PRESETS if p.name == "ds_zero2_offload.json")
    cfg = make_cfg(micro=2, gas=3, deepspeed_config=str(preset))  # typed stage 0: the file's stage wins
    ds = make_ds_config(cfg, 2, "cuda", "bf16", {"total_num_steps": 10, "warmup_num_steps": 0})
    zero = ds["zero_optimization"]
    assert zero["stage"] == 2
    assert zero["offload_optimizer"]["device"] == "cpu"
    assert "offload_param" not in zero
    assert ds["train_batch_size"] == 2 * 3 * 2
    assert ds["bf16"]["enabled"] is True and ds["fp16"]["enabled"] is False
    assert find_auto(ds) == []


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_every_shipped_preset_takes_the_flags_it_leaves_to_auto(preset):
    """A preset beside non-default optimizer, clipping and batch flags and the stage it sets: nothing is refused, and
    each ``"auto"`` comes out as the flag says."""
    user = load_user_config(str(preset))
    cfg = ToyConfig(optimizer=OptimizerConfig(lr=3e-4, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.05),
                    strategy=StrategyConfig(gradient_accumulation_steps=3, gradient_clipping=0.5,
                                            zero_stage=user["zero_optimization"]["stage"], deepspeed_config=str(preset)),
                    trainer=TrainerConfig(micro_batch_size=2, max_steps=10))
    ds = make_ds_config(cfg, 2, "cuda", "bf16", {"total_num_steps": 10, "warmup_num_steps": 0})
    assert ds["optimizer"]["params"] == {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-7, "weight_decay": 0.05}
    assert (ds["gradient_clipping"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (0.5, 2, 3)
    assert find_auto(ds) == []


def test_an_auto_block_or_a_stage_dependent_default_is_no_flag_left_out(tmp_path):
    """A block the file gives as ``"auto"`` is filled whole from the flags, so its flags are not refused; an ``"auto"``
    key that the flags' own stage does not generate takes the flag; a key DeepSpeed's default already runs as the flag
    says (``overlap_comm`` at stage 3) or does not read at the file's stage (``allgather_bucket_size`` at stage 3) is
    no flag left out either."""
    auto_params = write(tmp_path, json.dumps({"optimizer": {"type": "AdamW", "params": "auto"}}))
    tuned = make_cfg(deepspeed_config=str(auto_params))
    tuned.optimizer = OptimizerConfig(lr=0.02, betas=(0.8, 0.9))
    assert make_ds_config(tuned, 1, "cuda", "bf16")["optimizer"]["params"]["betas"] == [0.8, 0.9]
    stage2 = write(tmp_path, json.dumps({"zero_optimization": {"stage": 2, "allgather_bucket_size": "auto"}}), "s2.json")
    ds = make_ds_config(make_cfg(deepspeed_config=str(stage2), allgather_bucket_size=2 * 10**8), 1, "cuda", "bf16")
    assert ds["zero_optimization"]["allgather_bucket_size"] == 2 * 10**8
    stage3 = write(tmp_path, json.dumps({"zero_optimization": {"stage": 3}}), "s3.json")
    make_ds_config(make_cfg(deepspeed_config=str(stage3), overlap_comm=True, allgather_bucket_size=10**8), 1, "cuda", "bf16")
    with pytest.raises(ConfigError, match="--strategy.overlap_comm is true, but .*does not set zero_optimization.overlap"):
        make_ds_config(make_cfg(deepspeed_config=str(stage2), overlap_comm=True), 1, "cuda", "bf16")
    with pytest.raises(ConfigError, match='does not offload the optimizer: give its zero_optimization block stage 3 and '
                                          '"offload_optimizer": {"device": "cpu", "ratio": 0.5}'):
        make_ds_config(make_cfg(deepspeed_config=str(stage3), offload_optimizer_ratio=0.5), 1, "cuda", "bf16")
    # A stage the file leaves to "auto" is the flag's; a null is DeepSpeed's default, as a key left out
    auto_stage = write(tmp_path, json.dumps({"zero_optimization": {"stage": "auto"}}), "auto_stage.json")
    with pytest.raises(ConfigError, match="--strategy.allgather_bucket_size is 200000000, but .*does not set"):
        make_ds_config(make_cfg(deepspeed_config=str(auto_stage), zero_stage=2, allgather_bucket_size=2 * 10**8),
                       1, "cuda", "bf16")
    make_ds_config(make_cfg(deepspeed_config=str(auto_stage), zero_stage=3, overlap_comm=True), 1, "cuda", "bf16")
    null = write(tmp_path, json.dumps({"zero_optimization": {"stage": 2, "overlap_comm": None}}), "null.json")
    with pytest.raises(ConfigError, match="--strategy.overlap_comm is true, but .*does not set"):
        make_ds_config(make_cfg(deepspeed_config=str(null), overlap_comm=True), 1, "cuda", "bf16")
    # DeepSpeed's own default is read from its model, not a rule of ours: a non-default persistence of 1e5 is its default
    assert zero_default({"stage": 3}, "param_persistence_threshold") == 100_000
    assert zero_default({"stage": 3}, "overlap_comm") is True and zero_default({"stage": 1}, "overlap_comm") is False
    auto_ratio = write(tmp_path, json.dumps({"zero_optimization": {"stage": 2, "offload_optimizer": {
        "device": "cpu", "ratio": "auto"}}}), "auto_ratio.json")
    with pytest.raises(UserError, match=r'ratio is 0.5 \("auto", from --strategy.offload_optimizer_ratio\)'):
        make_ds_config(make_cfg(deepspeed_config=str(auto_ratio), offload_optimizer_ratio=0.5), 1, "cuda", "bf16")


def test_make_ds_config_without_file_is_the_generated_one():
    cfg = make_cfg(zero_stage=1)
    assert make_ds_config(cfg, 2, "cpu", "fp32") == build_ds_config(cfg, 2, "cpu", "fp32")


def test_make_ds_config_validates_a_user_file(tmp_path):
    path = write(tmp_path, '{"fp16": {"enabled": true}, "bf16": {"enabled": true}}')
    with pytest.raises(ConfigError, match=r"^fp16\.enabled "):
        make_ds_config(make_cfg(deepspeed_config=str(path)), 1, "cuda", "bf16")


def test_a_user_file_that_accumulates_is_refused_with_cuda_graphs(tmp_path):
    path = write(tmp_path, '{"gradient_accumulation_steps": 4}')
    cfg = make_cfg(gas=1, deepspeed_config=str(path))
    cfg.compile = CompileConfig(enabled=True, mode="reduce-overhead")
    with pytest.raises(ConfigError, match=r"^gradient_accumulation_steps = 4 in .*ds\.json.*compile\.mode default"):
        make_ds_config(cfg, 1, "cuda", "bf16")
    path = write(tmp_path, '{"gradient_accumulation_steps": 4, "zero_optimization": {"stage": 3}}', "z3.json")
    z3 = make_cfg(gas=1, deepspeed_config=str(path))
    z3.compile = CompileConfig(enabled=True, mode="reduce-overhead")
    assert make_ds_config(z3, 1, "cuda", "bf16")["gradient_accumulation_steps"] == 4  # ZeRO-3 compiles its own way


def test_batch_shape_reads_a_user_file(tmp_path):
    path = write(tmp_path, '# mine\n{"train_micro_batch_size_per_gpu": 6, "gradient_accumulation_steps": 5}')
    defaults = TrainerConfig().micro_batch_size, StrategyConfig().gradient_accumulation_steps  # no flags given
    assert batch_shape(make_cfg(*defaults, deepspeed_config=str(path))) == (6, 5)
    with pytest.raises(ConfigError, match=r"^--trainer.micro_batch_size is 4, but .*ds.json \(--strategy.deepspeed_"
                                          r"config\) sets train_micro_batch_size_per_gpu to 6, and the file would win"):
        batch_shape(make_cfg(micro=4, gas=5, deepspeed_config=str(path)))  # a flag given beside the file's value
    path = write(tmp_path, '{"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 3}', "b.json")
    assert batch_shape(make_cfg(micro=4, gas=1, deepspeed_config=str(path))) == (4, 3)
    path = write(tmp_path, '{"zero_optimization": {"stage": 1}}', "c.json")
    assert batch_shape(make_cfg(micro=4, gas=2, deepspeed_config=str(path))) == (4, 2)
    assert batch_shape(make_cfg(micro=4, gas=2)) == (4, 2)


@pytest.mark.parametrize("block, expected", [
    ({"device": "cpu", "pin_memory": True}, True),
    ({"device": "cpu"}, False),  # DeepSpeed's default
    (None, None),
])
def test_hparams_record_the_files_offload_pinning_not_the_flag(block, expected):
    """With --strategy.deepspeed_config the file's offload block decides pinning; the run's recorded config
    says what DeepSpeed ran with, whatever --strategy.offload_pin_memory said."""
    from zerotrain.config.ds_config import reflect_ds_config

    cfg = make_cfg(offload_pin_memory=not expected if expected is not None else True)
    zero = {"stage": 2, **({"offload_optimizer": block} if block else {})}
    reflect_ds_config(cfg, {"zero_optimization": zero, "train_micro_batch_size_per_gpu": 4,
                            "gradient_accumulation_steps": 1}, "bf16")
    assert cfg.strategy.offload_pin_memory is expected
    assert cfg.strategy.offload_optimizer == ("cpu" if block else "none")


@pytest.mark.parametrize("param_pin, expected", [(True, True), (False, None)])
def test_hparams_record_no_pinning_where_the_files_offload_blocks_differ(tmp_path, param_pin, expected):
    """Optimizer states pinned and parameters not: no one value says that, and any value recorded would make the
    recorded config refuse its own file on a rerun. Unset, it reruns (the file decides again)."""
    import json

    from zerotrain.config.ds_config import make_ds_config, reflect_ds_config

    zero = {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "cpu", "pin_memory": param_pin}}
    cfg = make_cfg(offload_pin_memory=None)
    reflect_ds_config(cfg, {"zero_optimization": zero, "train_micro_batch_size_per_gpu": 4,
                            "gradient_accumulation_steps": 1}, "bf16")
    assert cfg.strategy.offload_pin_memory is expected
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": zero}))
    rerun = make_cfg(offload_pin_memory=cfg.strategy.offload_pin_memory, deepspeed_config=str(path))
    make_ds_config(rerun, 1, "cpu", "bf16")  # what the recorded config does on a rerun: no ConfigError


@pytest.mark.parametrize("block, pin, refused", [
    ({"device": "cpu", "pin_memory": True}, True, None),  # the flag agrees with the file: nothing to say
    ({"device": "cpu", "pin_memory": True}, None, None),  # no flag: the file decides
    ({"device": "cpu", "pin_memory": True}, False, "sets true"),
    ({"device": "cpu"}, True, "leaves it out"),
    (None, False, "offloads nothing"),
])
def test_a_pinning_flag_the_users_file_contradicts_is_refused_in_one_line(tmp_path, block, pin, refused):
    """--strategy.offload_pin_memory cannot reach a user's file (its offload blocks decide); a flag that says
    otherwise is refused with a line naming the flag, the file's key and what to do, not dropped silently."""
    zero = {"stage": 2, **({"offload_optimizer": block} if block else {})}
    path = write(tmp_path, json.dumps({"zero_optimization": zero}))
    cfg = make_cfg(offload_pin_memory=pin, deepspeed_config=str(path))
    if refused is None:
        ds = make_ds_config(cfg, 1, "cuda", "bf16")
        assert ds["zero_optimization"]["offload_optimizer"]["pin_memory"] is True
        return
    with pytest.raises(ConfigError) as err:
        make_ds_config(cfg, 1, "cuda", "bf16")
    message = str(err.value)
    assert "--strategy.offload_pin_memory" in message and refused in message and "\n" not in message
    assert str(path) in message and "leave --strategy.offload_pin_memory unset" in message


def test_an_auto_warmup_of_warmup_cosine_is_one_deepspeed_accepts(tmp_path):
    """--scheduler.warmup_steps 0 would fill WarmupCosineLR's warmup_num_steps with 0, which DeepSpeed refuses:
    a real fit through DeepSpeed's scheduler shows the filled value is accepted."""
    from zerotrain.tasks.toy import ToyConfig, ToyTask
    from zerotrain.train.loop import fit

    (tmp_path / "ds.json").write_text(json.dumps({"scheduler": {"type": "WarmupCosineLR", "params": {
        "total_num_steps": "auto", "warmup_num_steps": "auto", "warmup_min_ratio": 0.0, "cos_min_ratio": "auto"}}}))
    cfg = ToyConfig()
    cfg.strategy.deepspeed_config = str(tmp_path / "ds.json")
    cfg.trainer.max_steps, cfg.trainer.num_workers, cfg.trainer.device = 3, 0, "cpu"
    cfg.trainer.output_dir, cfg.trainer.run_name = str(tmp_path), "r"
    cfg.logging.progress_bar, cfg.logging.tensorboard, cfg.trainer.export = False, False, False
    fit(ToyTask(cfg))
    params = json.loads((tmp_path / "r" / "ds_config.json").read_text())["scheduler"]["params"]
    assert params["warmup_num_steps"] == 1 and params["total_num_steps"] == 3


def _states_cfg(master: str = "bf16", states: str = "bf16", dtype: str = "bf16", **strategy: Any) -> ToyConfig:
    cfg = make_cfg(**{"zero_stage": 2, **strategy})
    cfg.precision = PrecisionConfig(dtype=dtype, master_weights=master, optimizer_states=states)
    return cfg


@pytest.mark.parametrize("master, states, offload", [("bf16", "bf16", "none"), ("bf16", "fp32", "cpu"),
                                                     ("bf16", "bf16", "cpu"), ("fp32", "fp32", "none")])
def test_state_precision_maps_to_deepspeeds_bf16_keys(master, states, offload):
    cfg = _states_cfg(master, states, offload_optimizer=offload)
    cfg.validate()
    ds = make_ds_config(cfg, 1, "cuda", "bf16")
    bf16 = ds["bf16"]
    assert bf16["enabled"] is True
    assert bf16.get("bf16_master_weights_and_grads", False) is (master == "bf16")
    assert bf16.get("bf16_optimizer_states", False) is (states == "bf16")
    assert ("bf16_master_weights_and_grads" in bf16) is (master == "bf16")  # the default writes nothing new


@pytest.mark.parametrize("change, start", [
    (dict(master="fp32"), "--precision.optimizer_states bf16 needs --precision.master_weights bf16"),
    (dict(backend="ddp", zero_stage=0), "--precision.master_weights bf16 needs --strategy.backend deepspeed"),
    (dict(zero_stage=0), "--precision.master_weights bf16 needs --strategy.zero_stage 1, 2 or 3"),
    (dict(dtype="fp16"), "--precision.master_weights bf16 needs --precision.dtype bf16, got fp16"),
    (dict(states="fp32"), "--precision.master_weights bf16 and fp32 optimizer states needs the optimizer on the host"),
    (dict(states="fp32", zero_stage=3, offload_optimizer="nvme", nvme_path="/n"),
     "--precision.master_weights bf16 cannot go to NVMe: DeepSpeed 0.19 stops at the first step"),
    (dict(zero_stage=3, offload_optimizer="nvme", nvme_path="/n"),
     "--precision.master_weights bf16 cannot go to NVMe: DeepSpeed 0.19 stops at the first step"),
    (dict(offload_optimizer="cpu", name="sgd"), "--precision.master_weights bf16 under --strategy.offload_optimizer cpu needs --optimizer.name "
                                                "adamw or adam (DeepSpeedCPUAdam), got sgd"),
])
def test_state_precision_is_refused_in_one_line_where_deepspeed_does_not_run_it(change, start):
    name = change.pop("name", None)
    cfg = _states_cfg(change.pop("master", "bf16"), change.pop("states", "bf16"), change.pop("dtype", "bf16"), **change)
    if name:
        cfg.optimizer.name = name
    with pytest.raises(ConfigError) as refused:
        cfg.validate()
    assert str(refused.value).startswith(start), str(refused.value)
    assert "\n" not in str(refused.value)


def test_state_precision_with_auto_is_refused_where_auto_is_not_bf16():
    cfg = _states_cfg(dtype="auto")
    cfg.validate()
    with pytest.raises(ConfigError, match=r"^--precision.master_weights bf16 needs bf16 training, and "
                                          r"--precision.dtype auto is fp32 on cpu: pass --precision.dtype bf16$"):
        make_ds_config(cfg, 1, "cpu", "fp32")


def test_a_users_file_decides_the_state_precision(tmp_path):
    """A flag the file does not say too is refused; the file's keys are what the run records."""
    from zerotrain.config.ds_config import reflect_ds_config

    plain, low = tmp_path / "plain.json", tmp_path / "low.json"
    plain.write_text(json.dumps({"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}))
    low.write_text(json.dumps({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True,
                                        "bf16_optimizer_states": True}, "zero_optimization": {"stage": 2}}))
    cfg = _states_cfg(deepspeed_config=str(plain))
    cfg.validate()
    with pytest.raises(ConfigError, match=r"^--precision.master_weights is bf16, but .*plain.json "
                                          r"\(--strategy.deepspeed_config\) decides and does not set "
                                          r"bf16.bf16_master_weights_and_grads"):
        make_ds_config(cfg, 1, "cuda", "bf16")
    recorded = _states_cfg("fp32", "fp32", deepspeed_config=str(low))
    ds = make_ds_config(recorded, 1, "cuda", "bf16")
    reflect_ds_config(recorded, ds, "bf16")
    assert (recorded.precision.master_weights, recorded.precision.optimizer_states) == ("bf16", "bf16")
    make_ds_config(_states_cfg(deepspeed_config=str(low)), 1, "cuda", "bf16")  # flags that agree pass


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "benchmarks").glob("ds_*.json")))
def test_the_shipped_peer_files_pass_the_checks_a_users_file_gets(name):
    """The DeepSpeed files the benchmarks hand to zerotrain and its peers: every key where DeepSpeed reads it,
    every value of the type DeepSpeed expects (a misplaced block would be ignored, and a row would measure
    something else than its name says)."""
    from zerotrain.config.ds_config import check_user_keys, check_user_types

    path = REPO / "benchmarks" / name
    user = load_user_config(path)
    check_user_keys(user, path)
    check_user_types(user, path)
    assert user["zero_optimization"]["stage"] in (2, 3)


def test_nvme_weight_buffers_hold_the_largest_parameter():
    """DeepSpeed swaps each NVMe-offloaded parameter through one buffer (100M elements by default) and stops at the
    build where one is larger, as a 32,000 x 4,096 embedding is: the buffers grow to the largest parameter."""
    cfg = make_cfg(zero_stage=3, offload_optimizer="nvme", offload_param="nvme", nvme_path="/n")
    block = lambda ds: ds["zero_optimization"]["offload_param"]  # noqa: E731
    assert block(make_ds_config(cfg, 1, "cuda", "bf16", {"largest_param_numel": 131_072_000}))["buffer_size"] \
        == 131_072_000
    assert block(make_ds_config(cfg, 1, "cuda", "bf16", {"largest_param_numel": 5_000}))["buffer_size"] == 100_000_000
    # each rank swaps its share: 4 ranks of a 525M-element embedding need buffers of 131.25M
    assert block(make_ds_config(cfg, 4, "cuda", "bf16", {"largest_param_numel": 525_000_001}))["buffer_size"] \
        == 131_250_001
    assert "buffer_size" not in block(make_ds_config(cfg, 1, "cuda", "bf16"))  # no fact: DeepSpeed's default


def test_nvme_weights_are_not_kept_in_their_swap_buffers_for_reuse_unless_a_users_file_says(tmp_path):
    """From its second step DeepSpeed keeps weights it will reuse within stage3_max_reuse_distance elements in their
    swap buffers, which ran out at 1.07B parameters: with weights on NVMe the distance is 0, unless a user's file
    sets it ("auto" is no setting); weights on the GPU or the host keep DeepSpeed's default."""
    zero = lambda ds: ds["zero_optimization"]  # noqa: E731
    nvme = make_cfg(zero_stage=3, offload_optimizer="nvme", offload_param="nvme", nvme_path="/n")
    assert zero(make_ds_config(nvme, 1, "cuda", "bf16", {"largest_param_numel": 10**6}))["stage3_max_reuse_distance"] == 0
    assert zero(make_ds_config(nvme, 1, "cuda", "bf16"))["stage3_max_reuse_distance"] == 0
    for cfg in (make_cfg(zero_stage=3, offload_optimizer="nvme", nvme_path="/n"),
                make_cfg(zero_stage=3, offload_optimizer="cpu", offload_param="cpu")):
        assert "stage3_max_reuse_distance" not in zero(make_ds_config(cfg, 1, "cuda", "bf16"))
    blocks = {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/n"},
              "offload_param": {"device": "nvme", "nvme_path": "/n"}}
    for name, users, kept in (("unset", {}, 0), ("auto", {"stage3_max_reuse_distance": "auto"}, 0),
                              ("set", {"stage3_max_reuse_distance": 1e8}, 1e8), ("other_name", {"max_reuse_distance": 5}, 5)):
        path = write(tmp_path, json.dumps({"zero_optimization": {**blocks, **users}}), f"{name}.json")
        got = zero(make_ds_config(make_cfg(deepspeed_config=str(path)), 1, "cuda", "bf16"))
        assert got.get("stage3_max_reuse_distance", got.get("max_reuse_distance")) == kept, name


def test_a_users_nvme_weight_buffer_under_the_largest_parameter_is_refused_in_one_line(tmp_path):
    zero = {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/n"},
            "offload_param": {"device": "nvme", "nvme_path": "/n"}}
    unset = write(tmp_path, json.dumps({"zero_optimization": zero}), "unset.json")
    cfg = make_cfg(deepspeed_config=str(unset))
    ds = make_ds_config(cfg, 1, "cuda", "bf16", {"largest_param_numel": 131_072_000})
    assert ds["zero_optimization"]["offload_param"]["buffer_size"] == 131_072_000  # unset: sized as zerotrain's own
    zero["offload_param"]["buffer_size"] = 1e8
    small = write(tmp_path, json.dumps({"zero_optimization": zero}), "small.json")
    with pytest.raises(ConfigError) as refused:
        make_ds_config(make_cfg(deepspeed_config=str(small)), 1, "cuda", "bf16", {"largest_param_numel": 131_072_000})
    assert str(refused.value) == (
        f"--strategy.deepspeed_config {small} zero_optimization.offload_param.buffer_size is 100000000, under a "
        "rank's share of the model's largest parameter (131,072,000 elements), which DeepSpeed swaps through one "
        "buffer: set it to 131072000 or more, or remove it")


def test_a_share_of_the_optimizer_on_the_gpu_is_deepspeeds_ratio_in_sub_groups_of_1e8():
    from zerotrain.config.ds_config import GPU_SHARE_SUB_GROUP

    cfg = make_cfg(zero_stage=3, offload_optimizer="cpu", offload_optimizer_ratio=0.6)
    zero = build_ds_config(cfg, 1, "cuda", "bf16")["zero_optimization"]
    assert zero["offload_optimizer"]["ratio"] == 0.6 and zero["sub_group_size"] == GPU_SHARE_SUB_GROUP == 10**8
    whole = build_ds_config(make_cfg(zero_stage=3, offload_optimizer="cpu"), 1, "cuda", "bf16")["zero_optimization"]
    assert "ratio" not in whole["offload_optimizer"] and "sub_group_size" not in whole


def test_a_users_file_that_splits_the_optimizer_is_recorded_with_its_ratio(tmp_path):
    from zerotrain.config.ds_config import reflect_ds_config

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}}))
    cfg = make_cfg(deepspeed_config=str(path))
    ds = make_ds_config(cfg, 1, "cuda", "bf16")
    assert ds["zero_optimization"]["offload_optimizer"]["ratio"] == 0.3
    reflect_ds_config(cfg, ds, "bf16")
    assert (cfg.strategy.zero_stage, cfg.strategy.offload_optimizer, cfg.strategy.offload_optimizer_ratio) == (3, "cpu", 0.3)
    flagged = make_cfg(deepspeed_config=str(path), offload_optimizer_ratio=0.5)
    with pytest.raises(ConfigError, match="--strategy.offload_optimizer_ratio.*0.3"):
        make_ds_config(flagged, 1, "cuda", "bf16")


def test_a_users_auto_ratio_is_the_flags_whatever_stage_and_device_the_flags_name(tmp_path):
    """The file decides the stage and the offload device; its ``"ratio": "auto"`` takes --strategy.offload_optimizer_ratio
    (1, no split, when the flag is left out), not a value from a config generated at the flags' own stage."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": "auto"}}}))
    ds = make_ds_config(make_cfg(deepspeed_config=str(path), offload_optimizer_ratio=0.4), 1, "cuda", "bf16")
    assert ds["zero_optimization"]["offload_optimizer"]["ratio"] == 0.4
    assert make_ds_config(make_cfg(deepspeed_config=str(path)), 1, "cuda", "bf16")[
        "zero_optimization"]["offload_optimizer"]["ratio"] == 1.0


def test_an_optimizer_flag_the_users_file_contradicts_is_refused(tmp_path):
    """--optimizer.name sgd beside a file whose optimizer is AdamW would train AdamW without a word."""
    path = write(tmp_path, json.dumps({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}))
    sgd = make_cfg(deepspeed_config=str(path))
    sgd.optimizer = OptimizerConfig(name="sgd")
    with pytest.raises(ConfigError, match='--optimizer.name is sgd, but .*sets optimizer.type to "AdamW".*"type": "SGD"'):
        make_ds_config(sgd, 1, "cuda", "bf16")
    path.write_text(json.dumps({"optimizer": {"type": "SGD", "params": {"lr": "auto", "momentum": 0.0}}}))
    assert make_ds_config(sgd, 1, "cuda", "bf16")["optimizer"]["type"] == "SGD"


def test_a_flag_that_a_users_file_leaves_to_deepspeeds_default_is_refused(tmp_path):
    """A flag given beside a file that does not set its key would lose to DeepSpeed's default without a word; the
    batch keys and a missing optimizer block are filled from the flags instead, so those flags stay."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto"}))
    with pytest.raises(ConfigError, match="--strategy.zero_stage is 2, but .*does not set zero_optimization.stage"):
        make_ds_config(make_cfg(deepspeed_config=str(path), zero_stage=2), 1, "cuda", "bf16")
    ds = make_ds_config(make_cfg(gas=3, deepspeed_config=str(path)), 1, "cuda", "bf16")
    assert ds["gradient_accumulation_steps"] == 3
    tuned = make_cfg(deepspeed_config=str(path))
    tuned.optimizer = OptimizerConfig(lr=0.02)
    assert make_ds_config(tuned, 1, "cuda", "bf16")["optimizer"]["params"]["lr"] == 0.02
    path.write_text(json.dumps({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.95]}}}))
    with pytest.raises(ConfigError, match="--optimizer.lr is 0.02, but .*does not set optimizer.params.lr"):
        make_ds_config(tuned, 1, "cuda", "bf16")


def test_a_split_optimizer_is_refused_where_deepspeed_would_not_run_it_as_asked(tmp_path):
    """Each in one line naming the flag or the file: a split under FSDP2, beside weights on NVMe, beside bf16 master
    weights (the GPU's share would keep bf16 moments), with a file that keeps the whole optimizer on the host or
    whose host optimizer is not AdamW (DeepSpeed steps the GPU's share with AdamW)."""
    from zerotrain.config import PrecisionConfig

    def refused(cfg: ToyConfig, match: str) -> None:
        with pytest.raises((ConfigError, UserError), match=match):
            cfg.validate()
            make_ds_config(cfg, 1, "cuda", "bf16")

    refused(make_cfg(backend="fsdp2", offload_optimizer_ratio=0.5), "--strategy.offload_optimizer_ratio.*fsdp2")
    refused(make_cfg(zero_stage=3, offload_optimizer="cpu", offload_param="nvme", nvme_path="/tmp",
                     offload_optimizer_ratio=0.5), "--strategy.offload_optimizer_ratio.*offload_param nvme")
    bf16_master = make_cfg(zero_stage=3, offload_optimizer="cpu", offload_optimizer_ratio=0.5)
    bf16_master.precision = PrecisionConfig(dtype="bf16", master_weights="bf16")
    refused(bf16_master, "--strategy.offload_optimizer_ratio.*master_weights bf16")
    whole = tmp_path / "whole.json"
    whole.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}))
    refused(make_cfg(deepspeed_config=str(whole), offload_optimizer_ratio=0.5),
            "--strategy.offload_optimizer_ratio is 0.5, but .*whole.json.*does not set zero_optimization.offload_optimizer"
            ".ratio, so DeepSpeed's default would apply: write 0.5")
    l2 = tmp_path / "l2.json"
    l2.write_text(json.dumps({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}))
    refused(make_cfg(deepspeed_config=str(l2)), "l2.json: zero_optimization.offload_optimizer.ratio is 0.5.*AdamW")
    split = tmp_path / "split.json"
    split.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}))
    adam = make_cfg(deepspeed_config=str(split))
    adam.optimizer = OptimizerConfig(name="adam")
    refused(adam, "--optimizer.name Adam steps the host's share.*pass --optimizer.name adamw")
    decoupled = tmp_path / "adamw.json"
    decoupled.write_text(json.dumps({"optimizer": {"type": "Adam", "params": {}}, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}))
    assert make_ds_config(make_cfg(deepspeed_config=str(decoupled)), 1, "cuda", "bf16")["optimizer"]["type"] == "Adam"


def test_a_resume_keeps_the_share_of_the_optimizer_on_the_host():
    """Another share changes DeepSpeed's sub-groups (1e8 elements below 1, 1e9 at 1) and which optimizer steps each
    one: a resume with it is refused by the recorded config's check, as any setting outside resume_safe."""
    import dataclasses

    from zerotrain.config import resume_changes

    saved = json.loads(json.dumps(dataclasses.asdict(make_cfg(zero_stage=3, offload_optimizer="cpu"))))
    _, unsafe = resume_changes(saved, make_cfg(zero_stage=3, offload_optimizer="cpu", offload_optimizer_ratio=0.7))
    assert unsafe == [("--strategy.offload_optimizer_ratio", 1.0, 0.7)]
