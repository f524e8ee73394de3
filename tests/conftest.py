"""Fixtures and hooks for every test under tests/; the plain helpers they share are in helpers.py.

Layout: tests/<package>/test_*.py tests src/zerotrain/<package>/ (config, cli, tasks, models, data, train,
engines, checkpoint, runtime, metrics, plan), a file going where what it mainly tests lives. The test_*.py
files at the top of tests/ are about the product as a whole: the docs, every documented bad input (also a
script: ``python tests/test_bad_inputs.py``), the GPU checks, the kill test of benchmarks/.

The folders are not packages (no __init__.py): pytest imports each test module under its file name, so file
names must stay unique across folders (pytest stops at collection when two collide). Packages would allow
equal names but would make ``config``, ``data``, ``train``... importable top-level packages that shadow
any module of that name. pyproject.toml's ``pythonpath = ["tests"]`` puts this folder on ``sys.path`` before
any conftest or test module is imported, under every import mode, so ``from helpers import ...`` works
from every folder; a script in this folder finds it as its own folder.

Test modules never import each other: what two of them need is a function in helpers.py or a fixture here.
The names this module takes from helpers (``zerotrain_cmd``, ``run_python``, ``start_zerotrain``, ``REPO``,
``WORDS``, ``make_tokenizer``, ``LAUNCHER_VARS``) stay importable from here, as ``from conftest import ...``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import (  # noqa: F401  (some only to be importable from here)
    LAUNCHER_VARS,
    LLAMA,
    REPO,
    RUNNING,
    SHARED_DATA,
    WORDS,
    make_tokenizer,
    run_python,
    start_zerotrain,
    zerotrain_cmd,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tokenizer")
    make_tokenizer(folder)
    return folder


@pytest.fixture()
def lora_files(tmp_path, tiny_tokenizer_dir) -> tuple[Path, Path]:
    """``(tmp_path, tokenizer)`` with ``tmp_path/llama.json`` (a tiny Llama for that tokenizer) and
    ``tmp_path/train.jsonl`` (32 prompt/target records in its words), the inputs of ``helpers.lora_fit_args``."""
    (tmp_path / "llama.json").write_text(json.dumps(dict(LLAMA, vocab_size=64)))
    records = [{"input": f"{WORDS[i % 20]} {WORDS[(i * 7) % 20]}", "target": f"{WORDS[(i * 3) % 20]} {WORDS[i % 5]}"}
               for i in range(32)]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return tmp_path, tiny_tokenizer_dir


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The real data beside the clone. A test that asks for it must be marked ``data`` (checked at collection)."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real data not found at {SHARED_DATA} (integration tests need ../shared/data beside the clone)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def cpu_adam_built() -> None:
    """DeepSpeed's CPU Adam op (DeepSpeedCPUAdam, the optimizer step under CPU offload), built once per session.

    DeepSpeed JIT-compiles it the first time it is loaded (65 to 140 s on 2 cores). Building it here
    puts that cost in this fixture's setup, once, instead of in the first offload test's run;
    later loads, in this process or in the ``python -m zerotrain`` processes tests start, find it in
    torch's extension cache. Where it cannot be built, the tests that need it are skipped with the
    reason (pytest's -ra summary prints it), not errored. Tests using it must be marked ``slow``.
    """
    try:
        from deepspeed.ops.op_builder import (
            CPUAdamBuilder,  # the import DeepSpeedCPUAdam itself uses
        )

        CPUAdamBuilder().load()
    except Exception as exc:  # no compiler, no headers, an unsupported CPU: skip what needs the op
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())
        pytest.skip(f"DeepSpeed's CPU Adam op cannot be built on this machine, so CPU-offload tests cannot run "
                    f"({reason[-600:]})")


@pytest.fixture(scope="session")
def aio_built(cpu_adam_built) -> None:
    """DeepSpeed's async I/O op (NVMe offload's reads and writes, compiled against libaio), built once per
    session, and the CPU Adam op NVMe optimizer offload steps with. Where libaio or its headers are missing,
    the tests that need it are skipped with ``zerotrain doctor``'s line saying what to install (the op is real:
    there is no NVMe offload to test without it). Tests using it must be marked ``slow``."""
    from zerotrain.runtime.doctor import nvme_offload_status

    status = nvme_offload_status()
    if status != "ready":
        pytest.skip(f"NVMe offload tests need DeepSpeed's async I/O op, and NVMe offload {status}")
    from deepspeed.accelerator import get_accelerator

    try:
        get_accelerator().create_op_builder("AsyncIOBuilder").load()
    except Exception as exc:  # libaio found, yet the build fails (a compiler, a header): skip with the reason
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())
        pytest.skip(f"DeepSpeed's async I/O op cannot be built on this machine, so NVMe tests cannot run "
                    f"({reason[-600:]})")


# A test that requests the fixture must carry the marker, so that `-m "not data"` / `-m "not slow"` select right.
MARKER_OF_FIXTURE = {"shared_data": "data", "cpu_adam_built": "slow", "aio_built": "slow"}


def pytest_runtest_setup(item):
    RUNNING["item"] = item


def pytest_runtest_teardown(item, nextitem):
    RUNNING.pop("item", None)


def pytest_collection_modifyitems(config, items):
    """Check the markers that follow from fixtures; GPU tests run on the GPU machine, elsewhere they are skipped."""
    import torch

    missing = [f"{item.nodeid}: uses the {fixture} fixture, so mark it @pytest.mark.{marker}"
               for item in items for fixture, marker in MARKER_OF_FIXTURE.items()
               if fixture in getattr(item, "fixturenames", ()) and item.get_closest_marker(marker) is None]
    if missing:
        raise pytest.UsageError("tests without the marker their fixtures imply:\n  " + "\n  ".join(missing))

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
