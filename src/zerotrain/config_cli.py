"""A recipe's typed config from command-line flags: what ``zerotrain fit`` parses, for any command.

The flags are generated from the recipe's config dataclasses (jsonargparse), so every field of
the typed config is a flag, its docstring is the help text, and a YAML file given with
``--config`` sets values that later flags override. ``zerotrain fit`` and ``zerotrain estimate``
(and the benchmark scripts) read the same flags through :func:`parse_config`.
"""

from __future__ import annotations

import dataclasses
from argparse import ArgumentError

from zerotrain import recipes
from zerotrain.config import RunConfig
from zerotrain.errors import UserError


def build_parser(recipe: str):
    """The jsonargparse parser of ``zerotrain fit RECIPE``'s flags."""
    from jsonargparse import ActionConfigFile, ArgumentParser, set_parsing_settings

    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    task_cls = recipes.get(recipe)
    cfg_cls, description = task_cls.config_class, task_cls.description
    # exit_on_error=False: a wrong flag becomes one line naming it, not seventy lines of usage.
    parser = ArgumentParser(prog=f"zerotrain fit {recipe}", description=description, default_env=False,
                            exit_on_error=False)
    parser.add_argument("--config", action=ActionConfigFile, help="YAML file with any of the options below")
    parser.add_class_arguments(cfg_cls, nested_key=None, as_group=False)
    return parser


def parse_config(recipe: str, argv: list[str]) -> RunConfig:
    """The typed config of ``recipe`` from defaults < ``--config`` file < flags."""
    cfg_cls = recipes.get(recipe).config_class
    parser = build_parser(recipe)
    try:
        parsed = parser.parse_args(argv)
    except ArgumentError as exc:
        raise UserError(f"{exc} (see: zerotrain fit {recipe} --help)") from None
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes  # renamed in jsonargparse 4.4x
    ns = instantiate(parsed)
    return cfg_cls(**{f.name: ns[f.name] for f in dataclasses.fields(cfg_cls)})
