"""``zerotrain doctor``: what this machine can run, before a long job finds out the hard way."""

from __future__ import annotations

import contextlib
import json
import sys

from zerotrain.runtime.doctor import report


def run(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print("usage: zerotrain doctor [--json]\n\nReport versions, GPUs, compilers, DeepSpeed op build readiness and the DeepSpeed patches active for the\ninstalled version.")
        return 0
    if "--json" in argv:
        # DeepSpeed logs to stdout (its accelerator warning on import); keep stdout pure JSON for `| jq`.
        with contextlib.redirect_stdout(sys.stderr):
            info = report()
        json.dump(info, sys.stdout, indent=2, default=str)
        print()
        return 0
    info = report()
    for section, values in info.items():
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
    return 0
