"""``zerotrain plan``: the fastest configuration that fits, predicted and then confirmed by short trials.

1. **Probe** (:mod:`zerotrain.plan.probe`, its own process): activation memory and step time of the real
   model on its longest batches, on this device.
2. **Candidates**: every backend/ZeRO stage/offload (:func:`~zerotrain.plan.strategies.available`: ZeRO-3's
   parameter offload too, NVMe offload with ``--strategy.nvme_path``, and FSDP2 with and without resharding
   after the forward pass and with CPU offload, so the trials compare the two families) x
   micro-batch (powers of two dividing the per-rank batch; accumulation keeps the global batch) x
   activation checkpointing, for the GPUs the launch flags name. Precision, global batch, optimizer
   and everything else stay as configured. When nothing fits, the offloads again with their host states
   unpinned (``--strategy.offload_pin_memory false``), which can halve their host memory, and ZeRO-3's
   optimizer offload with part of the optimizer on the GPU (``--strategy.offload_optimizer_ratio``).
3. **Memory model** (:func:`zerotrain.plan.memory.predict`) drops what does not fit; the **speed model**
   (:mod:`zerotrain.plan.speed`) ranks the rest.
4. **Trials**: the best few (``trials``, at most two per strategy) run as short ``zerotrain fit``
   processes, each its own process so an out-of-memory is a recorded row, not the end of the plan.
   The fastest measured wins.

Files in the plan folder: ``plan.json`` (probe, every candidate with predicted memory, predicted
and measured speed, why dropped; the choice), ``plan.md`` (the table), ``plan.yaml`` (the whole
zerotrain config with the choice: ``zerotrain fit RECIPE --config plan.yaml``) and ``ds_config.json``
(the fastest DeepSpeed candidate as a JSON the Hugging Face Trainer and Lightning accept, see
:func:`zerotrain.config.ds_config.portable_ds_config`).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from zerotrain import __version__
from zerotrain.checkpoint.manager import estimate_bytes
from zerotrain.config import RunConfig
from zerotrain.config.ds_config import (
    _enabled,
    hf_training_arguments,
    lightning_trainer_arguments,
    make_ds_config,
    portable_ds_config,
)
from zerotrain.engines.states import Buckets, count_params, optimizer_on_host, optimizer_states
from zerotrain.errors import ConfigError, UserError
from zerotrain.metrics.tracking import log
from zerotrain.plan.benchmark import run_one
from zerotrain.plan.memory import GIB, MemoryPrediction, fits, predict
from zerotrain.plan.probe import Probe, run_probe
from zerotrain.plan.speed import StepTime, step_time
from zerotrain.plan.strategies import HOST_SHARES, STRATEGIES, available, may_share_optimizer
from zerotrain.runtime.rundir import commit, environment, write_json
from zerotrain.tasks import registry as recipes

TRIAL_FLAGS = ["--trainer.evaluate", "false", "--trainer.export", "false", "--checkpoint.save_final", "false",
               "--checkpoint.resume", "null",
               "--checkpoint.every_steps", "0", "--logging.tensorboard", "false", "--logging.progress_bar", "false",
               "--scheduler.warmup_steps", "0", "--strategy.auto", "false"]
"""What makes a fit a trial: train only, write nothing but the run folder's logs and summary."""

MAX_TRIAL_STEPS = 200
"""At most this many measured steps per trial, whatever the predicted step time."""

SHOWN_UNTRIED = 6
"""Candidates that fit but were not trialled, shown in plan.md below the trials."""


