"""The one module that knows how a model is trained on this hardware.

:class:`DeepSpeedEngine` wraps ``deepspeed.initialize`` (ZeRO 0-3, offload, fp16/bf16);
:class:`TorchEngine` is plain PyTorch (DDP across ranks, autocast, GradScaler for fp16), the
baseline users compare DeepSpeed with. Both expose the same methods, so the training loop never
branches on the backend. :meth:`Engine.train_step` is written once, in the base class: it runs
the forward/backward of every micro-batch of one optimizer step and the step itself, and the two
engines differ only in :meth:`~Engine._backward` and :meth:`~Engine._optimizer_step` (and in the
contexts a micro-batch runs in). ``save``/``load`` move what is sharded: parameters, optimizer
states, scheduler; the loop's own state is :class:`~zerotrain.train_state.TrainState`.
:func:`build_engine` turns the typed config into either engine, building the DeepSpeed JSON itself.
"""

from __future__ import annotations

import contextlib
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from zerotrain.compiling import compile_model
from zerotrain.config import RunConfig
from zerotrain.distributed import all_reduce_max, all_reduce_sum, barrier, sum_on_device
from zerotrain.ds_config import (
    ResolvedPrecision,
    engine_clips,
    make_ds_config,
    precision_of,
)
from zerotrain.errors import UserError
from zerotrain.offload_norm import read_offload_norm_once
from zerotrain.schedule import make_scheduler
from zerotrain.tasks.base import Batch, StepOutput
from zerotrain.zero_clip import clip_without_sync, mask_norms_without_sync
from zerotrain.zero_host import (
    drop_idle_forward_hooks,
    forward_backward_add_nothing,
    norm_in_one_launch,
    rebind_only_moved_weights,
    reduce_scatter_into_partition,
    skip_one_rank_reduction,
    zero_grad_from_list,
)

logger = logging.getLogger(__name__)

StepFn = Callable[[nn.Module, Batch], StepOutput]
WeightFn = Callable[[Batch], Optional[float]]


@dataclass
class StepStats:
    loss: torch.Tensor
    """Mean loss over the step's micro-batches (this rank), a 0-d tensor on the device: reading it
    waits for the GPU, so the loop only does that when it logs."""
    samples: int
    tokens: int
    micro_batches: int
    flops: Optional[float] = None
    """Summed StepOutput.flops, when every micro-batch gave them."""


def to_device(batch: Batch, device: torch.device) -> Batch:
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


