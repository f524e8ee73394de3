"""The recipes: every :class:`~zerotrain.tasks.base.Task` subclass with a ``name`` registers itself.

The shipped recipes live in the modules below and are imported on first use (the LoRA recipe pulls
in peft and transformers); a user's own task registers as soon as its module is imported.
"""

from __future__ import annotations

import importlib

from zerotrain.errors import UserError
from zerotrain.tasks.base import REGISTRY, Task

BUILTIN_MODULES = ("zerotrain.tasks.imdb", "zerotrain.tasks.mlm", "zerotrain.tasks.lora", "zerotrain.tasks.toy")


def _import_builtins() -> None:
    for module in BUILTIN_MODULES:
        importlib.import_module(module)


def all_recipes() -> dict[str, type[Task]]:
    """Recipe name -> task class, the shipped ones first."""
    _import_builtins()
    return dict(REGISTRY)


def get(name: str) -> type[Task]:
    """The task class of recipe ``name``; a UserError listing the choices when there is none."""
    found = all_recipes().get(name)
    if found is None:
        raise UserError(f"unknown recipe {name!r}; choose one of: {', '.join(all_recipes())}")
    return found
