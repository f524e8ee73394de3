"""``zerotrain doctor [--json] [--build]``: what this machine can run, before a long job finds out the hard way."""

from __future__ import annotations

import contextlib
import json
import sys

from zerotrain.errors import UserError
from zerotrain.runtime.doctor import build_ops, report

USAGE = """usage: zerotrain doctor [--json] [--build]

Report versions, GPUs, compilers, DeepSpeed op build readiness and the DeepSpeed patches active for the
installed version.
  --json   the report as JSON on stdout
  --build  also compile the DeepSpeed ops this machine can use (the CPU communication op, CPUAdam, FusedAdam,
           AsyncIO), which a first run would otherwise compile on first use, for minutes"""


def run(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    unknown = [a for a in argv if a not in ("--json", "--build")]
    if unknown:

        raise UserError(f"unknown argument {unknown[0]!r}; zerotrain doctor takes --json and --build")
    if "--json" in argv:
        # DeepSpeed logs to stdout (its accelerator warning on import); keep stdout pure JSON for `| jq`.
        with contextlib.redirect_stdout(sys.stderr):
            info = report()
            if "--build" in argv:
                info["built"] = build_ops(say=lambda line: print(line, file=sys.stderr))
        json.dump(info, sys.stdout, indent=2, default=str)
        print()
        return 0
    info = report()
    for section, values in info.items():
        if isinstance(values, str):  # a verdict: one line
            print(f"{section}: {values}")
            continue
        print(f"{section}:")
        if isinstance(values, dict):
            width = max(map(len, values), default=0)
            for k, v in values.items():
                print(f"  {k:<{width}}  {v}")
        elif isinstance(values, list):
            for v in values or ["(none)"]:
                print(f"  {v}")
        else:
            print(f"  {values}")
    if "--build" in argv:
        print("building DeepSpeed's ops:")
        results = build_ops(say=lambda line: print(f"  {line}", flush=True))
        return 1 if any(v.startswith("FAILED") for v in results.values()) else 0
    return 0
