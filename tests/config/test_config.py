"""Every ``validate()`` error names its flag, and ``from_dict`` rebuilds a saved config."""

from __future__ import annotations

import dataclasses
import json

import pytest

from zerotrain.config import (
    CheckpointConfig,
    CompileConfig,
    LaunchConfig,
    LoggingConfig,
    OptimizerConfig,
    PrecisionConfig,
    RunConfig,
    SchedulerConfig,
    StrategyConfig,
    TrainerConfig,
    from_dict,
)
from zerotrain.errors import ConfigError, UserError
from zerotrain.tasks.toy import ToyConfig, ToyDataConfig, ToyModelConfig

# (section, bad kwargs, flag the message must start with, other words it must hold)
INVALID = [
    (StrategyConfig, dict(offload_param="cpu", zero_stage=2), "--strategy.offload_param", ["stage 3"]),
    (StrategyConfig, dict(offload_param="cpu", zero_stage=0), "--strategy.offload_param", ["stage 3"]),
    (StrategyConfig, dict(offload_optimizer="cpu", zero_stage=0), "--strategy.offload_optimizer", ["stage 1, 2 or 3"]),
    (StrategyConfig, dict(offload_optimizer="nvme", zero_stage=3), "--strategy.nvme_path", ["nvme"]),
    (StrategyConfig, dict(offload_param="nvme", zero_stage=3), "--strategy.nvme_path", ["nvme"]),
    (StrategyConfig, dict(offload_optimizer="nvme", zero_stage=2, nvme_path="/tmp/nvme"),
     "--strategy.offload_optimizer", ["--strategy.zero_stage 3"]),
    (StrategyConfig, dict(backend="ddp", zero_stage=2), "--strategy.backend", ["ddp", "--strategy.zero_stage"]),
    (StrategyConfig, dict(backend="ddp", offload_optimizer="cpu", zero_stage=0), "--strategy.backend", ["offload"]),
    (StrategyConfig, dict(backend="ddp", deepspeed_config="ds.json"), "--strategy.deepspeed_config", ["deepspeed"]),
    (StrategyConfig, dict(zero_stage=4), "--strategy.zero_stage", ["got 4"]),
    (StrategyConfig, dict(gradient_accumulation_steps=0), "--strategy.gradient_accumulation_steps", ["got 0"]),
    (StrategyConfig, dict(gradient_clipping=-1.0), "--strategy.gradient_clipping", ["got -1.0"]),
    (OptimizerConfig, dict(lr=0.0), "--optimizer.lr", ["> 0", "got 0.0"]),
    (OptimizerConfig, dict(lr=-1e-3), "--optimizer.lr", ["> 0"]),
    (OptimizerConfig, dict(betas=(0.9, 1.0)), "--optimizer.betas", ["[0, 1)"]),
    (OptimizerConfig, dict(weight_decay=-0.1), "--optimizer.weight_decay", ["got -0.1"]),
    (SchedulerConfig, dict(warmup_steps=-1), "--scheduler.warmup_steps", ["got -1"]),
    (SchedulerConfig, dict(min_lr_ratio=1.5), "--scheduler.min_lr_ratio", ["got 1.5"]),
    (SchedulerConfig, dict(step_size=0), "--scheduler.step_size", ["got 0"]),
    (SchedulerConfig, dict(gamma=0.0), "--scheduler.gamma", ["(0, 1]"]),
    (TrainerConfig, dict(), "--trainer.max_steps", ["--trainer.epochs"]),
    (TrainerConfig, dict(max_steps=0), "--trainer.max_steps", ["got 0"]),
    (TrainerConfig, dict(epochs=0), "--trainer.epochs", ["got 0"]),
    (TrainerConfig, dict(max_steps=1, micro_batch_size=0), "--trainer.micro_batch_size", ["got 0"]),
    (TrainerConfig, dict(max_steps=1, log_every_steps=0), "--trainer.log_every_steps", ["got 0"]),
    (TrainerConfig, dict(max_steps=1, eval_every_steps=-1), "--trainer.eval_every_steps", ["got -1"]),
    (TrainerConfig, dict(max_steps=1, num_workers=-1), "--trainer.num_workers", ["got -1"]),
    (CheckpointConfig, dict(every_steps=-1), "--checkpoint.every_steps", ["got -1"]),
    (CheckpointConfig, dict(keep_last=0), "--checkpoint.keep_last", ["got 0"]),
    (LaunchConfig, dict(rdzv_endpoint="localhost"), "--launch.rdzv_endpoint", ["host:port", "'localhost'"]),
    (LaunchConfig, dict(rdzv_endpoint=":29500"), "--launch.rdzv_endpoint", ["host:port"]),
    (LaunchConfig, dict(rdzv_endpoint="node0:port"), "--launch.rdzv_endpoint", ["host:port"]),
    (LaunchConfig, dict(nnodes=2, node_rank=2), "--launch.node_rank", ["[0, 2)", "got 2"]),
    (LaunchConfig, dict(node_rank=-1), "--launch.node_rank", ["got -1"]),
    (LaunchConfig, dict(nproc_per_node=0), "--launch.nproc_per_node", ["got 0"]),
    (LaunchConfig, dict(nnodes=0), "--launch.nnodes", ["got 0"]),
]


