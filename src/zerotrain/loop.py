"""The one training loop. Every recipe, and every model a user plugs in, runs through :func:`fit`.

Read top to bottom: set up the process group and the run directory, build data and model from
the task, hand the model to the engine, maybe resume, then step until done, logging, evaluating
and checkpointing on the way, and export the trained weights at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from zerotrain import checkpoint, rundir
from zerotrain.data.sampling import EpochBatches, eval_shard
from zerotrain.distributed import adopt_slurm_env, comm_backend, init_process_group, sanitize_cuda_arch_list
from zerotrain.ds_config import batch_shape, make_ds_config, resolve_precision
from zerotrain.engine import Engine, build_engine, to_device
from zerotrain.errors import DataError, UserError
from zerotrain.metrics import ThroughputMeter, memory_snapshot, numel
from zerotrain.tasks.base import Task
from zerotrain.tracking import Tracker, log, setup_logging


@dataclass
class FitResult:
    run_dir: Path
    final_step: int
    metrics: dict[str, float] = field(default_factory=dict)
    """Last training window, final validation and test metrics, throughput summary."""
    is_main: bool = True
    """Whether this process is rank 0 (the one that wrote the run directory)."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _device_type(requested: str) -> str:
    """``--trainer.device`` resolved: auto is cuda when a GPU is visible."""
    if requested == "cuda" and not torch.cuda.is_available():
        raise UserError("--trainer.device cuda: no CUDA GPU is visible. Use --trainer.device cpu (or auto)")
    return "cuda" if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()) else "cpu"


