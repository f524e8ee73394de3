"""What ``zerotrain estimate`` computes: a recipe's model-state memory under every strategy, and the pick.

The recipe's model is built on PyTorch's meta device (no memory, no weights read: ``build_model(
pretrained=False)``), its parameters are counted, and :func:`zerotrain.plan.memory.plan` sizes every
strategy for the GPUs of the config (``launch.nproc_per_node`` per host x ``launch.nnodes``).
Activations: with a :class:`~zerotrain.plan.probe.Probe` (``zerotrain estimate --measure``) they are
measured on this machine and added (:func:`zerotrain.plan.memory.predict`, at the config's micro-batch
and activation checkpointing); without one, a recipe that reports its transformer's shape
(:meth:`~zerotrain.tasks.base.Task.transformer_shape`) gets them from :mod:`zerotrain.plan.activations`, and
:func:`estimate` keeps ``reserve_gib`` of each GPU for the rest (all of the activations for other recipes).
The pick is the first strategy that fits in a fixed order; ``zerotrain plan`` finds the fastest.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch

from zerotrain.config import RunConfig
from zerotrain.config.ds_config import _enabled, make_ds_config
from zerotrain.engines.states import (
    Buckets,
    ParamCounts,
    count_params,
    full_numel,
    model_state_memory,
    optimizer_states,
)
from zerotrain.errors import ConfigError
from zerotrain.plan.memory import (
    GIB,
    PROCESS_HOST_BYTES,
    MemoryPrediction,
    PlanRow,
    fits,
    gpu_memory_bytes,
    plan,
    predict,
    step_peak,
)
from zerotrain.plan.activations import Activations, activation_bytes
from zerotrain.plan.strategies import HOST_SHARES, STRATEGIES, Strategy, available, may_share_optimizer
from zerotrain.tasks import registry as recipes

if TYPE_CHECKING:
    from zerotrain.plan.probe import Probe


@dataclass(frozen=True)
class EstimateReport:
    recipe: str
    counts: ParamCounts
    precision: str
    """The precision the model states are sized in: the probe's, or ``auto`` resolved to bf16 without one."""
    world_size: int
    gpu_bytes: Optional[float]
    """Memory of one GPU; None when unknown (no GPU here and none given)."""
    host_bytes: float
    reserve_bytes: float
    rows: list[PlanRow]
    """Every strategy in :data:`~zerotrain.plan.strategies.STRATEGIES` order, with its memory and whether it fits."""
    predictions: Optional[dict[str, MemoryPrediction]] = None
    """With a probe: each strategy's peak GPU and host memory, activations included."""
    micro_batch_size: int = 0
    activation_checkpointing: bool = False
    configured: dict[str, Strategy] = field(default_factory=dict)
    """Rows beyond :data:`~zerotrain.plan.strategies.STRATEGIES`: the configured NVMe offload, by row name."""
    unpinned: Optional[PlanRow] = None
    """When nothing fits with the offloads pinned (the default on GPUs): the first that fits unpinned."""
    shared: list[tuple[float, bool, PlanRow]] = field(default_factory=list)
    """When nothing fits pinned: each share of ZeRO-3's offloaded optimizer on the host
    (``--strategy.offload_optimizer_ratio``, :data:`~zerotrain.plan.strategies.HOST_SHARES`) at which it fits, with
    whether unpinned, and its row."""
    modelled: Optional[Activations] = None
    """Without a probe, for a recipe that reports its transformer's shape: the activations its config implies."""
    modelled_gpu_bytes: Optional[dict[str, float]] = None
    """With ``modelled``: each strategy's peak GPU bytes, its states and those activations (judged to fit with them)."""
    nvme_path: Optional[str] = None
    """``--strategy.nvme_path``: the disk NVMe offload puts the states on; None when not given."""
    disk_free_bytes: float = math.inf
    """Free bytes on the disk of ``nvme_path``."""

    @property
    def pick(self) -> Optional[str]:
        """The first (fastest) strategy that fits; None when nothing fits or the GPU memory is unknown."""
        if self.gpu_bytes is None:
            return None
        return next((row.name for row in self.rows if row.fits), None)


