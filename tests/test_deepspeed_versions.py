"""The installed DeepSpeed, whichever of the tested range it is: the toy trains under ZeRO-0, 1, 2 and 3.

CI runs the fast tests twice, on the newest DeepSpeed and on the lowest pyproject.toml admits; on a version
zerotrain's patches were not verified on, DeepSpeed's own code runs.
"""

from __future__ import annotations

import importlib.metadata

import pytest
from test_fit import toy_config, train_log

from zerotrain.engines.ds_private import patches
from zerotrain.tasks.toy import ToyTask
from zerotrain.train.loop import fit


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_toy_trains_under_every_zero_stage(tmp_path, stage):
    cfg = toy_config(tmp_path, f"z{stage}", zero_stage=stage)
    cfg.trainer.max_steps = 4
    fit(ToyTask(cfg))
    log = train_log(tmp_path / f"z{stage}")
    assert sorted(log) == [1, 2, 3, 4]
    assert log[4]["train_loss"] < log[1]["train_loss"]


def test_the_installed_version_is_in_the_tested_range():
    from packaging.version import Version

    version = Version(importlib.metadata.version("deepspeed"))
    assert Version("0.16.0") <= version < Version("0.20")
    assert patches.installed_version() == importlib.metadata.version("deepspeed")
