"""The run directory: its name, the early writability check, atomic JSON, the code state and env.json."""

from __future__ import annotations

import datetime as dt
import json
import re
import subprocess
from pathlib import Path

import pytest

from zerotrain.runtime import rundir
from zerotrain.errors import UserError

LAUNCHER_KEYS = {"RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_JOB_ID", "SLURM_NNODES"}


def test_new_run_name_is_recipe_timestamp_and_a_random_id():
    before = dt.datetime.now().replace(microsecond=0)
    name = rundir.new_run_name("imdb")
    after = dt.datetime.now()
    m = re.fullmatch(r"imdb\.(\d{4}\.\d{2}\.\d{2}\.\d{2}\.\d{2}\.\d{2})\.([0-9a-f]{6})", name)
    assert m, name
    assert before <= dt.datetime.strptime(m.group(1), "%Y.%m.%d.%H.%M.%S") <= after
    # Two runs started in the same second still get two folders.
    assert len({rundir.new_run_name("imdb") for _ in range(20)}) == 20


def test_check_writable_creates_the_folder_and_leaves_nothing_in_it(tmp_path):
    root = rundir.check_writable(str(tmp_path / "a" / "b"))
    assert root == tmp_path / "a" / "b" and root.is_dir()
    assert list(root.iterdir()) == []  # the write test's file is gone


def test_check_writable_expands_the_home_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert rundir.check_writable("~/runs") == tmp_path / "runs"


def test_unwritable_output_dir_is_a_user_error_naming_the_flag(tmp_path):
    (tmp_path / "a_file").write_text("not a folder")
    bad = tmp_path / "a_file" / "runs"
    with pytest.raises(UserError) as err:
        rundir.check_writable(str(bad))
    message = str(err.value)
    assert message.startswith("--trainer.output_dir") and str(bad) in message
    assert "--trainer.output_dir ./runs" in message  # what to do instead
    assert "\n" not in message


def test_create_makes_the_run_and_its_checkpoints_folder(tmp_path):
    run = rundir.create(str(tmp_path / "out"), "toy.run")
    assert run == tmp_path / "out" / "toy.run"
    assert (run / "checkpoints").is_dir()
    (run / "checkpoints" / "keep").write_text("x")
    assert rundir.create(str(tmp_path / "out"), "toy.run") == run  # a resumed run reuses its folder
    assert (run / "checkpoints" / "keep").read_text() == "x"


