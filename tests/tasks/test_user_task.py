"""A user's own Task on the command line: ``zerotrain fit module:Class`` and the commands on its runs.

The task lives outside the package, in ``tests/tasks/usertask/curve_fitting/sine.py`` (a package of the user's
own): the commands run in ``tests/tasks/usertask``, as a user runs them in their project folder. Entry points
are registered by a real ``*.dist-info`` folder on ``sys.path``, read by importlib.metadata itself.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers import zerotrain_cmd

PROJECT = Path(__file__).resolve().parent / "usertask"
SPEC = "curve_fitting.sine:SineTask"
FIT = ["--trainer.max_steps", "3", "--trainer.micro_batch_size", "8", "--trainer.num_workers", "0",
       "--trainer.device", "cpu", "--logging.progress_bar", "false", "--logging.tensorboard", "false"]


@pytest.fixture
def in_project(monkeypatch):
    """This process in the user's project folder, which is not on sys.path (as under the ``zerotrain`` script);
    sys.path and the user's modules are put back afterwards."""
    monkeypatch.chdir(PROJECT)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(PROJECT))])
    yield
    for name in [m for m in sys.modules if m == "curve_fitting" or m.startswith("curve_fitting.")]:
        del sys.modules[name]


@pytest.mark.slow  # python -m zerotrain subprocesses
def test_fit_then_predict_and_export_a_task_defined_outside_the_package(tmp_path):
    runs = tmp_path / "runs"
    fit = zerotrain_cmd(["fit", SPEC, *FIT, "--trainer.output_dir", str(runs), "--trainer.run_name", "sine",
                         "--model.hidden", "8"], cwd=PROJECT)
    assert fit.returncode == 0, fit.stderr[-3000:]
    run = runs / "sine"
    hparams = json.loads((run / "hparams.json").read_text())
    assert (hparams["recipe"], hparams["task"], hparams["model"]) == ("SineTask", SPEC, {"hidden": 8})

    pred = zerotrain_cmd(["predict", str(run), "0.5", "-1.0"], cwd=PROJECT)
    assert pred.returncode == 0, pred.stderr[-3000:]
    lines = pred.stdout.strip().splitlines()
    assert [line.split("\t")[1] for line in lines] == ["0.5", "-1.0"]
    assert all(abs(float(line.split("\t")[0])) < 10 for line in lines)

    out = tmp_path / "exported"
    exp = zerotrain_cmd(["export", str(run), "--out", str(out)], cwd=PROJECT)
    assert exp.returncode == 0, exp.stderr[-3000:]
    assert (out / "model" / "model.safetensors").is_file()
    again = zerotrain_cmd(["predict", str(out), "0.5", "-1.0"], cwd=PROJECT)
    assert again.returncode == 0 and again.stdout == pred.stdout, again.stderr[-3000:]

    # Elsewhere the module is not importable: one line naming the run's file and what to do.
    lost = zerotrain_cmd(["predict", str(run), "0.5"], cwd=tmp_path)
    assert lost.returncode == 2
    assert lost.stderr.strip() == (
        f'zerotrain predict: error: {run}/hparams.json: "task" {SPEC}: no module named \'curve_fitting\' in the '
        "current folder or the environment. Run from the folder that holds it, add its folder to PYTHONPATH, or "
        f"pip install its package (the run was trained with zerotrain fit {SPEC}: load it from the same folder or "
        "environment)")


def test_help_lists_the_task_flags_and_their_docstrings(in_project, capsys):
    from zerotrain.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["fit", SPEC, "--help"])
    assert exit_.value.code in (0, None)
    text = " ".join(capsys.readouterr().out.split())
    assert f"zerotrain fit {SPEC}" in text
    assert "--data.frequency" in text and "a in y = sin(a x)." in text
    assert "--trainer.max_steps" in text and "--strategy.zero_stage" in text