def _check_gib(flag: str, value: Optional[float], minimum_exclusive: bool) -> None:
    if value is None:
        return
    ok = math.isfinite(value) and (value > 0 if minimum_exclusive else value >= 0)
    if not ok:
        raise ConfigError(flag, f"must be a number {'>' if minimum_exclusive else '>='} 0 (GiB), got {value:g}")


def estimate(recipe: str, cfg: RunConfig, gpu_memory_gib: Optional[float] = None,
             host_memory_gib: Optional[float] = None, reserve_gib: float = 0.0,
             probe: Optional["Probe"] = None, *, search_shares: bool = True) -> EstimateReport:
    """Size ``recipe``'s model states under every strategy for the run ``cfg`` describes.

    Where nothing fits, the report also says what fits unpinned, and with ``search_shares`` (off in the re-estimates
    made for either) at which shares of ZeRO-3's offloaded optimizer on the host (``EstimateReport.shared``): pinned
    copies and a smaller host Adam may beat pageable copies of the whole optimizer, so both are reported.

    ``gpu_memory_gib`` defaults to GPU 0's memory (None without a GPU: nothing is judged to fit or
    not), ``host_memory_gib`` to this host's. ``cfg`` is not changed. Raises
    :class:`~zerotrain.errors.ConfigError` naming the flag for a non-positive memory size or an
    invalid config.
    """
    import psutil


    _check_gib("--gpu_memory_gib", gpu_memory_gib, minimum_exclusive=True)
    _check_gib("--host_memory_gib", host_memory_gib, minimum_exclusive=True)
    _check_gib("--reserve_gib", reserve_gib, minimum_exclusive=False)
    cfg = copy.deepcopy(cfg)
    if cfg.trainer.max_steps is None and cfg.trainer.epochs is None:
        cfg.trainer.max_steps = 1  # the run's length does not change its memory; validate() needs one
    cfg.validate()
    per_node = cfg.launch.nproc_per_node
    world = per_node * cfg.launch.nnodes
    if probe is not None:
        cfg.precision.dtype = probe.precision  # what the run resolves to on the probed device (fp32 on a CPU)
    elif cfg.precision.dtype == "auto":
        cfg.precision.dtype = "bf16"  # what auto resolves to on any GPU since Ampere; the model is built in it
    precision = cfg.precision.dtype
    device = probe.device if probe is not None else "cuda"
    task = recipes.get(recipe)(cfg)
    with torch.device("meta"):
        model = task.build_model(pretrained=False)
    # Each strategy's DeepSpeed JSON as its run would get it (from the flags, or from
    # --strategy.deepspeed_config): its bucket sizes, NVMe swap buffers (sized by the largest parameter, as the
    # run sizes them), and whether it keeps fp32 weights under autocast.
    facts = {"largest_param_numel": max(full_numel(p) for p in model.parameters())}
    own = make_ds_config(cfg, world, device, precision, facts)  # type: ignore[arg-type]
    ds_jsons = {}
    candidates = available(cfg)
    for name, strategy in candidates.items():
        if strategy.backend != "deepspeed":
            continue
        try:
            ds_jsons[name] = make_ds_config(strategy.apply(cfg), world, device, precision, facts)  # type: ignore[arg-type]
        except ConfigError:
            # A user's JSON can pin what this strategy would change (e.g. "stage": "auto" next to an
            # offload that only stages 1-3 take): the row is sized from the JSON the run would get.
            ds_jsons[name] = own
    buckets = {name: Buckets.from_ds_config(ds) for name, ds in ds_jsons.items()}
    buckets.update({name: Buckets.for_fsdp2(cfg, device) for name, st in candidates.items() if st.backend == "fsdp2"})
    # The optimizer's states per parameter: --optimizer.name's, or the optimizer block of a user's DeepSpeed file
    states = optimizer_states(cfg.optimizer, own)
    autocast = {name: _enabled(ds.get("torch_autocast")) for name, ds in ds_jsons.items()}

    counts = count_params(model)
    shape = task.transformer_shape(model) if probe is None else None
    modelled = None
    if shape is not None:
        element = 2 if precision in ("bf16", "fp16") else 4
        modelled = activation_bytes(shape, cfg.trainer.micro_batch_size, element, cfg.activation_checkpointing.enabled)

    gpu = gpu_memory_gib * GIB if gpu_memory_gib is not None else gpu_memory_bytes()
    host = host_memory_gib * GIB if host_memory_gib is not None else float(psutil.virtual_memory().total)
    strategies = dict(candidates)
    s = cfg.strategy
    disk = _free_disk(s.nvme_path) if s.nvme_path else math.inf
    yours = Strategy(s.backend, s.zero_stage, s.offload_optimizer, s.offload_param, s.reshard_after_forward)
    if "nvme" in (s.offload_optimizer, s.offload_param) and yours not in strategies.values():
        # An NVMe offload other than the candidates' (e.g. the optimizer on NVMe, the weights on the host): the
        # row of the configured strategy, with what it puts on that disk.
        name = f"yours: zero{s.zero_stage} nvme"
        strategies[name] = yours
        buckets[name], autocast[name] = Buckets.from_ds_config(own), _enabled(own.get("torch_autocast"))
    rows = plan(counts, world, precision, gpu if gpu is not None else float("inf"), host,
                procs_per_host=per_node, reserve_bytes=reserve_gib * GIB, buckets=buckets, autocast=autocast,
                grad_accum=cfg.strategy.gradient_accumulation_steps, strategies=strategies, disk_bytes=disk,
                optimizer_states=states, process_bytes=PROCESS_HOST_BYTES if probe is None else 0.0)
    predictions = None
    if probe is not None:
        predictions, judged = {}, []
        for row in rows:
            pred = predict(counts, strategies[row.name], cfg.trainer.micro_batch_size,
                           cfg.activation_checkpointing.enabled, world, precision, probe,
                           buckets.get(row.name, Buckets()), autocast.get(row.name, False),
                           cfg.strategy.gradient_accumulation_steps, export=cfg.trainer.export,
                           optimizer_states=states)
            predictions[row.name] = pred
            ok = fits(pred, probe, host, per_node) is None and row.memory.nvme_bytes * per_node <= disk
            judged.append(PlanRow(row.name, row.memory, ok))
        rows = judged
    modelled_gpu = None
    if modelled is not None:
        # The activations the config implies, added to each strategy's states at a step's largest moment.
        modelled_gpu, judged = {}, []
        limit = (gpu if gpu is not None else math.inf) - reserve_gib * GIB
        for row in rows:
            held = model_state_memory(counts, strategies[row.name], world, precision,
                                      buckets.get(row.name, Buckets()), autocast.get(row.name, False),
                                      cfg.strategy.gradient_accumulation_steps, optimizer_states=states)
            peak = step_peak(held, modelled.peak_bytes, modelled.peak_bytes, cfg.strategy.gradient_accumulation_steps)
            modelled_gpu[row.name] = peak
            judged.append(PlanRow(row.name, row.memory, row.fits and peak <= limit))
        rows = judged
    alternative = None
    pin = s.offload_pin_memory  # as configured: the unpinned re-estimate below changes it
    # Pinned blocks round up to powers of two: unpinned may fit. (A user's DeepSpeed file decides its own pinning.)
    if (gpu is not None and device == "cuda" and s.offload_pin_memory is None and not s.deepspeed_config
            and not any(r.fits for r in rows)):
        cfg.strategy.offload_pin_memory = False
        unpinned = estimate(recipe, cfg, gpu / GIB, host / GIB, reserve_gib, probe, search_shares=False)
        alternative = next((row for row in unpinned.rows if row.fits), None)
    shared: list[tuple[float, bool, PlanRow]] = []
    if (search_shares and gpu is not None and device == "cuda"
            and not any(r.fits for r in rows) and may_share_optimizer(cfg) and "zero3_offload_optimizer" in candidates):
        split, seen = STRATEGIES["zero3_offload_optimizer"].apply(cfg), set()
        split.strategy.offload_pin_memory = pin
        for share in HOST_SHARES:
            split.strategy.offload_optimizer_ratio = share
            report = estimate(recipe, split, gpu / GIB, host / GIB, reserve_gib, probe, search_shares=False)
            row = next(row for row in report.rows if row.name == "zero3_offload_optimizer")
            loose = report.unpinned if report.unpinned and report.unpinned.name == row.name else None
            fitting = row if row.fits else loose
            # Shares that keep the same sub-groups on the GPU are one layout: the highest names it
            if fitting is not None and (fitting.memory.gpu_bytes, fitting.memory.cpu_bytes) not in seen:
                seen.add((fitting.memory.gpu_bytes, fitting.memory.cpu_bytes))
                shared.append((share, not row.fits, fitting))
    return EstimateReport(recipe=recipe, counts=counts, precision=precision, world_size=world, gpu_bytes=gpu,
                          host_bytes=host, reserve_bytes=reserve_gib * GIB, rows=rows, predictions=predictions,
                          micro_batch_size=cfg.trainer.micro_batch_size,
                          activation_checkpointing=cfg.activation_checkpointing.enabled,
                          configured={k: v for k, v in strategies.items() if k not in STRATEGIES},
                          unpinned=alternative, shared=shared, modelled=modelled, modelled_gpu_bytes=modelled_gpu,
                          nvme_path=s.nvme_path, disk_free_bytes=disk)


