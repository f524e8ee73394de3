"""Out of GPU memory during training: one line with the sizes and the next smaller configuration, exit status 5.

The memory ladder (``zerotrain.train.oom.next_smaller``) is checked rung by rung and walked to its end through the
real flag parser; the line (``describe_oom``) on torch's message. End to end, the toy recipe runs out of
memory at step 3 (CPU only: a stand-in task raises ``torch.OutOfMemoryError`` with a CUDA-like message):
in-process through ``zerotrain.cli.main``, and through ``python -m zerotrain`` with 1 process and with 2
(Gloo) where only rank 1 runs out. The stand-in recipe ``toy_oom`` exists only in these tests: in-process it
is registered for one test, in a ``python -m zerotrain`` job by a ``sitecustomize`` put on PYTHONPATH.
"""

from __future__ import annotations

import os
import re
import textwrap

import pytest
import torch
from helpers import zerotrain_cmd

from zerotrain.config.flags import parse_config
from zerotrain.errors import OOM_EXIT, OutOfMemory
from zerotrain.runtime.launcher import describe_failure
from zerotrain.train.oom import describe_oom, failed_step, next_smaller
from zerotrain.tasks.base import REGISTRY
from zerotrain.tasks.toy import ToyConfig

TORCH_MESSAGE = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB of which "
                 "1.23 GiB is free. Including non-PyTorch memory, this process has 77.80 GiB memory in use. Of the "
                 "allocated memory 75.20 GiB is allocated by PyTorch, and 0.50 GiB is reserved by PyTorch but "
                 "unallocated. If reserved but unallocated memory is large try setting "
                 "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")


def _cfg(micro: int = 1, accum: int = 1, checkpointing: bool = True, **strategy) -> ToyConfig:
    cfg = ToyConfig()
    cfg.trainer.micro_batch_size, cfg.trainer.max_steps = micro, 10
    cfg.strategy.gradient_accumulation_steps, cfg.activation_checkpointing.enabled = accum, checkpointing
    for key, value in strategy.items():
        setattr(cfg.strategy, key, value)
    return cfg.validate()


# ---- the ladder ------------------------------------------------------------------------------------