class Engine(ABC):
    """Common interface of the DeepSpeed and plain-PyTorch engines; owns the one ``train_step``."""

    device: torch.device
    precision: ResolvedPrecision
    micro_batch_size: int
    grad_accum: int
    world_size: int
    rank: int
    ds_config: Optional[dict[str, Any]] = None
    """The DeepSpeed JSON the engine runs with (None for the plain engine)."""

    @property
    @abstractmethod
    def module(self) -> nn.Module:
        """The unwrapped model (under ZeRO-3 its parameters are partitioned)."""

    @property
    @abstractmethod
    def forward_model(self) -> nn.Module:
        """What a task calls for forward passes (the wrapped model)."""

    @abstractmethod
    def describe(self) -> str:
        """How this engine trains, for the log: e.g. 'deepspeed ZeRO-2, optimizer offload to cpu'."""

    # ---- the step: written once; engines fill in the four hooks below -------------------------
    def train_step(self, micro_batches: Iterable[Batch], step_fn: StepFn,
                   weight_fn: Optional[WeightFn] = None) -> StepStats:
        """Forward/backward every micro-batch of one optimizer step, then step.

        ``weight_fn`` (see :meth:`Task.loss_weight`) makes the step's gradient that of one big batch:
        micro-batch losses are weighted by their share of the step's weight summed over all ranks.
        """
        batches = list(micro_batches)
        factors = self._loss_factors(batches, weight_fn)
        loss_sum, samples, tokens, flops = torch.zeros((), device=self.device), 0, 0, None
        for i, (batch, factor) in enumerate(zip(batches, factors)):
            last = i == len(batches) - 1
            with self._accumulating(last):
                # Named ranges for --trainer.profile_steps: the host time of each phase, whatever runs inside
                with record_function("zerotrain.forward"), self._autocast():
                    out = step_fn(self.forward_model, to_device(batch, self.device))
                # A tensor factor would promote a half-precision loss: the product is kept in the loss's
                # dtype, as a Python-float factor keeps it (the same rounding: float32 product, then half)
                loss = out.loss if _is_one(factor) else (out.loss * factor).to(out.loss.dtype)
                with record_function("zerotrain.backward"):
                    self._backward(loss, len(batches), last)
            loss_sum += loss.detach().float()
            samples, tokens = samples + out.samples, tokens + out.tokens
            flops = _add_flops(flops, out, first=i == 0)
        with record_function("zerotrain.optimizer_step"):
            self._optimizer_step()
        return StepStats(loss_sum / max(1, len(batches)), samples, tokens, len(batches), flops)

    def _accumulating(self, last: bool) -> ContextManager:
        """Context of one micro-batch's forward and backward (DDP: no gradient sync before the last)."""
        return contextlib.nullcontext()

    def _autocast(self) -> ContextManager:
        """Context of forward passes, in training and evaluation (mixed precision by autocast)."""
        return contextlib.nullcontext()

    @abstractmethod
    def _backward(self, loss: torch.Tensor, micro_batches: int, last: bool) -> None:
        """Accumulate the gradient of ``loss``, one of ``micro_batches`` of this step."""

    @abstractmethod
    def _optimizer_step(self) -> None:
        """Clip, step the optimizer and the schedule, clear gradients; remember lr and grad norm."""

    def _loss_factors(self, batches: list[Batch], weight_fn: Optional[WeightFn]) -> list[float | torch.Tensor]:
        """Multipliers for each micro-batch's (mean) loss. Both engines average over micro-batches and
        ranks, so factor = weight x micro-batches x ranks / (the step's total weight): the gradient is
        then the weight-averaged one, e.g. every target token counts once however the tokens fall.

        Across ranks the total stays on the device (0-d float32 factors): reading it back would make
        the host wait, once a step, for the GPU to finish the previous step before it queues this one.
        """
        n = len(batches)
        if n == 1 and self.world_size == 1:
            return [1.0]  # one micro-batch on one rank: nothing to weigh
        weights = [weight_fn(b) for b in batches] if weight_fn is not None else [None]
        if any(w is None for w in weights):
            return [1.0] * n
        if self.world_size == 1:
            total = sum(weights)
            return [w * n / total for w in weights] if total > 0 else [1.0] * n
        total = sum_on_device(sum(weights), self.device)
        # The factor is formed in float64 as the host would (w * n * ranks, then / total), then rounded
        # once to float32, so the loss is bitwise what a Python-float factor gave
        return [torch.where(total > 0, torch.full_like(total, w * n * self.world_size) / total, 1.0).float()
                for w in weights]

    # ---- what the loop reads on log steps -----------------------------------------------------
    @abstractmethod
    def lr(self) -> float:
        """The learning rate the last optimizer step used."""

    @abstractmethod
    def grad_norm(self) -> Optional[float]: ...

    def loss_scale(self) -> Optional[float]:
        return None

    def skipped_steps(self) -> int:
        return 0

    # ---- state ---------------------------------------------------------------------------------
    @abstractmethod
    def save(self, folder: Path) -> None:
        """Write the sharded training state into ``folder`` (called on every rank)."""

    @abstractmethod
    def load(self, folder: Path) -> None:
        """Restore the sharded training state from ``folder``."""

    def load_resharded(self, folder: Path, saved_world_size: int, verify: bool = True) -> None:
        """Restore the sharded training state from ``folder``, written by ``saved_world_size`` processes
        (another count than this run's). Collective. The plain engine's state is whole; see the subclasses."""
        raise UserError(f"--checkpoint.resume: {folder} was written by {saved_world_size} processes and this engine "
                        f"cannot resume it on {self.world_size}. Start it with {saved_world_size} processes")

    @abstractmethod
    def consolidated_state_dict(self) -> Optional[dict[str, torch.Tensor]]:
        """Full model weights on rank 0 (gathered to its host under ZeRO-3, else the live tensors on their
        device), None elsewhere. Collective."""

    def eval_context(self) -> ContextManager:
        """Context for forward passes outside train_step (evaluation): the same precision as training."""
        return self._autocast()

    def train(self) -> None:
        self.forward_model.train()

    def eval(self) -> None:
        self.forward_model.eval()

    # ---- collectives the loop needs (implemented in zerotrain.distributed) ------------------------
    def all_reduce_sum(self, values: dict[str, float]) -> dict[str, float]:
        return all_reduce_sum(values, self.device)

    def all_reduce_max(self, value: float) -> float:
        return all_reduce_max(value, self.device)

    def barrier(self) -> None:
        barrier()