def _free_disk(folder: Optional[str]) -> float:
    """Free bytes on the disk of ``folder`` (its nearest existing parent: DeepSpeed creates it)."""
    import shutil

    path = Path(folder or ".").resolve()
    while not path.exists():
        path = path.parent
    return float(shutil.disk_usage(path).free)


def format_report(report: EstimateReport) -> str:
    """The report as ``zerotrain estimate`` prints it: a header, a Markdown table and the pick."""
    c, gpu = report.counts, report.gpu_bytes
    lines = [
        f"{report.recipe}: {c.total:,} parameters, {c.trainable:,} trainable, largest layer {c.largest_layer:,}; "
        f"{report.precision}, {report.world_size} GPU(s)",
        f"{gpu / GIB:.1f} GiB per GPU" if gpu is not None else "GPU memory unknown (no GPU here: pass --gpu_memory_gib)",
    ]
    lines[-1] += f", {report.host_bytes / GIB:.1f} GiB host memory, {report.reserve_bytes / GIB:g} GiB reserved for activations"
    preds = report.predictions
    modelled = report.modelled_gpu_bytes
    extra = (" peak GPU with activations (GiB) | peak host (GiB) |" if preds
             else " peak GPU with activations (GiB) |" if modelled else "")
    nvme = any(row.memory.nvme_bytes for row in report.rows)
    disk = " on NVMe per process (GiB) |" if nvme else ""
    lines += ["", f"| strategy | model states per GPU (GiB) | offloaded per process (GiB) |{disk}{extra} fits |",
              "|---|---|---|" + ("---|" if nvme else "") + ("---|---|" if preds else "---|" if modelled else "") + "---|"]
    for row in report.rows:
        ok = ("yes" if row.fits else "no") if gpu is not None else "?"
        cells = f" {row.memory.nvme_bytes / GIB:.2f} |" if nvme else ""
        if preds:
            cells += f" {preds[row.name].gpu_bytes / GIB:.2f} | {preds[row.name].host_bytes / GIB:.2f} |"
        elif modelled:
            cells += f" {modelled[row.name] / GIB:.2f} |"
        lines.append(f"| {row.name} | {row.memory.gpu_bytes / GIB:.2f} | {row.memory.cpu_bytes / GIB:.2f} |{cells} {ok} |")
    if preds:
        first = next(iter(preds.values()))
        lines += ["", f"Activations at micro-batch {report.micro_batch_size}"
                  f"{' with activation checkpointing' if report.activation_checkpointing else ''}: "
                  f"{first.activation_bytes / GIB:.2f} GiB, {first.activations}."]
        if first.workers_bytes:
            lines[-1] += (f" Data-loading workers: {first.workers_bytes / GIB:.2f} GiB per process beside the peak host "
                          "figure (measured), counted when judging what fits.")
    elif report.modelled is not None:
        act = report.modelled
        lines += ["", f"Activations at micro-batch {report.micro_batch_size}"
                  f"{' with activation checkpointing' if report.activation_checkpointing else ''}: "
                  f"{act.peak_bytes / GIB:.2f} GiB, {act.describe()} (--measure measures them on this machine). "
                  "The CUDA context and the allocator's slack come on top: keep room with --reserve_gib."]
    else:
        lines += ["", "Model states only (weights, gradients, optimizer, DeepSpeed's reduce bucket, FSDP2's gathered "
                  "blocks); activations come "
                  "on top (--measure measures them on this machine)."]
    if nvme:
        lines.append(f"NVMe: {report.disk_free_bytes / GIB:.1f} GiB free on the disk of {report.nvme_path} "
                     "(--strategy.nvme_path); a row fits only where its NVMe column times the processes of a host "
                     "fits there.")
    if gpu is None:
        return "\n".join(lines)
    pick = report.pick
    if pick is None and report.unpinned is not None:
        alt = report.unpinned
        lines.append(f"Nothing fits pinned. Unpinned, {alt.name} fits ({alt.memory.cpu_bytes / GIB:.2f} GiB on the host, "
                     f"per process, slower host-GPU copies)   ->   zerotrain fit {report.recipe} ... "
                     f"{' '.join({**STRATEGIES, **report.configured}[alt.name].flags())} --strategy.offload_pin_memory false")
    if pick is None and report.shared:
        # The most on the host leaves the GPU the most room (the allocator's slack, a longer batch); less steps faster
        share, loose, row = report.shared[0]
        shares = [f"{s:g}" for s, _, _ in report.shared]
        unpin = " --strategy.offload_pin_memory false" if loose else ""
        opening = ("Or, with part of the optimizer on the GPU (zerotrain plan measures which is faster), "
                   if report.unpinned is not None else
                   "Nothing fits with the optimizer all on the host. With part of it on the GPU, ")
        lines.append(f"{opening}zero3_offload_optimizer"
                     f" fits at --strategy.offload_optimizer_ratio {', '.join(shares)} (its share on the host; the "
                     f"highest leaves the GPU the most room, a lower one steps faster). At {share:g}: "
                     f"{row.memory.gpu_bytes / GIB:.2f} GiB of states per GPU, {row.memory.cpu_bytes / GIB:.2f} GiB on "
                     f"the host per process   ->   zerotrain fit {report.recipe} ... "
                     f"{' '.join(STRATEGIES['zero3_offload_optimizer'].flags())} --strategy.offload_optimizer_ratio "
                     f"{share:g}{unpin}")
    if pick is None and report.unpinned is None and not report.shared:
        disk = ("" if report.nvme_path else "put the weights and optimizer states on a fast local disk "
                "(--strategy.nvme_path DIR adds the zero3_nvme row), ")
        lines.append(f"Nothing fits: {disk}add GPUs (--launch.nproc_per_node, --launch.nnodes), train fewer parameters "
                     "(the lora recipe), or lower --reserve_gib.")
    if pick is not None:
        lines.append(f"Pick: {pick}   ->   zerotrain fit {report.recipe} ... {' '.join({**STRATEGIES, **report.configured}[pick].flags())}")
        lines.append(f"The first that fits, not the fastest: zerotrain plan {report.recipe} ... measures and tries them")
    return "\n".join(lines)
