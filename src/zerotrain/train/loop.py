"""The one training loop. Every recipe, and every model a user plugs in, runs through :func:`fit`.

Read top to bottom: join the job (:func:`zerotrain.runtime.distributed.setup`), build data, model and
engine (:func:`_build`), then step until done, asking each component whether it is its turn: the
step logger, the evaluator, the checkpointer. Where training stands is one
:class:`~zerotrain.train.state.TrainState`, which the checkpointer saves and restores.
"""

from __future__ import annotations

import contextlib
import copy
import json
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader

from zerotrain.checkpoint.layout import read_marker
from zerotrain.checkpoint.manager import (
    Checkpointer,
    check_compatible,
    check_same_config,
    crosses_engines,
    estimate_bytes,
    keep_global_batch,
    preflight_space,
    shape_of,
)
from zerotrain.checkpoint.weights import GatheredStateDict
from zerotrain.config import RunConfig, check_warmup
from zerotrain.config.ds_config import (
    REFLECTED,
    batch_shape,
    check_nvme_io,
    nvme_run_folder,
    reflect_ds_config,
    weights_on_nvme,
)
from zerotrain.data.loader import make_loader, micro_batch_stream
from zerotrain.data.sampling import EpochBatches
from zerotrain.data.streaming import Drawn, StreamedRows
from zerotrain.engines.base import Engine
from zerotrain.engines.build import build_engine, model_construction
from zerotrain.engines.states import (
    Buckets,
    ParamCounts,
    Strategy,
    count_params,
    full_numel,
    model_state_memory,
    optimizer_states,
)
from zerotrain.errors import ConfigError, DataError, OutOfMemory
from zerotrain.metrics.meters import (
    HostPeak,
    StepProfiler,
    ThroughputMeter,
    compile_counters,
    host_rss_gib,
    memory_snapshot,
)
from zerotrain.metrics.tracking import StepLogger, Tracker, log, progress_bar
from zerotrain.runtime import rundir
from zerotrain.runtime.collectives import all_gather_object, barrier, main_process_first, run_on_main
from zerotrain.runtime.distributed import Runtime, setup
from zerotrain.runtime.launcher import Progress, few_threads_line
from zerotrain.runtime.preemption import armed
from zerotrain.tasks import registry as recipes
from zerotrain.tasks.base import Splits, Task
from zerotrain.train.evaluate import Evaluator, fmt
from zerotrain.train.heap import FrozenHeap
from zerotrain.train.oom import describe_oom, failed_step
from zerotrain.train.state import TrainState


@dataclass
class FitResult:
    run_dir: Path
    final_step: int
    metrics: dict[str, float] = field(default_factory=dict)
    """Last training window, final validation and test metrics, throughput summary."""
    is_main: bool = True
    """Whether this process is rank 0 (the one that wrote the run directory)."""


@dataclass
class Run:
    """What :func:`_build` sets up for the loop."""

    task: Task
    cfg: RunConfig
    rt: Runtime
    run_dir: Path
    resume_from: Optional[Path]
    splits: Splits
    sampler: Optional[EpochBatches]
    """The plan of a map-style training split; None for a streamed one."""
    total_steps: int
    engine: Engine
    loader: Optional[DataLoader]
    """The training split's loader; its persistent workers (if any) were started before the model was built.
    None for a streamed split, which is read in the training process."""
    flops_per_token: float
    n_params: int
    param_counts: ParamCounts
    """Of the whole model before the engine (maybe) sharded it: what the out-of-memory line's prediction sizes."""
    model_load: dict[str, Any] = field(default_factory=dict)
    """How building the model went (:func:`_build_model`), for summary.json."""

    def batches(self, state: TrainState) -> Iterator[Drawn]:
        """The training micro-batches from where ``state`` says the data stands."""
        if isinstance(self.splits.train, StreamedRows):
            return self.splits.train.batches(self.engine.micro_batch_size, self.rt.rank, self.rt.world_size,
                                             self.task.collator(), state.epoch, state.batches_in_epoch,
                                             state.stream_offset, self.rt.device)
        return micro_batch_stream(self.loader, self.sampler, state.epoch, state.batches_in_epoch)


