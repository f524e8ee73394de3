"""Shared fixtures: a tiny tokenizer and tiny text data built in the test, never downloaded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
LAUNCHER_VARS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}
_RUNNING: dict[str, pytest.Item] = {}
"""The test being set up or run, for :func:`run_python`'s marker check."""


def run_python(argv: list[str], cwd: Path, timeout: int = 600, **env_extra: str):
    """Run ``python ARGV`` in a fresh process that imports this checkout's zerotrain.

    In-process fits earlier in the session set torchrun's variables for their group of one;
    they are dropped, so a command with --launch.nproc_per_node N starts its N workers itself.
    The test that calls it must be marked ``slow`` (a fresh process pays for importing torch).
    """
    import subprocess
    import sys

    return subprocess.run([sys.executable, *argv], cwd=cwd, env=_child_env(argv, env_extra), capture_output=True,
                          text=True, timeout=timeout)


def start_zerotrain(args: list[str], cwd: Path, **env_extra: str):
    """``python -m zerotrain ARGS`` started in the background (a ``subprocess.Popen``), for a test that acts
    on the job while it runs. Its stdout and stderr go to ``cwd/stdout.txt`` and ``cwd/stderr.txt`` (files,
    not pipes, which a long run fills while nobody reads them). Same environment as :func:`run_python`."""
    import subprocess
    import sys

    argv = ["-m", "zerotrain", *args]
    with open(cwd / "stdout.txt", "w") as out, open(cwd / "stderr.txt", "w") as err:
        return subprocess.Popen([sys.executable, *argv], cwd=cwd, env=_child_env(argv, env_extra), stdout=out,
                                stderr=err)


def _child_env(argv: list[str], env_extra: dict) -> dict:
    item = _RUNNING.get("item")
    if item is not None and item.get_closest_marker("slow") is None:
        pytest.fail(f"{item.nodeid} starts `python {' '.join(map(str, argv[:2]))} ...`: mark it @pytest.mark.slow",
                    pytrace=False)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    pythonpath = os.pathsep.join(p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH")) if p)
    env.update(PYTHONPATH=pythonpath, HF_HUB_OFFLINE="1", **env_extra)
    return env


def zerotrain_cmd(args: list[str], cwd: Path, timeout: int = 600, **env_extra: str):
    """Run ``python -m zerotrain ARGS`` as a user would (see :func:`run_python`)."""
    return run_python(["-m", "zerotrain", *args], cwd, timeout, **env_extra)


WORDS = (
    "the a movie film was great good bad awful terrible wonderful plot acting story actor boring "
    "fun loved hated and but not very really i it this of to in is".split()
)


def make_tokenizer(folder: Path):
    """A word-level tokenizer with RoBERTa's special tokens, saved as a Hugging Face folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "<pad>", "</s>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials + WORDS + ["<mask>"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
        mask_token="<mask>", cls_token="<s>", sep_token="</s>",
    )
    fast.save_pretrained(folder)
    return fast


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tokenizer")
    make_tokenizer(folder)
    return folder


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


# A test that requests the fixture must carry the marker, so that `-m "not data"` / `-m "not slow"` select right.
MARKER_OF_FIXTURE = {"shared_data": "data", "cpu_adam_built": "slow"}


def pytest_runtest_setup(item):
    _RUNNING["item"] = item


def pytest_runtest_teardown(item, nextitem):
    _RUNNING.pop("item", None)


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
