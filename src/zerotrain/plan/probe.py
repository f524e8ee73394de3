"""Measure, on this machine, what the memory and speed models cannot know from the config alone.

One short trace of the recipe's real model on its real (longest) batches, plain PyTorch, no engine:

* **activation memory** of one forward and backward at micro-batch 1, 2, 4, ... until the peak
  grows with the batch, fitted through the last two as ``intercept + per_sample * micro_batch_size``
  (never below the smallest batch's peak) and extrapolated. On CUDA it is the caching
  allocator's peak over what the weights and gradients hold (``max_memory_allocated``, what the
  benchmarks report); on CPU, PyTorch's ``MemTracker`` counts the live tensor storages.
  With ``activation_checkpointing`` both ways are traced, each on its own model. On CUDA it also
  records what is still allocated when the first gradient lands: gradients an engine frees between
  steps, and DeepSpeed's ZeRO-1/2 reduce bucket, are allocated from then on, so they add to that
  figure rather than to the forward's peak (:func:`zerotrain.plan.memory.predict`).
* **time** of that forward and backward at the same sizes (same fit), and of one optimizer step
  over the trainable parameters, on this device;
* a model whose fp32 weights, gradients and Adam moments do not fit the GPU (the case for offload)
  is traced with 16-bit weights only, as DeepSpeed's bf16/fp16 blocks hold it, and its Adam step is
  timed on a slice of the parameters and scaled;
* the **host**: resident memory once the data, the libraries and the kernels of a step are loaded
  (the model freed), host-to-device copy speed. On CUDA the model first steps once (one item, the
  autocast trace's weights) at every padded length the training split can produce (:func:`padded_lengths`;
  past 256 lengths at 256 of them, the growth scaled to all): each new shape leaves kernel
  selections and plans on the host for the rest of the run (IMDB padded to 8: ~3 MB a length,
  0.38 GiB over its 127 lengths), so the figure is the run's steady state, not its first step's; and the
  memory of the run's data-loading workers, started as a run starts them;
* the **GPU**: total memory and what the CUDA context and other processes already hold.

The batches are the longest examples of the training split (by ``Task.train_lengths``): the peak of
a run is set by its longest batch, whatever the order. The probe runs in its own process
(``python -m zerotrain.plan.probe``) so that the planner's parent process never holds GPU memory.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from zerotrain.config.ds_config import resolve_precision
from zerotrain.config.flags import parse_config
from zerotrain.data.loader import make_loader
from zerotrain.engines.base import to_device
from zerotrain.engines.states import count_params
from zerotrain.errors import UserError
from zerotrain.models import hf
from zerotrain.models.shape import TransformerShape
from zerotrain.plan.activations import activation_bytes
from zerotrain.runtime import distributed
from zerotrain.runtime.distributed import cap_gpu_memory
from zerotrain.runtime.launcher import environment_alone
from zerotrain.runtime.rundir import write_json
from zerotrain.tasks import registry as recipes
from zerotrain.tasks.base import Task
from zerotrain.train.loop import seed_everything

LINEAR_REGIME = 1.6
"""Peak growth from one probe size to twice it above which the peak scales with the batch. Below it a
constant (e.g. the embedding's gradient, materialised whole in the backward pass) sets the peak, and
two such points say nothing about larger batches: the probe doubles the batch until it sees the ratio."""


@dataclass(frozen=True)
class Linear:
    """``max(floor, intercept + per_sample * micro_batch_size)``, fitted through the two largest
    measured sizes; ``floor`` is the smallest size's value (constant costs that set small batches' peak)."""

    intercept: float
    per_sample: float
    floor: float = 0.0

    def at(self, micro_batch_size: int) -> float:
        return max(self.floor, self.intercept + self.per_sample * micro_batch_size, 0.0)

    @classmethod
    def through(cls, points: dict[int, float]) -> "Linear":
        if len(points) == 1:
            ((b, y),) = points.items()
            return cls(intercept=0.0, per_sample=y / b, floor=y)
        (b1, y1), (b2, y2) = sorted(points.items())[-2:]
        slope = max(0.0, (y2 - y1) / (b2 - b1))  # noise must not make more samples cost less
        return cls(intercept=y2 - slope * b2, per_sample=slope, floor=min(points.values()))


@dataclass(frozen=True)
class Probe:
    """What :func:`measure` found; JSON-serialisable (``to_dict``/``from_dict``)."""

    device: str
    """``cuda`` or ``cpu``."""
    device_name: str
    precision: str
    method: str
    """How activations were measured: ``cuda allocator`` or ``torch MemTracker``."""
    seq_len: int
    """Padded length of the probe's batches: the longest in the training split."""
    activations: dict[str, Linear]
    """Activation bytes by :func:`variant` (activation checkpointing off/on; autocast or 16-bit weights)."""
    forward_backward_s: dict[str, Linear]
    """Seconds of one forward and backward, by :func:`variant`."""
    optimizer_step_s: float
    """One Adam step over the trainable parameters on this device (fused on CUDA)."""
    host_base_bytes: float
    """This process's resident memory with the libraries, the data, a step's kernels and the process
    group's communicator loaded, without the model."""
    at_first_gradient: dict[str, Linear] = field(default_factory=dict)
    """Activation bytes still held when the backward pass writes its first gradient, by :func:`variant`
    (CUDA only). Empty where not measured: the peak stands for it."""
    gpu_total_bytes: Optional[float] = None
    gpu_context_bytes: Optional[float] = None
    """GPU memory held before any tensor: the CUDA context, other processes."""
    h2d_bytes_per_s: Optional[float] = None
    """Pinned host-to-device copy speed (what optimizer offload moves each step)."""
    h2d_pageable_bytes_per_s: Optional[float] = None
    """The same copy from pageable host memory: what an unpinned offload (``--strategy.offload_pin_memory
    false``) moves at. CUDA stages such a copy through a pinned buffer of its own, and the calling thread
    waits for it. None in older probe files and on the CPU."""
    host_before_model_bytes: Optional[float] = None
    """Resident memory once the data is loaded, before any model is built (None in older probe files)."""
    kernel_workspace_bytes: float = 0.0
    """GPU memory still allocated after a step beyond weights and gradients: mostly cuBLAS's workspaces,
    one per stream and thread (the backward pass runs on autograd's own thread), plus module buffers and
    whatever the model caches. The activation traces start from a warm step, so they leave it out; a
    run holds it from its first step."""
    host_workers_bytes: float = 0.0
    """Memory of the run's data-loading workers (``--trainer.num_workers``), unique to them (USS, summed), once
    each has made batches: forked from the training process, they share its pages until they write to them."""
    host_lengths: Optional[dict[str, float]] = None
    """The sweep over padded lengths behind ``host_base_bytes`` (CUDA): ``lengths`` the split can produce,
    ``stepped`` of them, ``bytes`` of resident memory they added (scaled up to all of them when fewer
    were stepped). None: not swept (CPU, one length, or an older probe file)."""
    builds_partitioned: Optional[bool] = None
    """The recipe's :meth:`~zerotrain.tasks.base.Task.builds_partitioned`: under ZeRO-3 no host holds the whole
    model (None in older probe files: counted as held)."""
    exports_streamed: Optional[bool] = None
    """Whether the recipe's model exports a shard at a time under ZeRO-3 and FSDP2
    (:func:`~zerotrain.models.hf.exports_streamed`; None in older probe files: counted as gathered whole)."""
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def key(self, checkpointing: bool, sixteen_bit: bool) -> str:
        """The traced variant that stands for a run: the closest one measured."""
        wanted = variant(checkpointing, sixteen_bit)
        for candidate in (wanted, variant(checkpointing, not sixteen_bit), variant(False, sixteen_bit),
                          variant(False, not sixteen_bit)):
            if candidate in self.activations:
                return candidate
        raise KeyError(wanted)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Probe":
        data = dict(data)
        for key in ("activations", "forward_backward_s", "at_first_gradient"):
            data[key] = {k: Linear(**v) for k, v in data.get(key, {}).items()}
        return cls(**data)


