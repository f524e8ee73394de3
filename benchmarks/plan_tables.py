"""The planner page's tables (docs/benchmarks/planner_h100_202611.md), regenerated from `zerotrain plan` files
(and from `zerotrain benchmark` files, whose rows carry predicted memory too).

    python benchmarks/plan_tables.py benchmarks/results/planner_h100_202611/plan_*.json [--plot trials.png]

Prints two Markdown tables: the plan's pick against the fastest configuration measured in the same
run, and the predicted peak memory of every trial (or benchmark row) against what it measured. ``--plot``
also draws every plan's trials, measured tokens/s by engine family, the planner's own pick marked.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _name(path: Path) -> str:
    """A plan's workload: ``plan_NAME.json`` as committed, or ``NAME/plan.json`` as zerotrain plan writes it."""
    return path.parent.name if path.stem == "plan" else path.stem.removeprefix("plan_")


def _pct(predicted: float, measured: float | None) -> str:
    return f"{100 * (predicted / measured - 1):+.0f}%" if measured else "-"


def _measured_rows(path: Path, result: dict) -> list[tuple[str, float, float | None, float, float | None]]:
    """(label, predicted GPU, measured GPU, predicted host, measured host) of every run that finished."""
    if "summary" in result:  # a plan: its trials
        return [(row["candidate"], row["predicted_gpu_mem_gib"], row["measured"].get("peak_gpu_mem_gib"),
                 row["predicted_host_mem_gib"], row["measured"].get("peak_host_mem_gib"))
                for row in result["rows"] if (row.get("measured") or {}).get("status") == "ok"]
    return [(f"{row['strategy']} x{row['n_gpus']} micro {row['micro_batch_size']}", row["predicted_gpu_mem_gib"],
             row.get("peak_gpu_mem_gib"), row["predicted_host_mem_gib"], row.get("peak_host_mem_gib"))
            for row in result["rows"] if row.get("status") == "ok" and row.get("predicted_gpu_mem_gib") is not None]


def tables(paths: list[Path]) -> str:
    results = [(p, json.loads(p.read_text())) for p in paths]
    plans = [(p, r) for p, r in results if "summary" in r]
    out = ["| workload | file | GPU | GPUs | planned | planned tokens/s | best measured | best tokens/s | planned / best |",
           "|---|---|---|---|---|---|---|---|---|"]
    for path, plan in plans:
        s = plan["summary"]
        out.append(f"| {_name(path)} | [{path.name}]({path}) | {s['gpu']} | {s['n_gpus']} | "
                   f"{s['planned_strategy']} | {s['planned_tokens_per_s']:,.0f} | {s['best_strategy']} | "
                   f"{s['best_tokens_per_s']:,.0f} | {s['planned_vs_best']:.2f} |")
    out += ["", "| workload | trial | predicted GPU GiB | measured GPU GiB | error | predicted host GiB "
            "| measured host GiB | error |", "|---|---|---|---|---|---|---|---|"]
    for path, result in results:
        name = _name(path) if "summary" in result else f"{result['recipe']} ({path.parent.name})"
        for label, p_gpu, gpu, p_host, host in _measured_rows(path, result):
            out.append(f"| {name} | {label} | {p_gpu:.2f} | {gpu or 0:.2f} | {_pct(p_gpu, gpu)} | {p_host:.2f} | "
                       f"{host or 0:.2f} | {_pct(p_host, host)} |")
    return "\n".join(out) + "\n"


def plot(paths: list[Path], out: Path) -> None:
    """One panel a plan: its trials' measured tokens/s, coloured by engine family; the planner's pick hatched."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plans = [(p, r) for p, r in ((p, json.loads(p.read_text())) for p in paths) if "summary" in r]
    if not plans:
        raise SystemExit("--plot: none of the files is a plan (plan.json of zerotrain plan)")
    ok = [[r for r in plan["rows"] if (r.get("measured") or {}).get("status") == "ok"] for _, plan in plans]
    fig, axes = plt.subplots(len(plans), 1, figsize=(8, sum(1.4 + 0.35 * len(t) for t in ok)), squeeze=False)
    colours = {"DeepSpeed ZeRO": "tab:blue", "FSDP2": "tab:orange"}
    for ax, (path, plan), done in zip(axes[:, 0], plans, ok):
        trials = sorted(done, key=lambda r: r["measured"]["tokens_per_s"])
        bars = ax.barh([r["candidate"] for r in trials], [r["measured"]["tokens_per_s"] for r in trials],
                       color=[colours.get(r["family"], "tab:gray") for r in trials])
        for bar, row in zip(bars, trials):
            if row["candidate"] == plan["summary"]["planned_strategy"]:
                bar.set_hatch("//")
        s = plan["summary"]
        ax.set_title(f"{_name(path)}: {s['n_gpus']} x {s['gpu']} (hatched: the planner's pick)",
                     fontsize=9)
        ax.set_xlabel("measured tokens/s")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    axes[-1, 0].legend(handles, list(colours), loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    args = sys.argv[1:]
    png = None
    if "--plot" in args:
        i = args.index("--plot")
        if i + 1 == len(args):
            raise SystemExit("--plot needs the PNG's path")
        png, args = Path(args[i + 1]), args[:i] + args[i + 2:]
    print(tables([Path(p) for p in args]))
    if png is not None:
        plot([Path(p) for p in args], png)
