"""``zerotrain plan RECIPE [fit flags] [--out DIR] [--trials K] [--trial_steps N] [--strategies a,b]``.

Measures the recipe's model on this machine, predicts the memory and speed of every configuration
(backend, ZeRO stage, offload, micro-batch with accumulation for the same global batch, activation
checkpointing) for the GPUs of the launch flags, tries the fastest few that fit in short runs of
their own, and writes the choice: DIR/plan.md (the table), plan.json, plan.yaml (train with
``zerotrain fit RECIPE --config DIR/plan.yaml``) and ds_config.json (for the Hugging Face Trainer or
Lightning). Flags it does not know are the run's own (e.g. ``--config FILE``, ``--launch.nproc_per_node``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from zerotrain.config.flags import parse_config
from zerotrain.errors import UserError
from zerotrain.plan.planner import plan
from zerotrain.plan.strategies import parse_strategies
from zerotrain.runtime.rundir import check_out_folder
from zerotrain.tasks import registry as recipes


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="zerotrain plan", description=__doc__.split("\n\n")[1])
    parser.add_argument("recipe", help="a recipe name (zerotrain fit --help lists them) or module:Class, a Task "
                        "subclass of your own")
    parser.add_argument("--out", default=None, help="plan folder (default: <output_dir>/plans/<recipe>)")
    parser.add_argument("--trials", type=int, default=3, help="short runs of the best predicted candidates")
    parser.add_argument("--trial_steps", type=int, default=8,
                        help="measured optimizer steps per trial at least (after the warm-up)")
    parser.add_argument("--trial_seconds", type=float, default=4.0,
                        help="measured training time per trial: more steps where the predicted step is short")
    parser.add_argument("--strategies", default=None, help="consider only these (comma-separated strategy names)")
    parser.add_argument("--compare_strategies", action="store_true",
                        help="also run every strategy at the configured micro-batch (what a benchmark sweep measures)")
    parser.add_argument("--host_memory_gib", type=float, default=None, help="memory of one host (default: this one's)")
    args, fit_args = parser.parse_known_args(argv)
    if args.trial_steps < 1:
        raise UserError(f"--trial_steps must be >= 1, got {args.trial_steps}")
    if not args.trial_seconds >= 0:
        raise UserError(f"--trial_seconds must be >= 0, got {args.trial_seconds}")
    if args.host_memory_gib is not None and not args.host_memory_gib > 0:
        raise UserError(f"--host_memory_gib must be > 0, got {args.host_memory_gib}")
    cfg = parse_config(args.recipe, fit_args)
    short = recipes.name_of(recipes.get(args.recipe))  # a module:Class spec holds a colon
    out = Path(args.out) if args.out else Path(cfg.trainer.output_dir) / "plans" / short
    check_out_folder(out, "--out" if args.out else "--trainer.output_dir")


    plan(args.recipe, cfg, fit_args, out, trials=args.trials, trial_steps=args.trial_steps,
         strategies=parse_strategies(args.strategies) if args.strategies is not None else None,
         compare_strategies=args.compare_strategies, host_memory_gib=args.host_memory_gib,
         trial_seconds=args.trial_seconds)
    print((out / "plan.md").read_text())
    return 0