Report = Callable[[int, dict[str, Any], Optional[Path]], None]
"""What :func:`fit` tells a host that runs it (Ray Train: :mod:`zerotrain.ray`): ``report(step, metrics, checkpoint)``."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def fit(task: Task, report: Optional[Report] = None) -> FitResult:
    """Train ``task`` as its config says; return where the run lives and its final metrics.

    ``task`` and its config are left as they were; so is the process (see ``distributed.setup``).

    ``report``: called on every rank, the same number of times (a host may make it a barrier), after each step
    that logged metrics or saved a checkpoint, with the step, the metrics logged at it (training window,
    validation) and the checkpoint folder saved at it (None: none).
    """
    task.cfg.validate()
    with setup(task.cfg) as rt, rundir.RunLock() as lock:  # rank 0 owns the run folder until fit returns
        run = _build(task, rt, lock)
        # The loader's workers end however the run does, set-up failures included (a streamed split has none)
        with contextlib.closing(run.loader) if run.loader is not None else contextlib.nullcontext():
            return _train(run, report)


def _train(run: Run, report: Optional[Report] = None) -> FitResult:
    """The loop: from the checkpoint to resume (if any) to the last step, then the run's end."""
    rt = run.rt
    tr = run.cfg.trainer
    state, engine = TrainState(), run.engine
    shape = shape_of(engine, recipes.name_of(type(run.task)))
    checkpointer = Checkpointer(run.cfg.checkpoint, run.run_dir, engine, state, shape)
    if run.resume_from is not None:
        checkpointer.load(run.resume_from, seed=tr.seed)  # the seed re-seeds RNG on another process count
        log.info("resumed from %s at step %d (epoch %d, %d micro-batches in)", run.resume_from,
                 state.step, state.epoch, state.batches_in_epoch)
    start_step = state.step
    barrier()  # the run folder exists before any rank writes into it
    tracker = Tracker(run.run_dir, run.cfg.logging, run.cfg.to_dict(), rt.is_main,
                      resumed_at=start_step if run.resume_from is not None else None)
    meter = ThroughputMeter(rt.device, rt.world_size, run.flops_per_token, engine.precision,
                            tr.warmup_steps_excluded, sum_across_ranks=engine.all_reduce_sum)
    bar = progress_bar(run.cfg.logging.progress_bar and rt.is_main, run.total_steps, state.step)
    logger = StepLogger(tr.log_every_steps, run.total_steps, engine, meter, tracker, bar)
    evaluator = Evaluator(run.task, engine, tr)
    # The meter's warm-up restarts with every process, a resumed one too; its first step compiles
    after_warmup = max(1, tr.warmup_steps_excluded)
    profiler = StepProfiler(tr.profile_steps, state.step + after_warmup, rt.device, run.run_dir, rt.is_main)
    stream = run.batches(state)
    results: dict[str, Any] = dict(run.model_load)
    heartbeat = Progress(rt.rank, run.run_dir, state.step)  # the launcher names the step of a rank lost
    heap = FrozenHeap(tr.gc_freeze, after_warmup, run.total_steps - state.step)
    engine.train()
    meter.start()
    try:
        # A stop signal waits for the checkpoint at the next step boundary; out of GPU memory ends in one line.
        with armed(rt.preemption), _out_of_memory_in_one_line(run, state):
            while state.step < run.total_steps:
                t0 = time.perf_counter()
                drawn = [next(stream) for _ in range(engine.grad_accum)]
                meter.add_data_wait(time.perf_counter() - t0)
                stats = engine.train_step([d.batch for d in drawn], run.task.training_step, run.task.loss_weight)
                state.advance(stats.loss, drawn[-1].epoch, drawn[-1].batches, drawn[-1].offset)
                heartbeat.beat(state.step)
                meter.add_step(stats.micro_batches, stats.samples, stats.tokens, stats.flops,
                               sum(run.task.real_tokens(d.batch) for d in drawn))
                last = state.step == run.total_steps
                if (collected_s := heap.step()) is not None:
                    log.info("step %d: Python's heap collected (%.2f s) and frozen", state.step, collected_s)
                    if meter.steps_seen <= meter.warmup_steps:  # with no warm-up, the first window holds it
                        meter.start()  # a one-off cost of the warm-up, like compilation
                logged: dict[str, Any] = {}
                saved: Optional[Path] = None
                if logger.should_log(state.step):
                    logged = logger.log(state)
                    results.update(logged)  # keeps the latest val_* next to the latest window
                bar.update(1)
                if profiler.step(state.step, run.total_steps):
                    meter.start()  # profiled steps run slower: they are not part of the throughput figures
                if last:
                    # The trained state first: whatever follows (validation, test, export, a signal) cannot lose it.
                    if checkpointer.should_save(state.step, last_step=True):
                        saved = checkpointer.save()
                        log.info("checkpoint: %s", saved)
                    checkpointer.save_if_preempted(rt.preemption)  # a stop signal now skips the evaluations
                if tr.evaluate and evaluator.should_validate(state.step, state.batches_in_epoch == 0, last):
                    if run.splits.val is not None:
                        val = evaluator.run(run.splits.val, "val")
                        tracker.log(state.step, val)
                        results.update(val)
                        logged = {**logged, **val}
                        log.info("step %d: %s", state.step, fmt(val))
                    meter.start()  # evaluation time is not training time
                if not last and checkpointer.should_save(state.step):
                    saved = checkpointer.save()
                    log.info("checkpoint: %s", saved)
                    meter.start()
                if report is not None and (logged or saved is not None):
                    report(state.step, logged, saved)
                    meter.start()  # the host's time (a barrier, a copy of the checkpoint) is not training time
                if not last:
                    checkpointer.save_if_preempted(rt.preemption)  # raises Preempted once saved
        bar.close()
        if state.step == start_step:
            log.info("the run had already reached step %d of %d: nothing to train", start_step, run.total_steps)
        summary = _finish(run, state, checkpointer, evaluator, tracker, meter, results, start_step)
    finally:  # however the run ends: what it logged is flushed, the logger's files and threads closed
        heap.close()  # first: it cannot fail, and the closings below may
        profiler.close()  # a profiler left recording would crash the process at exit
        stream.close()
        bar.close()
        heartbeat.close()
        tracker.close()
        meter.close()
        swapped = nvme_run_folder(run.cfg, run.run_dir)
        if swapped is not None and rt.local_rank == 0:  # ended here or failed everywhere: nothing reads it again
            shutil.rmtree(swapped, ignore_errors=True)  # scratch: the checkpoints hold copies of what resumes
    log.info("done: %s", run.run_dir)
    return FitResult(run_dir=run.run_dir, final_step=state.step, metrics=summary, is_main=rt.is_main)