def test_write_json_round_trips_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "hparams.json"
    data = {"recipe": "toy", "betas": [0.9, 0.999], "nested": {"a": None, "b": True}, "path": Path("/x/y")}
    rundir.write_json(path, data)
    assert json.loads(path.read_text()) == {**data, "path": "/x/y"}  # what JSON cannot hold is written as str
    rundir.write_json(path, {"second": 2})
    assert json.loads(path.read_text()) == {"second": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["hparams.json"]


def test_write_json_never_leaves_a_half_written_file(tmp_path, monkeypatch):
    """A crash while writing (disk full, kill) keeps the previous complete file, as os.replace promises."""
    path = tmp_path / "summary.json"
    rundir.write_json(path, {"final_step": 4})
    import zerotrain.data.io as data_io

    class HalfWrite:
        """The file handle of atomic_file: writes half of the data, then the disk is full."""

        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def write(self, data):
            self.f.write(data[: len(data) // 2])
            raise OSError(28, "No space left on device")

    real_fdopen = data_io.os.fdopen
    monkeypatch.setattr(data_io.os, "fdopen", lambda *a, **k: HalfWrite(real_fdopen(*a, **k)))
    with pytest.raises(OSError):
        rundir.write_json(path, {"final_step": 8, "padding": "x" * 100})
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]  # no temporary file left behind
    assert json.loads(path.read_text()) == {"final_step": 4}


def _git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", *args],
                          cwd=cwd, check=True, capture_output=True, text=True).stdout


def test_write_code_state_in_a_git_checkout(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git("init", "-q", cwd=repo)
    (repo / "train.py").write_text("lr = 1\n")
    _git("add", "train.py", cwd=repo)
    _git("commit", "-q", "-m", "first", cwd=repo)
    (repo / "train.py").write_text("lr = 2\n")  # uncommitted: must be in gitdiff.log
    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.chdir(repo)
    rundir.write_code_state(run)
    assert (run / "githash.log").read_text().strip() == _git("rev-parse", "HEAD", cwd=repo).strip()
    diff = (run / "gitdiff.log").read_text()
    assert "-lr = 1" in diff and "+lr = 2" in diff


def test_write_code_state_outside_git(tmp_path, monkeypatch):
    outside = tmp_path / "not_a_repo"
    outside.mkdir()
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # do not find a repository above tmp_path
    monkeypatch.chdir(outside)
    rundir.write_code_state(tmp_path)
    assert (tmp_path / "githash.log").read_text() == "not a git checkout\n"
    assert (tmp_path / "gitdiff.log").read_text() == ""


@pytest.mark.parametrize("argv0, program", [("/usr/bin/zerotrain", "zerotrain"),
                                            ("/x/site-packages/zerotrain/__main__.py", "python -m zerotrain")])
def test_environment_records_the_command_and_versions(monkeypatch, argv0, program):
    monkeypatch.setattr("sys.argv", [argv0, "fit", "toy", "--trainer.max_steps", "3"])
    env = rundir.environment()
    assert env["command"] == f"{program} fit toy --trainer.max_steps 3"
    assert {"zerotrain", "torch", "deepspeed", "transformers"} <= set(env["versions"])
    assert env["versions"]["torch"] and env["versions"]["zerotrain"]
    assert env["cwd"] == str(Path.cwd()) and env["cpu_count"] >= 1
    json.dumps(env)  # env.json is written without default=str surprises


def test_environment_holds_launcher_variables_and_no_others(monkeypatch):
    secret = "s3cr3t-token-value-do-not-record"
    for name in ("SECRET_TOKEN", "HF_TOKEN", "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(name, secret)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "node0")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    env = rundir.environment()
    assert {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "node0"}.items() <= env["launcher_env"].items()
    assert set(env["launcher_env"]) <= LAUNCHER_KEYS
    text = json.dumps(env)
    assert secret not in text
    for name in ("SECRET_TOKEN", "HF_TOKEN", "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY"):
        assert name not in text


def test_environment_records_the_allocator_and_nccl_settings(monkeypatch):
    """A memory peak depends on the CUDA allocator's settings and a multi-GPU speed on NCCL's: env.json keeps them."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    monkeypatch.setenv("NCCLX_OTHER", "not nccl's")
    monkeypatch.setenv("TORCH_NCCL_AVOID_RECORD_STREAMS", "1")
    env = rundir.environment()
    assert env["tuning_env"]["TORCH_NCCL_AVOID_RECORD_STREAMS"] == "1"
    assert env["tuning_env"]["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert env["tuning_env"]["NCCL_NVLS_ENABLE"] == "0" and "NCCLX_OTHER" not in env["tuning_env"]


def test_commit_outside_git_comes_from_zerotrain_commit(monkeypatch):
    """A GPU machine receives the tree without .git: the commit travels in ZEROTRAIN_COMMIT."""
    from zerotrain.runtime import rundir

    monkeypatch.setattr(rundir, "_git", lambda args, cwd: "")  # as in a copy without .git
    monkeypatch.delenv("ZEROTRAIN_COMMIT", raising=False)
    assert rundir.commit() is None
    monkeypatch.setenv("ZEROTRAIN_COMMIT", "249f40d")
    assert rundir.commit() == "249f40d" and rundir.environment()["commit"] == "249f40d"


def test_zerotrain_commit_wins_over_a_stale_git_head(monkeypatch):
    """A copied tree may carry an old .git: whoever set ZEROTRAIN_COMMIT said which code this is."""
    from zerotrain.runtime import rundir

    monkeypatch.setattr(rundir, "_git", lambda args, cwd: "f3e8638\n" if args[0] == "rev-parse" else "")
    monkeypatch.setenv("ZEROTRAIN_COMMIT", "2a7768a")
    assert rundir.commit() == "2a7768a"
    monkeypatch.delenv("ZEROTRAIN_COMMIT")
    assert rundir.commit() == "f3e8638"


def test_commit_is_marked_dirty_when_the_package_differs_from_head(tmp_path, monkeypatch):
    """A tree whose code is not its HEAD's (edited, or copied with an older .git) must not be recorded as
    that HEAD: git describe's -dirty mark, for changes under the package's folder only."""
    import subprocess

    from zerotrain.runtime import rundir

    def git(*args):
        return subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True, text=True).stdout

    monkeypatch.delenv("ZEROTRAIN_COMMIT", raising=False)
    pkg = tmp_path / "src" / "pkg"
    pkg.mkdir(parents=True)
    (pkg / "engine.py").write_text("x = 1\n")
    (tmp_path / "NOTES.md").write_text("notes\n")
    git("init", "-q")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
    head = git("rev-parse", "HEAD").strip()
    assert rundir.commit(pkg) == head
    (tmp_path / "NOTES.md").write_text("edited outside the package\n")
    assert rundir.commit(pkg) == head
    (pkg / "new_module.py").write_text("y = 2\n")  # untracked code runs too
    assert rundir.commit(pkg) == f"{head}-dirty"
    (pkg / "new_module.py").unlink()
    (pkg / "engine.py").write_text("x = 2\n")
    assert rundir.commit(pkg) == f"{head}-dirty"
