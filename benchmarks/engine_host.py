"""Host time of one IMDB (b) training step per engine, in one process, the engines taking turns.

Target 1 of the fast-path issue compares whole fits, and a host-bound fit's step time moves by more from run to
run than the tax it is meant to show (the host's CPUs change speed, BENCHMARKS.md session 23). This times only
what each engine makes the host do. One process builds every compared engine the way ``zerotrain fit`` does
(``build_engine``, IMDB preset (b)'s config and the flags given: on a GPU its compiled stack replayed as CUDA
graphs), each on its own copy of the same initial weights, and times ``Engine.train_step`` on one fixed batch,
started with the GPU idle: its host time is then the time the host needs to queue one step, and a step of a
host-bound loop takes about that long. The engines take turns in blocks (every other round reversed), so a drift
of the host's speed falls on all of them alike. Variants:

* ``plain``: plain PyTorch (``--strategy.backend ddp``);
* ``zero0``: DeepSpeed ZeRO-0 as zerotrain runs it, its forward and backward run directly;
* ``zero0 via deepspeed``: the same engine with DeepSpeed's ``forward`` and ``backward`` (the path before
  ``zero_host.forward_backward_add_nothing``);
* ``zero1``, ``zero2``: DeepSpeed ZeRO-1/2 as zerotrain runs them.

    python benchmarks/engine_host.py OUT_DIR [--steps 50] [--blocks 8] [--seq 320] [--variants ...] [-- fit flags]
    python benchmarks/engine_host.py --pool OUT_DIR RUN_DIR [RUN_DIR ...]

Writes ``OUT_DIR/engine_host.json``, ``.md`` and ``.png`` (each block's median per variant). ``--pool`` reads the
``engine_host.json`` of several runs and writes ``OUT_DIR/engine_host_pooled.json`` and ``.md``: their blocks
together, each block paired with the plain block of its run and index.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from blocks import plot_block_medians, provenance, quantile, write_result

VARIANTS = ("plain", "zero0", "zero0 via deepspeed", "zero1", "zero2")
CONFIG = Path(__file__).resolve().parents[1] / "configs" / "imdb_b.yaml"


def build(variants: list[str], fit_flags: list[str], micro_batch: int, seq: int, device: torch.device,
          precision: str):
    """The task that built the model (its ``training_step`` needs it), the engines (one per variant; both ZeRO-0
    variants share one) and a batch of IMDB (b)'s shape."""
    from zerotrain.tasks import registry as recipes
    from zerotrain.config.flags import parse_config
    from zerotrain.engines import build_engine

    base = ["--config", str(CONFIG), "--trainer.micro_batch_size", str(micro_batch), *fit_flags]
    cfg = parse_config("imdb", base)
    torch.manual_seed(cfg.trainer.seed)
    task = recipes.get("imdb")(cfg)
    model = task.build_model(pretrained=False)
    engines, by_strategy = {}, {}
    # ZeRO-0 last: on a GPU it runs DeepSpeed's torch_autocast, which sets a process-wide flag that ZeRO-1/2
    # optimizers built after it read for their gradients' communication dtypes (and their reduction reads at run
    # time, which one rank skips)
    for name in sorted(variants, key=lambda v: v.startswith("zero0")):
        strategy = "zero0" if name.startswith("zero0") else name
        if strategy not in by_strategy:
            flags = ["--strategy.backend", "ddp"] if strategy == "plain" else ["--strategy.zero_stage", strategy[-1]]
            vcfg = parse_config("imdb", [*base, *flags])
            by_strategy[strategy] = build_engine(copy.deepcopy(model), vcfg, device, precision, 10**6, 781, 1)
        engines[name] = by_strategy[strategy]
    engines = {name: engines[name] for name in variants}
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(3, len(task.tokenizer), (micro_batch, seq), generator=g),
             "attention_mask": torch.ones(micro_batch, seq, dtype=torch.long),
             "labels": torch.randint(0, 2, (micro_batch,), generator=g)}
    return task, engines, batch


