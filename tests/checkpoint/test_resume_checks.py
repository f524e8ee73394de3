"""A resume keeps what shapes the model, the data and the numerics (in-process toy fits on CPU).

Every setting is compared with the run's hparams.json before anything in the run folder is written; which
changes are safe each config section declares (``resume_safe``), so the check knows no recipe's flags.
"""

from __future__ import annotations

import pytest
from helpers import toy_config

from zerotrain.config import resume_changes
from zerotrain.errors import UserError
from zerotrain.tasks.toy import ToyConfig, ToyTask
from zerotrain.train.loop import fit


def test_the_comparison_is_generic_over_the_config_tree():
    saved = ToyConfig().to_dict()
    cfg = ToyConfig()
    cfg.data.dim, cfg.trainer.seed, cfg.optimizer.betas = 16, 7, (0.8, 0.999)  # data, trainer, a tuple
    cfg.trainer.max_steps, cfg.logging.tensorboard, cfg.launch.nproc_per_node = 10, False, 2
    safe, unsafe = resume_changes(saved, cfg)
    assert sorted(unsafe) == [("--data.dim", 8, 16), ("--optimizer.betas", [0.9, 0.999], [0.8, 0.999]),
                              ("--trainer.seed", 42, 7)]
    assert sorted(safe) == [("--launch.nproc_per_node", 1, 2), ("--logging.tensorboard", True, False),
                            ("--trainer.max_steps", None, 10)]
    assert sorted(resume_changes(saved, cfg, skip=frozenset({"data.dim"}))[1]) == sorted(unsafe)[1:]


@pytest.mark.parametrize("change,message", [
    (lambda c: setattr(c.data, "dim", 16), "--data.dim 8, this run has 16"),  # a shape outside --model
    (lambda c: setattr(c.data, "num_examples", 64), "--data.num_examples 48, this run has 64"),
    (lambda c: setattr(c.trainer, "seed", 7), "--trainer.seed 42, this run has 7"),
    (lambda c: setattr(c.optimizer, "lr", 0.5), "--optimizer.lr 0.01, this run has 0.5"),
])
def test_a_change_that_alters_the_run_is_refused_before_anything_is_written(tmp_path, change, message):
    first = toy_config(tmp_path, "r", zero_stage=0)
    first.trainer.max_steps = 2
    run = fit(ToyTask(first)).run_dir
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    cfg = toy_config(tmp_path, "r", zero_stage=0)
    cfg.checkpoint.resume, cfg.trainer.max_steps = "auto", 4
    change(cfg)
    with pytest.raises(UserError, match=rf"was trained with {message}\. A resume keeps") as err:
        fit(ToyTask(cfg))
    assert "\n" not in str(err.value)
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before


def test_a_safe_change_is_allowed_and_said_in_one_line(tmp_path, capsys):
    first = toy_config(tmp_path, "r", zero_stage=0)
    first.trainer.max_steps = 2
    fit(ToyTask(first))
    cfg = toy_config(tmp_path, "r", zero_stage=0)
    cfg.checkpoint.resume, cfg.trainer.max_steps, cfg.trainer.eval_every_steps = "auto", 4, 2
    capsys.readouterr()
    assert fit(ToyTask(cfg)).final_step == 4
    said = [line for line in capsys.readouterr().err.splitlines() if "changed settings" in line]  # the log: stderr
    assert said == ["[zerotrain] resuming with changed settings that leave the training as it was: --trainer.max_steps 2 -> 4, "
                    "--trainer.eval_every_steps 0 -> 2"]


def test_a_deepspeed_file_is_compared_by_what_it_sets(tmp_path):
    """With --strategy.deepspeed_config the settings the file decides are compared once it is resolved: a longer run
    (the schedule's total_num_steps follows) is allowed, another peak learning rate in the file is refused."""
    import json

    def config(max_steps: int, lr: float) -> ToyConfig:
        path = tmp_path / f"ds-{lr}.json"
        path.write_text(json.dumps({"scheduler": {"type": "WarmupDecayLR", "params": {
            "warmup_min_lr": 0, "warmup_max_lr": lr, "warmup_num_steps": 1, "total_num_steps": "auto"}}}))
        cfg = toy_config(tmp_path, "ds", zero_stage=0)
        cfg.strategy.gradient_accumulation_steps = 1  # the toy config's 2 is not the default: the file would refuse it
        cfg.optimizer.lr = ToyConfig().optimizer.lr
        cfg.strategy.deepspeed_config, cfg.trainer.max_steps = str(path), max_steps
        cfg.scheduler.name = "constant"
        return cfg

    fit(ToyTask(config(2, 0.01)))
    longer = config(4, 0.01)
    longer.checkpoint.resume = "auto"
    assert fit(ToyTask(longer)).final_step == 4
    other = config(6, 0.02)
    other.checkpoint.resume = "auto"
    with pytest.raises(UserError, match=r"was trained with the scheduler block of --strategy.deepspeed_config "
                                        r".*\"warmup_max_lr\": 0.01.*this run has .*\"warmup_max_lr\": 0.02"):
        fit(ToyTask(other))
