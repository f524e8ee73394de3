"""The engine a config names: :func:`build_engine` is the one place that chooses between them."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from zerotrain.config import RunConfig
from zerotrain.config.ds_config import ResolvedPrecision, engine_clips, make_ds_config
from zerotrain.engines.base import Engine
from zerotrain.engines.deepspeed import DeepSpeedEngine
from zerotrain.engines.plain import TorchEngine


def build_engine(model: nn.Module, cfg: RunConfig, device: torch.device, precision: ResolvedPrecision,
                 total_steps: int, steps_per_epoch: int, world_size: int,
                 hints: Optional[dict[str, Any]] = None) -> Engine:
    """The engine ``cfg.strategy.backend`` names, for ``model`` on ``device``.

    For DeepSpeed the JSON is built here from ``cfg`` (or the user's file, its "auto" values filled
    from ``cfg``, the schedule's length and the task's ``hints`` such as ``hidden_size``).
    """
    if cfg.strategy.backend != "deepspeed":
        return TorchEngine(model, cfg, device, precision, total_steps, steps_per_epoch)
    facts = {"total_num_steps": total_steps, "warmup_num_steps": cfg.scheduler.warmup_steps,
             "min_lr_ratio": cfg.scheduler.min_lr_ratio, **(hints or {})}
    ds = make_ds_config(cfg, world_size, device.type, precision, facts)
    clip = cfg.strategy.gradient_clipping if engine_clips(cfg, ds) else None
    return DeepSpeedEngine(model, cfg, device, ds, total_steps, steps_per_epoch, clip)
