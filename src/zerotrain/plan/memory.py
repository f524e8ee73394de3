"""How much memory a strategy needs at its peak: the model states (:mod:`zerotrain.engines.states`) plus the
activations the probe measured, and whether that fits.

Plain PyTorch and the autocast engines free their gradients after each step too. So a step's peak is
the largest of three moments: the forward's end (the states that persist plus all activations, plus
the gradients when they accumulate over micro-batches), the backward pass (what it still holds at
its first gradient, as the probe measured, plus the gradients it builds or the bucket they are copied
into, whichever is larger) and the step (all gradients, no activations, no bucket). Measured on one H100 at BERT-base shape (BENCHMARKS.md), the bucket
is under the forward's peak there; on IMDB's small model it adds on top.

Activations depend on the batch, the sequence length and ``--activation_checkpointing.enabled``,
not on the ZeRO stage: :mod:`zerotrain.plan.probe` measures them on the device, and :func:`predict` adds
them to the model states (peak GPU memory allocated by PyTorch, rank 0), with what a step's kernels
keep allocated (cuBLAS workspaces, ~0.1 GiB on an H100: the predictions of BERT-base, HelloDeepSpeed's
MLM and LoRA 1.2B trials were 0.06-0.11 GiB short without it), and sizes the host side
(the process with its data, the model as built on the CPU before it moves, offloaded states).
The CUDA context and the allocator's slack are not allocated memory: :func:`fits` keeps room for them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Optional

import torch

from zerotrain.checkpoint.weights import DEFAULT_MAX_SHARD_SIZE, parse_size
from zerotrain.engines.states import (
    ADAM_STATES,
    Buckets,
    ParamCounts,
    StateMemory,
    Strategy,
    model_state_memory,
)
from zerotrain.plan.strategies import STRATEGIES

if TYPE_CHECKING:
    from zerotrain.plan.probe import Probe

GIB = 2**30
EXPORT_SHARD_BYTES = parse_size(DEFAULT_MAX_SHARD_SIZE)  # the most a ZeRO-3 or FSDP2 export gathers at once


@dataclass(frozen=True)
class PlanRow:
    name: str
    memory: StateMemory
    fits: bool


def plan(counts: ParamCounts, world_size: int, precision: str, gpu_bytes: float, host_bytes: float,
         procs_per_host: int, reserve_bytes: float = 0.0, buckets: Mapping[str, Buckets] = {},
         autocast: Mapping[str, bool] = {}, grad_accum: int = 1,
         strategies: Optional[Mapping[str, Strategy]] = None, disk_bytes: float = math.inf,
         optimizer_states: int = ADAM_STATES, process_bytes: float = 0.0) -> list[PlanRow]:
    """Every strategy with its model-state memory and whether it fits: GPU states within ``gpu_bytes``
    minus ``reserve_bytes`` (kept for activations), the offloaded states of the processes of one host, each beside
    ``process_bytes`` of its own (:data:`PROCESS_HOST_BYTES` where nothing measured it; a row that offloads nothing
    is not judged on the host), within ``host_bytes``, and what they put on NVMe within ``disk_bytes``.
    ``buckets`` and ``autocast`` are per strategy name, from the DeepSpeed JSON each would run with (absent:
    DeepSpeed's default bucket, no autocast). ``strategies``: :data:`~zerotrain.plan.strategies.STRATEGIES` unless
    given, in order: the first that fits is the planner's pick. ``optimizer_states``:
    :func:`~zerotrain.engines.states.optimizer_states`."""
    rows = []
    for name, strategy in (STRATEGIES if strategies is None else strategies).items():
        mem = model_state_memory(counts, strategy, world_size, precision, buckets.get(name, Buckets()),
                                 autocast.get(name, False), grad_accum, optimizer_states)
        host_need = (mem.cpu_bytes + process_bytes) * procs_per_host if mem.cpu_bytes else 0.0
        fits = (mem.gpu_bytes <= gpu_bytes - reserve_bytes and host_need <= host_bytes
                and mem.nvme_bytes * procs_per_host <= disk_bytes)
        rows.append(PlanRow(name, mem, fits))
    return rows


PROCESS_HOST_BYTES = 6 * GIB
"""A margin of host memory for a training process itself (Python, torch, the CUDA context, the data) and what the
system keeps, beside its offloaded states, where no probe measured it. Not a measurement of any one process: 6.74B
runs on one H100 showed 2.3 GiB of RSS beside 67.6 GiB of bf16 states, and 4.9 GiB in use on the machine beside 69.1
GiB of fp32 states before the first step; fp32 states of 119.3 GiB on a host of 125 GiB were killed at 124 GiB."""


def gpu_memory_bytes() -> float | None:
    """Total memory of GPU 0, or None without a CUDA GPU."""
    if not torch.cuda.is_available():
        return None
    return float(torch.cuda.get_device_properties(0).total_memory)


ALLOCATOR_SLACK = 0.08
"""Share of the GPU kept free for the caching allocator's fragmentation (reserved above allocated:
2-8% in the benchmark runs), on top of the CUDA context the probe measured."""


@dataclass(frozen=True)
class MemoryPrediction:
    gpu_bytes: float
    """Peak GPU memory allocated by PyTorch on rank 0: model states, DeepSpeed's buffers, activations
    (0 when training on the CPU: all of it is in ``host_bytes``)."""
    host_bytes: float
    """Peak resident memory of the rank-0 process: libraries and data, the model as built, offloaded states."""
    states_bytes: float
    activation_bytes: float
    activations: str
    """How the activations were obtained (e.g. "measured: cuda allocator, micro-batch 1-8, extrapolated")."""
    workers_bytes: float = 0.0
    """The rank's data-loading workers, beside ``host_bytes`` (which is the rank's own process, as measured)."""
    rank0_extra_bytes: float = 0.0
    """The share of ``host_bytes`` that rank 0 alone holds (ZeRO-3's and FSDP2's export): not multiplied by the
    processes."""

    def as_row(self) -> dict[str, float]:
        return {"predicted_gpu_mem_gib": self.gpu_bytes / GIB, "predicted_host_mem_gib": self.host_bytes / GIB,
                "predicted_workers_host_gib": self.workers_bytes / GIB}


def predict(counts: ParamCounts, strategy: Strategy, micro_batch_size: int, checkpointing: bool, world_size: int,
            precision: str, probe: "Probe", buckets: Buckets = Buckets(), autocast: bool = False,
            grad_accum: int = 1, export: bool = False, optimizer_states: int = ADAM_STATES) -> MemoryPrediction:
    """Peak GPU and host memory of rank 0 for one configuration: :func:`model_state_memory` plus the
    activations ``probe`` measured at this micro-batch, plus the host side (module docstring). ``export``: the
    run ends with ``--trainer.export`` (FSDP2 and ZeRO-3 gather the model on rank 0's host, a shard at a time where
    the probe says the model exports so).
    ``optimizer_states``: :func:`~zerotrain.engines.states.optimizer_states`."""
    states = model_state_memory(counts, strategy, world_size, precision, buckets, autocast, grad_accum,
                                optimizer_states, device=probe.device)
    key = probe.key(checkpointing, sixteen_bit(strategy, precision, autocast))
    act = probe.activations[key].at(micro_batch_size)
    # What the backward pass still holds at its first gradient; unmeasured, the peak stands for it.
    first = probe.at_first_gradient[key].at(micro_batch_size) if key in probe.at_first_gradient else act
    # The recipe builds its model on the CPU in the dtypes as built before the engine moves it (and
    # frees it): the host's peak is then, or in the steady state of training, whichever is larger. Under
    # ZeRO-3 a recipe may build it partitioned instead (Task.builds_partitioned): no host holds it whole.
    # On one H100, the Llama-shaped 6.74B with its bf16 states offloaded peaked at 69.8 GiB of RSS, its states
    # (67.6 predicted) and about 2 GiB of process: the 25 GiB of the model in fp32 were never there. The 1.1B
    # without offload built at 1.44 GiB and trained at 2.09 (its probe's process: 2.10), but peaked at 3.55 GiB
    # once: a transient after the build, not located, that this leaves out.
    before_model = probe.host_before_model_bytes
    if before_model is None:  # a probe file from before that was measured: the sum, an upper bound
        before_model = probe.host_base_bytes
    zero3 = strategy.backend == "deepspeed" and strategy.zero_stage == 3
    built = 0 if zero3 and probe.builds_partitioned else counts.total_bytes
    if states.cpu_after_model:
        host = max(before_model + built, probe.host_base_bytes + states.cpu_bytes)
    else:
        host = max(before_model + built, probe.host_base_bytes) + states.cpu_bytes
    rank0_extra = 0.0
    if export and (strategy.backend == "fsdp2" or zero3):
        # The export gathers the model onto rank 0's host while the run's own states are still there: FSDP2 its
        # state dict as built (fp32), ZeRO-3 its 16-bit weights. A shard at a time where the model exports so (the
        # 6.74B's 4.94 GB shard added 4.61 GiB: safetensors writes from the tensors, no second copy), else whole (a
        # LoRA run's adapter and merged model, transformers' conversions on save, a probe file from before it said).
        if zero3:
            gathered = (2 if sixteen_bit(strategy, precision, autocast) else 4) * counts.total
        else:
            gathered = float(counts.total_bytes)
        if probe.exports_streamed:
            gathered = min(gathered, EXPORT_SHARD_BYTES)
        # ZeRO-3's engine has freed the model it was built from (DeepSpeed's partitioning); FSDP2's build is counted
        # on top, as measured. The optimizer's states on the host are freed first (Engine.release_optimizer).
        if zero3:
            during = probe.host_base_bytes + states.cpu_bytes - states.moments_cpu_bytes + gathered
            rank0_extra = max(0.0, during - host)
        else:
            rank0_extra = max(0.0, gathered - states.moments_cpu_bytes)
        host += rank0_extra
    # The three moments of a step (module docstring). Gradients the engine frees after each step build
    # up through the backward pass (in DeepSpeed's bucket, where there is one) while the activations
    # still held at its first gradient are freed (all of them counted: an upper bound); with
    # accumulation they, and the bucket, are there through the next micro-batches' forward passes too
    # (ZeRO-1 with optimizer offload measured 1.1 GiB over activations and gradients at 4 x 2 on one
    # H100, BENCHMARKS.md: the 0.93 GiB bucket).
    device = step_peak(states, act, first, grad_accum) + probe.kernel_workspace_bytes
    if probe.gpu_total_bytes and states.init_bytes <= probe.gpu_total_bytes - (probe.gpu_context_bytes or 0):
        device = max(device, states.init_bytes)  # DeepSpeed flattens on the GPU only when the copy fits there
    if probe.device == "cpu":  # training on the CPU: the device's memory is the host's
        host, device = host + device, 0.0
    how = f"measured ({probe.method}, longest batches of {probe.seq_len} positions), fitted in micro-batch"
    return MemoryPrediction(gpu_bytes=device, host_bytes=host, states_bytes=states.gpu_bytes,
                            activation_bytes=act, activations=how, workers_bytes=probe.host_workers_bytes,
                            rank0_extra_bytes=rank0_extra)


def step_peak(states: StateMemory, activations: float, at_first_gradient: float, grad_accum: int) -> float:
    """Peak GPU bytes of a training step, the largest of its three moments (module docstring): the model
    states that persist, plus ``activations`` at the forward's end, or what the backward pass still holds at
    its first gradient (``at_first_gradient``, never above the peak) with the gradients or bucket it builds, or
    the step's gradients."""
    persistent = states.gpu_bytes - states.transient_bytes - states.gathered_bytes
    grads = min(states.grad_bytes, states.transient_bytes - states.bucket_bytes)  # the freed gradients (0: kept)
    forward_end = activations + states.gathered_bytes + (grads + states.bucket_bytes if grad_accum > 1 else 0)
    held = min(at_first_gradient, activations)
    if states.bucket_beside_grads:  # FSDP2: each block's buffers beside the gradients, copies released as they come
        backward = held + max(grads, states.gathered_bytes) + states.bucket_bytes
    else:
        backward = held + max(grads, states.bucket_bytes) + states.gathered_bytes
    step = states.transient_bytes - states.bucket_bytes
    return persistent + max(forward_end, backward, step)