def _compile(module: nn.Module, cfg: RunConfig, device: torch.device) -> None:
    # CUDA graphs replay CUDA kernels; on a CPU inductor would only warn that it skips them
    mode = cfg.strategy.compile_mode if device.type == "cuda" else "default"
    logger.info("torch.compile: %s (mode %s)", compile_model(module, cfg.strategy.compile_scope, mode=mode), mode)


def _is_one(factor: float | torch.Tensor) -> bool:
    """A Python 1.0 factor is skipped; a tensor one is never compared on the host (that would sync)."""
    return not isinstance(factor, torch.Tensor) and factor == 1.0


def _add_flops(total: Optional[float], out: StepOutput, first: bool) -> Optional[float]:
    """Running sum of per-micro-batch FLOPs; None as soon as one micro-batch does not report them."""
    if out.flops is None or (total is None and not first):
        return None
    return (total or 0.0) + out.flops


class DeepSpeedEngine(Engine):
    """``deepspeed.initialize`` with zerotrain's schedule. With ``clip`` (see ``ds_config.engine_clips``)
    the engine clips the gradients itself before DeepSpeed's step, keeping the norm on the device."""

    def __init__(self, model: nn.Module, cfg: RunConfig, device: torch.device, ds: dict[str, Any],
                 total_steps: int, steps_per_epoch: int, clip: Optional[float] = None):
        import deepspeed

        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self.device = device
        self.ds_config = ds
        self.precision = precision_of(ds)
        self.micro_batch_size = ds["train_micro_batch_size_per_gpu"]
        self.grad_accum = ds["gradient_accumulation_steps"]
        # A "scheduler" block in the user's file makes DeepSpeed build the schedule; else ours runs.
        scheduler = None if "scheduler" in ds else (lambda opt: make_scheduler(opt, cfg, total_steps, steps_per_epoch))
        params = [p for p in model.parameters() if p.requires_grad]
        from zerotrain.doctor import ops_for, prepare_ops

        prepare_ops(ops_for(ds))  # a first run compiles DeepSpeed's optimizer op in there: say so, clear a stale lock
        self.ds, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=ds,
                                                lr_scheduler=scheduler)
        mask_norms_without_sync(cfg.strategy.fast_path)  # process-wide: set either way, so false is DeepSpeed's
        if cfg.strategy.fast_path:
            # Methods of DeepSpeed's optimizer, not config keys: a user's own JSON gets them too.
            read_offload_norm_once(self.ds.optimizer)
            clip_without_sync(self.ds.optimizer)
            norm_in_one_launch(self.ds.optimizer)
            skip_one_rank_reduction(self.ds.optimizer)
            reduce_scatter_into_partition(self.ds.optimizer)
            rebind_only_moved_weights(self.ds.optimizer)
            # And of its engine: at ZeRO-0 the gradients cleared from a list; at stages 0-2 no empty forward hooks.
            zero_grad_from_list(self.ds)
            drop_idle_forward_hooks(self.ds)
        if cfg.strategy.compile:
            if ds.get("zero_optimization", {}).get("stage", 0) == 3:
                # ZeRO-3 gathers each block's parameters in module hooks that a compiled block would trace
                # into; DeepSpeed's own entry point compiles the wrapped module with those hooks left out.
                self.ds.compile()
            else:
                _compile(self.ds.module, cfg, device)
        self._clip = clip
        self._params = params
        if clip is not None and self.world_size == 1:
            # One rank has nothing to average, yet stage 0 still flattens every gradient, all-reduces
            # it with itself and copies it back. DeepSpeed sets this same switch without a process group.
            self.ds.enable_backward_allreduce = False
        self._norm: Optional[torch.Tensor] = None
        self._lr: Optional[float] = None
        # Where DeepSpeed's forward and backward wrap only autograd (ZeRO-0 on one rank), they are run
        # directly: the same arithmetic without their host work (see forward_backward_add_nothing)
        self._direct = cfg.strategy.fast_path and forward_backward_add_nothing(self.ds)
        self._direct_model: nn.Module = self.ds.module
        if self.ds.torch_autocast_enabled():
            self._direct_model = Autocast(self.ds.module, device.type, self.ds.torch_autocast_dtype())

    def describe(self) -> str:
        zero = self.ds_config.get("zero_optimization", {})
        offload = [f"{what} offload to {zero[key]['device']}" for what, key in
                   (("optimizer", "offload_optimizer"), ("parameter", "offload_param"))
                   if zero.get(key, {}).get("device", "none") != "none"]
        return ", ".join([f"deepspeed ZeRO-{zero.get('stage', 0)}", *offload])

    @property
    def module(self) -> nn.Module:
        return self.ds.module

    @property
    def forward_model(self) -> nn.Module:
        return self._direct_model if self._direct else self.ds

    def train(self) -> None:
        self.ds.train()

    def eval(self) -> None:
        self.ds.eval()

    def _backward(self, loss: torch.Tensor, micro_batches: int, last: bool) -> None:
        if self._direct:
            (loss / self.grad_accum).backward()  # what DeepSpeed's backward computes here
        else:
            self.ds.backward(loss)  # it divides by gradient_accumulation_steps itself
        if not last:
            self.ds.step()  # off the accumulation boundary this only counts the micro-batch

    def _optimizer_step(self) -> None:
        # The rate this step uses: step() advances the schedule to the next step's.
        self._lr = float(self.ds.get_lr()[0])
        if self._clip is not None:
            # The global norm stays a device tensor until a log step reads it.
            self._norm = torch.nn.utils.clip_grad_norm_(self._params, self._clip or float("inf"))
        self.ds.step()

    def lr(self) -> float:
        return self._lr if self._lr is not None else float(self.ds.get_lr()[0])

    def grad_norm(self) -> Optional[float]:
        norm = self._norm if self._clip is not None else self.ds.get_global_grad_norm()
        return None if norm is None else float(norm)

    def loss_scale(self) -> Optional[float]:
        if self.precision != "fp16":
            return None
        return float(getattr(self.ds.optimizer, "cur_scale", getattr(self.ds.optimizer, "loss_scale", float("nan"))))

    def skipped_steps(self) -> int:
        return int(getattr(self.ds, "skipped_steps", 0))

    def save(self, folder: Path) -> None:
        # save_latest=False: zerotrain marks complete checkpoints itself (see checkpoint.py).
        self.ds.save_checkpoint(str(folder.parent), tag=folder.name, save_latest=False)

    def load(self, folder: Path) -> None:
        # DeepSpeed's checkpoint engine calls torch.load(weights_only=False): a crafted file in the
        # folder would run code. This engine's loader is replaced, for this call only, by a
        # weights-only load that also admits the few DeepSpeed classes its files hold (DS_SAFE_GLOBALS).
        from zerotrain.train_state import load_safely

        allow = _ds_safe_globals()
        ckpt_engine = self.ds.checkpoint_engine
        ckpt_engine.load = lambda path, map_location=None: load_safely(Path(path), map_location, allow)
        try:
            path, _ = self.ds.load_checkpoint(str(folder.parent), tag=folder.name)
        finally:
            del ckpt_engine.load  # the class's own method again
        if path is None:
            raise UserError(f"--checkpoint.resume: DeepSpeed found no checkpoint in {folder}")

    def load_resharded(self, folder: Path, saved_world_size: int, verify: bool = True) -> None:
        """Load a ZeRO checkpoint of another process count through DeepSpeed's universal checkpoint.

        ZeRO-1/2/3 files hold one partition of the flat fp32 weights and Adam moments per rank, cut
        for the world size that wrote them. Rank 0 converts the folder once into per-parameter
        tensors (:func:`zerotrain.universal.universal_checkpoint`, cached in ``folder/universal``;
        the other ranks wait in :func:`~zerotrain.distributed.run_on_main`, which hands them its
        error if it fails), then every rank loads its new partition with DeepSpeed's
        ``load_universal`` switched on for this call only (it is read at load time, so the JSON
        in the run folder stays the run's). The scheduler, global step and skipped steps come from
        the copied model-states file, as in a same-size load. Every ``torch.load`` inside is
        weights-only with :data:`DS_SAFE_GLOBALS`.

        ZeRO-0 keeps the whole optimizer state in its model-states file: it loads as a same-size
        checkpoint when no ``*optim_states.pt`` shard exists (fp32), else it is refused.
        """
        from zerotrain.distributed import run_on_main
        from zerotrain.train_state import load_safely, weights_only_torch_load
        from zerotrain.universal import universal_checkpoint

        if not self.ds.zero_optimization():
            if any(folder.glob("*optim_states.pt")):
                raise UserError(f"--checkpoint.resume: {folder} is a ZeRO-0 {self.precision} checkpoint of "
                                f"{saved_world_size} processes, whose optimizer shards cannot be resumed on "
                                f"{self.world_size}. Start it with {saved_world_size} processes")
            self.load(folder)
            return
        if self.ds.zero_nvme_offload_optimizer():
            raise UserError(f"--checkpoint.resume: {folder} cannot be resumed on another process count with the "
                            f"optimizer offloaded to NVMe. Start it with {saved_world_size} processes")
        universal = run_on_main(lambda: universal_checkpoint(folder, verify))
        allow = _ds_safe_globals()
        ckpt_engine = self.ds.checkpoint_engine
        ckpt_engine.load = lambda path, map_location=None: load_safely(Path(path), map_location, allow)
        config = self.ds._config
        before, config.load_universal_checkpoint = config.load_universal_checkpoint, True
        try:
            with weights_only_torch_load(allow):
                path, _ = self.ds.load_checkpoint(str(universal.parent), tag=universal.name,
                                                  load_optimizer_states=True, load_lr_scheduler_states=True)
        finally:
            config.load_universal_checkpoint = before
            del ckpt_engine.load
        if path is None:
            raise UserError(f"--checkpoint.resume: DeepSpeed found no checkpoint in {universal}")

    def consolidated_state_dict(self) -> Optional[dict[str, torch.Tensor]]:
        if self.ds.zero_optimization_partition_weights():
            sd = self.ds._zero3_consolidated_16bit_state_dict()
            return sd if self.rank == 0 else None
        if self.rank != 0:
            return None
        # Left where they are: the writer copies one shard at a time to the host (a 5B model is 10 GB in bf16).
        return {k: v.detach() for k, v in self.ds.module.state_dict().items()}