def variant(checkpointing: bool, sixteen_bit: bool) -> str:
    """``off``/``on`` (activation checkpointing) under autocast with the weights as built, as plain
    PyTorch and DeepSpeed's ZeRO-0 fast path run; ``off16``/``on16`` with the weights in 16 bits and no
    autocast, as DeepSpeed's bf16/fp16 blocks run (ZeRO-1/2/3). The two store different activations:
    under autocast, layer norms and softmaxes may keep fp32 outputs (torch's do; the MLM's LayerNorm returns bf16
    under bf16 autocast, models.roberta_mlm.LayerNorm)."""
    return ("on" if checkpointing else "off") + ("16" if sixteen_bit else "")


def _rss() -> float:
    import psutil

    return float(psutil.Process().memory_info().rss)


def _item_lengths(task: Task, train: Any) -> Optional[Sequence[int]]:
    """Tokens of every training item; None for fixed shapes. Tasks report lengths only when bucketing is
    on, but a run without it meets the same items."""
    lengths = task.train_lengths(train)
    data = getattr(task.cfg, "data", None)
    if lengths is None and data is not None and hasattr(data, "bucket_by_length"):
        bucketing = copy.deepcopy(task.cfg)
        bucketing.data.bucket_by_length = True
        lengths = task.with_config(bucketing).train_lengths(train)
    return lengths


