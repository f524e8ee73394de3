"""DeepSpeed's just-in-time op builds: announced before they start, a lock left by an interrupted build cleared.

The lock is torch's own (``<extensions root>/<op>/lock``, a bare file that ``torch.utils.cpp_extension.load``
waits on for as long as it exists); the tests put one in a temporary ``TORCH_EXTENSIONS_DIR``, as an
interrupted build leaves it, and need no compiler.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zerotrain.runtime.doctor import (
    LOCK_GRACE_S,
    clear_stale_lock,
    extensions_root,
    ops_for,
    prepare_ops,
)

SHM = "ShareMemCommBuilder"


@pytest.fixture()
def ext_root(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch_extensions"))
    return tmp_path / "torch_extensions"


def _lock(build_dir: Path, age_s: float) -> Path:
    build_dir.mkdir(parents=True, exist_ok=True)
    (build_dir / "build.ninja").write_text("# written by the interrupted build\n")
    lock = build_dir / "lock"
    lock.touch()
    then = time.time() - age_s
    for path in (lock, build_dir / "build.ninja"):
        os.utime(path, (then, then))
    return lock


def _shm_builder():
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder(SHM)
    if builder is None or not builder.is_compatible(verbose=False):
        pytest.skip("DeepSpeed cannot build its shared-memory op on this machine's accelerator")
    return builder


def test_extensions_root_follows_torch_extensions_dir(ext_root):
    assert extensions_root() == ext_root


def test_a_lock_left_by_an_interrupted_build_is_removed(tmp_path):
    lock = _lock(tmp_path / "cpu_adam", age_s=3600)
    line = clear_stale_lock(lock.parent, "CPUAdam")
    assert not lock.exists()
    assert line == f"removed {lock}, left by an interrupted build of CPUAdam (60 min old, no build running)"
    assert clear_stale_lock(lock.parent, "CPUAdam") is None  # nothing left to do


def test_a_lock_of_a_running_build_is_kept_and_named(tmp_path):
    lock = _lock(tmp_path / "cpu_adam", age_s=3600)
    compiler = subprocess.Popen(["sleep", "60"], cwd=lock.parent)  # as ninja and the compilers work there
    try:
        line = clear_stale_lock(lock.parent, "CPUAdam")
    finally:
        compiler.kill()
        compiler.wait()
    assert lock.exists()
    assert line.startswith(f"waiting for another build of CPUAdam to finish (processes {compiler.pid}")
    assert line.endswith(f"stop this run and remove it: rm {lock}")


def test_a_fresh_lock_is_kept(tmp_path):
    """Between taking the lock and starting its compiler, a build has no process in the folder yet."""
    lock = _lock(tmp_path / "cpu_adam", age_s=LOCK_GRACE_S / 4)
    line = clear_stale_lock(lock.parent, "CPUAdam")
    assert lock.exists() and "it changed recently" in line and f"rm {lock}" in line


def test_prepare_ops_clears_the_lock_and_announces_the_build(ext_root):
    builder = _shm_builder()
    build_dir = ext_root / builder.name
    lock = _lock(build_dir, age_s=3600)
    lines: list[str] = []
    assert prepare_ops([SHM], say=lines.append) == [SHM]
    assert not lock.exists()
    assert lines[0].startswith(f"removed {lock}, left by an interrupted build of DeepSpeed's shared-memory")
    assert lines[1].startswith("building DeepSpeed's shared-memory communication op (CPU runs) once for this "
                               "machine, which may take 1-5 minutes")
    assert lines[1].endswith(f"into {build_dir}. zerotrain doctor --build builds the ops ahead of time")
    assert len(lines) == 2

    (build_dir / f"{builder.name}.so").write_bytes(b"")  # built: nothing to say
    lines.clear()
    assert prepare_ops([SHM], say=lines.append) == [] and lines == []

    # Built, with a lock taken just now: another process loading it (torch locks to check the library is
    # current), no build to wait for; nothing said, the lock left to its owner. A stale one is still removed.
    fresh = _lock(build_dir, age_s=0)
    assert prepare_ops([SHM], say=lines.append) == [] and lines == []
    assert fresh.exists()
    _lock(build_dir, age_s=3600)
    then = time.time() - 3600
    os.utime(build_dir / f"{builder.name}.so", (then, then))  # nothing in the folder changed for an hour
    assert prepare_ops([SHM], say=lines.append) == []
    assert len(lines) == 1 and lines[0].startswith(f"removed {fresh}")


@pytest.mark.slow
def test_an_interrupted_build_does_not_hang_the_next_load(ext_root):
    """torch's loader really waits on the lock; after prepare_ops it goes on. The op is only loaded (from a copy
    of this machine's build) when one exists, so the test needs no compiler: a missing build is a skip."""
    builder = _shm_builder()
    built = Path(os.path.expanduser("~/.cache/torch_extensions")).glob(f"*_cpu/{builder.name}/{builder.name}.so")
    built = next(iter(built), None)
    if built is None:
        pytest.skip(f"no build of {builder.name} on this machine to copy (zerotrain doctor --build makes one)")
    shutil.copytree(built.parent, ext_root / builder.name)
    _lock(ext_root / builder.name, age_s=3600)
    code = ("import sys; from zerotrain.runtime.doctor import prepare_ops; prepare_ops(sys.argv[1:], say=print); "
            "from deepspeed.accelerator import get_accelerator; "
            "get_accelerator().create_op_builder(sys.argv[1]).load(verbose=False); print('loaded')")
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    out = subprocess.run([sys.executable, "-c", code, SHM], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[0].startswith("removed ") and out.stdout.splitlines()[-1] == "loaded"


@pytest.mark.parametrize("ds, ops", [
    ({"optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}, []),
    ({"optimizer": {"type": "Adam", "params": {}}}, ["FusedAdamBuilder"]),
    ({"optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
     ["CPUAdamBuilder"]),
    ({"optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"},
                                                            "offload_param": {"device": "nvme"}}},
     ["CPUAdamBuilder", "AsyncIOBuilder"]),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}, []),
])
def test_ops_a_deepspeed_config_builds(ds, ops):
    assert ops_for(ds) == ops


def test_the_nvme_offload_verdict_is_deepspeeds_own_check():
    """Ready where DeepSpeed's async I/O builder can build its op here (its check compiles and links a call of libaio's
    io_submit), else what is missing and how to install it; which of the two depends on this machine."""
    from zerotrain.runtime.doctor import LIBAIO_INSTALL, nvme_offload_status, op_buildable

    line = nvme_offload_status()
    if op_buildable("AsyncIOBuilder"):
        assert line == "ready"
    else:
        assert line.startswith("needs libaio") and f"{LIBAIO_INSTALL})" in line
        assert "apt install libaio-dev" in line and "yum install libaio-devel" in line


def test_doctor_prints_the_nvme_offload_verdict_in_one_line(capsys):
    from zerotrain.cli.doctor import run
    from zerotrain.runtime.doctor import nvme_offload_status

    assert run([]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "NVMe offload:" in line]
    assert lines == [f"NVMe offload: {nvme_offload_status()}"]