DS_SAFE_GLOBALS = ("deepspeed.runtime.fp16.loss_scaler.LossScaler", "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
                   "deepspeed.runtime.zero.config.ZeroStageEnum", "deepspeed.utils.tensor_fragment.fragment_address")
"""The classes DeepSpeed's checkpoint files hold besides tensors and containers (found by
``torch.serialization.get_unsafe_globals_in_checkpoint`` on ZeRO-0..3 checkpoints): plain records,
rebuilt by the weights-only unpickler without calling any of their code."""


class Autocast(nn.Module):
    """``module`` called under autocast, and only its call, as DeepSpeed's forward calls it under its
    ``torch_autocast`` block: a loss the task computes from the output stays outside, in full precision."""

    def __init__(self, module: nn.Module, device_type: str, dtype: torch.dtype):
        super().__init__()
        self.module = module
        # Not ``dtype``: a caller reading ``model.dtype`` (as Hugging Face models have it) would take the autocast's
        # for the weights'
        self.autocast_device, self.autocast_dtype = device_type, dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.autocast_device, dtype=self.autocast_dtype):
            return self.module(*args, **kwargs)


def _ds_safe_globals() -> list[type]:
    import importlib

    out = []
    for dotted in DS_SAFE_GLOBALS:
        module, _, name = dotted.rpartition(".")
        try:
            out.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):  # another DeepSpeed version: a file that needs it is refused
            pass
    return out