def _build(task: Task, rt: Runtime, lock: Optional[rundir.RunLock] = None) -> Run:
    """Data, sampling plan, model and engine; the run folder once all of them were built without error."""
    cfg = copy.deepcopy(task.cfg)
    cfg.precision.dtype = rt.precision  # tasks read it (LoRA loads weights in it); hparams.json shows it
    task = task.with_config(cfg)
    tr = cfg.trainer
    name = recipes.name_of(type(task))
    run_dir, resume_from = rundir.prepare(tr.output_dir, tr.run_name, name, cfg.checkpoint.resume, rt.is_main,
                                          lock, cfg.checkpoint.verify)
    if resume_from is not None:  # before anything is built or hparams.json rewritten
        unresolved = REFLECTED if cfg.strategy.deepspeed_config else frozenset()  # compared once the file is
        run_on_main(lambda: check_same_config(resume_from, name, cfg, unresolved))
        if (kept := keep_global_batch(resume_from, cfg, rt.world_size)) and rt.is_main:
            log.info("%s", kept)

    check_nvme_io(cfg)  # before the data and the model: a missing op would otherwise end the run minutes later
    # Identical initial weights on every rank, then per-rank randomness (dropout).
    seed_everything(tr.seed)
    with main_process_first(rt.is_main):  # rank 0 fills the tokenisation cache; the others then read it
        splits = task.build_datasets()
    micro, grad_accum = batch_shape(cfg)
    sampler: Optional[EpochBatches] = None
    loader: Optional[DataLoader] = None
    if isinstance(splits.train, StreamedRows):  # its length is unknown until it is read
        if tr.max_steps is None:
            raise ConfigError("--trainer.max_steps", "is required with --data.streaming true: a streamed split's "
                                                     "length is unknown until it is read")
        if cfg.scheduler.step_unit == "epochs" and cfg.scheduler.name == "step":
            raise ConfigError("--scheduler.step_unit", "must be steps with --data.streaming true (epochs are not "
                                                       "known in advance)")
        total_steps = steps_per_epoch = tr.max_steps
    else:
        sampler = EpochBatches(len(splits.train), micro, rt.rank, rt.world_size, tr.seed, grad_accum,
                               task.train_lengths(splits.train))
        steps_per_epoch = sampler.batches_per_epoch // grad_accum
        if steps_per_epoch < 1:
            raise DataError(f"the training set has {len(splits.train)} examples, fewer than one optimizer step needs "
                            f"({micro} x {grad_accum} x {rt.world_size}). Add data or lower --trainer.micro_batch_size")
        total_steps = tr.max_steps if tr.max_steps is not None else tr.epochs * steps_per_epoch
    check_warmup(cfg.scheduler.warmup_steps, total_steps)  # epochs: the run's length is known only now
    if sampler is not None:
        loader = make_loader(splits.train, sampler, task.collator(), tr.num_workers, tr.seed, persistent=True)
        loader.start_workers()  # before the model and the engine fill this process's memory
    with _closed_on_error(loader):
        model, model_load, swap_facts = _build_model(task, cfg, rt, total_steps, run_dir)
        # Counted on the whole model, before an engine may shard it (a partitioned one: its full sizes).
        flops_per_token = task.flops_per_token(model)
        n_params = sum(full_numel(p) for p in model.parameters())
        n_train = sum(full_numel(p) for p in model.parameters() if p.requires_grad)
        param_counts = count_params(model)
        engine = build_engine(model, cfg, rt.device, rt.precision, total_steps, steps_per_epoch, rt.world_size,
                              {**task.deepspeed_hints(model), **swap_facts})
        seed_everything(tr.seed + 1000 * rt.rank)

        if cfg.strategy.deepspeed_config and engine.ds_config is not None:
            reflect_ds_config(cfg, engine.ds_config, engine.precision)  # hparams.json records what the file set
        if rt.is_main and rt.device.type == "cuda":
            st = cfg.strategy  # FSDP2's CPU offload moves the step with the parameters
            host_step = st.offload_optimizer != "none" or (st.backend == "fsdp2" and st.offload_param != "none")
            few = few_threads_line(host_step)
            if few:
                log.warning(few)
        if resume_from is not None:  # the checkpoint's shape, before anything in the run folder is rewritten
            shape = shape_of(engine, name)
            check_compatible(resume_from, shape)
            if crosses_engines(read_marker(resume_from), shape):
                engine.check_loads_across(resume_from)
            changed = run_on_main(lambda: check_same_config(resume_from, name, cfg, ds_config=engine.ds_config))
            if changed and rt.is_main:
                log.info("resuming with changed settings that leave the training as it was: %s", ", ".join(changed))
        if cfg.checkpoint.save_final or cfg.checkpoint.every_steps:
            one_checkpoint = estimate_bytes(n_params, n_train, engine.precision, cfg.strategy.backend,
                                            optimizer_states(cfg.optimizer, engine.ds_config))
            run_on_main(lambda: preflight_space(run_dir, one_checkpoint))
        # On rank 0, with its error shared: a lock held by another run stops every rank.
        run_on_main(lambda: rundir.write_metadata(run_dir, name, cfg.to_dict(), engine.ds_config, lock,
                                                  task=recipes.spec_of(type(task)), tokenizer=task.run_tokenizer()))
        if rt.is_main:
            if engine.ds_config is not None and cfg.logging.print_ds_config:
                print(json.dumps(engine.ds_config, indent=2), flush=True)
        log.info("run directory: %s", run_dir)
        log.info("%s: %.2fM parameters (%.2fM trainable), %s x %d process(es), %s, %s", name, n_params / 1e6,
                 n_train / 1e6, rt.device.type, rt.world_size, engine.precision, engine.describe())
        log.info("%d optimizer steps (%d per epoch), global batch %d = %d micro x %d accumulation x %d ranks",
                 total_steps, steps_per_epoch, micro * grad_accum * rt.world_size, micro, grad_accum, rt.world_size)
        if unused := cfg.strategy.unused_flags():
            log.warning("%s: another engine's setting, which --strategy.backend %s does not use",
                        ", ".join(unused), cfg.strategy.backend)
        return Run(task, cfg, rt, run_dir, resume_from, splits, sampler, total_steps, engine, loader, flops_per_token,
                   n_params, param_counts, model_load)