def _longest_batch(task: Task, train: Any, n: int) -> dict[str, torch.Tensor]:
    """The ``n`` longest training examples, collated: the largest batch a run of this micro-batch meets."""
    lengths = _item_lengths(task, train)
    order = sorted(range(len(train)), key=lambda i: -lengths[i]) if lengths is not None else range(len(train))
    picked = [train[i] for i in list(order)[:n]]
    return task.collator()(picked)


MAX_SWEPT_LENGTHS = 256
"""Padded lengths the host sweep steps at, at most; past it they are sampled evenly and the growth scaled."""


def _padded_length(batch: dict[str, torch.Tensor]) -> int:
    """Tokens a row of ``batch`` has: its ``input_ids``' last dimension (its first tensor's, without them)."""
    ids = batch["input_ids"] if "input_ids" in batch else next(iter(batch.values()))
    return int(ids.shape[-1])


def padded_lengths(task: Task, train: Any) -> dict[int, int]:
    """Every padded length a batch of the training split can have, each with one example that gives it.

    A batch is padded to its longest item (rounded up by the collator), so the lengths a run meets are
    among those of single items, whatever the batching. Empty when the task reports no lengths (fixed
    shapes: packed blocks)."""
    lengths = _item_lengths(task, train)
    if lengths is None:
        return {}
    one_per_length: dict[int, int] = {}
    for i, n in enumerate(lengths):
        one_per_length.setdefault(int(n), i)
    collate = task.collator()
    found: dict[int, int] = {}
    for i in one_per_length.values():
        padded = _padded_length(collate([train[i]]))
        found.setdefault(padded, i)
    return dict(sorted(found.items()))


def _host_length_sweep(task: Task, train: Any, model: nn.Module, device: torch.device,
                       precision: Optional[str]) -> Optional[dict[str, float]]:
    """Step ``model`` (forward and backward, one item) at every padded length of the split, or at
    :data:`MAX_SWEPT_LENGTHS` of them spread evenly; the resident memory this added, scaled to all
    lengths. None when the split has one length or none."""

    found = padded_lengths(task, train)
    if len(found) < 2:
        return None
    picked = list(found.values())
    if len(picked) > MAX_SWEPT_LENGTHS:
        picked = [picked[round(k * (len(picked) - 1) / (MAX_SWEPT_LENGTHS - 1))] for k in range(MAX_SWEPT_LENGTHS)]
    collate = task.collator()
    before = _rss()
    for i in picked:
        batch = to_device(collate([train[i]]), device)
        with _autocast(device, precision):
            loss = task.training_step(model, batch).loss
        loss.backward()
    model.zero_grad(set_to_none=True)
    grown = max(0.0, _rss() - before)
    return {"lengths": float(len(found)), "stepped": float(len(picked)), "bytes": grown * len(found) / len(picked)}