@pytest.mark.parametrize("micro, accum", [(8, 1), (6, 3), (2, 4)])
def test_rung1_an_even_micro_batch_is_halved_with_the_same_global_batch(micro, accum):
    description, flags = next_smaller(_cfg(micro, accum, checkpointing=False, zero_stage=3), world_size=8)
    assert flags == ["--trainer.micro_batch_size", str(micro // 2), "--strategy.gradient_accumulation_steps",
                     str(accum * 2)]
    assert (micro // 2) * (accum * 2) == micro * accum
    assert description == f"micro-batch {micro // 2} x {accum * 2} accumulation steps (the same global batch)"


@pytest.mark.parametrize("micro", [1, 3])
def test_rung2_activation_checkpointing_when_the_micro_batch_cannot_be_halved(micro):
    assert next_smaller(_cfg(micro, checkpointing=False)) == (
        "activation checkpointing", ["--activation_checkpointing.enabled", "true"])


# (backend, stage, offload optimizer, offload param) -> the flags of the next rung, on 2 GPUs and on 1.
ZERO_RUNGS = [
    (("ddp", 0, "none", "none"), 2, ["--strategy.backend", "deepspeed", "--strategy.zero_stage", "2"]),
    (("deepspeed", 0, "none", "none"), 2, ["--strategy.zero_stage", "2"]),
    (("deepspeed", 1, "none", "none"), 2, ["--strategy.zero_stage", "2"]),
    (("deepspeed", 1, "cpu", "none"), 2, ["--strategy.zero_stage", "2"]),
    (("deepspeed", 2, "none", "none"), 2, ["--strategy.zero_stage", "3"]),
    (("deepspeed", 2, "cpu", "none"), 2, ["--strategy.zero_stage", "3"]),
    (("deepspeed", 3, "none", "none"), 2, ["--strategy.offload_optimizer", "cpu", "--strategy.offload_param", "cpu"]),
    (("deepspeed", 3, "cpu", "none"), 2, ["--strategy.offload_param", "cpu"]),
    (("deepspeed", 3, "cpu", "cpu"), 2, None),
    # One GPU: a partition of one holds everything, so the next rung that saves memory offloads.
    (("ddp", 0, "none", "none"), 1,
     ["--strategy.backend", "deepspeed", "--strategy.zero_stage", "2", "--strategy.offload_optimizer", "cpu"]),
    (("deepspeed", 0, "none", "none"), 1, ["--strategy.zero_stage", "2", "--strategy.offload_optimizer", "cpu"]),
    (("deepspeed", 2, "none", "none"), 1, ["--strategy.offload_optimizer", "cpu"]),
    (("deepspeed", 2, "cpu", "none"), 1, ["--strategy.zero_stage", "3", "--strategy.offload_param", "cpu"]),
    (("deepspeed", 1, "cpu", "none"), 1, ["--strategy.zero_stage", "3", "--strategy.offload_param", "cpu"]),
    (("deepspeed", 3, "none", "none"), 1, ["--strategy.offload_optimizer", "cpu", "--strategy.offload_param", "cpu"]),
    (("deepspeed", 3, "cpu", "none"), 1, ["--strategy.offload_param", "cpu"]),
    (("deepspeed", 3, "cpu", "cpu"), 1, None),
]


@pytest.mark.parametrize("strategy, world, flags", ZERO_RUNGS,
                         ids=[f"{'-'.join(map(str, s))}-on{w}" for s, w, _ in ZERO_RUNGS])
def test_rung3_zero_stages_then_offload(strategy, world, flags):
    backend, stage, opt, param = strategy
    found = next_smaller(_cfg(backend=backend, zero_stage=stage, offload_optimizer=opt, offload_param=param), world)
    assert (found[1] if found else None) == flags


@pytest.mark.parametrize("world", [1, 2])
def test_walking_the_ladder_through_the_flag_parser_ends_with_everything_offloaded(world):
    """From the defaults (micro-batch 8, DDP): every rung's flags parse, validate and keep the global batch."""
    argv = ["--trainer.max_steps", "10", "--trainer.micro_batch_size", "8", "--strategy.backend", "ddp"]
    seen = []
    while True:
        cfg = parse_config("toy", argv).validate()
        assert cfg.trainer.micro_batch_size * cfg.strategy.gradient_accumulation_steps == 8
        rung = next_smaller(cfg, world)
        if rung is None:
            break
        seen.append(rung[0])
        argv += rung[1]
        assert len(seen) < 10
    s = cfg.strategy
    assert (cfg.trainer.micro_batch_size, cfg.activation_checkpointing.enabled, s.backend, s.zero_stage, s.offload_optimizer,
            s.offload_param) == (1, True, "deepspeed", 3, "cpu", "cpu")
    assert seen[:4] == [f"micro-batch {m} x {8 // m} accumulation steps (the same global batch)" for m in (4, 2, 1)] + [
        "activation checkpointing"]


# ---- the line --------------------------------------------------------------------------------------


def test_the_line_reads_the_sizes_from_torchs_message_on_cpu():
    line = describe_oom(torch.OutOfMemoryError(TORCH_MESSAGE), 7, _cfg(8, 2, zero_stage=2), 4, 3.5 * 2**30,
                        torch.device("cpu"), rank=3)
    assert line == (
        "out of GPU memory at step 7 (rank 3) while allocating 2.00 GiB (GPU total 79.10 GiB, PyTorch had 75.20 GiB "
        "allocated); the memory model predicted 3.50 GiB per GPU for the model states of deepspeed ZeRO-2 on 4 GPUs "
        "(activations not included); try: micro-batch 4 x 4 accumulation steps (the same global batch): "
        "--trainer.micro_batch_size 4 --strategy.gradient_accumulation_steps 4")


def test_what_is_unknown_is_left_out():
    line = describe_oom(torch.OutOfMemoryError("CUDA out of memory.\nsomething else"), 1,
                        _cfg(backend="ddp"), 1, None, None, rank=0)
    assert line == ("out of GPU memory at step 1 (rank 0); try: ZeRO-2 with the optimizer state offloaded to CPU "
                    "memory: --strategy.backend deepspeed --strategy.zero_stage 2 --strategy.offload_optimizer cpu")


@pytest.mark.parametrize("said, shown", [("20.00 MiB", "0.02 GiB"), ("512.00 KiB", "0.50 MiB"), ("1000 bytes", "0.00 MiB"),
                                         ("1.50 GiB", "1.50 GiB")])
def test_small_sizes_are_not_written_as_zero_gib(said, shown):
    line = describe_oom(torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {said}. GPU 0"), 2, _cfg(), 2,
                        None, None, rank=1)
    assert f"while allocating {shown};" in line


def test_at_the_bottom_of_the_ladder_the_line_says_more_gpus_or_fewer_parameters():
    line = describe_oom(torch.OutOfMemoryError(TORCH_MESSAGE), 1,
                        _cfg(zero_stage=3, offload_optimizer="cpu", offload_param="cpu"), 2, 2**30, None, rank=0)
    assert "deepspeed ZeRO-3, optimizer offload to cpu, parameter offload to cpu on 2 GPUs" in line
    assert line.endswith("; nothing smaller is left on this many GPUs: add GPUs (--launch.nproc_per_node, "
                         "--launch.nnodes) or train fewer parameters (e.g. the lora recipe)")
    assert "\n" not in line


def test_with_a_deepspeed_file_the_line_says_to_change_the_file(tmp_path):
    cfg = _cfg(zero_stage=2)
    cfg.strategy.deepspeed_config = str(tmp_path / "ds.json")
    line = describe_oom(torch.OutOfMemoryError(TORCH_MESSAGE), 1, cfg, 2, None, None, rank=0)
    assert line.endswith(f"try: ZeRO-3 (weights partitioned too): --strategy.zero_stage 3 (set the same in "
                         f"{tmp_path / 'ds.json'}, which --strategy.deepspeed_config reads)")


def test_the_failed_step_is_the_next_one_inside_train_step_and_the_last_one_after_it():
    def train_step():
        raise torch.OutOfMemoryError("x")

    def evaluate():
        raise torch.OutOfMemoryError("x")

    for fn, expected in ((train_step, 5), (evaluate, 4)):
        with pytest.raises(torch.OutOfMemoryError) as caught:
            fn()
        assert failed_step(caught.value, 4) == expected


def test_the_launcher_says_the_lowest_ranks_line_once_and_exits_5():
    from types import SimpleNamespace

    def failure(exitcode, rank, line=None):
        message = {"message": line, "errorCode": OOM_EXIT, "extraInfo": {"timestamp": "1"}} if line else ""
        return SimpleNamespace(exitcode=exitcode, local_rank=rank, timestamp=100, message=message, pid=0,
                               signal_name=lambda: "SIGTERM")

    failures = {2: failure(OOM_EXIT, 2, "zerotrain fit: error: out of GPU memory at step 3 (rank 2)"),
                1: failure(OOM_EXIT, 1, "zerotrain fit: error: out of GPU memory at step 3 (rank 1)"), 0: failure(-15, 0)}
    assert describe_failure(failures) == ("zerotrain fit: error: out of GPU memory at step 3 (rank 1)", OOM_EXIT)
    # Rank 0 ran out but could not leave its line: the launcher still says something, once.
    assert describe_failure({0: failure(OOM_EXIT, 0), 1: failure(-15, 1)}) == (
        "zerotrain: rank 0 stopped on an error (exit status 5)", OOM_EXIT)


# ---- end to end ------------------------------------------------------------------------------------

OOM_TOY = '''
import os

import torch

from zerotrain.tasks.toy import ToyTask


class OomToy(ToyTask):
    """The toy recipe, out of GPU memory in step $ZEROTRAIN_TEST_OOM_AT_STEP (on rank $ZEROTRAIN_TEST_OOM_RANK
    only, when set)."""

    name = "toy_oom"

    def training_step(self, model, batch):
        self.calls = getattr(self, "calls", 0) + 1
        step = (self.calls - 1) // self.cfg.strategy.gradient_accumulation_steps + 1
        rank = os.environ.get("ZEROTRAIN_TEST_OOM_RANK")
        if step == int(os.environ["ZEROTRAIN_TEST_OOM_AT_STEP"]) and rank in (None, os.environ.get("RANK", "0")):
            raise torch.OutOfMemoryError(%r)
        return super().training_step(model, batch)
''' % TORCH_MESSAGE

SITECUSTOMIZE = '''
# Written by tests/train/test_oom.py, and on PYTHONPATH only in its jobs: it shadows the interpreter's own
# sitecustomize, which it runs first, then registers the recipe toy_oom in every process of the job.
import importlib.machinery
import importlib.util
import os
import re
import sys

_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _here])
if _spec is not None and _spec.loader is not None:
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
if os.environ.get("ZEROTRAIN_TEST_OOM_AT_STEP"):
''' + textwrap.indent(OOM_TOY, "    ")

FIT = ["fit", "toy_oom", "--trainer.max_steps", "5", "--trainer.device", "cpu", "--trainer.num_workers", "0",
       "--logging.progress_bar", "false", "--logging.tensorboard", "false", "--checkpoint.save_final", "false",
       "--trainer.export", "false"]

EXPECTED = ("zerotrain fit: error: out of GPU memory at step 3 (rank {rank}) while allocating 2.00 GiB (GPU total "
            "79.10 GiB, PyTorch had 75.20 GiB allocated); the memory model predicted {predicted} per GPU for the model "
            "states of deepspeed ZeRO-{stage}{gpus} (activations not included); try: micro-batch 4 x 2 accumulation "
            "steps (the same global batch): --trainer.micro_batch_size 4 --strategy.gradient_accumulation_steps 2")


def _zerotrain_lines(stderr: str) -> list[str]:
    """The CLI's and the launcher's lines (log lines start with "[zerotrain]")."""
    return [line for line in stderr.splitlines() if line.startswith("zerotrain")]


@pytest.fixture
def oom_toy():
    """The recipe toy_oom, registered for one test (other tests list the recipes)."""
    exec(compile(OOM_TOY, "oom_toy", "exec"), {"__name__": "oom_toy"})
    yield REGISTRY["toy_oom"]
    REGISTRY.pop("toy_oom", None)


def test_out_of_memory_in_process_is_one_line_and_status_5(tmp_path, capsys, monkeypatch, oom_toy):
    from zerotrain.cli import main

    monkeypatch.setenv("ZEROTRAIN_TEST_OOM_AT_STEP", "3")
    code = main([*FIT, "--trainer.output_dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == OOM_EXIT, err[-3000:]
    assert "Traceback" not in err
    # The toy MLP: 552 fp32 parameters x 16 bytes (weights, gradients, two moments), no ZeRO bucket at stage 0.
    assert _zerotrain_lines(err) == [EXPECTED.format(rank=0, predicted="0.01 MiB", stage=0, gpus="")], err[-3000:]


def test_the_loop_raises_out_of_memory_with_the_line(tmp_path, monkeypatch, oom_toy):
    from zerotrain.train.loop import fit

    cfg = parse_config("toy_oom", FIT[2:] + ["--trainer.output_dir", str(tmp_path)]).validate()
    monkeypatch.setenv("ZEROTRAIN_TEST_OOM_AT_STEP", "2")
    with pytest.raises(OutOfMemory, match=r"^out of GPU memory at step 2 \(rank 0\) while allocating 2\.00 GiB") as e:
        fit(oom_toy(cfg))
    assert e.value.__suppress_context__ and e.value.__cause__ is None


@pytest.mark.slow
@pytest.mark.parametrize("nproc, rank", [(1, "0"), (2, "1"), (2, None)], ids=["alone", "rank1-of-2", "both-of-2"])
def test_out_of_memory_in_a_job_is_one_line_and_status_5(tmp_path, nproc, rank, monkeypatch):
    """Two processes where only rank 1 runs out: rank 0 loses it in the step's all-reduce and says nothing.
    Both at once (the usual case, same model on same GPUs): the launcher says one of their lines, once."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(SITECUSTOMIZE)
    # run_python puts this checkout's src first, then what PYTHONPATH holds.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(inject), os.environ.get("PYTHONPATH")) if p))
    only = {"ZEROTRAIN_TEST_OOM_RANK": rank} if rank is not None else {}
    proc = zerotrain_cmd([*FIT, "--trainer.output_dir", str(tmp_path / "runs"), "--launch.nproc_per_node", str(nproc),
                          "--launch.timeout_minutes", "1"], cwd=tmp_path, timeout=300, ZEROTRAIN_TEST_OOM_AT_STEP="3",
                         **only)
    assert proc.returncode == OOM_EXIT, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    lines = _zerotrain_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr[-3000:]
    said = re.search(r"\(rank (\d)\)", lines[0])[1]
    assert said == rank or (rank is None and said in "01")
    gpus = " on 2 GPUs" if nproc == 2 else ""
    assert lines[0] == EXPECTED.format(rank=said, predicted="0.01 MiB", stage=0, gpus=gpus)