def _build_model(task: Task, cfg: RunConfig, rt: Runtime, total_steps: int, run_dir: Path
                 ) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """The recipe's model, built where the engine wants it (partitioned under ZeRO-3: see
    :func:`zerotrain.engines.build.model_construction`), with the host memory each process used meanwhile, and
    the NVMe facts (:func:`_swap_facts`) its DeepSpeed config was made with, for the engine's to be made alike.

    Every rank's figures go to summary.json (``model_load_host_rss_before_gib`` / ``..._peak_gib``, in rank
    order) and rank 0 logs them: whether loading a big model fits the host is read there, per process.
    """
    meta = None
    if weights_on_nvme(cfg):
        with torch.device("meta"):  # the largest parameter, which the weights' swap buffers must hold
            meta = task.build_model(pretrained=False)
    facts = _swap_facts(cfg, run_dir, meta)
    t0 = time.perf_counter()
    with model_construction(cfg, rt.device, rt.precision, total_steps, rt.world_size, facts) as zero3, \
            HostPeak(interval_s=0.01) as host:
        model = task.build_model()
    seconds = time.perf_counter() - t0
    # What the recipe's loader made of it (a model it builds whole stays whole): a partitioned parameter has ds_numel
    partitioned = any(hasattr(p, "ds_numel") for p in model.parameters())
    if zero3 and rt.is_main and partitioned != task.builds_partitioned():
        log.warning("%s.builds_partitioned() says %s, but under ZeRO-3 its model was built %s: zerotrain plan and "
                    "estimate predict this run's host memory %s by the whole model; override builds_partitioned to "
                    "return %s", type(task).__name__, not partitioned, "partitioned" if partitioned else "whole",
                    "high" if partitioned else "low", partitioned)
    mine = (host.before_gib, host.peak_gib)
    before, peak = zip(*(all_gather_object(mine) if rt.world_size > 1 else [mine]))
    log.info("model built in %.1f s%s: host memory at most %s GiB per process (%s before)", seconds,
             ", partitioned over the ranks (ZeRO-3)" if partitioned else "",
             " / ".join(f"{v:.2f}" for v in peak), " / ".join(f"{v:.2f}" for v in before))
    return model, {"model_load_s": seconds, "model_load_partitioned": partitioned,
                   "model_load_host_rss_before_gib": list(before), "model_load_host_rss_peak_gib": list(peak)}, facts