@pytest.mark.parametrize(
    "section, kwargs, flag, words", INVALID,
    ids=[f"{s.__name__}-{'-'.join(f'{k}={v}' for k, v in kw.items()) or 'defaults'}" for s, kw, _, _ in INVALID],
)
def test_validate_names_the_flag(section, kwargs, flag, words):
    with pytest.raises(ConfigError) as err:
        section(**kwargs).validate()
    message = str(err.value)
    assert err.value.flag == flag
    assert message.startswith(flag + " "), message
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
    assert "\n" not in message


@pytest.mark.parametrize("sections, flag, words", [
    (dict(strategy=StrategyConfig(gradient_accumulation_steps=2), compile=CompileConfig(enabled=True, mode="reduce-overhead")),
     "--compile.mode", ["--strategy.gradient_accumulation_steps 1", "--compile.mode default"]),
    (dict(precision=PrecisionConfig(dtype="fp16", initial_scale_power=-1)), "--precision.initial_scale_power", [">= 0"]),
])
def test_checks_across_sections_name_the_flag(sections, flag, words):
    with pytest.raises(ConfigError) as err:
        ToyConfig(trainer=TrainerConfig(max_steps=3), **sections).validate()
    assert err.value.flag == flag and all(word in str(err.value) for word in words), str(err.value)
    # ZeRO-3 compiles its own way; a plain engine has no fp16 scale power: both pass
    ToyConfig(trainer=TrainerConfig(max_steps=3), strategy=StrategyConfig(zero_stage=3, gradient_accumulation_steps=2),
              compile=CompileConfig(enabled=True, mode="reduce-overhead")).validate()
    ToyConfig(trainer=TrainerConfig(max_steps=3), strategy=StrategyConfig(backend="ddp"),
              precision=PrecisionConfig(dtype="fp16", initial_scale_power=-1)).validate()


def test_config_error_is_a_user_error():
    # The CLI turns UserError into one line without a traceback; ConfigError must be caught by it.
    assert issubclass(ConfigError, UserError)


