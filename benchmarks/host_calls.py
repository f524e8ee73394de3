"""Where a host-bound step's time goes, by Python function, and what the garbage collector costs there.

torch.profiler (``--trainer.profile_steps``) says how long the host spends in forward, backward and the
optimizer step, not in whose code. This runs one zerotrain job in-process with cProfile switched on
for the optimizer steps ``--first`` to ``--last`` only (after warm-up: compiles and CUDA-graph
recordings are over), and watches the garbage collector over the same steps (``gc.callbacks``).

cProfile sees the main thread: backward's own Python hooks run on the autograd engine's thread and
show up inside ``run_backward``. Its overhead grows with the number of Python calls, so a step takes
longer under it; compare engines by their rows, not by the profiled step time.

    python benchmarks/host_calls.py --first 900 --last 1400 OUT_DIR fit imdb --config configs/imdb_b.yaml ...

Writes ``OUT_DIR/host_calls.json`` and ``host_calls.md``: steps profiled, wall ms per step with and
without cProfile's overhead (the unprofiled steps right before), the top functions by own time and by
inclusive time (ms per step), GC collections per generation with their time, and every function's calls
per step (``calls_per_step``: counts, unlike times, do not depend on the machine, so two engines' host
work compares even on a CPU).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import re
import sys
import threading
import time
from pathlib import Path

TOP = 40


class _Window:
    """Counts ``Engine.train_step`` calls; profiles and watches GC from call ``first`` to ``last``."""

    def __init__(self, first: int, last: int):
        self.first, self.last = first, last
        self.calls = 0
        self.prof = cProfile.Profile()
        self.t_plain = self.t_first = self.t_last = None  # perf_counter at step first - 200, first, last
        self.gc: dict[int, list] = {}  # generation -> [collections, seconds, objects collected]
        self._gc_t0: dict[int, float] = {}
        self.watching = False
        self.threads: list[str] = []  # the process's Python threads at the last profiled step: GIL contenders

    def on_gc(self, phase: str, info: dict) -> None:
        if not self.watching:
            return
        g = info["generation"]
        if phase == "start":
            self._gc_t0[g] = time.perf_counter()
        elif g in self._gc_t0:
            row = self.gc.setdefault(g, [0, 0.0, 0])
            row[0] += 1
            row[1] += time.perf_counter() - self._gc_t0.pop(g)
            row[2] += info.get("collected", 0)

    def wrap(self, train_step):
        def step(engine, *args, **kwargs):
            import torch

            self.calls += 1
            if self.calls == max(1, self.first - 200):
                _sync(torch)
                self.t_plain = time.perf_counter()
            if self.calls == self.first:
                _sync(torch)
                self.t_first = time.perf_counter()
                self.watching = True
                self.prof.enable()
            try:
                return train_step(engine, *args, **kwargs)
            finally:
                if self.calls == self.last:
                    _sync(torch)
                    self.prof.disable()
                    self.watching = False
                    self.t_last = time.perf_counter()
                    self.threads = sorted(t.name for t in threading.enumerate())
        return step


def _sync(torch) -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _name(function: tuple[str, int, str]) -> str:
    """``file.py:line(name)``; a built-in's name without the object address cProfile gives it, which differs from
    one process to the next."""
    file, line, name = function
    return f"{Path(file).name}:{line}({name})" if file != "~" else re.sub(r" at 0x[0-9a-fA-F]+", "", name)


def _calls_per_step(stats: pstats.Stats, steps: int) -> dict[str, float]:
    """Every function's calls per step, by :func:`_name` (functions that share one, added up)."""
    calls: dict[str, float] = {}
    for function, (_, nc, _, _, _) in stats.stats.items():
        calls[_name(function)] = calls.get(_name(function), 0.0) + nc / steps
    return dict(sorted(calls.items()))


def _rows(stats: pstats.Stats, key: int, steps: int) -> list[dict]:
    """Top functions by own (key 2) or inclusive (key 3) time, in ms per profiled step."""
    entries = sorted(stats.stats.items(), key=lambda kv: kv[1][key], reverse=True)[:TOP]
    return [{"function": _name(function),
             "calls_per_step": nc / steps, "own_ms_per_step": tt * 1e3 / steps, "incl_ms_per_step": ct * 1e3 / steps}
            for function, (_, nc, tt, ct, _) in entries]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--first", type=int, required=True, help="first optimizer step profiled (1-based)")
    ap.add_argument("--last", type=int, required=True, help="last optimizer step profiled")
    ap.add_argument("zerotrain_args", nargs=argparse.REMAINDER, help="what follows is `zerotrain ...`")
    args = ap.parse_args()
    if not 1 <= args.first < args.last:
        ap.error("--first and --last: need 1 <= first < last")

    import zerotrain.engines as engine_module
    from zerotrain.cli import main as zerotrain_main

    window = _Window(args.first, args.last)
    engine_module.Engine.train_step = window.wrap(engine_module.Engine.train_step)
    gc.callbacks.append(window.on_gc)
    sys.argv = ["zerotrain", *args.zerotrain_args]
    rc = zerotrain_main()
    if rc:
        return rc
    if window.t_last is None:
        print(f"host_calls: the run took {window.calls} steps, fewer than --last {args.last}", file=sys.stderr)
        return 1

    steps = args.last - args.first + 1
    stats = pstats.Stats(window.prof)
    result = {
        "command": " ".join(sys.argv),
        "steps_profiled": steps,
        "first": args.first,
        "python": sys.version.split()[0],
        "ms_per_step_unprofiled": ((window.t_first - window.t_plain) * 1e3 / (args.first - max(1, args.first - 200))
                                   if window.t_plain is not None and args.first > 1 else None),
        "ms_per_step_profiled": (window.t_last - window.t_first) * 1e3 / steps,
        "gc": {str(g): {"collections": n, "ms": t * 1e3, "collected": c} for g, (n, t, c) in sorted(window.gc.items())},
        "gc_tracked_objects": len(gc.get_objects()),
        "python_threads": window.threads,
        "by_own_time": _rows(stats, 2, steps),
        "by_inclusive_time": _rows(stats, 3, steps),
        "calls_per_step": _calls_per_step(stats, steps),
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "host_calls.json").write_text(json.dumps(result, indent=1))
    (args.out_dir / "host_calls.md").write_text(_markdown(result))
    print(_markdown(result).split("\n\n")[0])
    return 0


def _markdown(r: dict) -> str:
    unprofiled = r["ms_per_step_unprofiled"]
    gc_rows = ", ".join(f"gen {g}: {v['collections']} ({v['ms']:.1f} ms)" for g, v in r["gc"].items()) or "none"
    lines = [f"Steps {r['first']}-{r['first'] + r['steps_profiled'] - 1} under cProfile: "
             f"{r['ms_per_step_profiled']:.2f} ms/step (unprofiled just before: "
             f"{'-' if unprofiled is None else f'{unprofiled:.2f}'} ms/step). Garbage collections in those steps: "
             f"{gc_rows}; {r['gc_tracked_objects']} objects tracked at the end. "
             f"Python threads: {', '.join(r['python_threads'])}.", "", f"`{r['command']}`", ""]
    for key, title in (("by_own_time", "own"), ("by_inclusive_time", "inclusive")):
        lines += [f"| function (by {title} time) | calls/step | own ms/step | incl. ms/step |", "|---|---|---|---|"]
        lines += [f"| `{x['function']}` | {x['calls_per_step']:.1f} | {x['own_ms_per_step']:.3f} | "
                  f"{x['incl_ms_per_step']:.3f} |" for x in r[key]] + [""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
