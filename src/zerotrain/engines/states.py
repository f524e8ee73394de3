"""What an engine layout keeps per parameter: the memory of the model states before a single activation.

Model states are the parameters, their gradients and the optimizer's state: ``k`` tensors of a parameter's
size per trainable parameter, ``k`` from the optimizer table (:mod:`zerotrain.engines.optimizers`: Adam 2,
SGD with momentum 1, without 0). With Ψ parameters of which T train, on N data-parallel GPUs, in bytes per
parameter:

===========================  =======================  ========================  ====================
precision                    weights (all Ψ)          gradients (T)             optimizer (T)
===========================  =======================  ========================  ====================
bf16/fp16 under DeepSpeed    2                        2                         8 + 4k: fp32 master,
                                                                                fp32 gradient, k fp32
                                                                                states (Adam: 16)
fp32 under DeepSpeed         4                        4                         4k (Adam: 8)
autocast: plain PyTorch, and  as built (fp32: 4)       as built; 2x in DDP on    k x as built
DeepSpeed ZeRO-0's fast path                          several GPUs (its
(``torch_autocast``)                                  buckets hold a copy)
===========================  =======================  ========================  ====================

(DeepSpeed's bf16/fp16 blocks cast the model to 16 bits; autocast keeps the dtypes the recipe
built, e.g. a LoRA base model loaded in bf16 with fp32 adapters.)

In bf16, DeepSpeed's ``bf16_master_weights_and_grads`` (``--precision.master_weights bf16``) keeps the master
weights and their gradient partition in bf16 and ``bf16_optimizer_states`` the states too: the optimizer's
8 + 4k becomes 4 + 4k, then 4 + 2k (Adam: 16, 12, 8 bytes a parameter; with the weights and gradients,
20, 16, 12), wherever they live (GPU, host or disk). :class:`Buckets` carries the two element sizes.

ZeRO partitions them over the N GPUs: stage 1 the optimizer state, stage 2 also the gradients,
stage 3 also the weights (plus the largest layer gathered twice over: the one computing and the one
prefetched). Offloading moves the optimizer state (and with ``offload_param`` the weights) to host
memory, where each process holds its partition; under ZeRO-1/2 with Adam that is 18 (bf16) or 20 (fp32) bytes
a parameter or more, as pinned blocks round up to a power of two (:func:`_offloaded_partition`). ZeRO-3's
NVMe offload (ZeRO-Infinity) puts them on disk instead (``nvme_bytes``: 16 bytes a parameter for Adam, 2
for bf16 weights) and keeps the flat gradient partition and DeepSpeed's pinned swap buffers on the host.
That accounting is read from DeepSpeed 0.19's swappers. With ``contiguous_gradients`` DeepSpeed's ZeRO
stages also allocate a gradient reduce bucket of ``reduce_bucket_size`` elements, two of them for stages 1-2
with ``overlap_comm`` (one 5e8-element bf16 bucket is 0.93 GiB, however small the model).

Not all of it is held at once. Stages 1-2 allocate the bucket when the backward pass writes its
first gradient (the gradients are copied into it as they arrive) and free it when that pass ends;
their gradients (16-bit, then the fp32 partition the optimizer reads) live from the backward pass
to the end of the step (DeepSpeed 0.19's ``stage_1_and_2.py``: ``setup_buckets``,
``independent_gradient_partition_epilogue``, ``step``).

FSDP2 (:mod:`zerotrain.engines.fsdp2`: ``fully_shard`` on each repeated block and on the root) keeps, per
process, the parameters as built sharded over the N processes (fp32: 4 bytes a parameter / N, the master
weights), their sharded gradients (the same, from the backward pass to the step's end) and the optimizer's
``k`` states, sharded likewise (Adam: 8 / N); ``CPUOffloadPolicy`` puts all three in host memory. Beside
them, :func:`fsdp2_memory`: the compute copies of the parameters in bf16 (``MixedPrecisionPolicy``) or as
built (fp32), gathered one block at a time, and in the backward pass one block's unsharded gradients on
their way into the reduce-scatter.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from zerotrain.engines import optimizers
from zerotrain.engines.compiling import repeated_blocks

if TYPE_CHECKING:
    from zerotrain.config import OptimizerConfig, RunConfig

ADAM_STATES = 2
"""State tensors per parameter of the default optimizer (AdamW's two moments): the memory model's default."""


def optimizer_states(o: "OptimizerConfig", ds: Optional[dict] = None) -> int:
    """State tensors of a parameter's size the run's optimizer keeps per trainable parameter: the optimizer
    table's count for ``o`` (:mod:`zerotrain.engines.optimizers`), or for the ``optimizer`` block of the
    DeepSpeed JSON ``ds`` where it has one (a user's file decides). A type outside the table counts as Adam."""
    block = (ds or {}).get("optimizer")
    if isinstance(block, dict):
        row = optimizers.by_ds_type(block.get("type", ""))
        if row is None:
            return ADAM_STATES
        params = block.get("params") or {}
        o = dataclasses.replace(o, momentum=float(params.get("momentum", 0.0) or 0.0))
        return row.states(o)
    return optimizers.state_count(o)


@dataclass(frozen=True)
class Strategy:
    backend: str  # "deepspeed", "ddp" or "fsdp2"
    zero_stage: int = 0
    offload_optimizer: str = "none"
    offload_param: str = "none"
    reshard_after_forward: bool = True
    """FSDP2's ``--strategy.reshard_after_forward`` (the other engines have no such choice)."""

    def flags(self) -> list[str]:
        """The ``zerotrain fit`` flags that select this strategy."""
        flags = ["--strategy.backend", self.backend, "--strategy.zero_stage", str(self.zero_stage),
                 "--strategy.offload_optimizer", self.offload_optimizer, "--strategy.offload_param", self.offload_param]
        if self.backend == "fsdp2":
            flags += ["--strategy.reshard_after_forward", str(self.reshard_after_forward).lower()]
        return flags

    def apply(self, cfg: "RunConfig") -> "RunConfig":
        """A copy of ``cfg`` running this strategy, offloads included (a user's --strategy.offload_param
        does not carry over to ZeRO-1, nor an --strategy.offload_optimizer_ratio to a layout that cannot split
        the optimizer)."""
        cfg = copy.deepcopy(cfg)
        s = cfg.strategy
        s.backend, s.zero_stage = self.backend, self.zero_stage
        s.offload_optimizer, s.offload_param = self.offload_optimizer, self.offload_param
        if not (self.backend == "deepspeed" and self.zero_stage == 3 and self.offload_optimizer == "cpu"):
            s.offload_optimizer_ratio = 1.0
        if self.backend == "fsdp2":
            s.reshard_after_forward = self.reshard_after_forward
        return cfg

    @property
    def family(self) -> str:
        """The engine family, as plan tables and benchmark plots label rows."""
        return {"deepspeed": "DeepSpeed ZeRO", "fsdp2": "FSDP2", "ddp": "PyTorch DDP"}.get(self.backend, self.backend)


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
    tensors: int = 0
    """Trainable parameter tensors: DeepSpeed's ZeRO stages do host-side work per tensor each step."""
    largest_trainable: int = 0
    """Elements of the largest trainable tensor (what DeepSpeed's offload staging buffer is sized for)."""
    largest_block: int = 0
    """Parameters of the largest repeated block (:func:`~zerotrain.engines.compiling.repeated_blocks`, a
    transformer layer with everything in it): what FSDP2 gathers at once."""
    in_blocks: int = 0
    """Parameters inside the repeated blocks; the rest (embeddings, head, final norm) is FSDP2's root group."""
    sizes: tuple[int, ...] = ()
    """Elements of each trainable tensor, in the order the engines hand them to the optimizer (``model.parameters()``):
    what ZeRO-3's sub-groups are cut from (:func:`sub_groups`). Empty where unknown."""


def full_numel(p: torch.Tensor) -> int:
    """Elements of parameter ``p`` as the model defines it, also when ZeRO-3 built it partitioned: such a
    parameter holds an empty tensor outside a gather, and its full size in DeepSpeed's ``ds_numel``."""
    return int(getattr(p, "ds_numel", None) or p.numel())


def count_params(model: nn.Module) -> ParamCounts:
    """Counts of ``model``'s parameters; works on a model built on the meta device or partitioned by ZeRO-3."""
    unique = list({id(p): p for p in model.parameters()}.values())
    trainable = [p for p in unique if p.requires_grad]
    largest = max((sum(full_numel(p) for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    blocks = [{id(p): p for p in block.parameters()} for block in repeated_blocks(model)]
    return ParamCounts(
        total=sum(full_numel(p) for p in unique), trainable=sum(full_numel(p) for p in trainable),
        largest_layer=largest, tensors=len(trainable),
        largest_trainable=max((full_numel(p) for p in trainable), default=0),
        total_bytes=sum(full_numel(p) * p.element_size() for p in unique),
        trainable_bytes=sum(full_numel(p) * p.element_size() for p in trainable),
        largest_block=max((sum(full_numel(p) for p in b.values()) for b in blocks), default=0),
        in_blocks=sum(full_numel(p) for p in {k: v for b in blocks for k, v in b.items()}.values()),
        sizes=tuple(full_numel(p) for p in trainable),
    )


@dataclass(frozen=True)
class Buckets:
    """DeepSpeed's settings that size what the ZeRO stages allocate beyond the stage and the precision: the gradient
    buckets, whether the offloaded states are pinned, the NVMe swap buffers (``zero_optimization``), and the
    precision of the master weights and optimizer states (the ``bf16`` block)."""

    reduce_bucket_size: int = 500_000_000
    overlap_comm: bool = False
    contiguous_gradients: bool = True
    pin_memory: bool = False
    """``offload_optimizer.pin_memory`` (DeepSpeed's default: false; zerotrain's JSON: true on GPUs)."""
    sub_group_size: int = 1_000_000_000
    """ZeRO-3 steps (and swaps to NVMe) the optimizer one sub-group of this many elements at a time."""
    optimizer_swap_buffers: int = 4
    """``offload_optimizer.buffer_count``: pinned host buffers, each one sub-group of fp32, for NVMe swaps."""
    param_swap_buffers: int = 5
    """``offload_param.buffer_count``: pinned host buffers of ``param_swap_buffer_size`` elements each."""
    param_swap_buffer_size: int = 100_000_000
    master_element: int = 4
    """Bytes of an element of the optimizer's master weights and of their gradients: 4 (fp32), 2 under
    ``bf16.bf16_master_weights_and_grads`` (``--precision.master_weights bf16``)."""
    state_element: int = 4
    """Bytes of an element of the optimizer's states: 4 (fp32), 2 under ``bf16.bf16_optimizer_states``."""
    grad_accum_element: Optional[int] = None
    """Bytes of an element of ZeRO-3's flat gradient partition: ``data_types.grad_accum_dtype`` where a JSON sets
    it, else (None) the weights' dtype, DeepSpeed's default."""
    optimizer_on_host: float = 1.0
    """ZeRO-3 with the optimizer on the cpu: ``offload_optimizer.ratio``, the share of its sub-groups kept on the
    host; the first ``int((1 - ratio) x sub-groups)`` stay on the GPU (DeepSpeed 0.19's ``subgroup_to_device``)."""

    @classmethod
    def for_fsdp2(cls, cfg: "RunConfig", device: str) -> "Buckets":
        """FSDP2's one setting here: whether an offload pins its host states, as the engine decides it
        (``--strategy.offload_pin_memory``; unset: on GPUs)."""
        pin = cfg.strategy.offload_pin_memory
        return cls(pin_memory=pin if pin is not None else device == "cuda")

    @classmethod
    def from_ds_config(cls, ds: dict) -> "Buckets":
        zero = ds.get("zero_optimization", {})
        offload = zero.get("offload_optimizer") or {}
        params = zero.get("offload_param") or {}
        # DeepSpeed 0.19's ZeRO-1/2 turn contiguous gradients back on under optimizer offload.
        offloaded = offload.get("device", "none") not in ("none", None)
        bf16 = ds.get("bf16") if isinstance(ds.get("bf16"), dict) and ds["bf16"].get("enabled") is True else {}
        # DeepSpeed's ZeRO stages 1-3 keep bf16 master weights; stage 0 has none of its own
        master = 2 if bf16.get("bf16_master_weights_and_grads") is True and zero.get("stage", 0) in (1, 2, 3) else 4
        state = 2 if master == 2 and bf16.get("bf16_optimizer_states") is True else 4
        data_types = ds.get("data_types")
        accum = data_types.get("grad_accum_dtype") if isinstance(data_types, dict) else None
        accum_element = {"fp32": 4, "float32": 4, "fp16": 2, "float16": 2, "bf16": 2, "bfloat16": 2}.get(str(accum).lower())
        shared = zero.get("stage", 0) == 3 and offload.get("device") == "cpu"
        return cls(int(zero.get("reduce_bucket_size", cls.reduce_bucket_size)), bool(zero.get("overlap_comm", False)),
                   bool(zero.get("contiguous_gradients", True)) or offloaded, bool(offload.get("pin_memory", False)),
                   int(zero.get("sub_group_size", cls.sub_group_size)),
                   int(offload.get("buffer_count", cls.optimizer_swap_buffers)),
                   int(params.get("buffer_count", cls.param_swap_buffers)),
                   int(params.get("buffer_size", cls.param_swap_buffer_size)), master, state, accum_element,
                   float(offload.get("ratio", 1.0)) if shared else 1.0)


def pinned(nbytes: float) -> float:
    """Host memory that pinning ``nbytes`` takes: PyTorch's pinned-memory allocator rounds every block up to
    a power of two (an 18.8 GiB fp32 partition takes 32 GiB)."""
    return float(2 ** math.ceil(math.log2(nbytes))) if nbytes > 0 else 0.0


@dataclass(frozen=True)
class StateMemory:
    gpu_bytes: int
    """Per GPU: model states plus DeepSpeed's reduce bucket."""
    cpu_bytes: int
    """Per process, in host memory: offloaded states."""
    grad_bytes: int = 0
    """The gradients' share of ``gpu_bytes``."""
    transient_bytes: int = 0
    """The share of ``gpu_bytes`` allocated only in the backward pass and the step (gradients the engine
    frees after each step, DeepSpeed's stage 1-2 bucket): not there at the forward's peak."""
    bucket_bytes: int = 0
    """DeepSpeed's stage 1-2 reduce bucket(s), part of ``transient_bytes``: allocated at the first
    gradient, freed when the backward pass ends."""
    init_bytes: int = 0
    """Per GPU at DeepSpeed's start: ZeRO-1/2 copy the trainable weights into one flat buffer while
    the parameters still hold them (``flatten_dense_tensors_aligned``), so the weights plus that copy, for a
    moment. DeepSpeed does it on the GPU when the copy fits there, else on the CPU. It sets the peak of
    offloaded runs whose activations are small: 5.06B parameters measured 18.84 GiB at micro-batches 4 and
    32, twice their 9.42 GiB of bf16 weights."""
    cpu_after_model: bool = False
    """``cpu_bytes`` are allocated only after the model built on the CPU has moved to the GPU (ZeRO-1/2
    optimizer offload): the host holds one or the other at its peak, not both."""
    nvme_bytes: int = 0
    """Per process, on the ``--strategy.nvme_path`` disk: states offloaded to NVMe (ZeRO-Infinity)."""
    moments_cpu_bytes: int = 0
    """The optimizer's states among ``cpu_bytes`` (Adam's moments on the host): what the engine frees before the
    export (:meth:`~zerotrain.engines.base.Engine.release_optimizer`)."""
    gathered_bytes: int = 0
    """The share of ``gpu_bytes`` held from the forward pass into the backward pass and released there block by
    block while the gradients build up, so the backward pass holds the larger of the two, not both: FSDP2's
    compute copies of the parameters under ``reshard_after_forward`` false, beyond the blocks it gathers anyway."""
    bucket_beside_grads: bool = False
    """The backward pass holds ``bucket_bytes`` on top of the gradients built so far (FSDP2: each block's unsharded
    gradients on their way into its reduce-scatter, beside the sharded gradients of the blocks before it), not in
    place of them (DeepSpeed's stage 1-2 bucket, which the gradients are copied into)."""


def _state_bytes(counts: ParamCounts, strategy: Strategy, precision: str, world_size: int,
                 autocast: bool, states: int, buckets: Buckets) -> tuple[float, float, float]:
    """Unpartitioned (weights, gradients, optimizer state) bytes: the module docstring's table."""
    psi, t = counts.total, counts.trainable
    if strategy.backend == "ddp" or autocast:
        ddp_copy = 2 if strategy.backend == "ddp" and world_size > 1 else 1
        return counts.total_bytes, ddp_copy * counts.trainable_bytes, states * counts.trainable_bytes
    if precision == "fp32":
        return 4 * psi, 4 * t, 4 * states * t
    return 2 * psi, 2 * t, (2 * buckets.master_element + buckets.state_element * states) * t


def model_state_memory(counts: ParamCounts, strategy: Strategy, world_size: int, precision: str,
                       buckets: Buckets = Buckets(), autocast: bool = False, grad_accum: int = 1,
                       optimizer_states: int = ADAM_STATES, device: str = "cuda") -> StateMemory:
    """Bytes the model states take per GPU and per process in host memory (see the module docstring).

    ``autocast``: DeepSpeed runs ``torch_autocast`` (ZeRO-0's fast path in bf16, see
    ``zerotrain.config.ds_config.fast_path``), keeping the dtypes as built like plain PyTorch does.
    ``grad_accum``: micro-batches a step; under ZeRO-1/2 optimizer offload more than one costs host memory.
    ``optimizer_states``: state tensors per trainable parameter (:func:`optimizer_states`; Adam: 2).

    ``device``: where the run computes (``cuda`` or ``cpu``); FSDP2 gathers one block ahead on a GPU only.
    FSDP2: :func:`fsdp2_memory`."""
    if strategy.backend == "fsdp2":
        return fsdp2_memory(counts, strategy, world_size, precision, buckets, grad_accum, optimizer_states, device)
    n = world_size
    weights, grads, optim = _state_bytes(counts, strategy, precision, world_size, autocast, optimizer_states, buckets)
    master = buckets.master_element if precision != "fp32" else 4
    stage = strategy.zero_stage if strategy.backend == "deepspeed" else 0
    element = 4 if precision == "fp32" else 2  # bytes of a weight/gradient element inside DeepSpeed
    if stage >= 1:
        optim /= n
    if stage >= 2:
        grads /= n
    staging = 0
    if stage == 2 and strategy.offload_optimizer != "none":
        # Each reduce bucket's gradients go to the host as it fills and are freed (DeepSpeed 0.19's
        # copy_grads_in_partition): only the bucket stays on the GPU. 5.06B at micro-batch 48 measured 19.9 GiB,
        # where a prediction that held the whole gradient partition was 4.2 GiB over.
        grads = 0
    if stage in (1, 2) and strategy.offload_optimizer != "none":
        # The GPU buffer that gradients pass through to the host (temp_grad_buffer_for_gpu_offload), sized for
        # the largest trainable tensor.
        staging = element * counts.largest_trainable
    gathered = 0
    if stage == 3:
        weights /= n
        gathered = 2 * element * counts.largest_layer
    cpu = nvme = gpu_share = moments = 0.0
    if strategy.offload_optimizer == "nvme":
        # ZeRO-3 swaps the fp32 master weights, gradients and the optimizer's states (Adam: 16 bytes a parameter,
        # an upper bound) to disk, one sub-group at a time through pinned buffers of one sub-group each (DeepSpeed 0.19's
        # OptimizerSwapper); the gradients are reduced into a flat partition in the weights' dtype (DeepSpeed's
        # default accumulation dtype) that stays on the host (stage3.py, grad_partitions_flat_buffer), pinned with
        # the offload's pin_memory.
        held = pinned if buckets.pin_memory else float
        nvme += optim
        cpu += buckets.optimizer_swap_buffers * master * min(buckets.sub_group_size, counts.trainable / n)
        cpu += held((buckets.grad_accum_element or element) * counts.trainable / n)
        optim = grads = 0
    elif strategy.offload_optimizer != "none":
        if stage in (1, 2):
            moments += buckets.state_element * optimizer_states * counts.trainable / n
            cpu += _offloaded_partition(counts.trainable / n, element, buckets.pin_memory, optimizer_states,
                                        master, buckets.state_element)
        else:
            groups = sub_groups(counts.trainable / n, counts.sizes, n, buckets.sub_group_size)
            host, on_gpu = _offloaded_sub_groups(groups, buckets.grad_accum_element or element, master, buckets,
                                                 optimizer_states)
            moments += buckets.state_element * optimizer_states * counts.trainable / n * optimizer_on_host(
                counts, n, buckets)
            cpu += host
            gpu_share = on_gpu
            grads = 0  # the gradient partition lives on the host with the optimizer (DeepSpeed's self.device)
        optim = 0
        if stage in (1, 2) and grad_accum > 1:
            # DeepSpeed sums the micro-batches' gradients in a second copy on the host, in the weights' dtype
            # (accumulated_grads_in_cpu): 5B parameters at micro-batch 16 x 4 outgrew a 125 GiB host that held
            # micro-batch 4 at 120 GiB. Not confirmed by a measurement: 0.93B at 4 x 2 peaked no higher than at 8 x 1.
            cpu += element * counts.trainable / n
    if strategy.offload_param == "nvme":
        # The 16-bit weights on disk; a pool of pinned buffers carries them in and out (AsyncPartitionedParameterSwapper).
        nvme += weights
        cpu += buckets.param_swap_buffers * buckets.param_swap_buffer_size * element
        weights = 0
    elif strategy.offload_param != "none":
        cpu += weights
        weights = 0
    n_buckets = 0 if stage == 0 or not buckets.contiguous_gradients else 2 if buckets.overlap_comm and stage < 3 else 1
    bucket = n_buckets * element * buckets.reduce_bucket_size  # allocated whole, however small the model
    transient = late_bucket = 0.0
    if strategy.backend == "ddp" or autocast:
        # zero_grad(set_to_none) frees the .grad share each step; DDP's bucket copy stays allocated.
        transient = min(grads, counts.trainable_bytes)
    elif stage in (1, 2):
        # The 16-bit gradients, the fp32 gradient partition inside the optimizer's 16 bytes (unless
        # offloaded with it) and the bucket: allocated in the backward pass, freed by the step's end.
        fp32_grad = master * counts.trainable / n if precision != "fp32" and strategy.offload_optimizer == "none" else 0
        late_bucket = bucket
        transient = grads + fp32_grad + bucket
    # At start-up ZeRO-1/2 copy the trainable weights (in their dtype) into one flat buffer while the parameters
    # still hold them.
    flat = element * counts.trainable if stage in (1, 2) and not autocast else 0
    return StateMemory(gpu_bytes=int(weights + grads + optim + gathered + bucket + staging + gpu_share),
                       cpu_bytes=int(cpu),
                       grad_bytes=int(grads), transient_bytes=int(transient), bucket_bytes=int(late_bucket),
                       init_bytes=int(weights + flat) if flat else 0,
                       cpu_after_model=stage in (1, 2) and strategy.offload_optimizer != "none", nvme_bytes=int(nvme),
                       moments_cpu_bytes=int(moments))


def _offloaded_partition(partition: float, element: int, pin: bool, states: int = ADAM_STATES, master: int = 4,
                         state: int = 4) -> float:
    """Host bytes of one ZeRO-1/2 optimizer-offload partition of ``partition`` parameters (one param group):
    the fp32 master weights, their fp32 gradients and a weights-dtype copy that the updated weights go back
    to the GPU through, each pinned when ``pin``, and the optimizer's ``states`` fp32 states (Adam's two moments:
    DeepSpeedCPUAdam allocates them, not pinned). DeepSpeed 0.19's ``stage_1_and_2.py``: ``single_partition_of_fp32_groups`` and its
    ``.grad``, ``param_buffer_of_bit16_for_cpu_offload_groups``. Measured on one H100 host: 5.06B parameters
    at 120.3 GiB (this model: 119.8), 0.93B at 19.2 GiB (18.5). ``master``/``state``: bytes of an element of the
    master weights (and their gradients) and of the states, 2 where they are bf16 (:class:`Buckets`)."""
    held = pinned if pin else float
    return held(master * partition) + held(master * partition) + held(element * partition) + state * states * partition


def sub_groups(partition: float, sizes: tuple[int, ...], world_size: int, sub_group_size: int) -> list[float]:
    """Elements of each sub-group of one rank's ZeRO-3 partition of ``partition`` parameters, as DeepSpeed 0.19 cuts
    them (``_create_fp16_sub_groups``): the rank's share of each tensor of ``sizes`` in turn, a group closed once it
    holds ``sub_group_size`` elements or more, so a group overshoots by up to one tensor (a 7B's 1e8-element groups
    hold up to 1.76e8). Without the sizes, equal groups."""
    if not sizes:
        count = max(1, math.ceil(partition / sub_group_size))
        return [partition / count] * count
    groups, current = [], 0
    for size in sizes:
        current += math.ceil(size / world_size)
        if current >= sub_group_size:
            groups.append(float(current))
            current = 0
    return groups + [float(current)] if current else groups


def optimizer_on_host(counts: ParamCounts, world_size: int, buckets: Buckets) -> float:
    """The fraction of a rank's optimizer that ZeRO-3's cpu offload keeps on the host under ``buckets``'
    ``optimizer_on_host`` ratio: whole sub-groups, the first ``int((1 - ratio) x groups)`` of them on the GPU."""
    if buckets.optimizer_on_host >= 1:
        return 1.0
    groups = sub_groups(counts.trainable / world_size, counts.sizes, world_size, buckets.sub_group_size)
    on_gpu = int((1 - buckets.optimizer_on_host) * len(groups))
    return sum(groups[on_gpu:]) / sum(groups) if sum(groups) else 1.0


def _offloaded_sub_groups(groups: list[float], flat_element: int, master: int, buckets: Buckets,
                          states: int = ADAM_STATES) -> tuple[float, float]:
    """(host, GPU) bytes of one ZeRO-3 optimizer-offload partition cut into sub-groups of ``groups`` elements
    (:func:`sub_groups`; DeepSpeed 0.19's ``stage3.py``). On the host:
    - the master weights (``fp32_partitioned_groups_flat``, ``master`` bytes an element), not pinned;
    - their gradients, one block per sub-group of ``sub_group_size`` elements, each pinned when the offload pins;
    - the flat gradient partition that the reduced gradients land in (``grad_partitions_flat_buffer``,
      ``flat_element`` bytes: the accumulation dtype), one block, pinned likewise;
    - the optimizer's states, allocated at the first step, not pinned.

    Pinned blocks round up to a power of two, and sub-groups round each on their own. Measured on one H100 host with
    6.74B parameters: pinned with fp32 states, 74 GiB in use on the machine before the first step (this model: 69.1
    of states), and the first step's moments took the host past its 125 GiB (119.3); with bf16 master weights and
    states, an RSS peak of 69.9 GiB (67.6 of states).

    With ``buckets.optimizer_on_host`` below 1, the first ``int((1 - ratio) x groups)`` sub-groups' master weights,
    gradients and states are on the GPU instead, and its AdamW step there (torch's, ``foreach``) allocates a
    square-root buffer of the sub-group it steps; the flat gradient partition stays whole on the host."""
    held = pinned if buckets.pin_memory else float
    on_gpu = int((1 - buckets.optimizer_on_host) * len(groups))
    gpu_groups, host_groups = groups[:on_gpu], groups[on_gpu:]
    host_part, gpu_part, partition = sum(host_groups), sum(gpu_groups), sum(groups)
    grads = sum(held(master * g) for g in host_groups)
    host = master * host_part + grads + held(flat_element * partition) + buckets.state_element * states * host_part
    scratch = master * max(gpu_groups, default=0.0)
    return host, (2 * master + buckets.state_element * states) * gpu_part + scratch


def fsdp2_memory(counts: ParamCounts, strategy: Strategy, world_size: int, precision: str,
                 buckets: Buckets = Buckets(), grad_accum: int = 1, optimizer_states: int = ADAM_STATES,
                 device: str = "cuda") -> StateMemory:
    """Bytes FSDP2 (:mod:`zerotrain.engines.fsdp2`) holds per process, from what ``fully_shard`` allocates.

    * **Sharded states** (persistent): the parameters as built / N (the master weights; fp32: 4 bytes a
      parameter), the optimizer's ``optimizer_states`` states of each trainable one, in its dtype, / N (Adam on
      fp32: 8). Their sharded gradients (the same dtype, / N) live from the backward pass to the step's end.
      ``CPUOffloadPolicy`` moves the three to the host; pinned (``--strategy.offload_pin_memory``), each
      parameter's shard and gradient is a block of its own that PyTorch's pinned-memory allocator rounds up to a
      power of two: counted at twice their bytes, the most that rounding takes (an upper bound, not measured).
    * **Gathered compute copies**, ``e`` bytes a parameter (2 in bf16: ``MixedPrecisionPolicy``; fp32: as
      built): the root group (embeddings, head, final norm: FSDP2 keeps a root gathered from forward to
      backward) and the block computing, plus on a GPU the one its all-gather stream brings in ahead (on the CPU
      the collectives run in line: one block). Counted at every moment of a step, the step included (an upper
      bound there). With ``reshard_after_forward`` false the whole model's copies are there at the forward's
      end and go block by block in the backward pass as the sharded gradients come in
      (:attr:`StateMemory.gathered_bytes`). Offloaded, each gathered block's shard is also copied to the
      device first.
    * **Backward pass** (:attr:`StateMemory.bucket_beside_grads`): one block's unsharded gradients (``e``
      bytes a parameter, the reduce dtype) as they are copied into its reduce-scatter, and the root's, which
      wait for the root's reduce-scatter at the end of the pass.
    * **Accumulation** (``grad_accum`` > 1): the micro-batches before the last skip the reduce-scatter and keep
      every parameter's unsharded gradient (``e`` bytes a trainable parameter) until the last one reduces them.
    * **Start**: the engine moves the model as built to the device whole, then shards it block by block.

    Checked against the live tensor storages of the engine's own steps on the CPU with Gloo, 1 and 2 processes,
    fp32 and bf16, both ``reshard_after_forward`` settings (tests/plan/test_fsdp2_memory.py): within 2% at one
    process; at two, within 8% over repeated runs, with Gloo's copy of each reduce-scatter's input (one block's
    unsharded gradients, counted on the CPU at several processes; NCCL makes none), which Gloo's worker thread
    frees at a time that varies from run to run (without it the figure was 6% to 10% short). Not measured on a
    GPU: the block prefetched on the all-gather stream, and the CUDA caching allocator's rounding, which :func:`zerotrain.plan.memory.fits`
    keeps room for. ``buckets``: only its ``pin_memory`` is read (:meth:`Buckets.for_fsdp2`)."""
    n = world_size
    offload = "cpu" in (strategy.offload_optimizer, strategy.offload_param)
    as_built = counts.total_bytes / counts.total if counts.total else 4.0
    e = 2.0 if precision in ("bf16", "fp16") else as_built
    block = min(counts.largest_block, counts.total)
    root = counts.total - counts.in_blocks
    weights = counts.total_bytes / n
    grads = counts.trainable_bytes / n
    optim = optimizer_states * counts.trainable_bytes / n
    ahead = 2 if device == "cuda" else 1
    held = e * min(counts.total, root + ahead * block)
    if offload:
        held += as_built * ahead * block / n  # each gathered block's shard, copied up from the host first
    extra = 0.0 if strategy.reshard_after_forward else max(0.0, e * counts.total - e * min(counts.total, root + ahead * block))
    bucket = e * min(counts.trainable, block + root)
    if device == "cpu" and n > 1:  # Gloo's reduce-scatter first copies its whole input; NCCL's does not
        bucket += e * min(counts.trainable, block)
    accumulated = e * counts.trainable if grad_accum > 1 else 0.0
    cpu = moments = 0.0
    if offload:
        pin = 2.0 if buckets.pin_memory else 1.0
        cpu, moments = pin * (weights + grads) + optim, optim
        weights = grads = optim = 0.0
    gpu = weights + optim + held + accumulated + extra + grads + bucket
    return StateMemory(gpu_bytes=int(gpu), cpu_bytes=int(cpu), grad_bytes=int(grads), moments_cpu_bytes=int(moments),
                       transient_bytes=int(grads + bucket), bucket_bytes=int(bucket),
                       init_bytes=0 if offload else int(counts.total_bytes + as_built * block / n),
                       gathered_bytes=int(extra), bucket_beside_grads=True)