def _workers_bytes(task: Task, train: Any, workers: int, micro_batch_size: int, seed: int) -> float:
    """Unique memory (USS) of ``workers`` data-loading workers, as a run starts them, after each has collated
    two of the split's first micro-batches (PyTorch keeps two in flight per worker). 0 without workers."""
    if workers <= 0 or len(train) == 0:
        return 0.0
    import psutil


    size = max(1, min(micro_batch_size, len(train)))
    batches = [[(k * size + i) % len(train) for i in range(size)] for k in range(2 * workers)]
    before = {c.pid for c in psutil.Process().children()}
    stream = iter(make_loader(train, batches, task.collator(), workers, seed))
    for _ in batches:
        next(stream)
    total = 0.0
    for child in psutil.Process().children():
        if child.pid not in before:
            with contextlib.suppress(psutil.Error):  # a worker may already be gone
                total += child.memory_full_info().uss
    del stream  # stops the workers
    return total


HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _autocast(device: torch.device, precision: Optional[str]):
    dtype = HALF.get(precision or "")
    if dtype is None:
        import contextlib

        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def _peak_activation_bytes(run: Callable[[], None], model: nn.Module, device: torch.device) -> tuple[float, float]:
    """Bytes above what the weights and (already allocated) gradients hold, over one ``run()``: the
    peak, and what is allocated when the first gradient is written (NaN where not measured)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        first: list[int] = []

        def record(_: torch.Tensor) -> None:
            if not first:  # the allocator's count is host-side bookkeeping: no synchronisation
                first.append(torch.cuda.memory_allocated(device))

        hooks = [p.register_post_accumulate_grad_hook(record) for p in model.parameters() if p.requires_grad]
        torch.cuda.reset_peak_memory_stats(device)
        try:
            run()
        finally:
            for hook in hooks:
                hook.remove()
        torch.cuda.synchronize(device)
        at_first = float(first[0] - base) if first else float("nan")
        return float(torch.cuda.max_memory_allocated(device) - base), at_first
    # PyTorch's own tensor-storage accounting (torch.distributed._tools), device-agnostic.
    from torch.distributed._tools.mem_tracker import MemTracker

    if any(not p.requires_grad for p in model.parameters()):
        # MemTracker hooks every parameter of every module it sees run, and a frozen one (LoRA's base)
        # refuses a gradient hook (torch 2.13): not measured on the CPU, and the probe says so.
        run()
        return float("nan"), float("nan")
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        base = tracker.get_tracker_snapshot("current")[device]["Total"]
        run()
        peak = tracker.get_tracker_snapshot("peak")[device]["Total"]
    return float(peak - base), float("nan")


def _held_beyond_model(model: nn.Module, device: torch.device) -> float:
    """CUDA memory allocated beyond ``model``'s weights and gradients after its steps (0 on the CPU)."""
    if device.type != "cuda":
        return 0.0
    tensors = {id(t): t for p in model.parameters() for t in (p, p.grad) if t is not None and t.is_cuda}
    torch.cuda.synchronize(device)
    held = torch.cuda.memory_allocated(device) - sum(t.numel() * t.element_size() for t in tensors.values())
    return float(max(0, held))


def _timed(run: Callable[[], None], device: torch.device, repeats: int = 3) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / repeats


def _trace(task: Task, model: nn.Module, batch_of: Callable[[int], dict[str, torch.Tensor]], max_micro: int,
           device: torch.device, precision: Optional[str]) -> tuple[Linear, Linear, Optional[Linear]]:
    """Activation bytes, forward/backward seconds and the bytes held at the first gradient (None where
    not measured) of ``model``, micro-batch 1, 2, 4, ... until both
    grow with the batch (:data:`LINEAR_REGIME`) or ``max_micro`` is reached; fitted. ``precision``
    None runs without autocast (a model already in 16 bits, as DeepSpeed's bf16/fp16 blocks hold it)."""

    memory: dict[int, float] = {}
    seconds: dict[int, float] = {}
    first: dict[int, float] = {}
    size = 1
    while True:
        batch = to_device(batch_of(size), device)

        def step() -> None:
            with _autocast(device, precision):
                loss = task.training_step(model, batch).loss
            loss.backward()

        try:
            step()  # allocates the gradients (and warms kernels): the baseline then holds them
            memory[size], first[size] = _peak_activation_bytes(step, model, device)
            seconds[size] = _timed(step, device)
        except torch.OutOfMemoryError:
            if not memory:
                raise
            break  # the sizes measured so far are the ones that fit a plain-PyTorch step
        finally:
            del batch
        if memory[size] != memory[size]:  # NaN: not measurable here (see _peak_activation_bytes)
            memory = {1: 0.0}
            break
        half = size // 2
        if size >= max_micro or (half in memory and memory[size] >= LINEAR_REGIME * memory[half]
                                 and seconds[size] >= LINEAR_REGIME * seconds[half]):
            break
        size = min(2 * size, max_micro)
    measured = {b: y for b, y in first.items() if y == y and b in memory}
    return Linear.through(memory), Linear.through(seconds), (Linear.through(measured) if measured else None)


