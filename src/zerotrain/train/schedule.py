"""Learning-rate schedules as a multiplier of the peak rate, one pure function per optimizer step.

Both engines drive torch's ``LambdaLR`` with :func:`lr_lambda`, so ZeRO and plain PyTorch follow
the same curve, and a resumed run continues it from the scheduler's saved step count.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from zerotrain.config import RunConfig, SchedulerConfig


def lr_lambda(sched: SchedulerConfig, total_steps: int, steps_per_epoch: int) -> Callable[[int], float]:
    """Learning-rate multiplier at optimizer step ``step`` (0-based), for torch's LambdaLR."""
    warm = sched.warmup_steps

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        if sched.name == "constant":
            return 1.0
        if sched.name == "warmup_linear":
            return max(0.0, (total_steps - step) / max(1, total_steps - warm))
        if sched.name == "cosine":
            progress = min(1.0, (step - warm) / max(1, total_steps - warm))
            return sched.min_lr_ratio + (1 - sched.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        unit = steps_per_epoch if sched.step_unit == "epochs" else 1
        return sched.gamma ** ((step // max(1, unit)) // sched.step_size)

    return factor


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: RunConfig, total_steps: int, steps_per_epoch: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.scheduler, total_steps, steps_per_epoch))
