"""How fast each CPU of this machine runs one Python thread, to tell a slow CPU from a slow engine.

A host-bound training step (IMDB (b): ~4 ms of Python and dispatch a step) is as fast as the CPU its loop
thread lands on. On a virtual machine the CPUs it sees are threads of a hypervisor, and they need not be
alike: one may share a physical core with a busy neighbour. This pins itself to each CPU in turn, times
the same pure-Python work there, repeats the sweep in a shuffled order, and reports each CPU's median.

    python benchmarks/cpu_speed.py --out OUT/cpu_speed   # writes cpu_speed.json and cpu_speed.md
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path


def work(n: int) -> int:
    """Interpreter work like a training loop's host side: calls, attribute and dict lookups, small ints."""
    table: dict[int, int] = {}
    total = 0
    for i in range(n):
        table[i & 255] = total
        total += len(str(i)) + table.get((i * 7) & 255, 0) % 3
    return total


def sweep(cpus: list[int], repeats: int, n: int, seed: int = 0) -> dict[int, list[float]]:
    """Seconds for ``work(n)`` on each CPU, ``repeats`` times, CPUs visited in a new random order each time."""
    rng = random.Random(seed)
    times: dict[int, list[float]] = {c: [] for c in cpus}
    mask = os.sched_getaffinity(0)
    try:
        for _ in range(repeats):
            order = cpus[:]
            rng.shuffle(order)
            for cpu in order:
                os.sched_setaffinity(0, {cpu})
                work(n // 10)  # the first instructions on a CPU warm its caches; not timed
                start = time.perf_counter()
                work(n)
                times[cpu].append(time.perf_counter() - start)
    finally:
        os.sched_setaffinity(0, mask)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--n", type=int, default=200_000)
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    times = sweep(cpus, args.repeats, args.n)
    median = {c: statistics.median(t) for c, t in times.items()}
    fastest = min(median.values())
    result = {"cpus": len(cpus), "n": args.n, "repeats": args.repeats, "seconds": times,
              "median_ms": {c: 1000 * m for c, m in median.items()},
              "slowest_over_fastest": max(median.values()) / fastest}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cpu_speed.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"{len(cpus)} CPUs, work({args.n}) x {args.repeats} per CPU: slowest CPU's median "
             f"{result['slowest_over_fastest']:.3f}x the fastest's", "",
             "| CPU | median ms | x fastest | spread of its repeats |", "|---|---|---|---|"]
    for c in cpus:
        t = times[c]
        lines.append(f"| {c} | {1000 * median[c]:.2f} | {median[c] / fastest:.3f} | {max(t) / min(t) - 1:.1%} |")
    (args.out / "cpu_speed.md").write_text("\n".join(lines) + "\n")
    print(lines[0])


if __name__ == "__main__":
    main()
