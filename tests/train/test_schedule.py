"""The learning-rate schedules (one multiplier per optimizer step) and the LambdaLR both engines drive."""

from __future__ import annotations

import pytest
import torch

from zerotrain.config import SchedulerConfig
from zerotrain.train.schedule import lr_lambda, make_scheduler
from zerotrain.tasks.toy import ToyConfig

NAMES = ["constant", "warmup_linear", "cosine", "step"]


def curve(sched: SchedulerConfig, total: int, steps_per_epoch: int = 10, n: int | None = None) -> list[float]:
    f = lr_lambda(sched, total, steps_per_epoch)
    return [f(s) for s in range(total + 1 if n is None else n)]


@pytest.mark.parametrize("name", NAMES)
def test_warmup_ramps_linearly_to_the_peak(name):
    # step_size large enough that the step schedule has not decayed when warm-up ends.
    sched = SchedulerConfig(name=name, warmup_steps=4, step_unit="steps", step_size=100)
    f = lr_lambda(sched, total_steps=20, steps_per_epoch=5)
    assert [f(s) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    # Warm-up hands over to the schedule at its peak: no jump at the boundary.
    assert f(4) == pytest.approx(1.0)


def test_no_warmup_starts_at_the_peak():
    for name in NAMES:
        assert lr_lambda(SchedulerConfig(name=name), 10, 5)(0) == 1.0, name


def test_constant_stays_at_the_peak():
    assert curve(SchedulerConfig(name="constant", warmup_steps=2), total=50)[2:] == [1.0] * 49


def test_warmup_linear_decays_to_zero_at_total_steps():
    sched = SchedulerConfig(name="warmup_linear", warmup_steps=2)
    f = lr_lambda(sched, total_steps=10, steps_per_epoch=5)
    after = [f(s) for s in range(2, 11)]
    assert after == pytest.approx([(10 - s) / 8 for s in range(2, 11)])
    assert f(10) == 0.0 and f(9) > 0.0  # the last optimizer step (9) still moves the weights
    assert all(a > b for a, b in zip(after, after[1:]))
    assert f(11) == 0.0 and f(100) == 0.0  # never negative past the end


@pytest.mark.parametrize("min_lr_ratio", [0.0, 0.1])
def test_cosine_ends_at_min_lr_ratio(min_lr_ratio):
    sched = SchedulerConfig(name="cosine", warmup_steps=4, min_lr_ratio=min_lr_ratio)
    f = lr_lambda(sched, total_steps=24, steps_per_epoch=5)
    assert f(4) == pytest.approx(1.0)
    assert f(14) == pytest.approx(min_lr_ratio + (1 - min_lr_ratio) / 2)  # half-way through the decay
    assert f(24) == pytest.approx(min_lr_ratio)
    assert f(30) == pytest.approx(min_lr_ratio)  # held past the end
    decay = [f(s) for s in range(4, 25)]
    assert all(a >= b for a, b in zip(decay, decay[1:]))


def test_step_schedule_counts_epochs():
    sched = SchedulerConfig(name="step", step_unit="epochs", step_size=2, gamma=0.5)
    f = lr_lambda(sched, total_steps=100, steps_per_epoch=5)
    # Two epochs of 5 steps per decay.
    assert [f(s) for s in (0, 9, 10, 19, 20, 29, 30)] == pytest.approx([1, 1, 0.5, 0.5, 0.25, 0.25, 0.125])


def test_step_schedule_counts_steps():
    sched = SchedulerConfig(name="step", step_unit="steps", step_size=3, gamma=0.5)
    f = lr_lambda(sched, total_steps=100, steps_per_epoch=5)  # steps_per_epoch plays no part
    assert [f(s) for s in range(9)] == pytest.approx([1, 1, 1, 0.5, 0.5, 0.5, 0.25, 0.25, 0.25])
    assert lr_lambda(sched, 100, 50)(3) == f(3)


def test_step_schedule_survives_an_empty_epoch_count():
    # steps_per_epoch 0 (max_steps runs shorter than an epoch) must not divide by zero.
    sched = SchedulerConfig(name="step", step_unit="epochs", step_size=1, gamma=0.5)
    assert lr_lambda(sched, 10, 0)(3) == pytest.approx(0.5**3)


def _optimizer(lr: float = 0.1) -> torch.optim.Optimizer:
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=lr)


def _cfg(**scheduler) -> ToyConfig:
    cfg = ToyConfig()
    cfg.scheduler = SchedulerConfig(**scheduler)
    return cfg


@pytest.mark.parametrize("name", NAMES)
def test_lambda_lr_follows_the_curve(name):
    """After N scheduler steps the optimizer's rate is peak x factor(N), as the engines read it."""
    cfg = _cfg(name=name, warmup_steps=3, min_lr_ratio=0.1, step_unit="steps", step_size=4, gamma=0.5)
    opt = _optimizer(0.1)
    sched = make_scheduler(opt, cfg, total_steps=12, steps_per_epoch=4)
    f = lr_lambda(cfg.scheduler, 12, 4)
    seen = []
    for _ in range(15):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.1 * f(n) for n in range(15)])
    assert sched.get_last_lr()[0] == pytest.approx(0.1 * f(15))


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_round_trip_continues_the_same_curve(name):
    """A resumed run (optimizer and scheduler state loaded into fresh ones) uses the rates of a straight run."""
    cfg = _cfg(name=name, warmup_steps=3, min_lr_ratio=0.1, step_unit="steps", step_size=4, gamma=0.5)

    def run(opt, sched, steps):
        rates = []
        for _ in range(steps):
            rates.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return rates

    opt = _optimizer()
    straight = run(opt, make_scheduler(opt, cfg, 16, 4), 16)

    opt = _optimizer()
    sched = make_scheduler(opt, cfg, 16, 4)
    first = run(opt, sched, 7)
    opt_state, sched_state = opt.state_dict(), sched.state_dict()
    assert sched_state["last_epoch"] == 7

    opt2 = _optimizer()
    sched2 = make_scheduler(opt2, cfg, 16, 4)
    opt2.load_state_dict(opt_state)
    sched2.load_state_dict(sched_state)
    second = run(opt2, sched2, 9)
    assert first + second == pytest.approx(straight)
    assert len(set(straight)) > 1  # the curve moves, so continuing it from step 0 would have shown
