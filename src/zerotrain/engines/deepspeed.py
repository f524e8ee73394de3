"""DeepSpeed as an engine: ``deepspeed.initialize`` (ZeRO 0-3, offload, fp16/bf16) behind :class:`~zerotrain.engines.base.Engine`."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from zerotrain.checkpoint.universal import check_weights, load_whole, universal_checkpoint
from zerotrain.config import RunConfig
from zerotrain.config.ds_config import (
    precision_of,
)
from zerotrain.engines import optimizers
from zerotrain.engines.base import Engine, _compile
from zerotrain.engines.ds_private.engine import (
    check_nvme_checkpoint,
    load_nvme_offloaded_optimizer,
    replay_cpu_adam_steps,
    zero3_gathered_state_dict,
)
from zerotrain.engines.ds_private.gpu_share import follow_schedule, gpu_masters, lent_for_save, take_loaded_states
from zerotrain.engines.ds_private.patches import Applied, apply_patches
from zerotrain.engines.ds_private.safe_load import ds_safe_globals
from zerotrain.engines.ds_private.universal import loading_universal
from zerotrain.engines.states import full_numel
from zerotrain.errors import UserError
from zerotrain.runtime.collectives import run_on_main
from zerotrain.runtime.doctor import ops_for, prepare_ops
from zerotrain.train.schedule import make_scheduler
from zerotrain.train.state import load_safely, weights_only_torch_load

logger = logging.getLogger(__name__)


class DeepSpeedRefused(UserError):
    """DeepSpeed refused the user's file while building the engine. Its checks may depend on the rank (a
    partition's size), so each rank that met one says it."""

    said_by_each_rank = True


@contextlib.contextmanager
def _refusal_names(user_file: Optional[str]) -> Iterator[None]:
    """A combination of settings in the user's own DeepSpeed file that DeepSpeed refuses only while it builds the
    engine (its checks there raise ``ValueError``, ``AssertionError`` or a bare ``Warning``) ends in one line
    that names the file, quotes DeepSpeed and names DeepSpeed's module that raised it. Only an error raised in
    DeepSpeed's own code is taken for a refusal: one from zerotrain's code that DeepSpeed calls (the learning-rate
    schedule) or any other library, or without a user file, is a bug to see whole."""
    try:
        yield
    except (ValueError, AssertionError, Warning) as exc:
        where = _raised_in_deepspeed(exc)
        if not user_file or where is None or (isinstance(exc, Warning) and type(exc) is not Warning):
            raise
        said = " ".join(str(exc).split()) or type(exc).__name__
        raise DeepSpeedRefused(f"--strategy.deepspeed_config: {user_file}: DeepSpeed refused it while building the "
                               f"engine ({where}): {said}") from exc