@pytest.mark.parametrize("section, kwargs", [
    (StrategyConfig, dict(offload_param="cpu", offload_optimizer="cpu", zero_stage=3)),
    (StrategyConfig, dict(offload_optimizer="cpu", zero_stage=1)),
    (StrategyConfig, dict(offload_optimizer="nvme", offload_param="nvme", zero_stage=3, nvme_path="/tmp/nvme")),
    (StrategyConfig, dict(offload_param="nvme", offload_optimizer="cpu", zero_stage=3, nvme_path="/tmp/nvme")),
    (StrategyConfig, dict(backend="ddp")),
    (StrategyConfig, dict(gradient_clipping=0.0)),
    (TrainerConfig, dict(epochs=1)),
    (TrainerConfig, dict(max_steps=1)),
    (LaunchConfig, dict(nnodes=4, node_rank=3, rdzv_endpoint="node-0.cluster:6000")),
    (LaunchConfig, dict(rdzv_endpoint="[::1]:29500")),
])
def test_valid_sections_pass(section, kwargs):
    section(**kwargs).validate()


def test_run_config_validate_checks_every_section_and_returns_self():
    cfg = ToyConfig(trainer=TrainerConfig(max_steps=3))
    assert cfg.validate() is cfg
    bad = ToyConfig(trainer=TrainerConfig(max_steps=3), model=ToyModelConfig(width=0))
    with pytest.raises(ConfigError, match=r"^--model\.width "):
        bad.validate()
    bad = ToyConfig(trainer=TrainerConfig(max_steps=3), launch=LaunchConfig(rdzv_endpoint="nope"))
    with pytest.raises(ConfigError, match=r"^--launch\.rdzv_endpoint "):
        bad.validate()


def _custom_toy() -> ToyConfig:
    return ToyConfig(
        optimizer=OptimizerConfig(name="adam", lr=3e-4, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.0),
        scheduler=SchedulerConfig(name="cosine", warmup_steps=5, min_lr_ratio=0.1),
        strategy=StrategyConfig(zero_stage=3, offload_param="cpu", offload_optimizer="cpu", gradient_accumulation_steps=4),
        precision=PrecisionConfig(dtype="bf16"),
        trainer=TrainerConfig(micro_batch_size=2, max_steps=11, run_name="r1"),
        model=ToyModelConfig(width=16, dropout=0.0),
        data=ToyDataConfig(num_examples=64, dim=4),
    )


def test_from_dict_round_trips_through_json():
    cfg = _custom_toy()
    cfg.logging.wandb_tags = ["a", "b"]
    saved = json.loads(json.dumps(dataclasses.asdict(cfg)))  # what hparams.json holds: tuples became lists
    assert isinstance(saved["optimizer"]["betas"], list)
    back = from_dict(ToyConfig, saved)
    assert back == cfg
    assert type(back.optimizer.betas) is tuple
    assert isinstance(back.model, ToyModelConfig) and isinstance(back.strategy, StrategyConfig)
    assert back.logging.wandb_tags == ["a", "b"]


def test_from_dict_round_trips_asdict():
    cfg = _custom_toy()
    assert from_dict(ToyConfig, dataclasses.asdict(cfg)) == cfg
    assert from_dict(ToyConfig, cfg.to_dict()).validate() == cfg


def test_from_dict_partial_keeps_defaults():
    back = from_dict(ToyConfig, {"trainer": {"max_steps": 5}, "optimizer": {"betas": [0.5, 0.6]}})
    assert back.trainer.max_steps == 5
    assert back.trainer.micro_batch_size == TrainerConfig().micro_batch_size
    assert back.optimizer.betas == (0.5, 0.6)
    assert back.strategy == StrategyConfig()


@pytest.mark.parametrize("data, key", [
    ({"no_such_section": {}}, "no_such_section"),
    ({"trainer": {"max_step": 5}}, "max_step"),
    ({"strategy": {"zero_stage": 2, "offload": "cpu"}}, "offload"),
])
def test_from_dict_rejects_unknown_keys(data, key):
    with pytest.raises(ConfigError) as err:
        from_dict(ToyConfig, data)
    assert err.value.flag == key
    assert str(err.value).startswith(key + " ")