@dataclass(frozen=True)
class Candidate:
    strategy: str
    """A key of :data:`~zerotrain.plan.strategies.STRATEGIES`."""
    micro_batch_size: int
    grad_accum: int
    checkpointing: bool
    unpinned: bool = False
    """An offload whose host states are not pinned (``--strategy.offload_pin_memory false``): tried only when
    no pinned candidate fits, as pinned copies are faster but pinned blocks round up to powers of two."""
    host_share: float = 1.0
    """ZeRO-3's optimizer offload with only this share on the host, the rest on the GPU
    (``--strategy.offload_optimizer_ratio``): tried only when nothing fits pinned with all of it on the host."""

    def flags(self) -> list[str]:
        return [*STRATEGIES[self.strategy].flags(), "--trainer.micro_batch_size", str(self.micro_batch_size),
                "--strategy.gradient_accumulation_steps", str(self.grad_accum),
                "--activation_checkpointing.enabled", str(self.checkpointing).lower(),
                *(["--strategy.offload_pin_memory", "false"] if self.unpinned else []),
                *(["--strategy.offload_optimizer_ratio", f"{self.host_share:g}"] if self.host_share < 1 else [])]

    @property
    def label(self) -> str:
        return (f"{self.strategy} micro {self.micro_batch_size} x {self.grad_accum}"
                + (" +ckpt" if self.checkpointing else "") + (" unpinned" if self.unpinned else "")
                + (f" host share {self.host_share:g}" if self.host_share < 1 else ""))

    def apply(self, cfg: RunConfig) -> RunConfig:
        """A copy of ``cfg`` set to this candidate."""
        cfg = STRATEGIES[self.strategy].apply(cfg)
        s = cfg.strategy
        s.gradient_accumulation_steps, cfg.activation_checkpointing.enabled = self.grad_accum, self.checkpointing
        s.auto = False
        if self.unpinned:
            s.offload_pin_memory = False
        if self.host_share < 1:
            s.offload_optimizer_ratio = self.host_share
        cfg.trainer.micro_batch_size = self.micro_batch_size
        return cfg


@dataclass
class Row:
    candidate: Candidate
    memory: MemoryPrediction
    time: StepTime
    dropped: Optional[str] = None
    """Why the candidate is out (memory, or a trial that failed); None while it is in."""
    offload_optimizer_ratio: float = 1.0
    """``--strategy.offload_optimizer_ratio`` as the candidate runs it: its own share, else the config's."""
    optimizer_on_host: float = 1.0
    """The fraction of the offloaded optimizer that stays on the host: whole sub-groups go to the GPU, so it differs
    from the ratio."""
    measured: dict[str, Any] = field(default_factory=dict)
    """The trial's figures: status, tokens_per_s, samples_per_s, peak_gpu_mem_gib, peak_host_mem_gib."""

    def to_dict(self, global_batch: int) -> dict[str, Any]:
        return {"candidate": self.candidate.label, "strategy": self.candidate.strategy,
                "family": STRATEGIES[self.candidate.strategy].family,
                "micro_batch_size": self.candidate.micro_batch_size, "grad_accum": self.candidate.grad_accum,
                "activation_checkpointing": self.candidate.checkpointing,
                "offload_pin_memory": False if self.candidate.unpinned else None,
                "offload_optimizer_ratio": self.offload_optimizer_ratio, "optimizer_on_host": self.optimizer_on_host,
                **self.memory.as_row(),
                "predicted_step_s": self.time.total, "predicted_samples_per_s": global_batch / self.time.total,
                "predicted_step_parts_s": {"compute": self.time.compute, "optimizer": self.time.optimizer,
                                           "communication": self.time.communication,
                                           "engine_overhead": self.time.engine_overhead},
                "dropped": self.dropped, "measured": self.measured or None}


@dataclass
class Plan:
    recipe: str
    world_size: int
    global_batch: int
    probe: Probe
    rows: list[Row]
    trialled: list[Row]
    choice: Row
    planned: Optional[Row]
    """The fastest of the trials the planner itself chose (the top of its ranking; None when all of
    them failed); ``choice`` is the fastest of every trial run, which differs only with ``compare_strategies``."""
    out_dir: Path


def _world(cfg: RunConfig) -> int:
    return cfg.launch.nproc_per_node * cfg.launch.nnodes


