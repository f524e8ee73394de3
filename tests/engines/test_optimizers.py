"""The optimizer table (zerotrain.engines.optimizers): what each engine builds from it, what DeepSpeed's JSON
says, and that the memory model's optimizer-state bytes are what the engine holds after a step."""

from __future__ import annotations

import json
import math

import pytest
import torch

from zerotrain.config import OptimizerConfig
from zerotrain.config.ds_config import build_ds_config
from zerotrain.engines import optimizers
from zerotrain.engines.build import build_engine
from zerotrain.engines.states import (
    Buckets,
    Strategy,
    count_params,
    model_state_memory,
    optimizer_states,
)
from zerotrain.errors import ConfigError
from zerotrain.runtime.distributed import setup
from zerotrain.tasks.toy import ToyConfig, ToyTask, stack_pairs


class DeclaredStates(torch.optim.SGD):
    """A user's optimizer that declares its state count instead of having it measured."""

    STATES_PER_PARAMETER = 3


@pytest.mark.parametrize("name, momentum, cls, states", [
    ("adamw", 0.0, torch.optim.AdamW, 2),
    ("adam", 0.0, torch.optim.Adam, 2),
    ("sgd", 0.0, torch.optim.SGD, 0),
    ("sgd", 0.9, torch.optim.SGD, 1),
    ("adagrad", 0.0, torch.optim.Adagrad, 1),
    ("torch.optim.RMSprop", 0.0, torch.optim.RMSprop, 1),  # measured: square_avg
    ("torch.optim:RMSprop", 0.9, torch.optim.RMSprop, 2),  # measured: square_avg, momentum_buffer
    (f"{__name__}:DeclaredStates", 0.0, DeclaredStates, 3),
])
def test_each_name_builds_its_optimizer_and_counts_its_states(name, momentum, cls, states):
    o = OptimizerConfig(name=name, lr=0.01, momentum=momentum)
    o.validate()
    opt = optimizers.build([torch.nn.Parameter(torch.zeros(3))], o, "cpu")
    assert type(opt) is cls and opt.param_groups[0]["lr"] == 0.01
    assert optimizer_states(o) == states


def test_an_unknown_name_is_one_line_naming_the_flag_and_the_choices():
    with pytest.raises(ConfigError) as err:
        OptimizerConfig(name="lamb").validate()
    assert str(err.value) == ("--optimizer.name = 'lamb' is not an optimizer: choose adamw, adam, sgd, adagrad or a "
                              "class path (torch.optim.RMSprop, my_package.module:MyOptimizer)")


def test_deepspeed_json_comes_from_the_table():
    cfg = ToyConfig()
    cfg.strategy.zero_stage = 2
    adamw = build_ds_config(cfg, 1, "cuda", "bf16")
    assert adamw["optimizer"]["type"] == "AdamW" and "zero_allow_untested_optimizer" not in adamw
    cfg.optimizer.name, cfg.optimizer.momentum = "sgd", 0.9
    sgd = build_ds_config(cfg, 1, "cuda", "bf16")
    # DeepSpeed builds torch.optim.SGD from the type; its ZeRO stages need the key for an optimizer off their list
    assert sgd["optimizer"] == {"type": "SGD", "params": {"lr": cfg.optimizer.lr, "momentum": 0.9,
                                                         "weight_decay": cfg.optimizer.weight_decay}}
    assert sgd["zero_allow_untested_optimizer"] is True
    cfg.optimizer.name = "torch.optim.RMSprop"
    client = build_ds_config(cfg, 1, "cuda", "bf16")
    assert "optimizer" not in client and client["zero_force_ds_cpu_optimizer"] is False
    # A user's DeepSpeed file decides the optimizer the memory model counts
    assert optimizer_states(cfg.optimizer, {"optimizer": {"type": "SGD", "params": {"momentum": 0}}}) == 0
    assert optimizer_states(cfg.optimizer, {"optimizer": {"type": "Adam"}}) == 2


