"""Loss curves of benchmark runs side by side: ``python benchmarks/loss_curves.py OUT.json SWEEP_DIR...``.

Reads ``SWEEP_DIR/runs/*/metrics.jsonl`` (what ``zerotrain benchmark`` leaves) and writes, per run,
the logged training loss by step, and for runs of the same strategy in two sweeps the largest
relative difference between their curves (e.g. the fast path against DeepSpeed's defaults).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def curves(sweep: Path) -> dict[str, dict[int, float]]:
    out = {}
    for metrics in sorted(sweep.glob("runs/*/metrics.jsonl")):
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        out[metrics.parent.name] = {r["step"]: r["train_loss"] for r in rows if "train_loss" in r}
    return out


def main(out: str, *sweeps: str) -> None:
    found = {s: curves(Path(s)) for s in sweeps}
    result: dict = {"sweeps": found, "max_rel_diff": {}}
    first, *others = sweeps
    for other in others:
        for run, curve in found[first].items():
            twin = found[other].get(run)
            if twin:
                common = sorted(set(curve) & set(twin))
                diffs = [abs(curve[s] - twin[s]) / abs(twin[s]) for s in common if twin[s]]
                result["max_rel_diff"][f"{run}: {first} vs {other}"] = max(diffs) if diffs else None
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    for key, value in result["max_rel_diff"].items():
        print(f"{key}: max relative loss difference {value}")


if __name__ == "__main__":
    main(*sys.argv[1:])
