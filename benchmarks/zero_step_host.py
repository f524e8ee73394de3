"""Host time of one ZeRO-1 optimizer step on one GPU, with and without zerotrain's patches, in one process.

A host-bound step (IMDB preset (b): ~80 parameter tensors, a ~7 ms step) moves by more from run to run than
one change to the optimizer step is worth, so this times the step alone. One engine (IMDB (b)'s model,
17.9M parameters, bf16, clip 1.0, the JSON rewritten by zerotrain's ``ds_config.fast_path``) takes a forward
and backward on a fixed batch, waits for the GPU, and then the host time of ``engine.step()`` is read. The
script first runs the two compared variants' steps under CUDA's sync-debug "error" mode: they never wait for
the GPU, so their host time is the time the host needs to queue the step. (Session 24's first run, without
the rewrite, had DeepSpeed's overflow check and throughput timer wait inside every variant's step: its times
are not this.) The variants take turns in blocks of ``--steps`` steps, so the host's drifting speed (BENCHMARKS.md, session 23) falls on every variant alike:

* ``zerotrain``: the engine's optimizer as zerotrain's fast path leaves it;
* ``without one-group norm``: the same with DeepSpeed's ``scaled_global_norm`` (its mask and group
  combination around zerotrain's one-launch norm);
* ``deepspeed``: every zerotrain method on the optimizer removed: DeepSpeed 0.19.8's own step (its norm,
  clip and rebinding; its clip reads the norm to the host, so this variant's time includes that wait).
  zerotrain's sync-free norm mask is a module global and stays in all three, as do the JSON rewrites.

    python benchmarks/zero_step_host.py OUT_DIR [--steps 100] [--blocks 8]

Writes ``OUT_DIR/zero_step_host.json``, ``.md`` and ``.png`` (each block's median per variant).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from blocks import plot_block_medians, provenance, quantile, write_result

# The instance attributes zerotrain sets on DeepSpeed's ZeRO-1/2 optimizer (zero_host, zero_clip, offload_norm)
PATCHES = ("scaled_global_norm", "get_grad_norm_direct", "unscale_and_clip_grads", "_update_model_bit16_weights",
           "reduce_ready_partitions_and_remove_grads")
VARIANTS = {"zerotrain": (), "without one-group norm": ("scaled_global_norm",), "deepspeed": PATCHES}


def build(stage: int, micro_batch: int, seq: int):
    """IMDB preset (b)'s model under zerotrain's engine setup for ZeRO ``stage``, and one batch for it."""
    import deepspeed

    from zerotrain.config.ds_config import fast_path
    from zerotrain.models.sentiment import SentimentClassifier
    from zerotrain.engines.ds_private.zero_clip import clip_without_sync, mask_norms_without_sync
    from zerotrain.engines.ds_private.zero_host import norm_in_one_launch, rebind_only_moved_weights, skip_one_rank_reduction

    torch.manual_seed(0)
    model = SentimentClassifier(vocab_size=50265, embed_dim=256, hidden_dim=1024, num_heads=8, num_layers=6,
                                max_len=1024, dropout=0.2, pad_token_id=1)
    config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_clipping": 1.0, "bf16": {"enabled": True},
              "optimizer": {"type": "Adam", "params": {"lr": 2e-4}},
              "zero_optimization": {"stage": stage, "overlap_comm": False}}
    # zerotrain's rewrites of the JSON (no bf16 overflow check, no throughput timer: both make the step wait)
    fast_path(config, "cuda" if torch.cuda.is_available() else "cpu", world_size=1)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
    mask_norms_without_sync(True)
    clip_without_sync(engine.optimizer)
    norm_in_one_launch(engine.optimizer)
    skip_one_rank_reduction(engine.optimizer)
    rebind_only_moved_weights(engine.optimizer)
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(3, 50265, (micro_batch, seq), generator=g),
             "attention_mask": torch.ones(micro_batch, seq, dtype=torch.long),
             "labels": torch.randint(0, 2, (micro_batch,), generator=g)}
    batch = {k: v.to(engine.device) for k, v in batch.items()}
    return engine, batch


def set_variant(optimizer, removed: tuple[str, ...], saved: dict) -> None:
    """Put every saved zerotrain method back, then remove ``removed`` (the class's method shows through)."""
    for name, method in saved.items():
        setattr(optimizer, name, method)
    for name in removed:
        optimizer.__dict__.pop(name, None)


def timed_steps(engine, batch, n: int, strict: bool = False) -> list[float]:
    """Host milliseconds of ``engine.step()`` for ``n`` steps, each started with the GPU idle (on a CPU, the
    whole step: a check that the script runs, not a measurement). ``strict``: a step that waits for the GPU
    raises (CUDA's sync-debug mode, around the step only)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    out = []
    for _ in range(n):
        loss = engine(**batch)["loss"]
        engine.backward(loss)
        sync()
        t0 = time.perf_counter()
        if strict:
            torch.cuda.set_sync_debug_mode("error")
        try:
            engine.step()
        finally:
            if strict:
                torch.cuda.set_sync_debug_mode("default")
        out.append((time.perf_counter() - t0) * 1e3)
        sync()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    # ZeRO-1 only: at ZeRO-2 zerotrain removes the gradient hooks that DeepSpeed's own reduction needs, so its
    # "deepspeed" variant could not be put back in the same engine
    ap.add_argument("--stage", type=int, default=1, choices=(1,))
    ap.add_argument("--steps", type=int, default=100, help="steps per block")
    ap.add_argument("--blocks", type=int, default=8, help="blocks per variant, the variants taking turns")
    ap.add_argument("--warmup", type=int, default=20, help="untimed steps first")
    ap.add_argument("--micro_batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=256)
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    engine, batch = build(args.stage, args.micro_batch, args.seq)
    opt = engine.optimizer
    saved = {name: opt.__dict__[name] for name in PATCHES if name in opt.__dict__}
    timed_steps(engine, batch, args.warmup)  # warm-up: the allocator, FusedAdam's first launch
    if torch.cuda.is_available():
        # The premise: the two variants compared never wait for the GPU in their step, so its host time is what
        # it costs to queue it. Under sync-debug "error" a wait inside the step raises (DeepSpeed's own clip, in
        # the "deepspeed" variant, does wait); the forward and backward are not checked.
        for name in ("zerotrain", "without one-group norm"):
            set_variant(opt, VARIANTS[name], saved)
            timed_steps(engine, batch, 2, strict=True)
    blocks: dict[str, list[float]] = {v: [] for v in VARIANTS}
    samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
    order = list(VARIANTS)
    deepspeeds: dict[str, list[str]] = {}  # per variant, the patched methods that were DeepSpeed's while timed
    for b in range(args.blocks):
        for name in (order if b % 2 == 0 else order[::-1]):
            set_variant(opt, VARIANTS[name], saved)
            deepspeeds[name] = [m for m in saved if m not in opt.__dict__]
            ms = timed_steps(engine, batch, args.steps)
            samples[name] += ms
            blocks[name].append(statistics.median(ms))
    set_variant(opt, (), saved)
    rows = {name: {"median_ms": statistics.median(samples[name]), "p10_ms": quantile(samples[name], 0.1),
                   "p90_ms": quantile(samples[name], 0.9), "block_medians_ms": blocks[name],
                   "removed": list(VARIANTS[name]), "deepspeeds_methods": deepspeeds[name]} for name in VARIANTS}
    result = {**provenance(), "stage": args.stage, "steps_per_block": args.steps, "blocks": args.blocks,
              "micro_batch": args.micro_batch, "seq": args.seq,
              "parameter_tensors": sum(len(g) for g in opt.bit16_groups), "rows": rows}
    write_result(result, args.out, "zero_step_host", markdown, plot)


def markdown(result: dict) -> str:
    base = result["rows"]["zerotrain"]["median_ms"]
    lines = [f"Host time of `engine.step()` (ZeRO-{result['stage']}, one {result['gpu']}, "
             f"{result['parameter_tensors']} parameter tensors), {result['blocks']} blocks of "
             f"{result['steps_per_block']} steps per variant, taking turns. torch {result['torch']}, DeepSpeed "
             f"{result['deepspeed']}, commit {result['commit']}. Command: `{result['command']}`", "",
             "| variant | DeepSpeed's own methods (zerotrain's removed) | median ms | p10 - p90 ms | vs zerotrain | block medians ms |",
             "|---|---|---|---|---|---|"]
    for name, row in result["rows"].items():
        lines.append(f"| {name} | {', '.join(row['deepspeeds_methods']) or '-'} | {row['median_ms']:.3f} | "
                     f"{row['p10_ms']:.3f} - {row['p90_ms']:.3f} | {row['median_ms'] - base:+.3f} ms | "
                     f"{', '.join(f'{m:.3f}' for m in row['block_medians_ms'])} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    plot_block_medians({name: row["block_medians_ms"] for name, row in result["rows"].items()},
                       "median host ms of engine.step()",
                       f"ZeRO-{result['stage']} optimizer step, host time, {result['gpu']}", path)


if __name__ == "__main__":
    main()