def _device(device_type: str, local_rank: int) -> torch.device:
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _broadcast(obj: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _loader(dataset: Dataset, batch_sampler, task: Task, workers: int, seed: int) -> DataLoader:
    return DataLoader(
        dataset, batch_sampler=batch_sampler, collate_fn=task.collate, num_workers=workers,
        pin_memory=torch.cuda.is_available(), persistent_workers=False,
        # A private generator: worker seeds must not draw from the global RNG that resume restores.
        generator=torch.Generator().manual_seed(seed),
    )


def _stream(loader: DataLoader, sampler: EpochBatches, epoch: int, skip: int) -> Iterator[tuple[int, int, Any]]:
    """Micro-batches forever, as (epoch, batches consumed in that epoch after this one, batch)."""
    while True:
        sampler.set_epoch(epoch, skip)
        for i, batch in enumerate(loader, start=skip + 1):
            yield epoch, i, batch
        epoch, skip = epoch + 1, 0


def evaluate(task: Task, engine: Engine, dataset: Dataset, prefix: str, max_batches: Optional[int],
             workers: int, seed: int) -> dict[str, float]:
    batches = eval_shard(len(dataset), engine.micro_batch_size, engine.rank, engine.world_size)[:max_batches]
    # Every rank runs the same number of forwards: under ZeRO-3 each forward is a collective
    # (parameter all-gather), so a rank with one batch fewer would leave the others waiting.
    # Ranks short of batches repeat one and discard the result.
    rounds = int(engine.all_reduce_max(len(batches)))
    filler = batches[0] if batches else [0]
    plan = batches + [filler] * (rounds - len(batches))
    loader = _loader(dataset, plan, task, workers, seed)
    engine.eval()
    sums: dict[str, float] = {}
    with torch.no_grad(), engine.eval_context():
        for i, batch in enumerate(loader):
            out = task.eval_step(engine.forward_model, to_device(batch, engine.device))
            if i < len(batches):
                for k, v in out.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
    engine.train()
    # Ranks with no batch still join the reduction with zeros.
    sums = engine.all_reduce_sum(_keys_everywhere(sums))
    return {f"{prefix}_{k}": v for k, v in task.eval_metrics(sums).items()}


def _keys_everywhere(sums: dict[str, float]) -> dict[str, float]:
    keys = sorted(set(k for ks in _all_gather(sorted(sums)) for k in ks))
    return {k: sums.get(k, 0.0) for k in keys}


def _all_gather(obj: Any) -> list[Any]:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def fit(task: Task) -> FitResult:
    """Train ``task`` as its config says; return where the run lives and its final metrics."""
    cfg = task.cfg
    cfg.validate()
    tr = cfg.trainer
    sanitize_cuda_arch_list()
    adopt_slurm_env(cfg.launch)
    device_type = _device_type(tr.device)
    backend = comm_backend(cfg.launch.comm_backend, device_type)
    info = init_process_group(backend, use_deepspeed=cfg.strategy.backend == "deepspeed", device=device_type,
                              timeout_minutes=cfg.launch.timeout_minutes)
    setup_logging(info.is_main)
    device = _device(device_type, info.local_rank)
    precision = resolve_precision(cfg.strategy.precision, device.type,
                                  device.type == "cuda" and torch.cuda.is_bf16_supported())
    # The resolved value goes into the config: tasks read it (LoRA loads weights in it) and hparams.json shows it.
    cfg.strategy.precision = precision
    if device.type == "cuda" and precision == "fp32":
        # fp32 matmuls on tensor cores (TF32), as MFU's fp32 peak assumes; IEEE fp32 runs ~7x slower on Hopper.
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    # --- run directory: rank 0 names it, everyone agrees; it is created once setup has succeeded,
    # so a bad flag or data file found below leaves no empty run folder behind ---
    name = _broadcast(tr.run_name or rundir.new_run_name(task.name) if info.is_main else None)
    if info.is_main:
        rundir.check_writable(tr.output_dir)
    run_dir = Path(tr.output_dir).expanduser() / name
    resume_from = None
    if cfg.checkpoint.resume:
        resume_from = checkpoint.find_resume_folder(cfg.checkpoint.resume, run_dir)

    # --- data and model: identical initial weights on every rank, then per-rank randomness ---
    seed_everything(tr.seed)
    if info.is_main:  # rank 0 fills the tokenisation cache; the others then read it
        splits = task.build_datasets()
    dist.barrier()
    if not info.is_main:
        splits = task.build_datasets()
    micro, grad_accum = batch_shape(cfg)
    lengths = None
    if getattr(getattr(cfg, "data", None), "bucket_by_length", False):
        lengths = [task.example_length(splits.train[i]) for i in range(len(splits.train))]
    sampler = EpochBatches(len(splits.train), micro, info.rank, info.world_size, tr.seed, grad_accum, lengths)
    steps_per_epoch = sampler.batches_per_epoch // grad_accum
    if steps_per_epoch < 1:
        raise DataError(f"the training set has {len(splits.train)} examples, fewer than one optimizer step needs "
                        f"({micro} x {grad_accum} x {info.world_size}). Add data or lower --trainer.micro_batch_size")
    total_steps = tr.max_steps if tr.max_steps is not None else tr.epochs * steps_per_epoch
    model = task.build_model()
    flops_per_token = task.flops_per_token(model)
    extra = {"total_num_steps": total_steps, "warmup_num_steps": cfg.scheduler.warmup_steps,
             "min_lr_ratio": cfg.scheduler.min_lr_ratio}
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    if hidden:
        extra["hidden_size"] = hidden
    ds_config = (make_ds_config(cfg, info.world_size, device.type, precision, extra)
                 if cfg.strategy.backend == "deepspeed" else None)
    engine = build_engine(model, cfg, device, precision, total_steps, steps_per_epoch, ds_config)
    seed_everything(tr.seed + 1000 * info.rank)

    if info.is_main:
        rundir.create(tr.output_dir, name)
        rundir.write_json(run_dir / "hparams.json", {"recipe": task.name, **cfg.to_dict()})
        if ds_config is not None:
            rundir.write_json(run_dir / "ds_config.json", ds_config)
            if cfg.logging.print_ds_config:
                print(json.dumps(ds_config, indent=2), flush=True)
        rundir.write_json(run_dir / "env.json", rundir.environment())
        rundir.write_code_state(run_dir)
    n_params = sum(numel(p) for p in model.parameters())
    n_train = sum(numel(p) for p in model.parameters() if p.requires_grad)
    log.info("run directory: %s", run_dir)
    log.info("%s: %.2fM parameters (%.2fM trainable), %s x %d process(es), %s, %s ZeRO-%s",
             task.name, n_params / 1e6, n_train / 1e6, device.type, info.world_size, engine.precision,
             cfg.strategy.backend, cfg.strategy.zero_stage if ds_config is None else
             ds_config.get("zero_optimization", {}).get("stage", 0))
    log.info("%d optimizer steps (%d per epoch), global batch %d = %d micro x %d accumulation x %d ranks",
             total_steps, steps_per_epoch, micro * grad_accum * info.world_size, micro, grad_accum, info.world_size)

    # --- resume ---
    step, epoch, in_epoch = 0, 0, 0
    window_loss, window_steps = 0.0, 0
    if resume_from is not None:
        client = checkpoint.load(engine, resume_from)
        step, epoch, in_epoch = client["step"], client["epoch"], client["batches_in_epoch"]
        # The unfinished log window goes on where it was, so the logged losses match an uninterrupted run.
        window_loss, window_steps = client.get("window_loss", 0.0), client.get("window_steps", 0)
        if info.is_main:
            _drop_rows_after(run_dir / "metrics.jsonl", step)
        log.info("resumed from %s at step %d (epoch %d, %d micro-batches in)", resume_from, step, epoch, in_epoch)
    start_step = step
    if start_step >= total_steps:
        log.info("the run had already reached step %d of %d: nothing to train", start_step, total_steps)

    dist.barrier()  # the run folder exists before any rank writes into it
    tracker = Tracker(run_dir, cfg.logging, cfg.to_dict(), info.is_main,
                      resumed_at=start_step if resume_from is not None else None)
    meter = ThroughputMeter(device, info.world_size, flops_per_token, engine.precision, tr.warmup_steps_excluded,
                            sum_across_ranks=engine.all_reduce_sum)
    loader = _loader(splits.train, sampler, task, tr.num_workers, tr.seed)
    stream = _stream(loader, sampler, epoch, in_epoch)
    bar = _progress(cfg.logging.progress_bar and info.is_main, total_steps, step)
    eval_args = dict(max_batches=tr.eval_max_batches, workers=tr.num_workers, seed=tr.seed)
    # A resumed run does not save again the checkpoint it started from.
    last_saved, results = (step if resume_from is not None else -1), {}
    engine.train()
    meter.start()
    try:
        while step < total_steps:
            t0 = time.perf_counter()
            drawn = [next(stream) for _ in range(grad_accum)]
            meter.add_data_wait(time.perf_counter() - t0)
            epoch, in_epoch, _ = drawn[-1]
            if in_epoch == sampler.batches_per_epoch:
                epoch, in_epoch = epoch + 1, 0
            stats = engine.train_step([b for _, _, b in drawn], task.training_step, task.loss_weight)
            step += 1
            meter.add_step(stats.micro_batches, stats.samples, stats.tokens, stats.flops)
            window_loss, window_steps = window_loss + stats.loss, window_steps + 1

            if step % tr.log_every_steps == 0 or step == total_steps:
                loss = engine.all_reduce_sum({"loss": window_loss / window_steps})["loss"] / info.world_size
                window = {"train_loss": loss, "lr": engine.lr(), "grad_norm": engine.grad_norm(),
                          "loss_scale": engine.loss_scale(), "skipped_steps": engine.skipped_steps(),
                          "epoch": epoch, **meter.read(), **memory_snapshot(device)}
                tracker.log(step, window)
                results.update(window)  # keeps the latest val_* next to the latest training window
                bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
                window_loss, window_steps = 0.0, 0
            bar.update(1)

            at_epoch_end = in_epoch == 0
            if step == total_steps or (step % tr.eval_every_steps == 0 if tr.eval_every_steps else at_epoch_end):
                if splits.val is not None:
                    val = evaluate(task, engine, splits.val, "val", **eval_args)
                    tracker.log(step, val)
                    results.update(val)
                    log.info("step %d: %s", step, _fmt(val))
                meter.start()  # evaluation time is not training time
            if cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0:
                _save(engine, run_dir, step, epoch, in_epoch, cfg.checkpoint.keep_last, float(window_loss), window_steps)
                last_saved = step
                meter.start()
    finally:
        bar.close()

    if cfg.checkpoint.save_final and last_saved != step:
        _save(engine, run_dir, step, epoch, in_epoch, cfg.checkpoint.keep_last, float(window_loss), window_steps)
    if splits.test is not None:
        test = evaluate(task, engine, splits.test, "test", **eval_args)
        tracker.log(step, test)
        results.update(test)
        log.info("test: %s", _fmt(test))
    state = engine.consolidated_state_dict()
    if info.is_main:
        task.export(engine.module, state, run_dir / "model")
    summary = {**results, **{f"throughput_{k}": v for k, v in meter.summary().items()},
               **memory_snapshot(device), "device": meter.device_name, "world_size": info.world_size,
               "precision": engine.precision, "final_step": step}
    if info.is_main and (step > start_step or not (run_dir / "summary.json").exists()):
        rundir.write_json(run_dir / "summary.json", summary)
    tracker.close()
    dist.barrier()
    log.info("done: %s", run_dir)
    return FitResult(run_dir=run_dir, final_step=step, metrics=summary, is_main=info.is_main)


def _save(engine: Engine, run_dir: Path, step: int, epoch: int, in_epoch: int, keep_last: int,
          window_loss: float, window_steps: int) -> None:
    client = {"step": step, "epoch": epoch, "batches_in_epoch": in_epoch,
              "window_loss": window_loss, "window_steps": window_steps}
    folder = checkpoint.save(engine, run_dir / "checkpoints", step, client, keep_last)
    log.info("checkpoint: %s", folder)


def _drop_rows_after(metrics_file: Path, step: int) -> None:
    """Forget what a killed run logged after its last checkpoint: the resumed run logs those steps again."""
    if not metrics_file.is_file():
        return
    lines = metrics_file.read_text().splitlines()
    kept = [line for line in lines if line.strip() and json.loads(line).get("step", 0) <= step]
    if len(kept) != len(lines):
        tmp = metrics_file.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, metrics_file)


def _fmt(metrics: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:.4f}" for k, v in metrics.items())


def _progress(enabled: bool, total: int, initial: int):
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)


class _NoBar(contextlib.AbstractContextManager):
    def update(self, n: int = 1) -> None: ...
    def set_postfix(self, **kwargs: Any) -> None: ...
    def close(self) -> None: ...
    def __exit__(self, *exc: Any) -> None: ...
