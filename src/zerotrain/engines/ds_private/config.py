"""What DeepSpeed's own config classes know, read for zerotrain's validation of a user's JSON."""

from __future__ import annotations

from typing import Any, Optional


def zero_optimization_keys() -> Optional[frozenset[str]]:
    """zero_optimization's keys from DeepSpeed's own config model (field names and their stage3_ aliases); None
    where this DeepSpeed's layout differs."""
    try:
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

        fields = DeepSpeedZeroConfig.model_fields
        return frozenset(list(fields) + [f.alias for f in fields.values() if f.alias])
    except Exception:
        return None


def zero_default(block: dict[str, Any], field: str) -> Any:
    """What DeepSpeed's zero_optimization model makes of ``field`` (a field name, e.g. ``overlap_comm``) when a file's
    ``block`` leaves it out: its default, which may follow the block's stage (``overlap_comm`` is on at stage 3); None
    where the block does not validate, the field is unknown, or this DeepSpeed's layout differs."""
    import logging

    try:
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
        from deepspeed.utils import logger
    except Exception:
        return None
    given = {k: v for k, v in block.items() if v != "auto" and not str(k).startswith("_")}
    level = logger.level
    logger.setLevel(logging.ERROR)  # its deprecation notes belong to the run, said once there
    try:
        return getattr(DeepSpeedZeroConfig(**given), field, None)
    except Exception:
        return None
    finally:
        logger.setLevel(level)


def builtin_optimizer_names() -> Optional[frozenset[str]]:
    """The optimizer types DeepSpeed builds itself (lower case); None where this DeepSpeed's layout differs."""
    try:
        from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

        return frozenset(DEEPSPEED_OPTIMIZERS)
    except Exception:
        return None


def builtin_scheduler_names() -> Optional[frozenset[str]]:
    """The learning-rate schedules DeepSpeed builds from a ``scheduler`` block; None where its layout differs."""
    try:
        from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES

        return frozenset(VALID_LR_SCHEDULES)
    except Exception:
        return None


def block_type_error(key: str, block: dict[str, Any]) -> Optional[tuple[str, Any, str]]:
    """The first value of the ``key`` block (``zero_optimization``, ``fp16``, ``bf16``) of a DeepSpeed JSON that
    DeepSpeed's own config model for it does not hold as given: (dotted key, value, what the model expects);
    None when every value fits, or when this DeepSpeed has no model for the block.

    DeepSpeed's models (pydantic) coerce where JSON is ambiguous: ``"yes"`` and ``1`` become true, ``true``
    becomes ZeRO stage 1. So each value is checked strictly against its field's declared type first (a bool is
    not a number, a number not a bool, a string neither; a whole float is an integer, as ``5e8`` is written),
    then the block goes through the model for its constraints (>= 0, the offload devices...). ``"auto"`` values
    are left to the caller, which fills them."""
    model = _block_models().get(key)
    if model is None:
        return None
    return _check_model(model, block, key)


def _block_models() -> dict[str, Any]:
    try:
        from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    except Exception:
        return {}
    return {"zero_optimization": DeepSpeedZeroConfig, "fp16": DeepSpeedFP16Config, "bf16": DeepSpeedBF16Config}


def _check_model(model: Any, block: dict[str, Any], prefix: str) -> Optional[tuple[str, Any, str]]:
    import pydantic

    block = {k: v for k, v in block.items() if not str(k).startswith("_")}  # "_comment" keys: a file's notes
    fields = model.model_fields
    aliases = {f.alias: name for name, f in fields.items() if f.alias}
    for key, value in block.items():
        name = key if key in fields else aliases.get(key)
        if name is None or value == "auto":
            continue  # an unknown key is refused by name elsewhere; "auto" is filled by zerotrain
        found = _mismatch(fields[name].annotation, value, f"{prefix}.{key}")
        if found is not None:
            return found
    try:
        model(**{k: v for k, v in block.items() if v != "auto"})
    except pydantic.ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join([prefix, *map(str, error["loc"])])
        expected = str(error["msg"]).removeprefix("Input should be ").removeprefix("Value error, ")
        if expected.startswith(("greater", "less")):
            expected = f"a value {expected}"
        if not error["loc"]:  # a check of the whole block: its input is DeepSpeed's model; show the file's block
            return where, block, expected.removeprefix("Assertion failed, ")
        return where, error.get("input"), expected
    except (TypeError, ValueError) as exc:  # a validator of DeepSpeed's that raised outside pydantic's errors
        return prefix, block, " ".join(str(exc).split())[:200]
    return None


def _mismatch(annotation: Any, value: Any, where: str) -> Optional[tuple[str, Any, str]]:
    """(where, value, expected) when ``value`` is not of ``annotation`` held strictly; None when it is."""
    import enum
    import types
    import typing

    import pydantic

    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        found = [_mismatch(option, value, where) for option in options if option is not type(None)]
        if any(f is None for f in found):
            return None
        return found[0] if len(found) == 1 else (where, value, " or ".join(f[2] for f in found if f))
    if origin is typing.Literal:
        allowed = typing.get_args(annotation)
        return None if value in allowed else (where, value, "one of " + ", ".join(map(repr, allowed)))
    if not isinstance(annotation, type):
        return None  # a generic container or another form: the model's own validation below decides
    if issubclass(annotation, bool):
        return None if isinstance(value, bool) else (where, value, "true or false")
    if issubclass(annotation, enum.Enum):
        members = [m.value for m in annotation]
        if any(value == m and type(value) is type(m) for m in members):
            return None
        return where, value, "one of " + ", ".join(json_text(m) for m in members)
    if issubclass(annotation, int):
        ok = (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float) and value.is_integer())
        return None if ok else (where, value, "an integer")
    if issubclass(annotation, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if ok else (where, value, "a number")
    if issubclass(annotation, str):
        return None if isinstance(value, str) else (where, value, "a string")
    if issubclass(annotation, pydantic.BaseModel):
        if not isinstance(value, dict):
            return where, value, "an object ({...})"
        return _check_model(annotation, value, where)
    return None


def json_text(value: Any) -> str:
    import json

    return json.dumps(value, default=str)
