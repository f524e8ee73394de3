"""``zerotrain benchmark RECIPE --strategies zero0,zero1,... [--nproc 1,2] --out DIR [fit flags]``.

Runs one ``zerotrain fit`` per strategy and process count and writes ``DIR/benchmark.json`` and
``DIR/benchmark.md`` and a plot ``DIR/benchmark.png`` (tokens/s against peak GPU memory); with
``--profile N``, a profile summary per run; with ``--rounds N``, every fit N times in alternating order and
a summary of the rounds (median s/step, spread, and each strategy's tax against the plain engine). Each row carries the memory model's predicted peaks next to
the measured ones (``--predict false`` skips the probe they need; ``--probe FILE`` reads an earlier one). Flags it does not know are passed to every fit (e.g. ``--config FILE``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from zerotrain.errors import UserError
from zerotrain.plan.benchmark import run_sweep
from zerotrain.plan.strategies import STRATEGIES, parse_strategies
from zerotrain.runtime.rundir import check_out_folder


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="zerotrain benchmark", description=__doc__.split("\n\n")[1])
    parser.add_argument("recipe", help="a recipe name or module:Class, a Task subclass of your own")
    parser.add_argument("--strategies", default="zero0,zero1,zero2,zero3",
                        help=f"comma-separated, from: {', '.join(STRATEGIES)}")
    parser.add_argument("--nproc", default="1", help="comma-separated process (GPU) counts, e.g. 1,2")
    parser.add_argument("--out", default="benchmarks/results/latest", help="folder for benchmark.json/.md/.png and runs/")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="profile STEPS steps of each run after its warm-up; writes profile_<strategy>_<n>gpu.md")
    parser.add_argument("--predict", choices=["true", "false"], default="true",
                        help="put the memory model's predicted peaks next to the measured ones (one probe first)")
    parser.add_argument("--probe", default=None, metavar="FILE",
                        help="predict from this probe file instead of probing first: one taken earlier of the same "
                             "workload on the same GPU kind (python -m zerotrain.plan.probe, or a sweep's probe.json)")
    parser.add_argument("--rounds", type=int, default=1, metavar="N",
                        help="run every fit N times, every other round in reverse order, and summarise the rounds "
                             "(for steps that wait on the host, whose time moves from run to run)")
    args, fit_args = parser.parse_known_args(argv)
    try:
        nprocs = [int(n) for n in args.nproc.split(",")]
    except ValueError:
        raise UserError(f"--nproc must be comma-separated integers, got {args.nproc!r}") from None
    if min(nprocs) < 1 or len(set(nprocs)) < len(nprocs):
        raise UserError(f"--nproc must be process counts >= 1, each once, got {args.nproc!r}")
    strategies = parse_strategies(args.strategies)
    if args.rounds < 1:
        raise UserError(f"--rounds must be >= 1 (fits per strategy), got {args.rounds}")
    if args.profile < 0:
        raise UserError(f"--profile must be >= 0 (steps to profile), got {args.profile}")
    check_out_folder(Path(args.out), "--out")
    result = run_sweep(args.recipe, strategies, nprocs, Path(args.out), fit_args,
                       profile_steps=args.profile, predict=args.predict == "true",
                       probe_file=Path(args.probe) if args.probe else None, rounds=args.rounds)
    print((Path(args.out) / "benchmark.md").read_text())
    return 1 if all("error" in r for r in result["rows"]) else 0