def timed_steps(engine, direct, batch, step_fn, n: int) -> tuple[list[float], list[float]]:
    """Host ms (to return from ``train_step``) and whole ms (until the GPU is done) of ``n`` steps, each started
    with the GPU idle. ``direct``: for the ZeRO-0 engine, whether its forward and backward bypass DeepSpeed's."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    if direct is not None:
        engine._direct = direct
    host, whole = [], []
    for _ in range(n):
        sync()
        t0 = time.perf_counter()
        engine.train_step([batch], step_fn)
        t1 = time.perf_counter()
        sync()
        host.append((t1 - t0) * 1e3)
        whole.append((time.perf_counter() - t0) * 1e3)
    return host, whole


def pool(out: Path, runs: list[Path]) -> str:
    """Every run's blocks together, each paired with the plain block (else the first variant's) of the same run
    and index; runs of different workloads or GPUs are refused."""
    results = [json.loads((run / "engine_host.json").read_text()) for run in runs]
    shape = ("gpu", "micro_batch", "seq", "steps_per_block", "fit_flags")
    differ = [key for key in shape if len({json.dumps(r.get(key)) for r in results}) > 1]
    if differ:
        sys.exit(f"engine_host --pool: the runs differ in {', '.join(differ)}; pool only runs of one workload and GPU")
    variants = list(dict.fromkeys(name for r in results for name in r["rows"]))
    against = "plain" if "plain" in variants else variants[0]
    missing = [str(run) for run, r in zip(runs, results) if against not in r["rows"]]
    if missing:
        sys.exit(f"engine_host --pool: {', '.join(missing)} ran no {against} variant to pair the others with")
    rows = {}
    for name in variants:
        pairs = [(r["rows"][against]["block_host_medians_ms"][i], block) for r in results if name in r["rows"]
                 for i, block in enumerate(r["rows"][name]["block_host_medians_ms"])]
        rows[name] = {"blocks": len(pairs), "block_median_ms": statistics.median(b for _, b in pairs),
                      "paired_difference_ms": statistics.median(b - a for a, b in pairs),
                      "paired_ratio": statistics.median(b / a - 1 for a, b in pairs),
                      "blocks_lower": sum(b < a for a, b in pairs)}
    pooled = {"runs": [str(run) for run in runs], "commits": sorted({r["commit"] for r in results}),
              "gpus": sorted({r["gpu"] for r in results}), "against": against, "rows": rows}
    lines = [f"Blocks of {len(runs)} runs of `benchmarks/engine_host.py` pooled, each block paired with the "
             f"{against} block of its run and index. GPUs: {', '.join(pooled['gpus'])}; commits "
             f"{', '.join(pooled['commits'])}. Runs: {', '.join(f'`{run}`' for run in runs)}", "",
             f"| variant | blocks | median of block medians, ms | vs {against}, block by block: median difference "
             f"| median ratio - 1 | blocks lower |", "|---|---|---|---|---|---|"]
    for name, row in rows.items():
        lines.append(f"| {name} | {row['blocks']} | {row['block_median_ms']:.3f} | {row['paired_difference_ms']:+.3f} ms "
                     f"| {row['paired_ratio']:+.1%} | {row['blocks_lower']} |")
    if "zero0" in rows and "zero0 via deepspeed" in rows:
        diffs = [a - b for r in results if "zero0" in r["rows"] and "zero0 via deepspeed" in r["rows"]
                 for a, b in zip(r["rows"]["zero0"]["block_host_medians_ms"],
                                 r["rows"]["zero0 via deepspeed"]["block_host_medians_ms"])]
        pooled["zero0_against_deepspeeds_forward_backward"] = {
            "blocks": len(diffs), "median_difference_ms": statistics.median(diffs), "blocks_lower": sum(d < 0 for d in diffs)}
        lines += ["", f"zero0 against zero0 via deepspeed, block by block: median difference "
                      f"{statistics.median(diffs):+.3f} ms, lower in {sum(d < 0 for d in diffs)} of {len(diffs)} blocks"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine_host_pooled.json").write_text(json.dumps(pooled, indent=1))
    (out / "engine_host_pooled.md").write_text("\n".join(lines) + "\n")
    return "\n".join(lines)


def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] == ["--pool"]:
        if len(argv) < 3:
            sys.exit("engine_host --pool: give OUT_DIR and at least one run folder")
        print(pool(Path(argv[1]), [Path(a) for a in argv[2:]]))
        return
    fit_flags = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--steps", type=int, default=50, help="steps per block")
    ap.add_argument("--blocks", type=int, default=8, help="blocks per variant, the variants taking turns")
    ap.add_argument("--warmup", type=int, default=30, help="untimed steps of every variant first")
    ap.add_argument("--micro_batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=320, help="the batch's padded length (preset (b) pads to 64s)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args(argv)
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    if len(set(variants)) < len(variants):
        ap.error("--variants: a variant named twice would be timed twice as often as the others")
    from zerotrain.runtime import distributed
    from zerotrain.config.flags import parse_config

    setup_cfg = parse_config("imdb", ["--config", str(CONFIG), *fit_flags])
    with distributed.setup(setup_cfg) as rt:  # the fit flags' device and precision, resolved as a fit does
        task, engines, batch = build(variants, fit_flags, args.micro_batch, args.seq, rt.device, rt.precision)
        step_fn = task.training_step
        direct = {name: (name == "zero0") if name.startswith("zero0") else None for name in variants}
        if "zero0" in engines and not engines["zero0"]._direct:
            sys.exit("engine_host: zerotrain's ZeRO-0 engine does not run its forward and backward directly here")
        for name in variants:
            timed_steps(engines[name], direct[name], batch, step_fn, args.warmup)
        host = {v: [] for v in variants}
        whole = {v: [] for v in variants}
        blocks = {v: [] for v in variants}
        for b in range(args.blocks):
            for name in (variants if b % 2 == 0 else variants[::-1]):
                h, w = timed_steps(engines[name], direct[name], batch, step_fn, args.steps)
                host[name] += h
                whole[name] += w
                blocks[name].append(statistics.median(h))
        rows = {v: {"host_median_ms": statistics.median(host[v]), "host_p10_ms": quantile(host[v], 0.1),
                    "host_p90_ms": quantile(host[v], 0.9), "whole_median_ms": statistics.median(whole[v]),
                    "block_host_medians_ms": blocks[v],
                    # whether its forward and backward bypassed DeepSpeed's (None: not a ZeRO-0 variant)
                    "direct_forward_backward": direct[v]} for v in variants}
        result = {**provenance(), "steps_per_block": args.steps, "blocks": args.blocks,
                  "micro_batch": args.micro_batch, "seq": args.seq, "fit_flags": fit_flags, "rows": rows}
    write_result(result, args.out, "engine_host", markdown, plot)


def markdown(result: dict) -> str:
    rows = result["rows"]
    base = rows.get("plain", next(iter(rows.values())))["host_median_ms"]
    against = "plain" if "plain" in rows else next(iter(rows))
    lines = [f"Host time of one `Engine.train_step` (IMDB (b), micro-batch {result['micro_batch']} x {result['seq']} "
             f"tokens, one {result['gpu']}), {result['blocks']} blocks of {result['steps_per_block']} steps per "
             f"variant, taking turns. torch {result['torch']}, DeepSpeed {result['deepspeed']}, commit "
             f"{result['commit']}. Command: `{result['command']}`", "",
             f"| variant | host median ms | p10 - p90 ms | vs {against} | block by block vs {against}: median "
             f"difference (blocks lower) | whole step median ms | block medians ms |",
             "|---|---|---|---|---|---|---|"]
    base_blocks = rows[against]["block_host_medians_ms"]
    for name, row in rows.items():
        # Blocks of one index ran next to each other in time: their difference leaves the host's drift out
        diffs = [b - a for a, b in zip(base_blocks, row["block_host_medians_ms"])]
        lower = sum(d < 0 for d in diffs)
        paired = "-" if name == against else f"{statistics.median(diffs):+.3f} ms ({lower} of {len(diffs)})"
        lines.append(f"| {name} | {row['host_median_ms']:.3f} | {row['host_p10_ms']:.3f} - {row['host_p90_ms']:.3f} "
                     f"| {row['host_median_ms'] / base - 1:+.1%} | {paired} | {row['whole_median_ms']:.3f} | "
                     f"{', '.join(f'{m:.3f}' for m in row['block_host_medians_ms'])} |")
    if "zero0" in rows and "zero0 via deepspeed" in rows:
        diffs = [a - b for a, b in zip(rows["zero0"]["block_host_medians_ms"],
                                       rows["zero0 via deepspeed"]["block_host_medians_ms"])]
        lines += ["", f"zero0 against zero0 via deepspeed, block by block: median difference "
                      f"{statistics.median(diffs):+.3f} ms, lower in {sum(d < 0 for d in diffs)} of {len(diffs)} blocks"]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    plot_block_medians({name: row["block_host_medians_ms"] for name, row in result["rows"].items()},
                       "median host ms of train_step", f"IMDB (b) step, host time per engine, {result['gpu']}", path)


if __name__ == "__main__":
    main()
