"""How much memory the model states need under each strategy, before a single activation.

Model states are the parameters, their gradients and the optimizer's state (Adam: two moments).
With Ψ parameters of which T train, on N data-parallel GPUs, in bytes per parameter:

===========================  =======================  ========================  ====================
precision                    weights (all Ψ)          gradients (T)             optimizer (T)
===========================  =======================  ========================  ====================
bf16/fp16 under DeepSpeed    2                        2                         16: fp32 master, two
                                                                                moments, fp32 gradient
fp32 under DeepSpeed         4                        4                         8: two moments
plain PyTorch DDP (autocast) as built (fp32: 4)       2x as built (DDP's        2x as built: two
                                                      buckets hold a copy)      moments
===========================  =======================  ========================  ====================

(DeepSpeed casts the model to 16 bits; plain PyTorch keeps the dtypes the recipe built, e.g. a
LoRA base model loaded in bf16 with fp32 adapters.)

ZeRO partitions them over the N GPUs: stage 1 the optimizer state, stage 2 also the gradients,
stage 3 also the weights (plus the largest layer gathered twice over: the one computing and the one
prefetched). Offloading moves the optimizer state (and with ``offload_param`` the weights) to host
memory, where each process holds its partition. With ``contiguous_gradients`` DeepSpeed's ZeRO stages
also allocate a gradient reduce bucket of ``reduce_bucket_size`` elements up front, two of them for
stages 1-2 with ``overlap_comm`` (one 5e8-element bf16 bucket is 0.93 GiB: the IMDB sweep in
BENCHMARKS.md shows it as what ZeRO-1/2/3 add over ZeRO-0 on one GPU).

Not counted: activations (they depend on batch and sequence length, not on the ZeRO stage, and
``--strategy.activation_checkpointing`` cuts them), the CUDA context (~0.5 GiB) and allocator slack.
``zerotrain benchmark`` measures all of it; this module says what cannot fit before trying.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from zerotrain.strategies import STRATEGIES, Strategy

GIB = 2**30


@dataclass(frozen=True)
class ParamCounts:
    total: int
    """Ψ: every parameter, shared ones once."""
    trainable: int
    """T: parameters with requires_grad (all of them in full training, the adapters under LoRA)."""
    largest_layer: int
    """Parameters of the largest single module (what ZeRO-3 gathers at once)."""
    total_bytes: int
    """Bytes of all parameters in the dtypes the model was built in."""
    trainable_bytes: int
    """Bytes of the trainable parameters in the dtypes the model was built in."""


def count_params(model: nn.Module) -> ParamCounts:
    """Counts of ``model``'s parameters; works on a model built on the meta device."""
    unique = list({id(p): p for p in model.parameters()}.values())
    trainable = [p for p in unique if p.requires_grad]
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    return ParamCounts(
        total=sum(p.numel() for p in unique), trainable=sum(p.numel() for p in trainable), largest_layer=largest,
        total_bytes=sum(p.numel() * p.element_size() for p in unique),
        trainable_bytes=sum(p.numel() * p.element_size() for p in trainable),
    )


@dataclass(frozen=True)
class Buckets:
    """DeepSpeed's gradient-bucket settings (``zero_optimization``): what the ZeRO stages allocate."""

    reduce_bucket_size: int = 500_000_000
    overlap_comm: bool = False
    contiguous_gradients: bool = True

    @classmethod
    def from_ds_config(cls, ds: dict) -> "Buckets":
        zero = ds.get("zero_optimization", {})
        return cls(int(zero.get("reduce_bucket_size", cls.reduce_bucket_size)), bool(zero.get("overlap_comm", False)),
                   bool(zero.get("contiguous_gradients", True)))


@dataclass(frozen=True)
class StateMemory:
    gpu_bytes: int
    """Per GPU: model states plus DeepSpeed's reduce bucket."""
    cpu_bytes: int
    """Per process, in host memory: offloaded states."""


def _state_bytes(counts: ParamCounts, strategy: Strategy, precision: str) -> tuple[float, float, float]:
    """Unpartitioned (weights, gradients, optimizer state) bytes: the module docstring's table."""
    psi, t = counts.total, counts.trainable
    if strategy.backend == "ddp":
        return counts.total_bytes, 2 * counts.trainable_bytes, 2 * counts.trainable_bytes
    if precision == "fp32":
        return 4 * psi, 4 * t, 8 * t
    return 2 * psi, 2 * t, 16 * t


def model_state_memory(counts: ParamCounts, strategy: Strategy, world_size: int, precision: str,
                       buckets: Buckets = Buckets()) -> StateMemory:
    """Bytes the model states take per GPU and per process in host memory (see the module docstring)."""
    n = world_size
    weights, grads, optim = _state_bytes(counts, strategy, precision)
    stage = strategy.zero_stage if strategy.backend == "deepspeed" else 0
    element = 4 if precision == "fp32" else 2  # bytes of a weight/gradient element inside DeepSpeed
    if stage >= 1:
        optim /= n
    if stage >= 2:
        grads /= n
    gathered = 0
    if stage == 3:
        weights /= n
        gathered = 2 * element * counts.largest_layer
    cpu = 0.0
    if strategy.offload_optimizer != "none":
        cpu += optim
        optim = 0
    if strategy.offload_param != "none":
        cpu += weights
        weights = 0
    n_buckets = 0 if stage == 0 or not buckets.contiguous_gradients else 2 if buckets.overlap_comm and stage < 3 else 1
    bucket = n_buckets * element * buckets.reduce_bucket_size  # allocated whole, however small the model
    return StateMemory(gpu_bytes=int(weights + grads + optim + gathered + bucket), cpu_bytes=int(cpu))


@dataclass(frozen=True)
class PlanRow:
    name: str
    memory: StateMemory
    fits: bool


def plan(counts: ParamCounts, world_size: int, precision: str, gpu_bytes: float, host_bytes: float,
         procs_per_host: int, reserve_bytes: float = 0.0, buckets: Buckets = Buckets()) -> list[PlanRow]:
    """Every strategy with its model-state memory and whether it fits: GPU states within ``gpu_bytes``
    minus ``reserve_bytes`` (kept for activations), and the offloaded states of the processes of one
    host within ``host_bytes``. In :data:`~zerotrain.strategies.STRATEGIES` order: the first that fits
    is the planner's pick."""
    rows = []
    for name, strategy in STRATEGIES.items():
        mem = model_state_memory(counts, strategy, world_size, precision, buckets)
        fits = mem.gpu_bytes <= gpu_bytes - reserve_bytes and mem.cpu_bytes * procs_per_host <= host_bytes
        rows.append(PlanRow(name, mem, fits))
    return rows


def gpu_memory_bytes() -> float | None:
    """Total memory of GPU 0, or None without a CUDA GPU."""
    if not torch.cuda.is_available():
        return None
    return float(torch.cuda.get_device_properties(0).total_memory)