def _optimizer_step_s(model: nn.Module, device: torch.device, lr: float) -> float:
    params = [p for p in model.parameters() if p.requires_grad and p.grad is not None]
    if not params:
        return 0.0
    opt = torch.optim.AdamW(params, lr=lr, **({"fused": True} if device.type == "cuda" else {}))
    opt.step()  # allocates the moments
    return _timed(opt.step, device)


ADAM_SAMPLE = 2**26
"""fp32 elements of the stand-in Adam step timed when the model's own fp32 states do not fit the GPU."""


def _sampled_optimizer_step_s(trainable: int, device: torch.device, lr: float) -> float:
    """One fused fp32 AdamW step over ``trainable`` parameters, timed on a slice and scaled: the step is
    bandwidth-bound, linear in the elements (what ZeRO-1/2's optimizer does to its fp32 partition)."""
    n = max(1, min(trainable, ADAM_SAMPLE))
    weight = torch.zeros(n, device=device, requires_grad=True)
    weight.grad = torch.zeros_like(weight)
    opt = torch.optim.AdamW([weight], lr=lr, **({"fused": True} if device.type == "cuda" else {}))
    opt.step()
    seconds = _timed(opt.step, device)
    del opt, weight
    return seconds * trainable / n


def _fp32_adam_fits(model: nn.Module, room: Optional[float]) -> bool:
    """Whether the model as built, its gradients and two Adam moments fit in ``room`` bytes of the GPU
    with a tenth to spare for activations (``room`` None: on the CPU, where the host is the limit)."""

    if room is None:
        return True
    counts = count_params(model)
    return counts.total_bytes + 3 * counts.trainable_bytes < 0.9 * room


def _h2d_bytes_per_s(device: torch.device, pinned: bool = True) -> Optional[float]:
    if device.type != "cuda":
        return None
    n = 64 * 2**20
    host = torch.empty(n, dtype=torch.uint8, pin_memory=pinned)
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    dev.copy_(host, non_blocking=True)
    return n / _timed(lambda: dev.copy_(host, non_blocking=True), device, repeats=5)


