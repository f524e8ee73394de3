"""Training time per epoch from runs' metrics.jsonl, for runs that log every N steps.

Each logged window (the steps since the previous log) ran at its ``sec_per_step``; a window that straddles
an epoch's end is split between the two epochs by its steps. Prints one Markdown row per run.

    python benchmarks/epoch_times.py --steps_per_epoch 781 RUN_DIR/metrics.jsonl [...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def epoch_seconds(path: Path, steps_per_epoch: int) -> tuple[list[float], float]:
    """Seconds of training per epoch (whole epochs only), and ms/step over the last window."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "sec_per_step" in r]
    seconds: dict[int, float] = {}
    previous = 0
    for r in rows:
        for step in range(previous, r["step"]):  # step counts from 0 within the window
            epoch = step // steps_per_epoch
            seconds[epoch] = seconds.get(epoch, 0.0) + r["sec_per_step"]
        previous = r["step"]
    whole = previous // steps_per_epoch
    last_ms = 1000 * rows[-1]["sec_per_step"] if rows else float("nan")
    return [seconds[e] for e in range(whole)], last_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps_per_epoch", type=int, required=True)
    parser.add_argument("metrics", nargs="+", type=Path)
    args = parser.parse_args()
    print("| run | training time per epoch (s) | ms/step, last window |")
    print("|---|---|---|")
    for path in args.metrics:
        times, last_ms = epoch_seconds(path, args.steps_per_epoch)
        print(f"| {path.parent.name} | {', '.join(f'{t:.1f}' for t in times)} | {last_ms:.1f} |")


if __name__ == "__main__":
    main()
