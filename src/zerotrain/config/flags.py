"""A recipe's typed config from command-line flags: what ``zerotrain fit`` parses, for any command.

The flags are generated from the recipe's config dataclasses (jsonargparse), so every field of
the typed config is a flag, its docstring is the help text, and a YAML file given with
``--config`` sets values that later flags override. ``zerotrain fit`` and ``zerotrain estimate``
(and the benchmark scripts) read the same flags through :func:`parse_config`.
"""

from __future__ import annotations

import dataclasses
from argparse import ArgumentError
from typing import Optional

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
    refuse_moved(argv, cfg_cls)
    parser = build_parser(recipe)
    try:
        parsed = parser.parse_args(argv)
    except ArgumentError as exc:
        raise UserError(f"{_explain(one_line(str(exc)), argv, cfg_cls)} (see: zerotrain fit {recipe} --help)") from None
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes  # renamed in jsonargparse 4.4x
    ns = instantiate(parsed)
    return cfg_cls(**{f.name: ns[f.name] for f in dataclasses.fields(cfg_cls)})


def refuse_moved(argv: list[str], cfg_cls: Optional[type] = None) -> None:
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
        data = read_config_file(path, cfg_cls)
        strategy = data.get("strategy") if isinstance(data, dict) else None
        for key, value in (strategy.items() if isinstance(strategy, dict) else ()):
            if f"strategy.{key}" in MOVED:
                raise UserError(f"--config {path}: {moved_setting(f'strategy.{key}', value, flag=False)}")


MAX_CONFIG_NODES = 100_000
"""Most values a ``--config`` file may hold once its YAML aliases are expanded. A real config holds a few
hundred; nested aliases (``&a [*b, *b, ...]``) grow exponentially, and the parser that walks them would run
until the machine runs out of memory."""


def read_config_file(path: str, cfg_cls: Optional[type] = None) -> object:
    """The contents of a ``--config`` file, or one line naming it when it cannot be a config: not UTF-8 text,
    more than :data:`MAX_CONFIG_NODES` values once its aliases are expanded, empty, not a mapping of sections, or a
    section (``trainer:``) given as a scalar or ``null`` where ``cfg_cls`` has a group of options.

    A file that cannot be read or is not valid YAML returns None: the parser names what is wrong with it."""
    import yaml

    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError:
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"--config {path}: not UTF-8 text (byte {exc.start} is {raw[exc.start]:#04x}): "
                        "give a YAML file of options (see --help)") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return None
    if _expanded_size(node) > MAX_CONFIG_NODES:
        raise UserError(f"--config {path}: its YAML aliases (*name) expand past {MAX_CONFIG_NODES:,} values: "
                        "write the options out without nested aliases")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        return None
    if data is None:
        raise UserError(f"--config {path}: holds no options: give a YAML file of options (see --help), or drop "
                        "--config")
    if not isinstance(data, dict):
        raise UserError(f"--config {path}: holds {_yaml_kind(data)}, not a mapping of sections "
                        "(e.g. 'trainer:' with 'max_steps: 100' indented below it)")
    _check_sections(path, data, cfg_cls, "")
    return data


def _expanded_size(root) -> int:
    """How many values the YAML node graph holds when every alias is expanded (shared nodes counted per use)."""
    import yaml

    sizes: dict[int, int] = {}
    order, stack, seen = [], [root], set()
    while stack:  # children before parents, without recursion (the nesting may be deep)
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        order.append(node)
        if isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)
        elif isinstance(node, yaml.MappingNode):
            stack.extend(v for pair in node.value for v in pair)
    for node in reversed(order):
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [v for pair in node.value for v in pair]
        else:
            children = []
        sizes[id(node)] = min(1 + sum(sizes.get(id(c), 1) for c in children), MAX_CONFIG_NODES + 1)
    return sizes.get(id(root), 0)


def _yaml_kind(value: object) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list"}.get(
        type(value), type(value).__name__) + f" ({value!r:.40})"


def _check_sections(path: str, data: dict, cls: Optional[type], prefix: str) -> None:
    """Each key of ``data`` that names a group of options of ``cls`` (a dataclass) holds a mapping."""
    if cls is None or not dataclasses.is_dataclass(cls):
        return
    groups = {f.name: f.default_factory for f in dataclasses.fields(cls)
              if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory)}
    for key, value in data.items():
        if key not in groups:
            continue
        if not isinstance(value, dict):
            raise UserError(f"--config {path}: '{prefix}{key}' holds {_yaml_kind(value)}, not a group of options: "
                            f"list its options indented below '{key}:' (see --help), or leave it out")
        _check_sections(path, value, groups[key], f"{prefix}{key}.")


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
