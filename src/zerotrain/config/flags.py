"""A recipe's typed config from command-line flags: what ``zerotrain fit`` parses, for any command.

The flags are generated from the recipe's config dataclasses (jsonargparse), so every field of
the typed config is a flag, its docstring is the help text, and a YAML file given with
``--config`` sets values that later flags override. ``zerotrain fit`` and ``zerotrain estimate``
(and the benchmark scripts) read the same flags through :func:`parse_config`.
"""

from __future__ import annotations

import dataclasses
from argparse import ArgumentError

from zerotrain.config import MOVED, RunConfig, moved_setting
from zerotrain.errors import UserError
from zerotrain.tasks import registry as recipes


def build_parser(recipe: str):
    """The jsonargparse parser of ``zerotrain fit RECIPE``'s flags."""
    from jsonargparse import ActionConfigFile, ArgumentParser, set_parsing_settings

    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    task_cls = recipes.get(recipe)
    cfg_cls, description = task_cls.config_class, task_cls.description
    # exit_on_error=False: a wrong flag becomes one line naming it, not seventy lines of usage.
    # allow_abbrev=False: argparse would take --trainer.max_step for --trainer.max_steps (and any unique prefix),
    # so a misspelt flag silently set another; the user should see the typo instead.
    parser = ArgumentParser(prog=f"zerotrain fit {recipe}", description=description, default_env=False,
                            exit_on_error=False, allow_abbrev=False)
    parser.add_argument("--config", action=ActionConfigFile, help="YAML file with any of the options below")
    parser.add_class_arguments(cfg_cls, nested_key=None, as_group=False)
    return parser


def parse_config(recipe: str, argv: list[str]) -> RunConfig:
    """The typed config of ``recipe`` from defaults < ``--config`` file < flags."""
    cfg_cls = recipes.get(recipe).config_class
    refuse_moved(argv)
    parser = build_parser(recipe)
    try:
        parsed = parser.parse_args(argv)
    except ArgumentError as exc:
        raise UserError(f"{_explain(one_line(str(exc)), argv, cfg_cls)} (see: zerotrain fit {recipe} --help)") from None
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes  # renamed in jsonargparse 4.4x
    ns = instantiate(parsed)
    return cfg_cls(**{f.name: ns[f.name] for f in dataclasses.fields(cfg_cls)})


def refuse_moved(argv: list[str]) -> None:
    """One line for a setting of the old layout (see :data:`zerotrain.config.MOVED`), as a flag or as a key of a
    ``--config`` file, naming where it is now; checked before parsing, so the line is the same from any command
    and before any process starts."""
    for i, arg in enumerate(argv):
        key, eq, value = arg.partition("=")
        if key.startswith("--") and key[2:] in MOVED:
            if not eq:
                value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None
            raise UserError(moved_setting(key[2:], value))
    configs = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"]
    configs += [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
    for path in configs:
        try:
            import yaml

            with open(path, encoding="utf-8") as f:
                data = yaml.safe_load(f)
        except (OSError, ValueError, yaml.YAMLError):
            continue  # the parser says what is wrong with the file
        strategy = data.get("strategy") if isinstance(data, dict) else None
        for key, value in (strategy.items() if isinstance(strategy, dict) else ()):
            if f"strategy.{key}" in MOVED:
                raise UserError(f"--config {path}: {moved_setting(f'strategy.{key}', value, flag=False)}")


def one_line(message: str) -> str:
    """jsonargparse's multi-line type errors as one line naming the flag, the value and what it takes.

    ``Parser key "trainer.max_steps": Does not validate ... Expected a <class 'int'> ... Given value: five``
    becomes ``--trainer.max_steps: 'five' is not an int or null``.
    """
    import re

    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else message
    key = re.search(r'Parser key "([^"]+)"', message)
    given = re.search(r"Given value: (.*)", message)
    expected = re.findall(r"Expected a <class '([\w.]+)'>", message)
    choices = re.findall(r"Expected a (Literal\[[^\]]*\])|not one of (\[[^\]]*\])|choices: (.*)", message)
    if key and given:
        kinds = [{"NoneType": "null"}.get(k, k) for k in dict.fromkeys(expected)]
        what = " or ".join(kinds) or next((c for group in choices for c in group if c), "") or lines[-2]
        return f"--{key.group(1)}: {given.group(1)!r} is not a valid value (expected {what})"
    return " ".join(lines)


def _explain(message: str, argv: list[str], cfg_cls: type) -> str:
    """Name the flag as the user writes it, the YAML file a key came from, and the closest valid key."""
    import difflib
    import re

    message = re.sub(r'^Parser key "([^"]+)": ', r"--\1: ", message)
    choice = re.match(r"(--[\w.]+): Expected a typing\.Literal\[(.*)\]\. Got value: (.*)$", message)
    if choice:
        flag, options, value = choice.groups()
        message = f"{flag}: {value!r} is not one of {options.replace(chr(39), '')}"
    configs = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"]
    configs += [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
    unknown = re.match(r"Group '([^']+)' does not accept option '([^']+)'", message)
    if unknown:
        section, key = unknown.groups()
        field = {f.name: f for f in dataclasses.fields(cfg_cls)}.get(section)
        options = [f.name for f in dataclasses.fields(field.default_factory())] if field is not None and \
            field.default_factory is not dataclasses.MISSING else []
        close = difflib.get_close_matches(key, options, n=1)
        message = f"{section}.{key} is not an option" + (f": did you mean {section}.{close[0]}?" if close else "")
    if configs and (unknown or message.startswith("Problems parsing config")):
        message = f"--config {configs[-1]}: " + message.removeprefix("Problems parsing config: ")
    return message
