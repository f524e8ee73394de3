"""How long one optimizer step of a configuration takes: the planner's speed model.

A step is the sum of (seconds, all per rank):

* **compute**: ``accumulation x forward_backward(micro_batch, checkpointing)``, measured by
  :mod:`zerotrain.plan.probe` on this device with this model (so attention, kernels and dtype are in it);
* **optimizer**: the probe's Adam step over the trainable parameters, divided by the ranks that
  share it (ZeRO >= 1); with optimizer offload, DeepSpeed's CPU Adam over this rank's share plus
  moving its gradients down (fp32: DeepSpeed casts them on the GPU first) and its weights back up
  (16-bit where the model runs in 16 bits), at the host-device speed the probe measured from pinned
  memory, or from pageable memory for an unpinned offload;
* **the disk**, for an offload to NVMe: the bytes DeepSpeed swaps a step (:func:`nvme_bytes_per_step`) at
  :data:`NVME_BYTES_PER_S`, beside the host's part above;
* **communication** (several ranks): the gradient all-reduce (or reduce-scatter + all-gather, the
  same volume), ZeRO-3's two weight all-gathers per step, at :data:`LINK_BYTES_PER_S`, minus what
  overlaps the backward pass;
* **the engine's overhead**: DeepSpeed's ZeRO stages spend time per parameter tensor (gradient bookkeeping,
  partition copies, ZeRO-3's gathers) that a plain step does not: :data:`ZERO_S_PER_TENSOR`.

FSDP2 is timed like ZeRO-3 with its own volumes: the optimizer over this rank's shard (on the host with CPU
offload, where torch's own AdamW runs, at DeepSpeed's CPU Adam speed for want of a measurement), the gradients'
reduce-scatter in the reduce dtype, and the parameters' all-gathers in the compute dtype, two a step or one
without resharding after the forward pass; its overhead per tensor, once a step and for each all-gather,
is :data:`FSDP2_S_PER_TENSOR`.

The model only ranks candidates; the planner's short trials decide. Constants not measured by the
probe are stated with where they came from.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerotrain.engines.states import ParamCounts, Strategy
from zerotrain.plan.memory import sixteen_bit
from zerotrain.plan.probe import Probe

LINK_BYTES_PER_S = {"nvlink": 50e9, "network": 10e9, "gloo": 1e9}
"""Effective all-reduce speed. nvlink: measured on 2 x H200
(DDP's BERT-base step grew 8.5 ms for its 0.44 GB of fp32 gradients). network: a 100 Gb/s
fabric between nodes. gloo: processes on one CPU host."""

EXPOSED_COMMUNICATION = {"ddp": 0.3, 0: 1.0, 1: 1.0, 2: 1.0, 3: 0.5}
"""Share of the communication not hidden behind the backward pass: DDP's buckets all-reduce while
backward runs; DeepSpeed's ZeRO-0/1/2 reduce after it (``overlap_comm`` off, zerotrain's default);
ZeRO-3 prefetches the next layer's weights while one computes."""

ZERO_S_PER_TENSOR = {1: 65e-6, 2: 115e-6, 3: 800e-6}
"""Seconds per trainable tensor that the ZeRO stages add over ZeRO-0, beyond the compute and optimizer step the
probe measures: once a step for ZeRO-1/2 (gradient bookkeeping, partition copies), once a micro-batch for ZeRO-3
(which also gathers and releases every weight in each forward and backward). ZeRO-1/2: measured on one H100 at
BERT-base while DeepSpeed still reduced on one rank (62.1 and 72.1 ms against 49.1 ms, ~200 tensors); they stand
for several ranks and for an offload, where it still does, and have not been measured there. ZeRO-3: BERT-base
(153 tensors) on one H100 took 122 ms a step beyond its probe's 35.3 ms (155 ms beyond an earlier probe's 42.4)."""

ZERO_S_PER_TENSOR_ONE_RANK = {1: 6e-6, 2: 6e-6}
"""ZeRO-1/2 on one rank without offload, where zerotrain skips DeepSpeed's reduction (an identity there;
``zerotrain doctor`` lists the patch): BERT-base on one H100 took 1.2 and 0.7 ms a step beyond its probe's 35.3 ms
(153 tensors), the same within the trials' noise."""

