"""Plain PyTorch as an engine (DDP across ranks, autocast, GradScaler for fp16): the baseline users compare DeepSpeed with."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import ContextManager, Optional

import torch
import torch.distributed as dist
from torch import nn

from zerotrain.checkpoint.universal import load_whole
from zerotrain.config import RunConfig
from zerotrain.config.ds_config import (
    ResolvedPrecision,
)
from zerotrain.engines import optimizers
from zerotrain.engines.base import Engine, _compile
from zerotrain.train.schedule import make_scheduler
from zerotrain.train.state import load_safely

logger = logging.getLogger(__name__)


class TorchEngine(Engine):
    """Plain PyTorch: DDP when several ranks, autocast for bf16/fp16, GradScaler for fp16."""

    backend = "ddp"
    STATE_FILE = "torch_state.pt"

    def __init__(self, model: nn.Module, cfg: RunConfig, device: torch.device, precision: ResolvedPrecision,
                 total_steps: int, steps_per_epoch: int):
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self.device, self.precision = device, precision
        self.micro_batch_size = cfg.trainer.micro_batch_size
        self.grad_accum = cfg.strategy.gradient_accumulation_steps
        self.clip = cfg.strategy.gradient_clipping
        self._module = model.to(device)
        if cfg.compile.enabled:
            _compile(self._module, cfg, device)
        self._wrapped: nn.Module = self._module
        if self.world_size > 1:
            ids = [device.index] if device.type == "cuda" else None
            self._wrapped = nn.parallel.DistributedDataParallel(self._module, device_ids=ids)
        # Kept: the clip needs them every step, and walking the module tree for them is host time a small
        # model's step waits for (the parameters never change object)
        self._params = params = [p for p in self._module.parameters() if p.requires_grad]
        self.optimizer = optimizers.build(params, cfg.optimizer, device.type)
        self.scheduler = make_scheduler(self.optimizer, cfg, total_steps, steps_per_epoch)
        self.scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
        self._autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        self._grad_norm: Optional[torch.Tensor] = None
        self._lr: Optional[float] = None
        self._skipped = 0

    def describe(self) -> str:
        return "plain PyTorch" + (" DDP" if self.world_size > 1 else "")

    @property
    def module(self) -> nn.Module:
        return self._module

    @property
    def forward_model(self) -> nn.Module:
        return self._wrapped

    def _accumulating(self, last: bool) -> ContextManager:
        # Reduce gradients across ranks only once, on the last micro-batch.
        return contextlib.nullcontext() if last or self.world_size == 1 else self._wrapped.no_sync()

    def _autocast(self) -> ContextManager:
        if self._autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self._autocast_dtype)

    def _backward(self, loss: torch.Tensor, micro_batches: int, last: bool) -> None:
        self.scaler.scale(loss / micro_batches).backward()

    def _optimizer_step(self) -> None:
        self.scaler.unscale_(self.optimizer)
        max_norm = self.clip if self.clip > 0 else float("inf")
        self._grad_norm = torch.nn.utils.clip_grad_norm_(self._params, max_norm).detach()  # read when logged
        self._lr = float(self.optimizer.param_groups[0]["lr"])
        scale = self.scaler.get_scale()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if self.precision == "fp16" and self.scaler.get_scale() < scale:
            # An overflow: GradScaler skipped the update. Like DeepSpeed, count it and hold the schedule.
            self._skipped += 1
        else:
            self.scheduler.step()

    def lr(self) -> float:
        return self._lr if self._lr is not None else float(self.scheduler.get_last_lr()[0])

    def grad_norm(self) -> Optional[float]:
        return None if self._grad_norm is None else float(self._grad_norm)

    def loss_scale(self) -> Optional[float]:
        return float(self.scaler.get_scale()) if self.precision == "fp16" else None

    def skipped_steps(self) -> int:
        return self._skipped

    def save(self, folder: Path) -> None:
        self.check_not_released()
        if self.rank == 0:
            folder.mkdir(parents=True, exist_ok=True)
            state = {
                "module": self._module.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict(),
                "skipped_steps": self._skipped,
            }
            torch.save(state, folder / self.STATE_FILE)

    def load(self, folder: Path) -> None:

        # Tensors and plain containers only: a crafted file cannot run code here (it is one UserError line).
        state = load_safely(folder / self.STATE_FILE, map_location=self.device)
        self._module.load_state_dict(state["module"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self._skipped = state.get("skipped_steps", 0)

    def load_resharded(self, folder: Path, saved_world_size: int, verify: bool = True) -> None:
        """Any process count: rank 0 wrote the whole state (DDP replicates it), so every rank loads it as is."""
        self.load(folder)

    def load_universal(self, folder: Path) -> None:
        """Another engine's checkpoint as a universal one: every rank reads the whole state (DDP replicates it),
        one parameter at a time (:func:`~zerotrain.checkpoint.universal.load_whole`)."""
        load_whole(folder, self._module, self.optimizer, self.scheduler)

    def consolidated_state_dict(self) -> Optional[dict[str, torch.Tensor]]:
        if self.rank != 0:
            return None
        return {k: v.detach() for k, v in self._module.state_dict().items()}  # see DeepSpeedEngine's
