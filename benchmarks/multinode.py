"""Two nodes against one: the same job started by two launchers that meet over NCCL, each with half the GPUs,
against one launcher with all of them; optionally a ZeRO-3 run checkpointed on two nodes and resumed on one.

    python benchmarks/multinode.py --out DIR/NAME --title TEXT [--resume] -- RECIPE <zerotrain fit flags>

The machine's GPUs are split in two halves (CUDA_VISIBLE_DEVICES), one per launcher, as two nodes of a cluster
would each see their own; they meet at a c10d rendezvous on 127.0.0.1. Both runs use the same flags, so they
train the same global batch on the same number of processes and their losses can be compared step by step.
With --resume, the two-node run stops at half the steps (its final checkpoint) and one launcher with all the
GPUs resumes it to the end; its losses are compared with the one-node run's at the same steps.

Writes NAME.json (the rows, the per-step losses and their largest difference, the machine), NAME.md and
NAME.png (tokens/s per GPU by run; loss by step).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from zerotrain.runtime.distributed import free_port
from zerotrain.runtime.rundir import environment


def _fit(recipe: str, flags: list[str], runs: Path, name: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "zerotrain", "fit", recipe, *flags, "--trainer.output_dir", str(runs),
            "--trainer.run_name", name, *extra]


def _run(cmds: list[tuple[list[str], dict[str, str]]], log: Path) -> tuple[list[int], float]:
    """Start every command at once, wait for all; their output goes to ``log``. Returns the exit codes and seconds."""
    t0 = time.perf_counter()
    with open(log, "a") as out:
        procs = [subprocess.Popen(cmd, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT)
                 for cmd, env in cmds]
        codes = [p.wait() for p in procs]
    return codes, time.perf_counter() - t0


def _half(gpus: int, i: int) -> str:
    half = gpus // 2
    return ",".join(str(g) for g in range(i * half, (i + 1) * half))


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: float(r["train_loss"]) for r in rows if "train_loss" in r}


def _row(label: str, run: Path, codes: list[int], seconds: float, nodes: int, cmds: list[str]) -> dict[str, Any]:
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").is_file() else {}
    world = summary.get("world_size")
    tokens = summary.get("throughput_real_tokens_per_s")
    return {"label": label, "nodes": nodes, "exit_codes": codes, "wall_s": round(seconds, 1), "world_size": world,
            "tokens_per_s": tokens, "tokens_per_s_per_gpu": tokens / world if tokens and world else None,
            "mfu": summary.get("throughput_mfu"), "sec_per_step": summary.get("throughput_sec_per_step"),
            "peak_gpu_mem_gib": summary.get("gpu_mem_peak_gib"), "n_params": summary.get("n_params"),
            "precision": summary.get("precision"), "engine": summary.get("engine"), "commands": cmds}


def _largest_difference(a: dict[int, float], b: dict[int, float]) -> dict[str, Any]:
    steps = sorted(set(a) & set(b))
    diffs = [abs(a[s] - b[s]) for s in steps]
    return {"steps_compared": len(steps), "max_abs_loss_diff": max(diffs) if diffs else None,
            "max_rel_loss_diff": max(d / abs(a[s]) for d, s in zip(diffs, steps)) if diffs else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="DIR/NAME: where NAME.json, NAME.md and NAME.png go")
    p.add_argument("--title", required=True)
    p.add_argument("--resume", action="store_true", help="also checkpoint on two nodes at half the steps and "
                   "resume on one")
    p.add_argument("--procs", type=int, default=0, help="processes in all (default: one per GPU); on a machine "
                   "without GPUs, CPU processes over Gloo, to check the script")
    args, rest = p.parse_known_args()
    rest = rest[1:] if rest[:1] == ["--"] else rest
    recipe, flags = rest[0], rest[1:]
    gpus = args.procs or torch.cuda.device_count()
    if gpus < 2 or gpus % 2:
        raise SystemExit(f"needs an even number of processes (GPUs), got {gpus}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    runs, log = out.parent / f"{out.name}_runs", out.parent / f"{out.name}.log"
    steps = int(flags[flags.index("--trainer.max_steps") + 1])

    def two_nodes(name: str, *extra: str) -> tuple[list[int], float, list[str]]:
        endpoint = f"127.0.0.1:{free_port()}"
        cmds = [(_fit(recipe, flags, runs, name, "--launch.nproc_per_node", str(gpus // 2), "--launch.nnodes", "2",
                      "--launch.node_rank", str(r), "--launch.rdzv_endpoint", endpoint, *extra),
                 {"CUDA_VISIBLE_DEVICES": _half(gpus, r)} if torch.cuda.is_available() else {}) for r in (0, 1)]
        codes, seconds = _run(cmds, log)
        return codes, seconds, [" ".join(c) for c, _ in cmds]

    one_cmd = _fit(recipe, flags, runs, "one_node", "--launch.nproc_per_node", str(gpus))
    codes, seconds = _run([(one_cmd, {})], log)
    rows = [_row(f"one node, {gpus} GPUs", runs / "one_node", codes, seconds, 1, [" ".join(one_cmd)])]
    codes, seconds, cmds = two_nodes("two_nodes")
    rows.append(_row(f"two nodes of {gpus // 2} GPUs", runs / "two_nodes", codes, seconds, 2, cmds))
    curves = {r["label"]: _losses(runs / n) for r, n in zip(rows, ("one_node", "two_nodes"))
              if (runs / n / "metrics.jsonl").is_file()}
    result: dict[str, Any] = {"title": args.title, "environment": environment(), "rows": rows,
                              "command": " ".join([sys.executable, *sys.argv])}
    if len(curves) == 2:
        result["two_nodes_vs_one"] = _largest_difference(*curves.values())

    if args.resume:
        half = str(steps // 2)
        codes, seconds, cmds = two_nodes("resumed", "--trainer.max_steps", half, "--checkpoint.save_final", "true")
        resume_cmd = _fit(recipe, flags, runs, "resumed", "--launch.nproc_per_node", str(gpus),
                          "--checkpoint.resume", "auto")
        codes2, seconds2 = _run([(resume_cmd, {})], log)
        rows.append(_row(f"two nodes to step {half}, then one node", runs / "resumed", codes + codes2,
                         seconds + seconds2, 2, cmds + [" ".join(resume_cmd)]))
        if (runs / "resumed" / "metrics.jsonl").is_file() and rows[0]["label"] in curves:
            resumed = _losses(runs / "resumed")
            curves[rows[-1]["label"]] = resumed
            one = curves[rows[0]["label"]]
            after = {s: v for s, v in resumed.items() if s > steps // 2}
            result["resumed_vs_one_node"] = _largest_difference(one, after)

    result["losses"] = {label: {str(s): v for s, v in c.items()} for label, c in curves.items()}
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    out.with_suffix(".md").write_text(markdown(result))
    plot(result, out.with_suffix(".png"))
    print(out.with_suffix(".md").read_text())
    return 0 if all(c == 0 for r in rows for c in r["exit_codes"]) else 1


def markdown(result: dict[str, Any]) -> str:
    env = result["environment"]
    lines = [f"# {result['title']}", "",
             f"GPU: {', '.join(env.get('gpus') or ['cpu'])}; torch {env['versions']['torch']}, DeepSpeed "
             f"{env['versions']['deepspeed']}; commit {env.get('commit')}", "", f"Command: `{result['command']}`", "",
             "| run | exit | GPUs | tokens/s | tokens/s per GPU | MFU | s/step | peak GPU GiB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        def f(v, fmt):
            return format(v, fmt) if v is not None else "-"
        lines.append(f"| {r['label']} | {','.join(map(str, r['exit_codes']))} | {r['world_size'] or '-'} | "
                     f"{f(r['tokens_per_s'], ',.0f')} | {f(r['tokens_per_s_per_gpu'], ',.0f')} | "
                     f"{f(r['mfu'] and 100 * r['mfu'], '.1f')}% | {f(r['sec_per_step'], '.3f')} | "
                     f"{f(r['peak_gpu_mem_gib'], '.1f')} |")
    for key, what in (("two_nodes_vs_one", "Two nodes against one node, same steps"),
                      ("resumed_vs_one_node", "Resumed on one node against the uninterrupted one-node run")):
        if key in result:
            d = result[key]
            lines += ["", f"{what}: {d['steps_compared']} steps compared, largest loss difference "
                      f"{d['max_abs_loss_diff']:.3g} (relative {d['max_rel_loss_diff']:.3g})."]
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bars, curves) = plt.subplots(1, 2, figsize=(12, 4.5))
    rows = [r for r in result["rows"] if r["tokens_per_s_per_gpu"]]
    bars.barh([r["label"] for r in rows], [r["tokens_per_s_per_gpu"] for r in rows])
    bars.set_xlabel("tokens/s per GPU")
    for label, curve in result["losses"].items():
        steps = sorted(int(s) for s in curve)
        curves.plot(steps, [curve[str(s)] for s in steps], label=label, linewidth=1)
    curves.set_xlabel("step")
    curves.set_ylabel("train loss")
    curves.legend(fontsize=8)
    fig.suptitle(result["title"], fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