class TorchEngine(Engine):
    """Plain PyTorch: DDP when several ranks, autocast for bf16/fp16, GradScaler for fp16."""

    STATE_FILE = "torch_state.pt"

    def __init__(self, model: nn.Module, cfg: RunConfig, device: torch.device, precision: ResolvedPrecision,
                 total_steps: int, steps_per_epoch: int):
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self.device, self.precision = device, precision
        self.micro_batch_size = cfg.trainer.micro_batch_size
        self.grad_accum = cfg.strategy.gradient_accumulation_steps
        self.clip = cfg.strategy.gradient_clipping
        self._module = model.to(device)
        if cfg.strategy.compile:
            _compile(self._module, cfg, device)
        self._wrapped: nn.Module = self._module
        if self.world_size > 1:
            ids = [device.index] if device.type == "cuda" else None
            self._wrapped = nn.parallel.DistributedDataParallel(self._module, device_ids=ids)
        o = cfg.optimizer
        # Kept: the clip needs them every step, and walking the module tree for them is host time a small
        # model's step waits for (the parameters never change object)
        self._params = params = [p for p in self._module.parameters() if p.requires_grad]
        cls = torch.optim.AdamW if o.name == "adamw" else torch.optim.Adam
        kwargs = {"fused": True} if device.type == "cuda" else {}
        self.optimizer = cls(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, **kwargs)
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
        from zerotrain.train_state import load_safely

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

    def consolidated_state_dict(self) -> Optional[dict[str, torch.Tensor]]:
        if self.rank != 0:
            return None
        return {k: v.detach() for k, v in self._module.state_dict().items()}  # see DeepSpeedEngine's


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
