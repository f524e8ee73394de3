"""``zerotrain fit RECIPE [--config FILE] [--section.field VALUE ...]``: train.

RECIPE is a shipped or installed recipe's name, or ``module:Class``, a Task subclass of your own that
Python imports from the current folder or the environment (see :mod:`zerotrain.tasks.registry`).

The flags are generated from the recipe's config dataclasses (jsonargparse), so every field of
the typed config is a flag, its docstring is the help text, and a YAML file given with
``--config`` sets values that later flags override.
"""

from __future__ import annotations

import sys

# parse_config lives in zerotrain.config.flags (estimate and the benchmarks use it too, without this command).
from zerotrain.config.flags import parse_config
from zerotrain.errors import ConfigError
from zerotrain.plan.planner import plan_for_fit
from zerotrain.runtime.launcher import (
    launched_by_a_launcher,
    restart_flags,
    resume_after_restart,
    spawn_local_workers,
)
from zerotrain.runtime.rundir import new_run_name
from zerotrain.tasks import registry as recipes
from zerotrain.train.loop import fit


def _recipe_list() -> str:
    lines = [f"  {name:<6}{task.description}" for name, task in recipes.all_recipes().items()]
    lines.append("  module:Class  your own Task subclass, imported from the current folder or the environment "
                 "(e.g. my_package.my_module:MyTask)")
    return "\n".join(lines)


def _drop_local_rank(argv: list[str]) -> list[str]:
    """The ``deepspeed`` launcher appends ``--local_rank=N``; zerotrain reads LOCAL_RANK from the environment."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--local_rank", "--local-rank"):
            skip = True
        elif not arg.startswith(("--local_rank=", "--local-rank=")):
            out.append(arg)
    return out


def run(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print(f"usage: zerotrain fit RECIPE [--config FILE] [flags]\n\nrecipes:\n{_recipe_list()}",
              file=sys.stderr if not argv or argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    recipe, rest = argv[0], _drop_local_rank(argv[1:])
    task_cls = recipes.get(recipe)  # one line naming RECIPE when it names no task
    cfg = parse_config(recipe, rest).validate()


    launch = cfg.launch
    if cfg.strategy.auto:
        if launched_by_a_launcher(launch):

            raise ConfigError("--strategy.auto", "plans before the processes start, which another launcher (torchrun, "
                              "srun, deepspeed) has already done: run `zerotrain plan RECIPE ...` once and start the "
                              "job with --config <plan folder>/plan.yaml, or launch with zerotrain itself")

        rest = [*rest, *plan_for_fit(recipe, cfg, rest)]  # later flags win: the plan's choice, auto off
        argv = [recipe, *rest]
        cfg = parse_config(recipe, rest).validate()
    if (launch.nproc_per_node > 1 or launch.nnodes > 1 or launch.max_restarts) and not launched_by_a_launcher(launch):
        return spawn_local_workers(launch, ["fit", *argv, *restart_flags(cfg, new_run_name(recipe))])
    if resumed := resume_after_restart(cfg):  # a restarted worker: from the run's last complete checkpoint
        cfg = parse_config(recipe, [*rest, *resumed]).validate()


    result = fit(task_cls(cfg))  # leaves no process group behind (distributed.setup)
    if result.is_main:
        print(f"run directory: {result.run_dir}")
    return 0
