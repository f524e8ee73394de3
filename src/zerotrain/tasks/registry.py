"""The recipes: the shipped ones, those installed through an entry point, and any Task class by its path.

A recipe argument (``zerotrain fit RECIPE``, ``plan``, ``estimate``, ``benchmark``) is one of:

* a name: a shipped recipe (imported on first use: the LoRA recipe pulls in peft and transformers), a
  ``Task`` subclass with that ``name`` whose module is already imported, or an entry point of the
  ``zerotrain.tasks.registry`` group (``[project.entry-points."zerotrain.tasks.registry"] myrecipe = "my_pkg.tasks:MyTask"``
  in an installed package's ``pyproject.toml``), loaded only when its name is asked for or the list is shown;
* ``module:Class`` (``my_pkg.my_module:MyTask``): any ``Task`` subclass importable from the environment or
  from the current folder, as ``python -m`` would find it, whatever the way zerotrain was started.

A run records its task (:func:`spec_of`) in ``hparams.json`` so that ``predict``, ``export`` and ``load_run``
find the class again, and every subprocess zerotrain starts (``python -m zerotrain fit SPEC`` in the same
folder) resolves the same argument the same way.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import os
import sys
import traceback
from typing import Optional

from zerotrain.errors import UserError
from zerotrain.tasks.base import REGISTRY, Task

BUILTIN_MODULES = ("zerotrain.tasks.imdb", "zerotrain.tasks.mlm", "zerotrain.tasks.lora", "zerotrain.tasks.causal_lm", "zerotrain.tasks.classify",
                   "zerotrain.tasks.toy")
ENTRY_POINT_GROUP = "zerotrain.tasks.registry"
"""The entry point group through which an installed package adds recipes: name -> ``module:Class``."""


def _import_builtins() -> None:
    for module in BUILTIN_MODULES:
        importlib.import_module(module)


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def all_recipes() -> dict[str, type[Task]]:
    """Recipe name -> task class: the shipped ones first, then imported ones, then entry points."""
    _import_builtins()
    found = dict(REGISTRY)
    for name, ep in _entry_points().items():
        found.setdefault(name, _load_entry_point(ep))
    return found


def get(spec: str, argument: str = "RECIPE") -> type[Task]:
    """The task class that ``spec`` (a recipe name or ``module:Class``) names.

    Every failure is one :class:`UserError` line that starts with ``argument`` (how the caller's user
    wrote the spec: the command's RECIPE, or the run's hparams.json) and says what to do.
    """
    if ":" in spec:
        return _import_class(spec, argument)
    _import_builtins()
    if spec in REGISTRY:
        return REGISTRY[spec]
    ep = _entry_points().get(spec)
    if ep is not None:
        return _load_entry_point(ep)
    names = sorted({*REGISTRY, *_entry_points()})
    raise UserError(f"unknown recipe {spec!r}: choose one of {', '.join(names)}, or name a Task class of your own "
                    "as module:Class (zerotrain fit --help describes them)")


def name_of(cls: type[Task]) -> str:
    """The short name of a run of ``cls``: its recipe ``name``, else the class name (run folders start with it)."""
    return cls.name or cls.__name__


def spec_of(cls: type[Task]) -> Optional[str]:
    """``module:Class`` of a task that its recipe name alone would not find in a new process, else None.

    A shipped recipe and one installed through an entry point are found by name. A class defined in a script
    run as ``__main__`` cannot be imported by another process: None too (its runs load once the script's
    module is imported, as before).
    """
    path = f"{cls.__module__}:{cls.__qualname__}"
    if cls.__module__ in BUILTIN_MODULES and cls.name:
        return None
    ep = _entry_points().get(cls.name) if cls.name else None
    if ep is not None and ep.value.replace(" ", "") == path:
        return None
    if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
        return None
    return path


def _import_class(spec: str, argument: str) -> type[Task]:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise UserError(f"{argument} {spec}: write module:Class, e.g. my_package.my_module:MyTask")
    try:
        module = _import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or module_name
        if module_name == missing or module_name.startswith(missing + "."):
            raise UserError(f"{argument} {spec}: no module named {missing!r} in the current folder or the "
                            "environment. Run from the folder that holds it, add its folder to PYTHONPATH, "
                            "or pip install its package") from None
        raise UserError(f"{argument} {spec}: importing {module_name} failed: it needs the module {missing!r}, "
                        "which is not installed (pip install it)") from None
    except SyntaxError as exc:
        raise UserError(f"{argument} {spec}: {exc.filename}:{exc.lineno}: {exc.msg}: fix the module's syntax") from None
    except (Exception, SystemExit) as exc:  # the module's own code failed, or called sys.exit, while imported
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        what = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
        raise UserError(f"{argument} {spec}: importing {module_name} raised {what} (at {frame.filename}:"
                        f"{frame.lineno}); a task module must import without running the job") from None
    cls = module
    for part in attr.split("."):
        if not hasattr(cls, part):
            tasks = sorted(name for name, value in vars(module).items()
                           if inspect.isclass(value) and issubclass(value, Task) and value.__module__ == module_name)
            hint = f" (its Task classes: {', '.join(tasks)})" if tasks else " (it defines no Task class)"
            raise UserError(f"{argument} {spec}: module {module_name} has no attribute {attr!r}{hint}")
        cls = getattr(cls, part)
    return _checked(cls, f"{argument} {spec}")


def _import_module(name: str):
    """Import ``name`` as ``python -m`` run here would: from the environment, else from the current folder.

    The console script ``zerotrain`` has its own folder, not the current one, first on ``sys.path``; the
    current folder is added (at the end, so that it shadows nothing installed) only when the import needs it,
    and stays there: the task's module may import its neighbours later, in this process or a DataLoader
    worker."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        here, top = os.getcwd(), name.partition(".")[0]
        in_here = os.path.isdir(os.path.join(here, top)) or os.path.isfile(os.path.join(here, f"{top}.py"))
        if exc.name != top or not in_here or here in sys.path or "" in sys.path:
            raise
    sys.path.append(here)
    importlib.invalidate_caches()
    return importlib.import_module(name)


def _load_entry_point(ep: importlib.metadata.EntryPoint) -> type[Task]:
    where = f"entry point {ep.name} = {ep.value} (group {ENTRY_POINT_GROUP}"
    where += f", package {ep.dist.name})" if getattr(ep, "dist", None) is not None else ")"
    try:
        loaded = ep.load()
    except (Exception, SystemExit) as exc:  # missing, or the package's own code failed or exited while imported
        raise UserError(f"{where} cannot be loaded ({type(exc).__name__}: {exc}): reinstall or uninstall that "
                        "package") from None
    return _checked(loaded, where)


def _checked(cls: object, what: str) -> type[Task]:
    if not (inspect.isclass(cls) and issubclass(cls, Task)):
        kind = type(cls).__name__ if not inspect.isclass(cls) else "class not derived from Task"
        raise UserError(f"{what} is not a Task subclass (it is a {kind}): name a class that subclasses "
                        "zerotrain.tasks.base.Task")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise UserError(f"{what} is abstract: it does not define {missing}. Name a Task subclass that does")
    return cls