def measure(task: Task, device: torch.device, precision: str, max_micro: int,
            checkpointing: tuple[bool, ...] = (False, True)) -> Probe:
    """Trace ``task``'s model on ``device`` at micro-batches up to ``max_micro`` (see the module
    docstring). ``task.cfg`` is not changed."""

    cfg = copy.deepcopy(task.cfg)
    cfg.precision.dtype = precision  # tasks read it (LoRA loads its base weights in it)
    seed_everything(cfg.trainer.seed)
    gpu_total = context = room = None
    if device.type == "cuda":

        torch.cuda.init()
        free, total = torch.cuda.mem_get_info(device)
        gpu_total, context = float(total), float(total - free)
        cap = cap_gpu_memory(device, cfg.trainer.gpu_memory_gib)
        if cap is not None:  # --trainer.gpu_memory_gib bounds the caching allocator; the context is outside it,
            # unless other processes leave less than the cap free
            gpu_total, context = cap, max(0.0, cap - float(free))
        room = min(float(free), gpu_total)
    import deepspeed  # noqa: F401  (its libraries are part of every DeepSpeed run's host memory)

    splits = task.with_config(cfg).build_datasets()
    host_base = before_model = _rss()  # on CUDA, measured again once a step has loaded its kernels (below)
    cache: dict[int, dict[str, torch.Tensor]] = {}

    def batch_of(n: int) -> dict[str, torch.Tensor]:
        if n not in cache:
            cache[n] = _longest_batch(task.with_config(cfg), splits.train, n)
        return cache[n]

    seq_len = _padded_length(batch_of(1))
    activations, seconds, at_first, notes, opt_s = {}, {}, {}, [], 0.0
    half = HALF.get(precision)

    workspace = 0.0
    swept: Optional[dict[str, float]] = None
    shape: Optional[TransformerShape] = None

    def trace(key: str, model: nn.Module, autocast_precision: Optional[str]) -> None:
        nonlocal workspace, swept
        activations[key], seconds[key], first = _trace(variant_task, model, batch_of, max_micro, device,
                                                       autocast_precision)
        if first is not None:
            at_first[key] = first
        workspace = max(workspace, _held_beyond_model(model, device))
        if device.type == "cuda" and swept is None:
            try:
                swept = _host_length_sweep(variant_task, splits.train, model, device, autocast_precision) or {}
            except torch.OutOfMemoryError:  # one item at a length the trace met already: not expected; no sweep
                model.zero_grad(set_to_none=True)
                swept = {}
                notes.append("host: the sweep over padded lengths ran out of GPU memory; the host figure is a "
                             "first step's")

    for ckpt in checkpointing:
        variant_cfg = copy.deepcopy(cfg)
        variant_cfg.activation_checkpointing.enabled = ckpt
        variant_task = task.with_config(variant_cfg)  # one clone builds and steps: a task may keep facts of its model
        model = variant_task.build_model()
        streamed = hf.exports_streamed(model)
        model.train()
        # A model whose fp32 weights and Adam states do not fit is traced only as DeepSpeed's bf16/fp16
        # blocks hold it (16-bit weights, the fp32 states partitioned or offloaded), built on the CPU.
        whole = half is None or _fp32_adam_fits(model, room)
        if whole:
            try:
                model.to(device)
                trace(variant(ckpt, False), model, precision)
                if not ckpt or not opt_s:
                    opt_s = _optimizer_step_s(model, device, cfg.optimizer.lr)
            except torch.OutOfMemoryError:
                if half is None:
                    raise
                # The weights fit but one sample's step with fp32 weights does not: trace the 16-bit
                # model only (below), from the CPU, so that the conversion needs no room on the GPU.
                whole = False
                model.zero_grad(set_to_none=True)
                model.to("cpu")
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            model.zero_grad(set_to_none=True)
        if half is not None:  # the same model as DeepSpeed's bf16/fp16 blocks hold it
            model.to(half).to(device)
            trace(variant(ckpt, True), model, None)
            if not whole and not opt_s:
                model.zero_grad(set_to_none=True)  # room for the stand-in step's fp32 tensors
                trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
                opt_s = _sampled_optimizer_step_s(trainable, device, cfg.optimizer.lr)
                only16 = "" if variant(ckpt, False) in activations else "traced with 16-bit weights only; "
                notes.append(f"fp32 weights with Adam do not fit this GPU: {only16}the Adam step timed on a "
                             "slice and scaled")
        shape = shape or variant_task.transformer_shape(model)
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if device.type == "cuda" and not ckpt:
            # Libraries, data and the CUDA kernels a step loads (cuBLAS and the like: hundreds of MB),
            # without the model. On the CPU the freed activations stay in the process (the C
            # allocator keeps them), so there the figure before the model is the one that holds.
            # A run's process group sets up its communicator at the first collective (NCCL's host
            # buffers and code: part of every run's steady state); the probe's group of one does it here.
            if torch.distributed.is_initialized():
                torch.distributed.all_reduce(torch.zeros(1, device=device))
            host_base = _rss()
            if swept:
                # the lengths not stepped, at the rate of those that were
                host_base += swept["bytes"] * (1 - swept["stepped"] / swept["lengths"])
                notes.append(f"host: stepped at {swept['stepped']:.0f} of {swept['lengths']:.0f} padded lengths, "
                             f"+{swept['bytes'] / 2**30:.2f} GiB resident")
    workers = _workers_bytes(task.with_config(cfg), splits.train, cfg.trainer.num_workers, cfg.trainer.micro_batch_size,
                             cfg.trainer.seed)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    method = "cuda allocator" if device.type == "cuda" else "torch MemTracker"
    if all(fit.floor == 0 and fit.per_sample == 0 for fit in activations.values()):
        if shape is None:
            notes.append("activations not measured: PyTorch's MemTracker cannot trace frozen parameters on the CPU")
        else:
            # Every term of the formula grows with the micro-batch: a line through zero.
            activations = {key: Linear(0.0, activation_bytes(dataclasses.replace(shape, seq_len=seq_len), 1,
                                                             2 if key.endswith("16") or half else 4,
                                                             key.startswith("on")).peak_bytes)
                           for key in activations}
            method = f"modelled from the model's config ({method} cannot measure this model)"
            notes.append("activations modelled from the config: PyTorch's MemTracker cannot trace frozen parameters "
                         "on the CPU")
    return Probe(device=device.type, device_name=name, precision=precision, method=method, seq_len=seq_len,
                 activations=activations, forward_backward_s=seconds, at_first_gradient=at_first, optimizer_step_s=opt_s,
                 host_base_bytes=host_base, host_before_model_bytes=before_model, gpu_total_bytes=gpu_total,
                 gpu_context_bytes=context,
                 h2d_bytes_per_s=_h2d_bytes_per_s(device),
                 h2d_pageable_bytes_per_s=_h2d_bytes_per_s(device, pinned=False), kernel_workspace_bytes=workspace,
                 host_lengths=swept or None, host_workers_bytes=workers,
                 builds_partitioned=task.with_config(cfg).builds_partitioned(), exports_streamed=streamed,
                 notes=notes)


