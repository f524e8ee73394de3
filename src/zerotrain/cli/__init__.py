"""``zerotrain`` command line: one module per subcommand, each mapping its arguments onto a library call.

A :class:`~zerotrain.errors.UserError` raised anywhere below is printed as one line naming the
flag or file, and the command exits with status 2: no traceback for mistakes a user can fix.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

from zerotrain.errors import UserError

SUBCOMMANDS = {
    "fit": "train a recipe (zerotrain fit RECIPE --help)",
    "benchmark": "sweep ZeRO stages / offload / DDP and tabulate speed and memory",
    "estimate": "model-state memory of every strategy, and the fastest that fits",
    "predict": "classify texts with a trained IMDB run",
    "doctor": "report versions, GPUs, compilers and DeepSpeed op readiness",
}


def _usage() -> str:
    lines = ["usage: zerotrain SUBCOMMAND ...", "", "subcommands:"]
    lines += [f"  {name:<11}{desc}" for name, desc in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"zerotrain: error: unknown subcommand {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    import importlib

    module = importlib.import_module(f"zerotrain.cli.{name}")
    try:
        return module.run(rest) or 0
    except UserError as exc:
        print(f"zerotrain {name}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("zerotrain: interrupted", file=sys.stderr)
        return 130