def test_run_config_has_docstring_on_every_field():
    # The docstrings are the --help text; the CLI test checks one of them is shown.
    import inspect

    for cls in (RunConfig, OptimizerConfig, SchedulerConfig, StrategyConfig, TrainerConfig, LaunchConfig,
                CheckpointConfig, LoggingConfig):
        source = inspect.getsource(cls)
        for f in dataclasses.fields(cls):
            lines = source.splitlines()
            idx = next(i for i, line in enumerate(lines) if line.strip().startswith(f"{f.name}:"))
            assert lines[idx + 1].strip().startswith('"""'), f"{cls.__name__}.{f.name} has no docstring"


def test_config_file_with_a_few_aliases_still_parses(tmp_path):
    """The alias limit refuses exponential expansion only: an anchor reused a few times is a valid config."""
    from zerotrain.config.flags import parse_config

    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  max_steps: &n 7\n  log_every_steps: *n\noptimizer: &opt\n  lr: 0.002\n")
    cfg = parse_config("toy", ["--config", str(path)])
    assert (cfg.trainer.max_steps, cfg.trainer.log_every_steps, cfg.optimizer.lr) == (7, 7, 0.002)


def test_config_file_alias_count_is_the_expanded_size(tmp_path):
    """The size counted is what the aliases expand to: one level past the limit is refused, one below is not."""
    import yaml

    from zerotrain.config.flags import MAX_CONFIG_NODES, _expanded_size

    def nested(levels: int) -> str:  # level k holds 10 uses of level k-1: about 10**levels values
        lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x, x]"]
        lines += [f"l{k}: &l{k} [{', '.join([f'*l{k - 1}'] * 10)}]" for k in range(1, levels)]
        return "\n".join(lines) + "\n"

    assert _expanded_size(yaml.compose(nested(4), Loader=yaml.SafeLoader)) < MAX_CONFIG_NODES
    assert _expanded_size(yaml.compose(nested(6), Loader=yaml.SafeLoader)) > MAX_CONFIG_NODES


@pytest.mark.parametrize("settings, flag", [
    (dict(auto=True), "--strategy.auto"),
    (dict(offload_param="nvme", nvme_path="/nvme"), "--strategy.offload_param"),
    (dict(offload_optimizer="nvme", nvme_path="/nvme"), "--strategy.offload_optimizer"),
])
def test_fsdp2_refuses_what_only_deepspeed_or_the_planner_does_naming_the_flag_given(settings, flag):
    with pytest.raises(ConfigError) as err:
        StrategyConfig(backend="fsdp2", **settings).validate()
    assert err.value.flag == flag


@pytest.mark.parametrize("backend,kwargs,unused", [
    ("fsdp2", {"overlap_comm": True, "reduce_bucket_size": 1000}, ["--strategy.overlap_comm", "--strategy.reduce_bucket_size"]),
    ("ddp", {"reshard_after_forward": False, "fast_path": False}, ["--strategy.fast_path", "--strategy.reshard_after_forward"]),
    ("deepspeed", {"reshard_after_forward": False, "overlap_comm": True}, ["--strategy.reshard_after_forward"]),
    ("fsdp2", {"reshard_after_forward": False, "gradient_clipping": 0.5}, []),
])
def test_another_engine_s_settings_are_named_as_unused(backend, kwargs, unused):
    assert StrategyConfig(backend=backend, **kwargs).unused_flags() == unused


def test_a_fit_says_which_flags_its_engine_does_not_use(tmp_path, capsys):
    from helpers import toy_config

    from zerotrain.tasks.toy import ToyTask
    from zerotrain.train.loop import fit

    cfg = toy_config(tmp_path, "run", backend="ddp", overlap_comm=True)
    cfg.trainer.max_steps = 1
    fit(ToyTask(cfg))
    said = [line for line in capsys.readouterr().err.splitlines() if "does not use" in line]
    assert said == ["[zerotrain] --strategy.overlap_comm: another engine's setting, which --strategy.backend ddp does "
                    "not use"]