def test_the_current_folder_is_searched_only_when_the_import_needs_it(in_project):
    from zerotrain.tasks import registry as recipes

    assert str(PROJECT) not in sys.path
    cls = recipes.get(SPEC)
    assert cls.__name__ == "SineTask" and sys.path[-1] == str(PROJECT)
    assert (recipes.name_of(cls), recipes.spec_of(cls)) == ("SineTask", SPEC)
    toy = recipes.get("toy")
    assert (recipes.name_of(toy), recipes.spec_of(toy)) == ("toy", None)


def test_estimate_sizes_a_user_task(in_project, capsys):
    from zerotrain.cli import main

    assert main(["estimate", SPEC, "--gpu_memory_gib", "8", "--host_memory_gib", "8", "--model.hidden", "4"]) == 0
    report = capsys.readouterr().out
    assert report.startswith(f"{SPEC}: 33 parameters"), report  # 1x4+4, 4x4+4, 4x1+1
    assert f"Pick: ddp   ->   zerotrain fit {SPEC} ... " in report


def _dist_info(site: Path, entry_points: str) -> None:
    info = site / "zt_user_recipes-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: zt-user-recipes\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(entry_points)


def test_a_recipe_registered_through_an_entry_point(tmp_path, monkeypatch, in_project):
    from zerotrain.errors import UserError
    from zerotrain.tasks import registry as recipes

    _dist_info(tmp_path / "site", f"[zerotrain.tasks.registry]\nsine = {SPEC}\nbroken = curve_fitting.sine:Nothing\n"
               "exits = zt_exits_on_import:T\n")
    (tmp_path / "site" / "zt_exits_on_import.py").write_text("import sys\nsys.exit(0)\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.syspath_prepend(str(PROJECT))
    cls = recipes.get("sine")
    assert cls.__module__ == "curve_fitting.sine" and cls.__name__ == "SineTask"
    assert recipes.get("toy").name == "toy"  # shipped recipes do not load the entry points
    with pytest.raises(Exception) as broken:
        recipes.get("broken")
    assert str(broken.value) == ("entry point broken = curve_fitting.sine:Nothing (group zerotrain.tasks.registry, package "
                                 "zt-user-recipes) cannot be loaded (AttributeError: module 'curve_fitting.sine' has "
                                 "no attribute 'Nothing'): reinstall or uninstall that package")
    with pytest.raises(UserError, match=r"^entry point exits = .* cannot be loaded \(SystemExit: 0\)"):
        recipes.get("exits")  # its module calls sys.exit while imported: one line, not an exit 0 having trained nothing


def test_the_fit_help_lists_entry_point_recipes(tmp_path, monkeypatch, in_project, capsys):
    from zerotrain.cli import main

    _dist_info(tmp_path / "site", f"[zerotrain.tasks.registry]\nsine = {SPEC}\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.syspath_prepend(str(PROJECT))
    assert main(["fit", "--help"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "  sine  fit a sine curve (a user's own task)" in lines
    assert any(line.strip().startswith("module:Class") for line in lines)


@pytest.mark.parametrize("body,says", [
    ("def broken(:\n", r"badtask\.py:1: invalid syntax"),
    ("raise RuntimeError('boom')\n", r"importing badtask raised RuntimeError: boom \(at .*badtask\.py:1\)"),
    ("import sys\nsys.exit(0)\n", r"importing badtask raised SystemExit: 0 \(at .*badtask\.py:2\)"),
])
def test_a_task_module_that_fails_or_exits_while_imported_is_one_line_naming_it(tmp_path, monkeypatch, body, says):
    """The module is the user's: its syntax error, an exception at import and a ``sys.exit`` at import (which
    exited 0 having trained nothing) each end in one line naming the file and line."""
    from zerotrain.errors import UserError
    from zerotrain.tasks import registry as recipes

    (tmp_path / "badtask.py").write_text(body)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    try:
        with pytest.raises(UserError, match=rf"^RECIPE badtask:T: .*{says}"):
            recipes.get("badtask:T")
    finally:
        sys.modules.pop("badtask", None)