def run_probe(recipe: str, fit_args: list[str], out: Path, max_micro: int, timeout_s: int = 1800,
              checkpointing: bool = True) -> Probe:
    """:func:`measure` in a fresh process (``python -m zerotrain.plan.probe``); raises UserError with its last line.
    ``checkpointing`` False traces without activation checkpointing only (half the time)."""
    import subprocess
    import sys


    cmd = [sys.executable, "-m", "zerotrain.plan.probe", recipe, "--out", str(out), "--max_micro", str(max_micro),
           *([] if checkpointing else ["--no_checkpointing"]), *fit_args]
    # The probe is one process on its own: a launcher's variables (torchrun's, SLURM's) inherited from
    # the caller would make its group of one wait for ranks that never come.
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=environment_alone())
    except subprocess.TimeoutExpired:
        raise UserError(f"the memory probe of {recipe} did not finish within {timeout_s} s") from None
    if proc.returncode != 0 or not out.is_file():
        lines = [line for line in (proc.stderr or proc.stdout).splitlines() if line.strip()]
        ours = [line for line in lines if line.startswith("zerotrain")]
        raise UserError(f"the memory probe of {recipe} failed: {(ours or lines or ['no output'])[-1][:300]}")
    return Probe.from_dict(json.loads(out.read_text()))


def main(argv: Optional[list[str]] = None) -> int:
    import sys


    parser = argparse.ArgumentParser(prog="python -m zerotrain.plan.probe")
    parser.add_argument("recipe")
    parser.add_argument("--out", required=True)
    parser.add_argument("--no_checkpointing", action="store_true", help="trace without activation checkpointing only")
    parser.add_argument("--max_micro", type=int, default=None, help="largest micro-batch to trace (default: the config's)")
    args, fit_args = parser.parse_known_args(argv)
    try:
        cfg = parse_config(args.recipe, fit_args)
        want = cfg.trainer.device
        device = torch.device("cuda" if want != "cpu" and torch.cuda.is_available() else "cpu")
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        precision = resolve_precision(cfg.precision.dtype, device.type, bf16)
        ckpt = (False,) if args.no_checkpointing else (False, True)
        max_micro = args.max_micro or cfg.trainer.micro_batch_size
        # In a process group of one, as a run of one process is: its communicator is part of the host memory.
        with distributed.setup(cfg):
            probe = measure(recipes.get(args.recipe)(cfg), device, precision, max_micro, ckpt)
    except UserError as exc:
        print(f"zerotrain probe: error: {exc}", file=sys.stderr)
        return 2
    except torch.OutOfMemoryError:
        print("zerotrain probe: error: a step of one sample does not fit this GPU even with 16-bit weights and "
              "gradients: the probe cannot measure this model here. Train with --strategy.zero_stage 3 "
              "--strategy.offload_optimizer cpu --strategy.offload_param cpu, or more GPUs", file=sys.stderr)
        return 2
    write_json(Path(args.out), probe.to_dict())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