FSDP2_S_PER_TENSOR = (170e-6, 98e-6)
"""Seconds per trainable tensor that FSDP2 adds beyond the compute and optimizer step the probe measures: once a
step, and for each all-gather (two a micro-batch, one with the parameters kept after forward). Fitted to BERT-base
(153 tensors) on one H100, where FSDP2's step took 56 ms beyond its probe's 35.3 ms, and 41 ms kept after forward
(91.3 and 76.4 ms). Where the time goes (the hooks around each block, the DTensor optimizer and clip, waits on
the GPU) was not profiled."""


CPU_ADAM_PARAMS_PER_S = 4.8e9
"""DeepSpeed's CPU Adam on an H100 host's 16 cores: a step over 10^9 fp32 parameters took 0.21 s on its 16
threads, 0.89 s on one (``benchmarks/cpu_adam_threads.py``; result in
``benchmarks/results/offload_7b_h100_202612/cpu_threads_ab_8_layers/cpu_adam_threads.txt``). It is bound by the
host's memory bandwidth, not its cores: 16 threads gave 4.3 times one. The rate is the host's, shared by the
processes on it, each stepping its own partition at the same time."""


NVME_BYTES_PER_S = 1.5e9
"""Reads and writes of a host's disk, shared by its processes: 1.6 GB/s written, 1.4 GB/s read by ``dd`` with
direct I/O on an H100 machine (``benchmarks/results/offload_7b_h100_202612/zero_infinity_12_layers/disk_speed.txt``).
A local NVMe drive is several times faster: the planner's trials decide."""


def nvme_bytes_per_step(strategy: Strategy, counts: ParamCounts, share: float, half: bool, grad_accum: int) -> float:
    """Bytes one rank moves to and from the disk a step under DeepSpeed 0.19's NVMe offload. The optimizer on NVMe:
    its fp32 gradients written in the backward pass and read for the step, its fp32 master weights and Adam's moments
    read and written (4 + 4 + 4 + 4 + 8 + 8). The weights on NVMe: read for each micro-batch's forward and backward
    pass, written once updated (2 x accumulation + 1 times the model's element size). An estimate from what is
    swapped, not from a timed step."""
    moved = 0.0
    if strategy.offload_optimizer == "nvme":
        moved += 32 * counts.trainable * share
    if strategy.offload_param == "nvme":
        moved += (2 * grad_accum + 1) * (2 if half else 4) * counts.total * share
    return moved


@dataclass(frozen=True)
class StepTime:
    compute: float
    optimizer: float
    communication: float
    engine_overhead: float

    @property
    def total(self) -> float:
        return self.compute + self.optimizer + self.communication + self.engine_overhead