def test_the_planners_optimizer_bytes_follow_the_optimizer():
    counts = count_params(torch.nn.Linear(1000, 1000))
    for strategy, precision, per_state in ((Strategy("ddp"), "fp32", 4), (Strategy("deepspeed", 1), "bf16", 4),
                                           (Strategy("deepspeed", 2, offload_optimizer="cpu"), "bf16", 4)):
        gpu, cpu = {}, {}
        for name in ("adamw", "sgd"):
            mem = model_state_memory(counts, strategy, 1, precision, Buckets(10),
                                     optimizer_states=optimizer_states(OptimizerConfig(name=name)))
            gpu[name], cpu[name] = mem.gpu_bytes, mem.cpu_bytes
        saved = (gpu["adamw"] - gpu["sgd"]) + (cpu["adamw"] - cpu["sgd"])
        assert saved == 2 * per_state * counts.trainable, strategy  # AdamW's two moments, SGD none


def _one_step_states(backend: str, stage: int, name: str, momentum: float) -> tuple[int, int, float]:
    """(state bytes the engine's optimizer holds after one step, the memory model's, the step's loss)."""
    cfg = ToyConfig()
    cfg.strategy.backend, cfg.strategy.zero_stage = backend, stage
    cfg.optimizer.name, cfg.optimizer.momentum, cfg.optimizer.lr = name, momentum, 0.05
    cfg.trainer.device, cfg.trainer.micro_batch_size, cfg.trainer.max_steps = "cpu", 8, 1
    cfg.validate()
    task = ToyTask(cfg)
    with setup(cfg) as rt:
        model = task.build_model()
        counts = count_params(model)
        engine = build_engine(model, cfg, rt.device, rt.precision, 4, 4, rt.world_size)
        train = task.build_datasets().train
        batch = stack_pairs([train[i] for i in range(8)])
        loss = float(engine.train_step([batch], task.training_step).loss)
        # The optimizer that steps the fp32 weights: torch's under the plain engine, the one DeepSpeed's ZeRO
        # stages hand their fp32 partition to
        opt = engine.optimizer if backend == "ddp" else engine.ds.basic_optimizer
        held = sum(v.numel() * v.element_size() for state in opt.state.values() for v in state.values()
                   if torch.is_tensor(v) and v.numel() > 1)  # not the step counters
        strategy = Strategy(backend, stage)
        states = optimizer_states(cfg.optimizer, getattr(engine, "ds_config", None))
        mem = [model_state_memory(counts, strategy, 1, rt.precision, optimizer_states=k).gpu_bytes for k in (states, 0)]
    return held, mem[0] - mem[1], loss


@pytest.mark.parametrize("backend, stage, name, momentum", [
    ("ddp", 0, "adamw", 0.0),
    ("ddp", 0, "sgd", 0.9),
    ("ddp", 0, "sgd", 0.0),
    ("deepspeed", 1, "sgd", 0.9),
    ("deepspeed", 2, "sgd", 0.9),
    ("deepspeed", 2, "adamw", 0.0),
    ("deepspeed", 1, "torch.optim.RMSprop", 0.0),
])
def test_the_memory_model_counts_what_the_engine_holds_after_a_step(backend, stage, name, momentum):
    held, predicted, loss = _one_step_states(backend, stage, name, momentum)
    assert math.isfinite(loss)
    # DeepSpeed pads its flat fp32 partition to an aligned length: a few elements a state at most
    assert predicted <= held <= predicted + 4 * 64 * 2, (held, predicted)
    if name == "sgd" and momentum == 0:
        assert held == predicted == 0


@pytest.mark.parametrize("strategy", [
    ["--strategy.backend", "ddp"],
    ["--strategy.backend", "deepspeed", "--strategy.zero_stage", "1"],
    ["--strategy.backend", "deepspeed", "--strategy.zero_stage", "2"],
])
def test_fit_with_sgd(strategy, tmp_path):
    from zerotrain.cli import main

    code = main(["fit", "toy", "--trainer.max_steps", "4", "--trainer.output_dir", str(tmp_path), "--trainer.run_name",
                 "r", "--trainer.num_workers", "0", "--trainer.device", "cpu", "--logging.progress_bar", "false",
                 "--logging.tensorboard", "false", "--trainer.log_every_steps", "2", "--trainer.evaluate", "false", "--trainer.export", "false",
                 "--checkpoint.save_final", "false", "--optimizer.name", "sgd", "--optimizer.momentum", "0.9",
                 "--optimizer.lr", "0.05", *strategy])
    assert code == 0
    assert json.loads((tmp_path / "r" / "hparams.json").read_text())["optimizer"]["name"] == "sgd"
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    losses = [row["train_loss"] for row in rows if "train_loss" in row]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
