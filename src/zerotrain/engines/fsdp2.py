"""PyTorch's FSDP2 as an engine: ``fully_shard`` on each transformer block and on the root, behind
:class:`~zerotrain.engines.base.Engine`.

Every parameter becomes a DTensor sharded over the ranks (dim 0), like ZeRO-3: each block gathers its
parameters just before its forward (and again before its backward unless
``--strategy.reshard_after_forward false`` keeps them gathered in between, ZeRO-2's memory for one
all-gather fewer) and reduce-scatters its gradients after its backward. Blocks are the model's repeated
layers as :func:`~zerotrain.engines.compiling.repeated_blocks` finds them (the units compile and
activation checkpointing use too); what is left (embeddings, head, final norm) is one group on the root.

Precision: ``--precision.dtype bf16`` is FSDP2's mixed precision, the sharded parameters (the optimizer's
master weights) and their gradients stay as the recipe built them (fp32), each block computes with a
bf16 copy and reduces its gradients in bf16. fp32 computes as built. fp16 is refused in the config (it
would need a loss scaler that knows DTensors). ``--strategy.offload_optimizer cpu`` or
``--strategy.offload_param cpu`` keep the sharded parameters, gradients and optimizer step on the host
(FSDP2's ``CPUOffloadPolicy`` moves the three together).

Checkpoints are DCP's (:mod:`zerotrain.checkpoint.dcp`): the model and optimizer state as
``get_state_dict`` gives them, sharded, in ``<step>/dcp/``; the schedule, the same on every rank, in
``fsdp2_state.pt`` by rank 0. DCP reshards on load, so a resume on another process count is a plain load.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from pathlib import Path
from typing import Any, ContextManager, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from zerotrain.checkpoint import dcp
from zerotrain.checkpoint.universal import optimizer_step, parameter_states, run_states
from zerotrain.checkpoint.weights import GatheredStateDict
from zerotrain.config import RunConfig
from zerotrain.config.ds_config import ResolvedPrecision
from zerotrain.engines import optimizers
from zerotrain.engines.base import Engine, _compile
from zerotrain.engines.compiling import repeated_blocks
from zerotrain.runtime.collectives import ask_others
from zerotrain.train.schedule import make_scheduler
from zerotrain.train.state import load_safely

logger = logging.getLogger(__name__)


class FSDP2Engine(Engine):
    """``fully_shard`` per block and on the root; DCP checkpoints."""

    backend = "fsdp2"
    STATE_FILE = dcp.STATE_FILE

    def __init__(self, model: nn.Module, cfg: RunConfig, device: torch.device, precision: ResolvedPrecision,
                 total_steps: int, steps_per_epoch: int):
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self.device, self.precision = device, precision
        self.micro_batch_size = cfg.trainer.micro_batch_size
        self.grad_accum = cfg.strategy.gradient_accumulation_steps
        self.clip = cfg.strategy.gradient_clipping
        s = cfg.strategy
        self.offload = "cpu" in (s.offload_optimizer, s.offload_param)
        self.reshard_after_forward = s.reshard_after_forward
        # Offloaded, the sharded parameters live on the host and FSDP2 copies each block's to the device to gather it
        self._module = model if self.offload else model.to(device)
        if cfg.compile.enabled:
            # Compiled first, sharded after: each block's graph is the block's own code, and FSDP2's hooks stay
            # outside it (dynamo skips them), as torch's own FSDP2 examples order the two
            _compile(self._module, cfg, device)
        bf16 = precision == "bf16"
        mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None,
                                     reduce_dtype=torch.bfloat16 if bf16 else None)
        # Pinned as --strategy.offload_pin_memory says (default: on GPUs; pinning needs one)
        pin = s.offload_pin_memory if s.offload_pin_memory is not None else device.type == "cuda"
        offload: OffloadPolicy = CPUOffloadPolicy(pin_memory=pin) if self.offload else OffloadPolicy()
        self.blocks = repeated_blocks(self._module)
        for block in self.blocks:
            fully_shard(block, mp_policy=mixed, offload_policy=offload, reshard_after_forward=s.reshard_after_forward)
        # The root's group (embeddings, head, final norm); FSDP2 itself keeps a root gathered from forward to backward
        fully_shard(self._module, mp_policy=mixed, offload_policy=offload, reshard_after_forward=s.reshard_after_forward)
        self._params = params = [p for p in self._module.parameters() if p.requires_grad]
        self.optimizer = optimizers.build(params, cfg.optimizer, "cpu" if self.offload else device.type)
        self.scheduler = make_scheduler(self.optimizer, cfg, total_steps, steps_per_epoch)
        self._grad_norm: Optional[torch.Tensor] = None
        self._lr: Optional[float] = None

    def describe(self) -> str:
        parts = [f"FSDP2 over {self.world_size} process(es), {len(self.blocks)} blocks sharded one by one"]
        if not self.reshard_after_forward:
            parts.append("parameters kept gathered from forward to backward")
        if self.offload:
            parts.append("parameters, gradients and optimizer offload to cpu")
        return ", ".join(parts)

    @property
    def module(self) -> nn.Module:
        return self._module

    @property
    def forward_model(self) -> nn.Module:
        return self._module

    def _accumulating(self, last: bool) -> ContextManager:
        # Before the last micro-batch, gradients accumulate unsharded on each rank; the last one reduce-scatters them
        return contextlib.nullcontext() if last else self._no_sync()

    @contextlib.contextmanager
    def _no_sync(self) -> Iterator[None]:
        self._module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self._module.set_requires_gradient_sync(True)

    def _backward(self, loss: torch.Tensor, micro_batches: int, last: bool) -> None:
        (loss / micro_batches).backward()

    def _optimizer_step(self) -> None:
        max_norm = self.clip if self.clip > 0 else float("inf")
        # On DTensor gradients: the global norm over every shard (a DTensor, read when logged)
        self._grad_norm = torch.nn.utils.clip_grad_norm_(self._params, max_norm).detach()
        self._lr = float(self.optimizer.param_groups[0]["lr"])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    def lr(self) -> float:
        return self._lr if self._lr is not None else float(self.scheduler.get_last_lr()[0])

    def grad_norm(self) -> Optional[float]:
        if self._grad_norm is None:
            return None
        norm = self._grad_norm
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)

    # ---- state ---------------------------------------------------------------------------------
    def _sharded_state(self) -> dict[str, dict]:
        model, optim = get_state_dict(self._module, self.optimizer)
        return {dcp.MODEL: model, dcp.OPTIMIZER: optim}

    def save(self, folder: Path) -> None:
        self.check_not_released()
        folder.mkdir(parents=True, exist_ok=True)
        dcp.save(self._sharded_state(), folder)
        if self.rank == 0:
            torch.save({"scheduler": self.scheduler.state_dict()}, folder / self.STATE_FILE)

    def load(self, folder: Path) -> None:
        """Any process count: DCP reads each rank's slices of the saved shards (both files weights-only)."""
        state = self._sharded_state()
        dcp.load(state, folder)
        set_state_dict(self._module, self.optimizer, model_state_dict=state[dcp.MODEL],
                       optim_state_dict=state[dcp.OPTIMIZER])
        self.scheduler.load_state_dict(load_safely(folder / self.STATE_FILE)["scheduler"])

    def load_resharded(self, folder: Path, saved_world_size: int, verify: bool = True) -> None:
        self.load(folder)

    def load_universal(self, folder: Path) -> None:
        """A DeepSpeed ZeRO-1/2/3 checkpoint converted to a universal one (``zero/<parameter>/fp32.pt``, its
        optimizer states beside it, the schedule in the model-states file, which ZeRO-3 names otherwise; ZeRO-3's
        tensors are flat and take the parameter's shape): every rank reads the whole fp32
        weights and states (weights-only) and keeps its shards of them (``set_state_dict`` with full state
        dicts). The optimizer's settings are this run's (the resume checks made them the checkpoint's)."""
        shapes = {name: p.shape for name, p in self._module.named_parameters() if p.requires_grad}  # the whole shapes
        names = list(shapes)
        group_step = functools.cache(lambda: optimizer_step(folder))
        model_sd: dict[str, torch.Tensor] = {}
        optim_state: dict[str, dict[str, Any]] = {}
        for name in names:
            states = parameter_states(folder, name, shapes[name], group_step)
            model_sd[name] = states.pop("fp32")
            step = states.pop("step", None)
            optim_state[name] = states
            if step is not None:
                optim_state[name]["step"] = torch.tensor(float(step), dtype=torch.float32)
        # One group: the engine built the optimizer over one flat list of parameters
        group = {k: v for k, v in self.optimizer.param_groups[0].items() if k != "params"} | {"params": names}
        set_state_dict(self._module, self.optimizer, model_state_dict=model_sd,
                       optim_state_dict={"state": optim_state, "param_groups": [group]},
                       options=StateDictOptions(full_state_dict=True, strict=False))
        self.scheduler.load_state_dict(run_states(folder)["lr_scheduler"])
        # The rate the next step uses: a schedule's state does not reach the optimizer it drives
        for g, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
            g["lr"] = lr

    def consolidated_state_dict(self) -> GatheredStateDict:
        """Each parameter gathered whole (``DTensor.full_tensor``, on the mesh's device) when rank 0 reads it, the
        other ranks joining that gather: the host holds what the writer holds, not the model. Names are
        ``get_model_state_dict``'s (without the wrappers' prefixes); its sharded form gathers nothing."""
        sharded = get_model_state_dict(self._module, options=StateDictOptions(full_state_dict=False))

        def whole(name: str) -> torch.Tensor:
            t = sharded[name]
            return t.to(t.device_mesh.device_type).full_tensor() if isinstance(t, DTensor) else t

        def read(name: str) -> torch.Tensor:
            if isinstance(sharded[name], DTensor):
                ask_others(name)
            return whole(name).detach().to("cpu", copy=True)

        return GatheredStateDict({k: (t.shape, t.dtype) for k, t in sharded.items()}, read, serve=whole)