def step_time(strategy: Strategy, micro_batch_size: int, grad_accum: int, checkpointing: bool, counts: ParamCounts,
              probe: Probe, world_size: int, nnodes: int, autocast: bool, pinned: bool = True,
              host_share: float = 1.0) -> StepTime:
    """Predicted seconds of one optimizer step (module docstring); ``pinned`` False: the offloaded states sit in
    pageable memory (``--strategy.offload_pin_memory false``); ``host_share``: the fraction of the offloaded optimizer
    on the host (:func:`~zerotrain.engines.states.optimizer_on_host`), the rest stepping on the GPU at the probe's
    optimizer speed, its 16-bit gradients still through the host's flat partition and back."""
    if strategy.backend == "fsdp2":
        return _fsdp2_step_time(strategy, micro_batch_size, grad_accum, checkpointing, counts, probe, world_size,
                                nnodes, pinned)
    n = world_size
    half = sixteen_bit(strategy, probe.precision, autocast)
    traced = probe.key(checkpointing, half)
    compute = grad_accum * probe.forward_backward_s[traced].at(micro_batch_size)
    stage = strategy.zero_stage if strategy.backend == "deepspeed" else 0
    share = 1 / n if stage >= 1 else 1.0
    # An older probe measured no pageable copy: its pinned speed stands in, as before it was measured
    link_to_host = (probe.h2d_bytes_per_s if pinned else probe.h2d_pageable_bytes_per_s or probe.h2d_bytes_per_s) or 10e9
    if strategy.offload_optimizer != "none":
        moved = (4 + (2 if half else 4)) * counts.trainable * share  # fp32 gradients down, the model's weights up
        adam = counts.trainable * share * (n / nnodes) / CPU_ADAM_PARAMS_PER_S
        # The GPU share's 16-bit gradients still go down to the host's flat partition and back up
        trip = 2 * (2 if half else 4) * counts.trainable * share
        optimizer = (host_share * (adam + moved / link_to_host)
                     + (1 - host_share) * (probe.optimizer_step_s * share + trip / link_to_host))
    else:
        optimizer = probe.optimizer_step_s * share
    if strategy.offload_param != "none":
        optimizer += 2 * (2 if half else 4) * counts.total * share / link_to_host  # weights up for forward and backward
    # The processes of a host share its disk
    optimizer += nvme_bytes_per_step(strategy, counts, share, half, grad_accum) * (n / nnodes) / NVME_BYTES_PER_S
    communication = 0.0
    if n > 1:
        link = LINK_BYTES_PER_S["gloo" if probe.device == "cpu" else "network" if nnodes > 1 else "nvlink"]
        grad_bytes = counts.trainable_bytes if strategy.backend == "ddp" or autocast else 2 * counts.trainable
        volume = 2 * (n - 1) / n * grad_bytes
        if stage == 3:
            volume += 2 * (n - 1) / n * 2 * counts.total
        communication = volume / link * EXPOSED_COMMUNICATION["ddp" if strategy.backend == "ddp" else stage]
    one_rank = n == 1 and strategy.offload_optimizer == "none"  # offloaded, DeepSpeed reduces on one rank too
    per_tensor = (ZERO_S_PER_TENSOR_ONE_RANK if one_rank else {}).get(stage, ZERO_S_PER_TENSOR.get(stage, 0.0))
    engine_overhead = per_tensor * counts.tensors * (grad_accum if stage == 3 else 1)
    return StepTime(compute, optimizer, communication, engine_overhead)


def _fsdp2_step_time(strategy: Strategy, micro_batch_size: int, grad_accum: int, checkpointing: bool,
                     counts: ParamCounts, probe: Probe, world_size: int, nnodes: int, pinned: bool) -> StepTime:
    """FSDP2's step (module docstring). Offloaded, each all-gather first copies the rank's fp32 shard of the
    parameters up, and the sharded fp32 gradients come down once a step."""
    n = world_size
    half = sixteen_bit(strategy, probe.precision, False)
    compute = grad_accum * probe.forward_backward_s[probe.key(checkpointing, half)].at(micro_batch_size)
    element = 2 if half else 4
    gathers = 2 if strategy.reshard_after_forward else 1
    link_to_host = (probe.h2d_bytes_per_s if pinned else probe.h2d_pageable_bytes_per_s or probe.h2d_bytes_per_s) or 10e9
    if "cpu" in (strategy.offload_optimizer, strategy.offload_param):
        moved = grad_accum * gathers * 4 * counts.total / n + 4 * counts.trainable / n
        optimizer = counts.trainable / nnodes / CPU_ADAM_PARAMS_PER_S + moved / link_to_host
    else:
        optimizer = probe.optimizer_step_s / n
    communication = 0.0
    if n > 1:
        link = LINK_BYTES_PER_S["gloo" if probe.device == "cpu" else "network" if nnodes > 1 else "nvlink"]
        # Each a reduce-scatter or an all-gather: (n - 1) / n of the volume; the gradients once a step, the
        # parameters for every micro-batch's forward (and backward, when resharded)
        volume = (n - 1) / n * element * (counts.trainable + grad_accum * gathers * counts.total)
        communication = volume / link * EXPOSED_COMMUNICATION[3]
    once, per_gather = FSDP2_S_PER_TENSOR
    engine_overhead = counts.tensors * (once + grad_accum * gathers * per_gather)
    return StepTime(compute, optimizer, communication, engine_overhead)