def sixteen_bit(strategy: Strategy, precision: str, autocast: bool) -> bool:
    """Whether the engine computes with 16-bit weights (DeepSpeed's bf16/fp16 blocks, FSDP2's mixed-precision
    policy) rather than running autocast over the weights as built (plain PyTorch, ZeRO-0's fast path)."""
    return strategy.backend in ("deepspeed", "fsdp2") and not autocast and precision in ("bf16", "fp16")


def fits(prediction: MemoryPrediction, probe: "Probe", host_bytes: float, procs_per_host: int) -> Optional[str]:
    """None when ``prediction`` fits this machine, else what is short, in words."""
    if probe.gpu_total_bytes is not None:
        room = probe.gpu_total_bytes * (1 - ALLOCATOR_SLACK) - (probe.gpu_context_bytes or 0.0)
        if prediction.gpu_bytes > room:
            return f"GPU memory: needs {prediction.gpu_bytes / GIB:.1f} GiB, {room / GIB:.1f} GiB usable"
    per_process = prediction.host_bytes - prediction.rank0_extra_bytes + prediction.workers_bytes  # with its workers
    if per_process * procs_per_host + prediction.rank0_extra_bytes > host_bytes:
        workers = f" ({prediction.workers_bytes / GIB:.1f} of it data workers')" if prediction.workers_bytes else ""
        return (f"host memory: {procs_per_host} process(es) x {per_process / GIB:.1f} GiB{workers}, "
                f"{host_bytes / GIB:.1f} GiB on this host")
    return None
