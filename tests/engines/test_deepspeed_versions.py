"""The installed DeepSpeed, whichever of the tested range it is: the toy trains under ZeRO-0, 1, 2 and 3.

CI runs the fast tests twice, on the newest DeepSpeed and on the lowest pyproject.toml admits; on a version
zerotrain's patches were not verified on, DeepSpeed's own code runs.
"""

from __future__ import annotations

import importlib.metadata
import re

import pytest
from helpers import REPO, toy_config, train_log

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


def _deepspeed_range():
    """The deepspeed requirement of pyproject.toml, as a SpecifierSet."""
    from packaging.requirements import Requirement

    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    (spec,) = [Requirement(r).specifier for r in project["dependencies"] if Requirement(r).name == "deepspeed"]
    return spec


def test_the_installed_version_is_in_the_tested_range():
    version = importlib.metadata.version("deepspeed")
    assert version in _deepspeed_range()
    assert patches.installed_version() == version


def test_ci_tests_the_floor_pyproject_states():
    """.ci/run's second venv installs the lowest DeepSpeed pyproject.toml admits, not some other version."""
    (floor,) = [s.version for s in _deepspeed_range() if s.operator == ">="]
    ci = (REPO / ".ci" / "run").read_text()
    (low,) = re.findall(r"^DS_LOW=(\S+)", ci, flags=re.MULTILINE)
    assert low == floor
