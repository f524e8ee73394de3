"""Where each thread of a process was, from py-spy's raw stacks: one table per thread, by innermost frame.

``py-spy record --threads --idle -f raw`` samples every thread at a fixed rate, running or not, so a frame's
share of a thread's samples is its share of that thread's wall time. For the training loop's thread the
frames are also grouped by the innermost zerotrain frame above them (what zerotrain code was waiting).

    python benchmarks/stack_shares.py RAW.txt [--threads MainThread,Dummy] [--top 12] > RAW.md
"""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict
from pathlib import Path
from typing import Optional


def _short(frame: str) -> str:
    """``fn (path/to/file.py:12)`` -> ``fn (file.py:12)``."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rsplit('/', 1)[-1]}" if where else frame


def shares(lines: list[str], phases: Optional[defaultdict] = None) -> dict[str, tuple[int, Counter, Counter]]:
    """Per thread: its samples, and its samples by innermost frame and by innermost zerotrain frame > frame;
    by step phase (:func:`phase`) into ``phases`` where given."""
    phases = defaultdict(Counter) if phases is None else phases
    threads: dict[str, tuple[int, Counter, Counter]] = {}
    for line in lines:
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        frames, n = stack.split(";"), int(count)
        thread = next((f.split(": ", 1)[-1] for f in frames if f.startswith("thread (")), "?")
        total, leaf, ours = threads.get(thread, (0, Counter(), Counter()))
        calls = [f for f in frames if not f.startswith(("thread (", "process "))]
        inner = _short(calls[-1]) if calls else "(no Python frame: native code, or idle)"
        leaf[inner] += n
        zt = [f for f in calls if "zerotrain/" in f]
        ours[f"{_short(zt[-1]) if zt else '-'} > {inner}"] += n
        phases[thread][phase(calls)] += n
        threads[thread] = (total + n, leaf, ours)
    return threads


def phase(calls: list[str]) -> str:
    """The part of zerotrain's training step a stack is in, from the frame that ``Engine.train_step`` called:
    its backward or optimizer-step hook, or its own lines (the forward, moving the batch, adding up the loss)."""
    for i, frame in enumerate(calls):
        name, _, where = frame.partition(" (")
        if name.endswith("train_step") and "zerotrain/engine.py" in where:
            callee = calls[i + 1].partition(" (")[0] if i + 1 < len(calls) else ""
            if callee.endswith("._backward"):
                return "backward"
            if callee.endswith("._optimizer_step"):
                return "optimizer step"
            return "forward and the step's own lines"
    return "outside the step"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("raw", type=Path)
    parser.add_argument("--threads", default="", help="comma-separated name parts; default: every thread")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    wanted = [t for t in args.threads.split(",") if t]
    out = [f"py-spy samples from `{args.raw.name}`, share of each thread's samples", ""]
    phases: defaultdict = defaultdict(Counter)
    threads = shares(args.raw.read_text().splitlines(), phases)
    for thread, (total, leaf, ours) in sorted(threads.items(), key=lambda x: -x[1][0]):
        if wanted and not any(w in thread for w in wanted):
            continue
        out += [f"### {thread}: {total} samples", ""]
        if set(phases[thread]) != {"outside the step"}:  # the loop's thread
            out += ["| share | part of the training step |", "|---|---|"]
            out += [f"| {c / total:.1%} | {k} |" for k, c in phases[thread].most_common()] + [""]
        out += ["| share | innermost frame |", "|---|---|"]
        out += [f"| {c / total:.1%} | `{k}` |" for k, c in leaf.most_common(args.top)]
        if any(not k.startswith("- >") for k in ours):
            out += ["", "| share | innermost zerotrain frame > innermost frame |", "|---|---|"]
            out += [f"| {c / total:.1%} | `{k}` |" for k, c in ours.most_common(args.top)]
        out.append("")
    print("\n".join(out))


if __name__ == "__main__":
    main()