def _raised_in_deepspeed(exc: BaseException) -> Optional[str]:
    """``deepspeed/<path>`` of the frame that raised ``exc`` when it is DeepSpeed's, else None."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return None
    parts = Path(tb.tb_frame.f_code.co_filename).parts
    if "deepspeed" not in parts:
        return None
    inner = parts[len(parts) - 1 - parts[::-1].index("deepspeed"):]
    return "/".join(inner)


class DeepSpeedEngine(Engine):
    """``deepspeed.initialize`` with zerotrain's schedule. With ``clip`` (see ``ds_config.engine_clips``)
    the engine clips the gradients itself before DeepSpeed's step, keeping the norm on the device."""

    backend = "deepspeed"

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
        prepare_ops(ops_for(ds))  # a first run compiles DeepSpeed's optimizer op in there: say so, clear a stale lock
        # No optimizer block: --optimizer.name is a class path, built here and handed to DeepSpeed
        client = None if "optimizer" in ds else optimizers.build(params, cfg.optimizer, device.type)
        with _refusal_names(cfg.strategy.deepspeed_config):
            self.ds, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=ds, optimizer=client,
                                                    lr_scheduler=scheduler)
        if cfg.compile.enabled:
            if ds.get("zero_optimization", {}).get("stage", 0) == 3:
                # ZeRO-3 gathers each block's parameters in module hooks that a compiled block would trace
                # into; DeepSpeed's own entry point compiles the wrapped module with those hooks left out.
                self.ds.compile()
            else:
                _compile(self.ds.module, cfg, device)
        self._clip = clip
        self._params = params
        # Part of ZeRO-3's optimizer on the GPU (offload_optimizer.ratio): DeepSpeed's second optimizer there
        # follows the schedule, and its moments are checkpointed, only through zerotrain (ds_private.gpu_share)
        on_gpu = gpu_masters(self.ds.optimizer)
        self._gpu_share = bool(on_gpu)
        if on_gpu:
            groups = self.ds.optimizer.fp32_partitioned_groups_flat
            logger.info("optimizer: %d of %d sub-groups (%s of %s parameters) on the GPU, the rest on the host",
                        len(on_gpu), len(groups), f"{sum(t.numel() for t in on_gpu):,}",
                        f"{sum(t.numel() for t in groups):,}")
        if clip is not None and self.world_size == 1:
            # One rank has nothing to average, yet stage 0 still flattens every gradient, all-reduces
            # it with itself and copies it back. DeepSpeed sets this same switch without a process group.
            self.ds.enable_backward_allreduce = False
        self._norm: Optional[torch.Tensor] = None
        self._lr: Optional[float] = None
        # Methods of DeepSpeed's optimizer and engine instances, not config keys: a user's own JSON gets them too,
        # on the DeepSpeed versions they were verified on (see ds_private.patches); after the
        # switches above, which some of them read
        self.patches = apply_patches(self.ds) if cfg.strategy.fast_path else Applied()
        # Where DeepSpeed's forward and backward wrap only autograd (ZeRO-0 on one rank), they are run
        # directly: the same arithmetic without their host work (the patch zero0_direct_forward_backward)
        self._direct = "zero0_direct_forward_backward" in self.patches
        self._direct_model: nn.Module = self.ds.module
        if self._direct and self.ds.torch_autocast_enabled():  # a DeepSpeed with torch_autocast (0.17+)
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
        if self._gpu_share:
            follow_schedule(self.ds.optimizer)
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

    def torch_optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizer DeepSpeed steps (inside its ZeRO wrapper where there is one) and, with part of ZeRO-3's
        offloaded optimizer on the GPU, the one that steps that part."""
        outer = self.ds.optimizer
        found = [getattr(outer, "optimizer", outer), getattr(outer, "backup_optimizer", None)]
        return [opt for opt in found if isinstance(opt, torch.optim.Optimizer)]

    def save(self, folder: Path) -> None:
        self.check_not_released()
        # save_latest=False: zerotrain marks complete checkpoints itself (see checkpoint.py).
        with lent_for_save(self.ds.optimizer) if self._gpu_share else contextlib.nullcontext():
            self.ds.save_checkpoint(str(folder.parent), tag=folder.name, save_latest=False)

    def load(self, folder: Path) -> None:
        # DeepSpeed's checkpoint engine calls torch.load(weights_only=False): a crafted file in the
        # folder would run code. This engine's loader is replaced, for this call only, by a
        # weights-only load that also admits the few DeepSpeed classes its files hold (DS_SAFE_GLOBALS);
        # any torch.load DeepSpeed makes around it directly is forced weights-only too.

        if self.ds.zero_nvme_offload_optimizer():
            check_nvme_checkpoint(self.ds, folder)
        allow = ds_safe_globals()
        ckpt_engine = self.ds.checkpoint_engine
        ckpt_engine.load = lambda path, map_location=None: load_safely(Path(path), map_location, allow)
        try:
            with weights_only_torch_load(folder, allow):
                path, _ = self.ds.load_checkpoint(str(folder.parent), tag=folder.name)
                if path is not None and self.ds.zero_nvme_offload_optimizer():
                    path = path if load_nvme_offloaded_optimizer(self.ds, str(folder.parent), folder.name) else None
        finally:
            del ckpt_engine.load  # the class's own method again
        if path is None:
            raise UserError(f"--checkpoint.resume: DeepSpeed found no checkpoint in {folder}")
        self._loaded()

    def _loaded(self) -> None:
        """What DeepSpeed's ``load_checkpoint`` leaves to do: the GPU share's moments to its optimizer, the host
        Adam's step counter to the loaded step."""
        if self._gpu_share:
            take_loaded_states(self.ds.optimizer)
        replay_cpu_adam_steps(self.ds.basic_optimizer)

    def load_resharded(self, folder: Path, saved_world_size: int, verify: bool = True) -> None:
        """Load a ZeRO checkpoint of another process count through DeepSpeed's universal checkpoint.

        ZeRO-1/2/3 files hold one partition of the flat fp32 weights and Adam moments per rank, cut
        for the world size that wrote them. Rank 0 converts the folder once into per-parameter
        tensors (:func:`zerotrain.checkpoint.universal.universal_checkpoint`, cached in ``folder/universal``;
        the other ranks wait in :func:`~zerotrain.runtime.collectives.run_on_main`, which hands them its
        error if it fails), then every rank loads its new partition with DeepSpeed's
        ``load_universal`` switched on for this call only (it is read at load time, so the JSON
        in the run folder stays the run's). The scheduler, global step and skipped steps come from
        the copied model-states file, as in a same-size load. Every ``torch.load`` inside is
        weights-only with :data:`DS_SAFE_GLOBALS`.

        ZeRO-0 keeps the whole optimizer state in its model-states file: it loads as a same-size
        checkpoint when no ``*optim_states.pt`` shard exists (fp32), else it is refused.
        """

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
        self._load_universal(run_on_main(lambda: universal_checkpoint(folder, verify)))

    def load_universal(self, folder: Path) -> None:
        """Another engine's checkpoint converted to a universal one (every parameter's fp32 weights and optimizer
        states whole, the schedule in the model-states file), on any process count.

        ZeRO-1/2/3: DeepSpeed's own universal loader, every rank taking its partition. ZeRO-0 keeps everything
        whole on every rank, and DeepSpeed's loader restores no weights there: the weights, the torch optimizer's
        states and the schedule are set through them (:func:`~zerotrain.checkpoint.universal.load_whole`); a
        16-bit run whose optimizer DeepSpeed wraps is refused in one line (:meth:`check_loads_across`)."""
        self.check_loads_across(folder.parent)
        if self.ds.zero_optimization():
            self._load_universal(folder)
            return
        load_whole(folder, self.ds.module, self.ds.optimizer, self.ds.lr_scheduler)

    def check_loads_across(self, checkpoint: Path) -> None:
        if self.ds.zero_optimization():
            if self.ds.zero_nvme_offload_optimizer():
                raise UserError(f"--checkpoint.resume: {checkpoint} was written by another engine and cannot be "
                                "resumed with the optimizer offloaded to NVMe: pass --strategy.offload_optimizer cpu "
                                "or none")
        elif not isinstance(self.ds.optimizer, torch.optim.Optimizer) or self.ds.lr_scheduler is None:
            raise UserError(f"--checkpoint.resume: {checkpoint} was written by another engine, and DeepSpeed "
                            f"ZeRO-0 {self.precision} keeps its optimizer in its own wrapper here: pass "
                            "--strategy.zero_stage 1, 2 or 3")

    def _load_universal(self, universal: Path) -> None:
        """``universal`` through DeepSpeed's universal loader, switched on for this call only (it is read at load
        time, so the JSON in the run folder stays the run's); every ``torch.load`` in there, DeepSpeed's checkpoint
        engine's and its direct ones, loads weights only. A model whose parameters the folder does not hold, at
        their sizes, is refused in one line first (DeepSpeed's loader asserts)."""
        check_weights(universal, {name: full_numel(p) for name, p in self.ds.module.named_parameters()
                                  if p.requires_grad})
        with loading_universal(self.ds), weights_only_torch_load(universal, ds_safe_globals()):
            path, _ = self.ds.load_checkpoint(str(universal.parent), tag=universal.name,
                                              load_optimizer_states=True, load_lr_scheduler_states=True)
        if path is None:
            raise UserError(f"--checkpoint.resume: DeepSpeed found no checkpoint in {universal}")
        self._loaded()

    def consolidated_state_dict(self) -> Optional[Mapping[str, torch.Tensor]]:
        if self.ds.zero_optimization_partition_weights():
            return zero3_gathered_state_dict(self.ds)  # every rank: the others serve rank 0's reads
        if self.rank != 0:
            return None
        # Left where they are: the writer copies one shard at a time to the host (a 5B model is 10 GB in bf16).
        return {k: v.detach() for k, v in self.ds.module.state_dict().items()}


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


