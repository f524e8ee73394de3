"""The engine a config names: :func:`build_engine` is the one place that chooses between them (DeepSpeed, FSDP2,
plain PyTorch)."""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Optional

import torch
from torch import nn

from zerotrain.config import RunConfig
from zerotrain.config.ds_config import ResolvedPrecision, engine_clips, make_ds_config
from zerotrain.engines.base import Engine
from zerotrain.engines.deepspeed import DeepSpeedEngine
from zerotrain.engines.partitioning import partitioned_construction
from zerotrain.engines.plain import TorchEngine
from zerotrain.errors import ConfigError


def build_engine(model: nn.Module, cfg: RunConfig, device: torch.device, precision: ResolvedPrecision,
                 total_steps: int, steps_per_epoch: int, world_size: int,
                 hints: Optional[dict[str, Any]] = None) -> Engine:
    """The engine ``cfg.strategy.backend`` names, for ``model`` on ``device``.

    For DeepSpeed the JSON is built here from ``cfg`` (or the user's file, its "auto" values filled
    from ``cfg``, the schedule's length and the task's ``hints`` such as ``hidden_size``).
    """
    if cfg.strategy.backend == "fsdp2":
        if precision == "fp16":
            # --precision.dtype auto on a GPU without bf16 (the config refuses fp16 itself): the engine would compute
            # in fp32 and record fp16, and a ZeRO fp16 checkpoint would resume under it without its loss scale
            raise ConfigError("--precision.dtype", "auto is fp16 on this GPU (it has no bf16), which --strategy.backend "
                              "fsdp2 does not offer (its loss scaling would need a scaler that knows sharded "
                              "gradients): pass --precision.dtype fp32, or --strategy.backend deepspeed or ddp")
        try:  # deferred: torch.distributed.fsdp's fully_shard API is public from torch 2.6; the others run on 2.4
            from zerotrain.engines.fsdp2 import FSDP2Engine
        except ImportError as exc:
            raise ConfigError("--strategy.backend", f"fsdp2 needs torch >= 2.6 (fully_shard), this is "
                              f"{torch.__version__} ({exc}): upgrade torch or choose deepspeed or ddp") from None
        return FSDP2Engine(model, cfg, device, precision, total_steps, steps_per_epoch)
    if cfg.strategy.backend != "deepspeed":
        return TorchEngine(model, cfg, device, precision, total_steps, steps_per_epoch)
    ds = _ds_config(cfg, device, precision, total_steps, world_size, hints)
    clip = cfg.strategy.gradient_clipping if engine_clips(cfg, ds) else None
    return DeepSpeedEngine(model, cfg, device, ds, total_steps, steps_per_epoch, clip)


def model_construction(cfg: RunConfig, device: torch.device, precision: ResolvedPrecision, total_steps: int,
                       world_size: int, facts: Optional[dict[str, Any]] = None) -> ContextManager[bool]:
    """The block the recipe's model is built in; it yields whether models are built partitioned there.

    Under DeepSpeed ZeRO-3 (the generated JSON's stage or the user's file's), Hugging Face models loaded in the
    block through :mod:`zerotrain.models.hf` are built partitioned over the ranks and pretrained weights are read
    one tensor at a time into the partitions, so that no process holds the whole model (see
    :mod:`zerotrain.engines.partitioning`). Elsewhere the block changes nothing.
    """
    if cfg.strategy.backend != "deepspeed":
        return contextlib.nullcontext(False)
    # Without the model's hints (what they fill, bucket sizes, does not change how parameters are partitioned),
    # with ``facts`` that do: the largest parameter, which sizes the buffers NVMe-offloaded weights pass through.
    ds = _ds_config(cfg, device, precision, total_steps, world_size, facts)
    if (ds.get("zero_optimization") or {}).get("stage", 0) != 3:
        return contextlib.nullcontext(False)
    return partitioned_construction(ds)


def _ds_config(cfg: RunConfig, device: torch.device, precision: ResolvedPrecision, total_steps: int,
               world_size: int, hints: Optional[dict[str, Any]]) -> dict[str, Any]:
    facts = {"total_num_steps": total_steps, "warmup_num_steps": cfg.scheduler.warmup_steps,
             "min_lr_ratio": cfg.scheduler.min_lr_ratio, **(hints or {})}
    return make_ds_config(cfg, world_size, device.type, precision, facts)
