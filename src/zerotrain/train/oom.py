"""What a run that ran out of GPU memory says: one line with the sizes involved and what to try next.

A CUDA out-of-memory error is a traceback of a few hundred lines whose useful part is buried in
torch's message. The loop (:func:`zerotrain.train.loop.fit`) turns it into
:class:`~zerotrain.errors.OutOfMemory` with :func:`describe_oom`'s line, which the CLI prints and ends
with exit status :data:`~zerotrain.errors.OOM_EXIT`. The line names the next rung of a memory
ladder (:func:`next_smaller`) as the ``zerotrain fit`` flags that select it, so that retrying is a
copy and paste, and a job script can walk the ladder on exit status 5.
"""

from __future__ import annotations

import os
import re
from typing import Optional

import torch

from zerotrain.config import RunConfig, StrategyConfig

GIB = 2**30

_UNITS = {"bytes": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
# What torch's caching allocator writes (c10 format_size: bytes, KiB, MiB or GiB, two decimals), e.g.
# "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB of which
# 1.23 GiB is free. ... Of the allocated memory 75.20 GiB is allocated by PyTorch, and ...".
_SIZE = r"([\d.]+)\s*(bytes|B|KiB|MiB|GiB|TiB)"
_TRIED = re.compile(r"Tried to allocate " + _SIZE)
_TOTAL = re.compile(r"total capacity of " + _SIZE)
_ALLOCATED = re.compile(_SIZE + r" is allocated by PyTorch")


def next_smaller(cfg: RunConfig, world_size: int = 1) -> Optional[tuple[str, list[str]]]:
    """The next configuration down the memory ladder from ``cfg``: (what it changes, the flags that select it).

    The global batch stays the same on every rung, so the run trains the same model the same way;
    only speed changes. Cheapest first:

    1. an even micro-batch is halved and the accumulation doubled (activations halve; a step makes
       twice the forward/backward passes, each half as large);
    2. activation checkpointing (activations of one layer at a time, ~30% more compute);
    3. ZeRO: stage 2 (gradients and optimizer state partitioned), then stage 3 (weights too), then
       offload to host memory. On one GPU partitioning saves nothing (a partition of one is the whole),
       so there the rungs that only partition are skipped: ZeRO-2 with the optimizer state offloaded
       comes next, then ZeRO-3 with the weights offloaded too.

    None when nothing is left: every state is offloaded and activations are checkpointed.
    """
    tr, s = cfg.trainer, cfg.strategy
    micro, accum = tr.micro_batch_size, s.gradient_accumulation_steps
    if micro > 1 and micro % 2 == 0:
        return (f"micro-batch {micro // 2} x {accum * 2} accumulation steps (the same global batch)",
                ["--trainer.micro_batch_size", str(micro // 2), "--strategy.gradient_accumulation_steps", str(accum * 2)])
    if not cfg.activation_checkpointing.enabled:
        return "activation checkpointing", ["--activation_checkpointing.enabled", "true"]
    return _next_zero(s, world_size)


def _next_zero(s: StrategyConfig, world_size: int) -> Optional[tuple[str, list[str]]]:
    """Rung 3 of :func:`next_smaller`: the strategy with less model state on each GPU."""
    if s.backend == "fsdp2":  # everything is sharded already: what is left is the host
        if s.offload_optimizer != "none" or s.offload_param != "none":
            return None
        return "FSDP2 with parameters, gradients and optimizer state offloaded to CPU memory", [
            "--strategy.offload_optimizer", "cpu"]
    stage = s.zero_stage if s.backend == "deepspeed" else 0
    to_deepspeed = ["--strategy.backend", "deepspeed"] if s.backend != "deepspeed" else []
    opt_offloaded, param_offloaded = s.offload_optimizer != "none", s.offload_param != "none"
    if param_offloaded:
        return None  # ZeRO-3 with the weights (and so everything) off the GPU: the bottom rung
    if stage == 3:
        flags = ([] if opt_offloaded else ["--strategy.offload_optimizer", "cpu"]) + ["--strategy.offload_param", "cpu"]
        return "ZeRO-3 with the optimizer state and weights offloaded to CPU memory", flags
    if world_size > 1:
        if stage < 2:
            return "ZeRO-2 (gradients and optimizer state partitioned)", [*to_deepspeed, "--strategy.zero_stage", "2"]
        return "ZeRO-3 (weights partitioned too)", ["--strategy.zero_stage", "3"]
    # One GPU: a partition of one is the whole, so ZeRO-1/2 without offload hold as much as ZeRO-0 (plus a
    # reduce bucket): the next rung that saves memory offloads the optimizer state.
    if not opt_offloaded:
        to_stage2 = [] if stage == 2 else [*to_deepspeed, "--strategy.zero_stage", "2"]
        return ("ZeRO-2 with the optimizer state offloaded to CPU memory",
                [*to_stage2, "--strategy.offload_optimizer", "cpu"])
    return ("ZeRO-3 with the optimizer state and weights offloaded to CPU memory",
            ["--strategy.zero_stage", "3", "--strategy.offload_param", "cpu"])


def strategy_name(s: StrategyConfig, world_size: int) -> str:
    """How ``s`` is called in the line, as the engines describe themselves in the log."""
    gpus = f" on {world_size} GPUs" if world_size > 1 else ""
    if s.backend == "fsdp2":
        return "FSDP2" + (", offload to cpu" if "cpu" in (s.offload_optimizer, s.offload_param) else "") + gpus
    if s.backend != "deepspeed":
        return "plain PyTorch" + (" DDP" if world_size > 1 else "") + gpus
    offload = [f"{what} offload to {device}" for what, device in
               (("optimizer", s.offload_optimizer), ("parameter", s.offload_param)) if device != "none"]
    return ", ".join([f"deepspeed ZeRO-{s.zero_stage}", *offload]) + gpus


def failed_step(exc: BaseException, finished: int) -> int:
    """The step the error stopped: ``finished + 1`` when it came from an optimizer step (``Engine.train_step``
    is on its traceback), else ``finished`` (an evaluation or a checkpoint after that step)."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "train_step":
            return finished + 1
        tb = tb.tb_next
    return finished


def describe_oom(exc: BaseException, step: int, cfg: RunConfig, world_size: int,
                 predicted_gpu_bytes: Optional[float], device: Optional[torch.device],
                 rank: Optional[int] = None) -> str:
    """One line (no traceback) for an out-of-memory error at ``step``: the sizes, and what to try.

    The request's size comes from torch's message ("Tried to allocate 2.00 GiB"); the GPU's total and
    what PyTorch had allocated are read from the device when it is a CUDA one (else from the message,
    when it says them); ``predicted_gpu_bytes`` is :func:`zerotrain.engines.states.model_state_memory`'s figure.
    What is unknown is left out. ``rank`` defaults to this process's rank in the job.
    """
    text = str(exc)
    sizes = []
    tried = _parse(_TRIED, text)
    total, allocated = _parse(_TOTAL, text), _parse(_ALLOCATED, text)
    if device is not None and device.type == "cuda":
        try:  # the live figures: the tensors of the failed step are still referenced here
            total = float(torch.cuda.get_device_properties(device).total_memory)
            allocated = float(torch.cuda.memory_allocated(device))
        except Exception:  # a broken context after the error: keep what the message said
            pass
    if total is not None:
        sizes.append(f"GPU total {_size(total)}")
    if allocated is not None:
        sizes.append(f"PyTorch had {_size(allocated)} allocated")
    line = f"out of GPU memory at step {step} (rank {_rank() if rank is None else rank})"
    if tried is not None:
        line += f" while allocating {_size(tried)}"
    if sizes:
        line += f" ({', '.join(sizes)})"
    if predicted_gpu_bytes is not None:
        line += (f"; the memory model predicted {_size(predicted_gpu_bytes)} per GPU for the model states of "
                 f"{strategy_name(cfg.strategy, world_size)} (activations not included)")
    rung = next_smaller(cfg, world_size)
    if rung is None:
        line += ("; nothing smaller is left on this many GPUs: add GPUs (--launch.nproc_per_node, --launch.nnodes) "
                 "or train fewer parameters (e.g. the lora recipe)")
    else:
        description, flags = rung
        line += f"; try: {description}: {' '.join(flags)}"
        if cfg.strategy.deepspeed_config and cfg.strategy.backend == "deepspeed":
            # Explicit values of the user's file win over flags: the change belongs in the file.
            line += f" (set the same in {cfg.strategy.deepspeed_config}, which --strategy.deepspeed_config reads)"
    return line


def _parse(pattern: re.Pattern, text: str) -> Optional[float]:
    m = pattern.search(text)
    return float(m.group(1)) * _UNITS[m.group(2)] if m else None


def _size(n: float) -> str:
    """Bytes as GiB (two decimals), or MiB for what would read 0.00 GiB."""
    return f"{n / GIB:.2f} GiB" if n >= 0.005 * GIB else f"{n / 2**20:.2f} MiB"


def _rank() -> int:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", 0))
    except ValueError:
        return 0