def _swap_facts(cfg: RunConfig, run_dir: Path, model: Optional[torch.nn.Module]) -> dict[str, Any]:
    """What an NVMe offload's DeepSpeed config needs beyond the flags: ``nvme_folder``, the run's own folder under
    ``--strategy.nvme_path`` (:func:`~zerotrain.config.ds_config.nvme_run_folder`), and, where the weights are
    swapped, ``largest_param_numel`` (each swap buffer holds a rank's share of it; ``model`` on the meta device)."""
    folder = nvme_run_folder(cfg, run_dir)
    facts: dict[str, Any] = {"nvme_folder": str(folder)} if folder else {}
    if model is not None and weights_on_nvme(cfg):
        facts["largest_param_numel"] = max(full_numel(p) for p in model.parameters())
    return facts


@contextlib.contextmanager
def _closed_on_error(loader: Optional[DataLoader]) -> Iterator[None]:
    """Stops the loader's workers if what the block builds fails: ``fit`` may be called again in this process."""
    try:
        yield
    except BaseException:
        if loader is not None:
            loader.close()
        raise


@contextlib.contextmanager
def _out_of_memory_in_one_line(run: Run, state: TrainState):
    """Turn torch's out-of-memory error in the training loop into :class:`OutOfMemory`: one line with the
    sizes and the next smaller configuration to try (:func:`zerotrain.train.oom.describe_oom`), exit status 5."""
    try:
        yield
    except torch.OutOfMemoryError as exc:
        line = describe_oom(exc, failed_step(exc, state.step), run.cfg, run.rt.world_size,
                            _predicted_gpu_bytes(run), run.rt.device, run.rt.rank)
        exc.__traceback__ = None  # what is raised next does not keep the failed step's frames (its activations)
        if run.rt.device.type == "cuda":
            torch.cuda.empty_cache()  # what the run's closing steps (logs, process group) may need
        raise OutOfMemory(line) from None


