"""``zerotrain fit RECIPE [--config FILE] [--section.field VALUE ...]``: train.

The flags are generated from the recipe's config dataclasses (jsonargparse), so every field of
the typed config is a flag, its docstring is the help text, and a YAML file given with
``--config`` sets values that later flags override.
"""

from __future__ import annotations

import dataclasses
import sys
from argparse import ArgumentError

from zerotrain import recipes
from zerotrain.config import RunConfig
from zerotrain.errors import UserError


def build_parser(recipe: str):
    from jsonargparse import ActionConfigFile, ArgumentParser, set_parsing_settings

    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    cfg_cls, _ = recipes.load(recipe)
    description = recipes.RECIPES[recipe][3]
    # exit_on_error=False: a wrong flag becomes one line naming it, not seventy lines of usage.
    parser = ArgumentParser(prog=f"zerotrain fit {recipe}", description=description, default_env=False,
                            exit_on_error=False)
    parser.add_argument("--config", action=ActionConfigFile, help="YAML file with any of the options below")
    parser.add_class_arguments(cfg_cls, nested_key=None, as_group=False)
    return parser


def parse_config(recipe: str, argv: list[str]) -> RunConfig:
    """The typed config of ``recipe`` from defaults < ``--config`` file < flags."""
    cfg_cls, _ = recipes.load(recipe)
    parser = build_parser(recipe)
    try:
        parsed = parser.parse_args(argv)
    except ArgumentError as exc:
        raise UserError(f"{exc} (see: zerotrain fit {recipe} --help)") from None
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes  # renamed in jsonargparse 4.4x
    ns = instantiate(parsed)
    return cfg_cls(**{f.name: ns[f.name] for f in dataclasses.fields(cfg_cls)})


def _recipe_list() -> str:
    return "\n".join(f"  {name:<6}{desc}" for name, (_, _, _, desc) in recipes.RECIPES.items())


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
    if recipe not in recipes.RECIPES:
        print(f"zerotrain fit: error: unknown recipe {recipe!r}; choose one of:\n{_recipe_list()}", file=sys.stderr)
        return 2
    cfg = parse_config(recipe, rest).validate()

    from zerotrain.distributed import launched_by_a_launcher, spawn_local_workers

    launch = cfg.launch
    if (launch.nproc_per_node > 1 or launch.nnodes > 1) and not launched_by_a_launcher(launch):
        return spawn_local_workers(launch, ["fit", *argv])

    import torch.distributed

    from zerotrain.loop import fit

    _, task_cls = recipes.load(recipe)
    result = fit(task_cls(cfg))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # a clean exit: NCCL warns about a group left open
    if result.is_main:
        print(f"run directory: {result.run_dir}")
    return 0
