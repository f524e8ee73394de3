"""TrainState: the loop's half of an exact resume, saved in a form that loads without pickle."""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
import torch

from zerotrain.errors import UserError
from zerotrain.train.state import SCHEMA_VERSION, TrainState


def draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), float(torch.rand(()))


def test_round_trip_restores_fields_and_every_generator():
    state = TrainState()
    state.advance(torch.tensor(0.5), epoch=1, batches_in_epoch=3)
    state.advance(torch.tensor(0.25), epoch=1, batches_in_epoch=5)
    buf = io.BytesIO()
    torch.save(state.state_dict(), buf)
    expected = draws()

    random.seed(7), np.random.seed(7), torch.manual_seed(7)  # somewhere else entirely
    restored = TrainState()
    buf.seek(0)
    restored.load_state_dict(torch.load(buf, weights_only=True))  # no pickle of arbitrary objects
    assert draws() == expected
    assert (restored.step, restored.epoch, restored.batches_in_epoch) == (2, 1, 5)
    assert (restored.window_loss, restored.window_steps) == (0.75, 2)


def test_close_window_keeps_the_position():
    state = TrainState()
    state.advance(1.0, epoch=0, batches_in_epoch=1)
    state.close_window()
    assert (state.step, state.window_loss, state.window_steps) == (1, 0.0, 0)
    assert state.plain() == {"step": 1, "epoch": 0, "batches_in_epoch": 1}


def test_another_schema_version_is_refused_in_one_line():
    saved = TrainState().state_dict()
    saved["version"] = SCHEMA_VERSION + 1
    with pytest.raises(UserError, match="--checkpoint.resume: .*schema version"):
        TrainState().load_state_dict(saved)