def _predicted_gpu_bytes(run: Run) -> Optional[float]:
    """The memory model's model states per GPU for this run (None if it cannot say: the line goes without)."""
    s, ds = run.cfg.strategy, run.engine.ds_config or {}
    try:
        strategy = Strategy(s.backend, s.zero_stage, s.offload_optimizer, s.offload_param)
        autocast = bool((ds.get("torch_autocast") or {}).get("enabled"))  # ZeRO-0's bf16 fast path keeps fp32 weights
        return float(model_state_memory(run.param_counts, strategy, run.rt.world_size, run.engine.precision,
                                        Buckets.from_ds_config(ds), autocast=autocast,
                                        grad_accum=run.engine.grad_accum,
                                        optimizer_states=optimizer_states(run.cfg.optimizer, ds)).gpu_bytes)
    except Exception:  # a figure for the message is not worth hiding the out-of-memory error behind another
        return None


def _finish(run: Run, state: TrainState, checkpointer: Checkpointer, evaluator: Evaluator, tracker: Tracker,
            meter: ThroughputMeter, results: dict[str, Any], start_step: int) -> dict[str, Any]:
    """Final checkpoint (when the loop had no last step to save at: a resumed run that had finished), test,
    export and summary.json."""
    if checkpointer.should_save(state.step, last_step=True):
        log.info("checkpoint: %s", checkpointer.save())
    if run.splits.test is not None and run.cfg.trainer.evaluate:
        test = evaluator.run(run.splits.test, "test")
        tracker.log(state.step, test)
        results.update(test)
        log.info("test: %s", fmt(test))
    if run.cfg.trainer.export:
        held = host_rss_gib()
        run.engine.release_optimizer()  # its memory holds the export's shard: training and its checkpoints are done
        results["export_optimizer_freed_gib"] = held - host_rss_gib()
        weights = run.engine.consolidated_state_dict()  # every rank calls it (collective)

        def export() -> None:
            t0 = time.perf_counter()
            # Written beside model/ and renamed into place: a full disk leaves no half-written model/.
            with rundir.writing("the exported model", run.run_dir), HostPeak() as host, \
                    rundir.replaced(run.run_dir / "model") as staging:
                run.task.export(run.engine.module, weights, staging)
                rundir.write_model_config(run.task, staging)
            results.update(export_s=time.perf_counter() - t0, export_host_rss_before_gib=host.before_gib,
                           export_host_rss_peak_gib=host.peak_gib)
            log.info("export: %s in %.1f s, host memory %.2f GiB at most (%.2f GiB before, the optimizer's %.2f GiB "
                     "freed first)", run.run_dir / "model", results["export_s"], host.peak_gib, host.before_gib,
                     results["export_optimizer_freed_gib"])

        # A full disk on rank 0 stops every rank with its one line; under ZeRO-3 and FSDP2 the others gather with it
        run_on_main(export, serve=weights.serve if isinstance(weights, GatheredStateDict) else None)
    summary = {**results, **{f"throughput_{k}": v for k, v in meter.summary().items()},
               **memory_snapshot(run.rt.device), "device": meter.device_name, "world_size": run.rt.world_size,
               "precision": run.engine.precision, "final_step": state.step, "n_params": run.n_params,
               "micro_batch_size": run.engine.micro_batch_size, "grad_accum": run.engine.grad_accum,
               "engine": run.engine.describe(), **compile_counters()}
    if run.rt.is_main and (state.step > start_step or not (run.run_dir / "summary.json").exists()):
        rundir.write_json(run.run_dir / "summary.json", summary)
    barrier()
    return summary
