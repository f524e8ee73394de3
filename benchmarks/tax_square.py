"""The engine tax from a Latin square: one ``zerotrain benchmark`` per GPU, all running at once.

GPU g ran the engines in an order rotated by g (``gpu_suite.sh imdb_tax_square``), so at any moment the GPUs
ran different engines, and each engine ran on every GPU. On one GPU a host-bound step moves more from one
process to the next than two engines differ by (IMDB (b): 6.2 and 8.6 ms for the same engine, BENCHMARKS.md
session 22); many rows, paired two ways, say what the engine itself costs:

* **same GPU, same round**: each row against the plain row that ran on its GPU in its round (cancels
  what differs between GPUs and their CPU slices);
* **same time slot**: each row against the plain row that ran at the same time on another GPU (cancels
  what the whole machine did at that moment).

Writes ``tax_square.json``, ``tax_square.md`` and ``tax_square.png`` (every row's s/step per engine) into
the folder it reads.

    python benchmarks/tax_square.py OUT/imdb_tax_square   # reads OUT/imdb_tax_square/gpu*/benchmark.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

BASELINE = "ddp"


def read_rows(folder: Path) -> list[dict[str, Any]]:
    """Every ok row of ``folder/gpu*/benchmark.json`` with its GPU, round and time slot (its place in its
    GPU's run order, which the rotation lines up across GPUs)."""
    rows = []
    for path in sorted(folder.glob("gpu*/benchmark.json")):
        gpu = int(path.parent.name.removeprefix("gpu"))
        for slot, row in enumerate(json.loads(path.read_text())["rows"]):
            if row.get("status") == "ok" and row.get("throughput_sec_per_step"):
                rows.append({"gpu": gpu, "round": row.get("round", 1), "slot": slot, "strategy": row["strategy"],
                             "sec_per_step": row["throughput_sec_per_step"],
                             "host_cpu_frac": row.get("throughput_host_cpu_frac"),
                             "backward_cpu_frac": row.get("throughput_host_backward_cpu_frac")})
    return rows


def paired_taxes(rows: list[dict[str, Any]], key: tuple[str, ...]) -> dict[str, list[float]]:
    """Per engine, each row's s/step over the baseline row's that shares ``key`` with it, minus 1."""
    base = {tuple(r[k] for k in key): r["sec_per_step"] for r in rows if r["strategy"] == BASELINE}
    taxes: dict[str, list[float]] = {}
    for r in rows:
        ref = base.get(tuple(r[k] for k in key))
        if r["strategy"] != BASELINE and ref:
            taxes.setdefault(r["strategy"], []).append(r["sec_per_step"] / ref - 1)
    return taxes


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    same_gpu = paired_taxes(rows, ("gpu", "round"))
    same_slot = paired_taxes(rows, ("slot",))
    engines = []
    for name in dict.fromkeys(r["strategy"] for r in rows):
        times = sorted(r["sec_per_step"] for r in rows if r["strategy"] == name)
        engines.append({
            "strategy": name, "rows": len(times), "median_ms": 1000 * statistics.median(times),
            "fastest_ms": 1000 * times[0], "slowest_ms": 1000 * times[-1],
            "tax_same_gpu": _spread(same_gpu.get(name)), "tax_same_slot": _spread(same_slot.get(name)),
        })
    gpus = sorted({r["gpu"] for r in rows})
    per_gpu = {g: 1000 * statistics.median(r["sec_per_step"] for r in rows if r["gpu"] == g) for g in gpus}
    return {"baseline": BASELINE, "engines": engines, "median_ms_per_gpu": per_gpu, "rows": rows}


def _spread(values: list[float] | None) -> dict[str, Any] | None:
    if not values:
        return None
    v = sorted(values)
    return {"n": len(v), "median": statistics.median(v), "lowest": v[0], "highest": v[-1],
            "within_5pct": sum(abs(x) <= 0.05 for x in v), "within_10pct": sum(abs(x) <= 0.10 for x in v)}


def markdown(s: dict[str, Any]) -> str:
    def tax(t: dict[str, Any] | None) -> str:
        if t is None:
            return "-"
        return f"{t['median']:+.1%} ({t['lowest']:+.1%} to {t['highest']:+.1%}, n={t['n']})"

    env = s.get("environment", {})
    lines = [f"GPUs: {', '.join(env.get('gpus', []))}; torch {env.get('versions', {}).get('torch')}, DeepSpeed "
             f"{env.get('versions', {}).get('deepspeed')}; commit {env.get('commit')}.", "",
             *[f"- GPU {g}: `{c}`" for g, c in enumerate(s.get("commands", []))], "",
             "| engine | rows | median ms/step | fastest - slowest | tax, same GPU and round | tax, same time slot |",
             "|---|---|---|---|---|---|"]
    for e in s["engines"]:
        lines.append(f"| {e['strategy']} | {e['rows']} | {e['median_ms']:.2f} | {e['fastest_ms']:.2f} - "
                     f"{e['slowest_ms']:.2f} | {tax(e['tax_same_gpu'])} | {tax(e['tax_same_slot'])} |")
    lines += ["", "Median ms/step per GPU (all engines): "
              + ", ".join(f"GPU {g} {ms:.2f}" for g, ms in s["median_ms_per_gpu"].items()), "",
              "| GPU | round | slot | engine | ms/step | loop thread on CPU | backward thread on CPU |",
              "|---|---|---|---|---|---|---|"]
    for r in sorted(s["rows"], key=lambda r: (r["slot"], r["gpu"])):
        shares = [f"{r[k]:.0%}" if r.get(k) is not None else "-" for k in ("host_cpu_frac", "backward_cpu_frac")]
        lines.append(f"| {r['gpu']} | {r['round']} | {r['slot']} | {r['strategy']} | {1000 * r['sec_per_step']:.2f} | "
                     f"{shares[0]} | {shares[1]} |")
    return "\n".join(lines) + "\n"


def plot(s: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    names = [e["strategy"] for e in s["engines"]]
    for i, name in enumerate(names):
        ys = [1000 * r["sec_per_step"] for r in s["rows"] if r["strategy"] == name]
        ax.scatter([i + 0.04 * (k - len(ys) / 2) for k in range(len(ys))], ys, s=14)
        ax.hlines(statistics.median(ys), i - 0.3, i + 0.3, color="k")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("ms per step (every row; line: median)")
    ax.set_title("Engine tax, Latin square over the GPUs")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="holds gpu0/benchmark.json, gpu1/benchmark.json, ...")
    args = parser.parse_args()
    rows = read_rows(args.folder)
    if not rows:
        raise SystemExit(f"tax_square: no ok rows in {args.folder}/gpu*/benchmark.json")
    results = [json.loads(p.read_text()) for p in sorted(args.folder.glob("gpu*/benchmark.json"))]
    s = {**summarize(rows), "environment": results[0]["environment"], "commands": [r["command"] for r in results]}
    (args.folder / "tax_square.json").write_text(json.dumps(s, indent=1) + "\n")
    (args.folder / "tax_square.md").write_text(markdown(s))
    plot(s, args.folder / "tax_square.png")
    print(markdown(s))


if __name__ == "__main__":
    main()
