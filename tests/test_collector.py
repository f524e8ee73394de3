"""zerotrain.collector: Python's garbage collections at chosen steps during training, and the collector
handed back as it was."""

from __future__ import annotations

import gc

import pytest

from zerotrain.collector import collections_every


@pytest.fixture
def counted(monkeypatch) -> list[int]:
    """The generations gc.collect was asked for (the collector itself still runs)."""
    calls: list[int] = []
    real = gc.collect

    def collect(generation: int = 2) -> int:
        calls.append(generation)
        return real(generation)

    monkeypatch.setattr(gc, "collect", collect)
    return calls


def test_collections_run_every_n_steps_with_automatic_collection_off(counted):
    assert gc.isenabled() and gc.get_freeze_count() == 0
    with collections_every(3) as collect:
        assert counted == [2]  # set-up's garbage, before the freeze
        assert not gc.isenabled() and gc.get_freeze_count() > 0
        for step in range(1, 10):
            collect(step)
        assert counted == [2, 1, 1, 1]  # steps 3, 6, 9: the young generations only
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_the_collector_is_restored_when_training_fails():
    with pytest.raises(RuntimeError, match="a failing step"):
        with collections_every(5):
            raise RuntimeError("a failing step")
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_zero_leaves_the_collector_alone(counted):
    gc.disable()  # a user's own choice stays as it is, before and after
    try:
        with collections_every(0) as collect:
            for step in range(1, 10):
                collect(step)
            assert not gc.isenabled() and gc.get_freeze_count() == 0
        assert counted == [] and not gc.isenabled()
    finally:
        gc.enable()
    with collections_every(2):
        pass
    assert gc.isenabled()  # and one that was on is back on
