"""The one module that knows how a model is trained on this hardware.

:class:`DeepSpeedEngine` wraps ``deepspeed.initialize`` (ZeRO 0-3, offload, fp16/bf16);
:class:`TorchEngine` is plain PyTorch (DDP across ranks, autocast, GradScaler for fp16), the
baseline users compare DeepSpeed with. Both expose the same methods, so the training loop never
branches on the backend. :meth:`Engine.train_step` is written once, in the base class: it runs
the forward/backward of every micro-batch of one optimizer step and the step itself, and the two
engines differ only in :meth:`~Engine._backward` and :meth:`~Engine._optimizer_step` (and in the
contexts a micro-batch runs in). ``save``/``load`` move what is sharded: parameters, optimizer
states, scheduler; the loop's own state is :class:`~zerotrain.train.state.TrainState`.
:func:`build_engine` turns the typed config into either engine, building the DeepSpeed JSON itself.
"""

from __future__ import annotations

import contextlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterable, Optional

import torch
from torch import nn
from torch.profiler import record_function

from zerotrain.config import RunConfig
from zerotrain.config.ds_config import (
    ResolvedPrecision,
)
from zerotrain.engines.compiling import compile_model
from zerotrain.errors import UserError
from zerotrain.runtime.collectives import (
    all_reduce_max,
    all_reduce_sum,
    barrier,
    sum_on_device,
)
from zerotrain.tasks.base import Batch, StepOutput

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
    backend: str
    """What ``--strategy.backend`` calls this engine (recorded in checkpoints)."""
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
    optimizer_released: bool = False
    """Set by :meth:`release_optimizer`: the optimizer's states are gone, and no checkpoint may be written."""

    def torch_optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers whose ``state`` holds the optimizer's states (the engine's own by default)."""
        opt = getattr(self, "optimizer", None)
        return [opt] if isinstance(opt, torch.optim.Optimizer) else []

    def release_optimizer(self) -> None:
        """Free the optimizer's states once training is over and its last checkpoint written: the export that follows
        gathers the weights a shard at a time into the memory they held, where a run at the host's limit would
        otherwise go past it. A checkpoint afterwards is refused (:meth:`check_not_released`)."""
        for opt in self.torch_optimizers():
            opt.state.clear()
        self.optimizer_released = True

    def check_not_released(self) -> None:
        if self.optimizer_released:
            raise RuntimeError("the optimizer's states were released after training: no checkpoint can be written")

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

    def check_loads_across(self, checkpoint: Path) -> None:
        """Refuse, in one line, a resume from ``checkpoint``, another engine's, that this engine's settings cannot
        load (:meth:`load_universal` would): called before anything in the run folder is rewritten."""

    def load_universal(self, folder: Path) -> None:
        """Restore the training state from ``folder``, a DeepSpeed universal checkpoint (every parameter's fp32
        weights and optimizer states whole, the schedule in its model-states file) that another engine's
        checkpoint was converted to. Collective. Only engines that resume across engines implement it."""
        raise UserError(f"--checkpoint.resume: {folder.parent} was written by another engine, and this one cannot "
                        "load it. Resume it with the --strategy.backend that wrote it")

    @abstractmethod
    def consolidated_state_dict(self) -> Optional[Mapping[str, torch.Tensor]]:
        """Full model weights on rank 0 (the live tensors on their device, or gathered to its host), None
        elsewhere. Collective. An engine whose model is sharded (ZeRO-3, FSDP2) returns a
        :class:`~zerotrain.checkpoint.weights.GatheredStateDict` on every rank instead: rank 0 reads it inside
        ``run_on_main(..., serve=weights.serve)``, a tensor at a time, and the other ranks serve its reads."""

    def eval_context(self) -> ContextManager:
        """Context for forward passes outside train_step (evaluation): the same precision as training."""
        return self._autocast()

    def train(self) -> None:
        self.forward_model.train()

    def eval(self) -> None:
        self.forward_model.eval()

    # ---- collectives the loop needs (implemented in zerotrain.runtime.distributed) ------------------------
    def all_reduce_sum(self, values: dict[str, float]) -> dict[str, float]:
        return all_reduce_sum(values, self.device)

    def all_reduce_max(self, value: float) -> float:
        return all_reduce_max(value, self.device)

    def barrier(self) -> None:
        barrier()


def _compile(module: nn.Module, cfg: RunConfig, device: torch.device) -> None:
    # CUDA graphs replay CUDA kernels; on a CPU inductor would only warn that it skips them
    mode = cfg.compile.mode if device.type == "cuda" else "default"
    logger.info("torch.compile: %s (mode %s)", compile_model(module, cfg.compile.scope, mode=mode), mode)


def _is_one(factor: float | torch.Tensor) -> bool:
    """A Python 1.0 factor is skipped; a tensor one is never compared on the host (that would sync)."""
    return not isinstance(factor, torch.Tensor) and factor == 1.0


def _add_flops(total: Optional[float], out: StepOutput, first: bool) -> Optional[float]:
    """Running sum of per-micro-batch FLOPs; None as soon as one micro-batch does not report them."""
    if out.flops is None or (total is None and not first):
        return None
    return (total or 0.0) + out.flops