def candidates(cfg: RunConfig, device: str, strategies: Optional[list[str]] = None,
               checkpointing: bool = True, precision: Optional[str] = None) -> list[Candidate]:
    """Every configuration the planner considers for ``cfg``'s global batch (module docstring); ``precision``:
    what the probe resolved ``--precision.dtype`` to."""
    per_rank = cfg.trainer.micro_batch_size * cfg.strategy.gradient_accumulation_steps
    micros = sorted({m for m in (2**i for i in range(per_rank.bit_length())) if per_rank % m == 0} | {per_rank})
    if cfg.compile.enabled and cfg.compile.mode == "reduce-overhead":
        micros = [per_rank]  # CUDA graphs cannot accumulate gradients (config.check_across_sections)
    names = strategies or list(available(cfg, device, precision))  # offload needs a GPU to offload from, NVMe a path
    return [Candidate(name, m, per_rank // m, ckpt) for name in names for m in micros
            for ckpt in ((False, True) if checkpointing else (False,))]


def unpinned(cands: list[Candidate], cfg: RunConfig) -> list[Candidate]:
    """The offload candidates again with unpinned host states, unless the config pins or unpins them itself."""
    if cfg.strategy.offload_pin_memory is not None:
        return []
    return [dataclasses.replace(c, unpinned=True) for c in cands if STRATEGIES[c.strategy].offload_optimizer == "cpu"]


def shared(cands: list[Candidate], cfg: RunConfig) -> list[Candidate]:
    """ZeRO-3's optimizer-offload candidates again at each :data:`HOST_SHARES` of the optimizer on the host (the rest
    on the GPU), pinned and unpinned as :func:`unpinned` allows, where :func:`may_share_optimizer`."""
    if not may_share_optimizer(cfg):
        return []
    base = [c for c in cands if c.strategy == "zero3_offload_optimizer"]
    base += unpinned(base, cfg)
    return [dataclasses.replace(c, host_share=share) for c in base for share in HOST_SHARES]


def _meta_counts(recipe: str, cfg: RunConfig):
    with torch.device("meta"):
        model = recipes.get(recipe)(cfg).build_model(pretrained=False)
    return count_params(model)


def assess(recipe: str, cfg: RunConfig, probe: Probe, cands: list[Candidate], host_bytes: float) -> list[Row]:
    """Predicted memory and step time of every candidate, and why each dropped one is out."""

    counts = _meta_counts(recipe, cfg)
    world = _world(cfg)
    device = probe.device
    # Checkpointing is worth trying only where it cuts the activations at the largest batch.
    # (A model traced in 16 bits only, the offload case, has the on16/off16 traces and no others.)
    largest = max(c.micro_batch_size for c in cands)
    on, off = probe.key(True, False), probe.key(False, False)
    saves = on != off and probe.activations[on].at(largest) < 0.9 * probe.activations[off].at(largest)
    rows, layouts = [], set()
    for cand in cands:
        run_cfg = cand.apply(cfg)
        try:
            run_cfg.validate()
        except ConfigError as exc:
            raise UserError(f"the plan's candidate {cand.label} is not a valid configuration: {exc}") from None
        buckets, autocast, ds = Buckets(), False, None
        if run_cfg.strategy.backend == "deepspeed":
            # NVMe weights' swap buffers hold the largest parameter (the largest layer's bounds it), as in the run
            ds = make_ds_config(run_cfg, world, device, probe.precision,  # type: ignore[arg-type]
                                {"largest_param_numel": counts.largest_layer})
            buckets, autocast = Buckets.from_ds_config(ds), _enabled(ds.get("torch_autocast"))
        elif run_cfg.strategy.backend == "fsdp2":
            buckets = Buckets.for_fsdp2(run_cfg, device)
        on_host = optimizer_on_host(counts, world, buckets)
        if cand.host_share < 1:
            # Shares that move the same sub-groups run the same layout: the first (highest) names it. (One that moves
            # none still differs from no share: the split cuts the optimizer into smaller sub-groups.)
            layout = (dataclasses.replace(cand, host_share=1.0), on_host)
            if layout in layouts:
                continue
            layouts.add(layout)
        states = optimizer_states(run_cfg.optimizer, ds)
        strategy = STRATEGIES[cand.strategy]
        # The row carries the trial's figures (trials run without the export, TRIAL_FLAGS), next to what the trial
        # measures; whether the run fits is judged with its own end, the export included.
        mem = predict(counts, strategy, cand.micro_batch_size, cand.checkpointing, world, probe.precision, probe,
                      buckets, autocast, cand.grad_accum, optimizer_states=states)
        run_mem = predict(counts, strategy, cand.micro_batch_size, cand.checkpointing, world, probe.precision, probe,
                          buckets, autocast, cand.grad_accum, export=run_cfg.trainer.export, optimizer_states=states)
        time = step_time(strategy, cand.micro_batch_size, cand.grad_accum, cand.checkpointing, counts, probe, world,
                         cfg.launch.nnodes, autocast, pinned=not cand.unpinned, host_share=on_host)
        dropped = fits(run_mem, probe, host_bytes, cfg.launch.nproc_per_node)
        if dropped is None and cand.checkpointing and not saves:
            dropped = "activation checkpointing saves no memory for this model (probe)"
        rows.append(Row(cand, mem, time, dropped, offload_optimizer_ratio=run_cfg.strategy.offload_optimizer_ratio,
                        optimizer_on_host=on_host))
    return rows


def _nothing_fits(rows: list[Row], cfg: RunConfig) -> UserError:
    """Say what is missing for the configuration that needs the least."""
    least = min(rows, key=lambda r: (r.memory.gpu_bytes, r.memory.host_bytes))
    disk = ("" if cfg.strategy.nvme_path else ", put the states on a fast local disk (--strategy.nvme_path DIR makes "
            "ZeRO-3 with NVMe offload a candidate; zerotrain doctor says whether it runs here)")
    return UserError(f"nothing fits this machine: the smallest configuration ({least.candidate.label}) is short of "
                     f"{least.dropped}. Add GPUs (--launch.nproc_per_node, --launch.nnodes) or host memory{disk}, or "
                     "train fewer parameters (a smaller model, or the lora recipe)")


def _disk_problem(recipe: str, cfg: RunConfig, precision: str) -> Optional[str]:
    """Whether one checkpoint of the run fits the disk of ``--trainer.output_dir``."""

    if not (cfg.checkpoint.save_final or cfg.checkpoint.every_steps):
        return None
    counts = _meta_counts(recipe, cfg)
    need = estimate_bytes(counts.total, counts.trainable, precision, cfg.strategy.backend,
                          optimizer_states(cfg.optimizer))
    folder = Path(cfg.trainer.output_dir).resolve()
    while not folder.exists():
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    if need > free:
        return (f"disk: one checkpoint needs {need / GIB:.1f} GiB, {free / GIB:.1f} GiB free under {folder} "
                "(--trainer.output_dir)")
    return None


def _layout_family(cand: Candidate) -> tuple[str, bool]:
    """A strategy, and whether part of its optimizer is on the GPU: the split's step time comes from its own constants
    (the GPU's Adam, the host's on a part), so it is ranked as a family of its own."""
    return cand.strategy, cand.host_share < 1


def pick_trials(rows: list[Row], trials: int, per_strategy: int = 2) -> list[Row]:
    """The fastest predicted candidates that fit, at most ``per_strategy`` of each strategy (a share of the optimizer
    on the GPU counting apart from the whole optimizer on the host), so one wrong speed constant cannot fill every
    trial with one strategy."""
    ranked = sorted((r for r in rows if r.dropped is None), key=lambda r: r.time.total)
    chosen: list[Row] = []
    for row in ranked:
        if len(chosen) == trials:
            break
        if sum(_layout_family(r.candidate) == _layout_family(row.candidate) for r in chosen) < per_strategy:
            chosen.append(row)
    return chosen


def _trial(recipe: str, fit_args: list[str], row: Row, out_dir: Path, trial_steps: int, warmup: int,
           timeout_s: int, trial_seconds: float) -> None:

    # Enough steps for ~trial_seconds of predicted training: ten 50 ms steps measured start-up noise
    # (a 2-GPU BERT-base plan ranked ZeRO-1 over DDP on them; 100 steps ranked them the other way).
    wanted = math.ceil(trial_seconds / max(row.time.total, 1e-3))
    steps = warmup + min(MAX_TRIAL_STEPS, max(trial_steps, wanted))
    args = [*fit_args, *row.candidate.flags(), *TRIAL_FLAGS, "--trainer.max_steps", str(steps),
            "--trainer.log_every_steps", str(steps)]
    name = row.candidate.label.replace(" ", "_").replace("+", "")
    result = run_one(recipe, args, out_dir / "trials", name, timeout_s)
    row.measured = {k: result.get(k) for k in ("status", "tokens_per_s", "peak_gpu_mem_gib", "peak_host_mem_gib",
                                               "wall_s", "command")}
    row.measured["samples_per_s"] = result.get("throughput_samples_per_s")
    if result["status"] != "ok":
        row.dropped = f"trial {result['status']}"


def _speed(row: Row) -> float:
    return (row.measured.get("tokens_per_s") or 0.0) if row.dropped is None else -1.0


def plan(recipe: str, cfg: RunConfig, fit_args: list[str], out_dir: Path, trials: int = 3, trial_steps: int = 8,
         strategies: Optional[list[str]] = None, compare_strategies: bool = False,
         host_memory_gib: Optional[float] = None, timeout_s: int = 900, trial_seconds: float = 4.0) -> Plan:
    """Probe, rank, trial and choose (module docstring); writes the plan folder ``out_dir``."""
    import psutil


    checked = copy.deepcopy(cfg)
    if checked.trainer.max_steps is None and checked.trainer.epochs is None:
        checked.trainer.max_steps = 1  # the run's length changes nothing in the plan; validate() needs one
    checked.validate()  # plan.yaml keeps the config as given: no placeholder length in it
    if cfg.launch.nnodes > 1:
        raise ConfigError("--launch.nnodes", "must be 1 to plan: the trials run on this node only. Plan with one "
                          "node's GPUs and start every node with --config <plan folder>/plan.yaml")
    if cfg.strategy.deepspeed_config:
        raise ConfigError("--strategy.deepspeed_config", "cannot be planned: the file sets the strategy, and the "
                          "planner chooses it. Drop the file to plan (the plan writes its own ds_config.json), or "
                          "train with the file as is")
    if trials < 1:
        raise UserError(f"--trials must be >= 1, got {trials}")
    unknown = [s for s in strategies or [] if s not in STRATEGIES]
    if unknown:
        raise UserError(f"--strategies: unknown {unknown}; choose from {', '.join(STRATEGIES)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    per_rank = cfg.trainer.micro_batch_size * cfg.strategy.gradient_accumulation_steps
    world = _world(cfg)
    print(f"[plan] probing {recipe} on this machine (micro-batch up to {per_rank})", flush=True)
    probe = run_probe(recipe, fit_args, out_dir / "probe.json", per_rank)
    host = host_memory_gib * GIB if host_memory_gib else float(psutil.virtual_memory().total)
    cands = candidates(cfg, probe.device, strategies, precision=probe.precision)
    rows = assess(recipe, checked, probe, cands, host)
    # Where nothing fits pinned: unpinned, an offload's host states take their bytes, not power-of-two blocks; or part
    # of the optimizer goes into the GPU memory the weights and activations leave, pinned or not. The step-time model
    # ranks the two (pinned copies and a smaller host Adam against pageable copies) and the trials confirm.
    retry = unpinned(cands, cfg) + shared(cands, cfg) if all(r.dropped for r in rows) and probe.device == "cuda" else []
    if retry:
        rows += assess(recipe, checked, probe, retry, host)
    if all(r.dropped for r in rows):
        raise _nothing_fits(rows, cfg)
    disk = _disk_problem(recipe, cfg, probe.precision)
    if disk:
        raise UserError(f"nothing fits this machine: {disk}. Free space or point --trainer.output_dir at a larger disk")
    to_run = pick_trials(rows, trials)
    planned_set = list(to_run)
    if compare_strategies:  # every strategy at the configured micro-batch too: what a benchmark sweep measures
        same = [r for r in rows if r.dropped is None and r.candidate.micro_batch_size == cfg.trainer.micro_batch_size
                and r.candidate.checkpointing == cfg.activation_checkpointing.enabled]
        to_run += [r for r in same if r not in to_run]
    # Out of memory in every trial of the planner's own: the memory model was wrong for this model;
    # try the next candidates in the ranking, at most as many again. Other failures end the plan.
    ranked_rest = [r for r in sorted(rows, key=lambda r: r.time.total) if r.dropped is None and r not in to_run]
    done: list[Row] = []
    while to_run:
        row = to_run.pop(0)
        print(f"[plan] trial {len(done) + 1}: {row.candidate.label}", flush=True)
        _trial(recipe, fit_args, row, out_dir, trial_steps, cfg.trainer.warmup_steps_excluded, timeout_s,
               trial_seconds)
        print(f"[plan]   {row.measured.get('status')}, {row.measured.get('tokens_per_s') or 0:,.0f} tokens/s", flush=True)
        done.append(row)
        planned_done = [r for r in planned_set if r in done]
        if (row in planned_set and len(planned_done) == len(planned_set) and ranked_rest
                and all(r.measured.get("status") == "oom" for r in planned_done)
                and len(planned_set) < 2 * trials):
            nxt = ranked_rest.pop(0)
            planned_set.append(nxt)
            to_run.insert(0, nxt)
    ok = [r for r in done if r.dropped is None]
    if not ok:
        raise UserError(f"every trial failed ({'; '.join(f'{r.candidate.label}: {r.dropped}' for r in done)}); "
                        f"see {out_dir / 'trials'}")
    choice = max(ok, key=_speed)
    planned = max((r for r in planned_set if r.dropped is None), key=_speed, default=None)
    result = Plan(recipe, world, per_rank * world, probe, rows, done, choice, planned, out_dir)
    write(result, cfg, fit_args)
    log.info("plan: %s (%s)", choice.candidate.label, out_dir)
    return result


def write(p: Plan, cfg: RunConfig, fit_args: list[str]) -> None:
    """plan.json, plan.md, plan.yaml and ds_config.json in the plan folder."""
    import yaml


    chosen_cfg = p.choice.candidate.apply(cfg)
    deepspeed_rows = [r for r in p.trialled if r.dropped is None and STRATEGIES[r.candidate.strategy].backend == "deepspeed"]
    best_ds = max(deepspeed_rows, key=_speed, default=None)
    data = {"recipe": p.recipe, "world_size": p.world_size, "global_batch": p.global_batch, "fit_args": fit_args,
            "environment": environment(), "probe": p.probe.to_dict(),
            "choice": p.choice.to_dict(p.global_batch),
            "planned": p.planned.to_dict(p.global_batch) if p.planned else None,
            "command": f"zerotrain fit {p.recipe} --config {p.out_dir / 'plan.yaml'}",
            "summary": summary(p),
            "rows": [r.to_dict(p.global_batch) for r in p.rows]}
    write_json(p.out_dir / "plan.json", data)
    plain = json.loads(json.dumps(chosen_cfg.to_dict()))  # tuples as lists: YAML that --config reads back
    (p.out_dir / "plan.yaml").write_text(f"# zerotrain plan for {p.recipe}: {p.choice.candidate.label}\n"
                                         + yaml.safe_dump(plain, sort_keys=False))
    others = ""
    if best_ds is not None:
        ds_cfg, precision = best_ds.candidate.apply(cfg), p.probe.precision
        hf_file = p.out_dir / "ds_config.json"
        write_json(hf_file, portable_ds_config(ds_cfg, p.world_size, precision))
        # Lightning refuses a file that sets gradient_accumulation_steps; the HF Trainer needs it above 1.
        pl_file = hf_file if best_ds.candidate.grad_accum == 1 else p.out_dir / "ds_config_lightning.json"
        if pl_file != hf_file:
            write_json(pl_file, portable_ds_config(ds_cfg, p.world_size, precision, for_lightning=True))
        hf = ", ".join(f"{k}={v!r}" for k, v in hf_training_arguments(ds_cfg, p.world_size, precision).items())
        pl = ", ".join(f"{k}={v!r}" for k, v in lightning_trainer_arguments(ds_cfg, p.world_size, precision).items())
        others = (f"\nThe fastest DeepSpeed candidate ({best_ds.candidate.label}) for other trainers, on "
                  f"{p.world_size} GPU(s):\n\n"
                  f"- Hugging Face: `TrainingArguments(deepspeed=\"{hf_file}\", {hf})`\n"
                  f"- Lightning: `Trainer(strategy=DeepSpeedStrategy(config=\"{pl_file}\"), {pl})`\n")
    (p.out_dir / "plan.md").write_text(markdown(p) + others)


def summary(p: Plan) -> dict[str, Any]:
    """The plan's result as one row: what the planner picked against the fastest of everything
    measured (all trials ran on this machine, one after another)."""
    fastest = max((r for r in p.trialled if r.dropped is None), key=_speed)
    return {"workload": p.recipe, "gpu": p.probe.device_name, "n_gpus": p.world_size,
            "planned_strategy": p.planned.candidate.label if p.planned else None,
            "planned_tokens_per_s": _speed(p.planned) if p.planned else None,
            "best_strategy": fastest.candidate.label, "best_tokens_per_s": _speed(fastest),
            "planned_vs_best": _speed(p.planned) / _speed(fastest) if p.planned else 0.0,
            "trials": len(p.trialled), "ooms": sum(1 for r in p.trialled if r.measured.get("status") == "oom")}


def markdown(p: Plan) -> str:
    pr = p.probe
    lines = [f"### Plan for `{p.recipe}` on {p.world_size} x {pr.device_name}, global batch {p.global_batch}, "
             f"{pr.precision}", "",
             f"Activations {p.rows[0].memory.activations}; speed: the probe's step times and `zerotrain.plan.speed`'s "
             "constants; trials: short `zerotrain fit` runs.", "",
             "| family | candidate | predicted GPU GiB | predicted host GiB | predicted samples/s | measured tokens/s "
             "| measured GPU GiB | status |", "|---|---|---|---|---|---|---|---|"]
    # Trialled first, then the best of the rest; the others are counted by why they are out.
    trialled = sorted(p.trialled, key=lambda r: -_speed(r))
    rest = sorted((r for r in p.rows if r not in p.trialled), key=lambda r: (r.dropped is not None, r.time.total))
    shown, hidden = trialled + [r for r in rest if r.dropped is None][:SHOWN_UNTRIED], rest
    for r in shown:
        m = r.measured
        measured = f"{m['tokens_per_s']:,.0f}" if m.get("tokens_per_s") else "-"
        gpu = f"{m['peak_gpu_mem_gib']:.2f}" if m.get("peak_gpu_mem_gib") is not None else "-"
        status = r.dropped or ("chosen" if r is p.choice else "ok" if m else "fits, not trialled")
        predicted_gpu = f"{r.memory.gpu_bytes / GIB:.2f}" if pr.device == "cuda" else "-"
        lines.append(f"| {STRATEGIES[r.candidate.strategy].family} | {r.candidate.label} | {predicted_gpu} | {r.memory.host_bytes / GIB:.2f} | "
                     f"{p.global_batch / r.time.total:,.1f} | {measured} | {gpu} | {status} |")
    reasons: dict[str, int] = {}
    for r in hidden:
        if r not in shown:
            why = (r.dropped or "fits, slower than the rows above").split(":")[0]
            reasons[why] = reasons.get(why, 0) + 1
    if reasons:
        lines.append("")
        lines.append("Not shown (plan.json has them): " + "; ".join(f"{n} {why}" for why, n in reasons.items()) + ".")
    lines += ["", f"Choice: **{p.choice.candidate.label}** -> `zerotrain fit {p.recipe} --config "
              f"{p.out_dir / 'plan.yaml'}`"]
    return "\n".join(lines) + "\n"


def plan_key(recipe: str, cfg: RunConfig, device_name: str) -> str:
    """What a cached plan is valid for: the recipe's resolved config (a ``--config`` file's contents,
    not its name) without what names or lengthens the run, the GPUs, and the versions that set the speed:
    torch's, DeepSpeed's and zerotrain's own (its version and commit: a change inside zerotrain made ZeRO-1 13%
    faster on two GPUs, which can change the pick)."""
    import deepspeed


    tree = cfg.to_dict()
    for section, key in (("trainer", "run_name"), ("trainer", "output_dir"), ("trainer", "max_steps"),
                         ("trainer", "epochs"), ("checkpoint", "resume"), ("strategy", "auto")):
        tree[section].pop(key, None)
    versions = [torch.__version__, deepspeed.__version__, __version__, commit()]
    text = json.dumps([recipe, tree, device_name, *versions], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def plan_for_fit(recipe: str, cfg: RunConfig, fit_args: list[str]) -> list[str]:
    """``--strategy.auto``: the flags of the plan for this run, made now or reused from the cache
    ``<output_dir>/.plans/<key>/`` (a plan depends on the machine, the recipe and its flags, not the run)."""
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() and cfg.trainer.device != "cpu" else "cpu"
    folder = Path(cfg.trainer.output_dir) / ".plans" / plan_key(recipe, cfg, device)
    cached = folder / "plan.json"
    if cached.is_file():
        choice = json.loads(cached.read_text())["choice"]
        print(f"[plan] --strategy.auto: {choice['candidate']}, the plan made for this machine and these flags "
              f"({folder}; delete it to plan again)", flush=True)
    else:
        print(f"[plan] --strategy.auto: planning before training (once per machine and flags; {folder})", flush=True)
        choice = plan(recipe, cfg, fit_args, folder).choice.to_dict(1)
        print(f"[plan] --strategy.auto: {choice['candidate']}", flush=True)
    cand = Candidate(choice["strategy"], choice["micro_batch_size"], choice["grad_accum"],
                     choice["activation_checkpointing"], choice.get("offload_pin_memory") is False)
    return [*cand.flags(), "--strategy.auto", "false"]
