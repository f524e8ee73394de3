"""What DeepSpeed refuses in a user's file while it builds the engine is one line; anything else stays whole."""

from __future__ import annotations

import pytest

from zerotrain.engines.deepspeed import DeepSpeedRefused, _refusal_names
from zerotrain.errors import UserError


def _raise_from(filename: str, error: BaseException) -> None:
    """Raise ``error`` from a frame whose code lives in ``filename``, as DeepSpeed's own would."""
    namespace = {"error": error}
    exec(compile("def check():\n    raise error\n", filename, "exec"), namespace)
    namespace["check"]()


DS_FILE = "/venv/lib/python3.12/site-packages/deepspeed/runtime/zenflow/engine.py"


@pytest.mark.parametrize("error", [ValueError("select_interval must be a number"),
                                   AssertionError("needs stage 3"), Warning("would be overwritten")])
def test_deepspeeds_refusal_names_the_file_and_deepspeeds_module(error):
    with pytest.raises(DeepSpeedRefused) as caught, _refusal_names("my.json"):
        _raise_from(DS_FILE, error)
    assert str(caught.value) == ("--strategy.deepspeed_config: my.json: DeepSpeed refused it while building the "
                                 f"engine (deepspeed/runtime/zenflow/engine.py): {error}")
    assert isinstance(caught.value, UserError) and caught.value.said_by_each_rank


@pytest.mark.parametrize("user_file,filename,error", [
    (None, DS_FILE, ValueError("bad")),  # zerotrain's own configuration: a bug, seen whole
    ("my.json", "/repo/src/zerotrain/train/schedule.py", ValueError("bad")),  # zerotrain's code DeepSpeed calls
    ("my.json", "/venv/lib/python3.12/site-packages/torch/optim/lr_scheduler.py", AssertionError()),
    ("my.json", DS_FILE, DeprecationWarning("raised under -W error")),  # a warning made an error, not a refusal
    ("my.json", DS_FILE, RuntimeError("CUDA out of memory")),
])
def test_anything_else_is_raised_as_it_was(user_file, filename, error):
    with pytest.raises(type(error)) as caught, _refusal_names(user_file):
        _raise_from(filename, error)
    assert caught.value is error
