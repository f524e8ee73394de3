"""The BENCHMARKS.md tables of `zerotrain plan` results, regenerated from the plan_*.json files.

    python benchmarks/plan_tables.py benchmarks/results/h100/plan/plan_*.json benchmarks/results/h200x2/plan/plan_*.json

Prints two Markdown tables: the plan's pick against the fastest configuration measured in the same
session, and the predicted peak memory of every trial against what that trial measured.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _pct(predicted: float, measured: float | None) -> str:
    return f"{100 * (predicted / measured - 1):+.0f}%" if measured else "-"


def tables(paths: list[Path]) -> str:
    plans = [(p, json.loads(p.read_text())) for p in paths]
    out = ["| workload | file | GPU | GPUs | planned | planned tokens/s | best measured | best tokens/s | planned / best |",
           "|---|---|---|---|---|---|---|---|---|"]
    for path, plan in plans:
        s = plan["summary"]
        out.append(f"| {path.stem.removeprefix('plan_')} | [{path.name}]({path}) | {s['gpu']} | {s['n_gpus']} | "
                   f"{s['planned_strategy']} | {s['planned_tokens_per_s']:,.0f} | {s['best_strategy']} | "
                   f"{s['best_tokens_per_s']:,.0f} | {s['planned_vs_best']:.2f} |")
    out += ["", "| workload | trial | predicted GPU GiB | measured GPU GiB | error | predicted host GiB "
            "| measured host GiB | error |", "|---|---|---|---|---|---|---|---|"]
    for path, plan in plans:
        for row in plan["rows"]:
            m = row.get("measured") or {}
            if m.get("status") != "ok":
                continue
            gpu, host = m.get("peak_gpu_mem_gib"), m.get("peak_host_mem_gib")
            out.append(f"| {path.stem.removeprefix('plan_')} | {row['candidate']} | {row['predicted_gpu_mem_gib']:.2f} | "
                       f"{gpu:.2f} | {_pct(row['predicted_gpu_mem_gib'], gpu)} | {row['predicted_host_mem_gib']:.2f} | "
                       f"{host:.2f} | {_pct(row['predicted_host_mem_gib'], host)} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(tables([Path(p) for p in sys.argv[1:]]))
