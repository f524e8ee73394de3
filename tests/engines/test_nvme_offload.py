"""ZeRO-3 with the optimizer (and the weights) on NVMe, through DeepSpeed's real async I/O op and libaio, on
whatever device the machine has: the run swaps to the named folder, its checkpoints carry the swapped states,
and a resumed run continues bitwise, in fp32 and in bf16, its states swapped or held in memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import LLAMA, WORDS, train_log, zerotrain_cmd

from zerotrain.cli import main

pytestmark = pytest.mark.slow

LAYOUTS = {
    # fp32 weights and states; the optimizer and the weights both on disk
    "fp32_optimizer_and_weights": ("--precision.dtype", "fp32", "--strategy.offload_param", "nvme"),
    # bf16 weights on the device, their fp32 master weights and moments on disk
    "bf16": ("--precision.dtype", "bf16"),
}
SWAPPED = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4)
"""0.67M parameters: one optimizer sub-group over the 1 MiB DeepSpeed swaps at least, so its states go to disk."""
HELD: dict = {}
"""The tests' tiny Llama (25k parameters): a sub-group under 1 MiB, which DeepSpeed keeps in memory beside the
swapped ones (its checkpoint is the partition file, not the swap files)."""


def _inputs(tmp_path: Path, dims: dict) -> None:
    (tmp_path / "llama.json").write_text(json.dumps(dict(LLAMA, vocab_size=64, **dims)))
    (tmp_path / "train.txt").write_text(
        "\n".join(" ".join(WORDS[(i * 7 + j * 3) % 12] for j in range(4 + i % 5)) for i in range(48)) + "\n")


def _flags(tmp_path: Path, tok: Path, run: str, steps: int) -> list[str]:
    return ["--model.init", "random", "--model.config", str(tmp_path / "llama.json"), "--model.tokenizer", str(tok),
            "--data.train_path", str(tmp_path / "train.txt"), "--data.seq_len", "32",
            "--data.cache_dir", str(tmp_path / "cache"), "--trainer.micro_batch_size", "2",
            "--trainer.max_steps", str(steps), "--trainer.log_every_steps", "1", "--trainer.num_workers", "0",
            "--trainer.output_dir", str(tmp_path), "--trainer.run_name", run, "--logging.progress_bar", "false",
            "--optimizer.lr", "1e-2", "--checkpoint.every_steps", "2", "--strategy.zero_stage", "3",
            "--strategy.offload_optimizer", "nvme", "--strategy.nvme_path", str(tmp_path / "swap")]


@pytest.mark.parametrize("layout,size", [(layout, "swapped") for layout in LAYOUTS] + [("bf16", "held")])
def test_an_nvme_offloaded_run_resumes_bitwise(tmp_path, tiny_tokenizer_dir, aio_built, layout, size):
    """Each run is a process of its own, as a resume after a stop is."""
    _inputs(tmp_path, SWAPPED if size == "swapped" else HELD)

    def run(name: str, steps: int, *extra: str) -> Path:
        out = zerotrain_cmd(["fit", "causal-lm", *_flags(tmp_path, tiny_tokenizer_dir, name, steps),
                             *LAYOUTS[layout], *extra], cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
        return tmp_path / name

    straight = run("straight", 8)
    run("split", 2)  # at step 2: CPU Adam's powers of the betas differ in float32 if computed afresh at step 3
    resumed = run("split", 8, "--checkpoint.resume", "auto")

    a, b = train_log(straight), train_log(resumed)
    assert sorted(a) == sorted(b) == list(range(1, 9))
    assert [b[s]["train_loss"] for s in a] == [a[s]["train_loss"] for s in a]
    assert [b[s]["grad_norm"] for s in a] == [a[s]["grad_norm"] for s in a]
    assert a[8]["train_loss"] < a[1]["train_loss"]
    # Swapped states: the checkpoint holds the disk's copy of them (DeepSpeed writes them beside its own files),
    # listed in the folder's manifest like every other file. Held ones are in the partition file alone.
    marker = json.loads((resumed / "checkpoints" / "step00000008" / "COMPLETE.json").read_text())
    swapped = [name for name in marker["files"] if name.startswith("offloaded_tensors/")]
    assert any("exp_avg_sq" in name for name in swapped) == (size == "swapped"), sorted(marker["files"])
    # Each run swapped into a folder of its own under the path given, removed when the run ended.
    offload = json.loads((resumed / "ds_config.json").read_text())["zero_optimization"]["offload_optimizer"]
    assert Path(offload["nvme_path"]).parent == tmp_path / "swap" and offload["nvme_path"] != str(tmp_path / "swap")
    assert list((tmp_path / "swap").iterdir()) == []


def test_a_resume_in_a_process_that_built_another_model_is_refused_in_one_line(tmp_path, tiny_tokenizer_dir,
                                                                               aio_built, capfd):
    """DeepSpeed names swap files by a count of the parameters the process has built: resumed in the process
    that wrote it (the count has moved on), the checkpoint's files are not the ones the run would read."""
    _inputs(tmp_path, SWAPPED)
    fp32 = ("--precision.dtype", "fp32")  # as on a CPU: a GPU's bf16 would compile flex attention in this process
    assert main(["fit", "causal-lm", *_flags(tmp_path, tiny_tokenizer_dir, "split", 4), *fp32]) == 0
    capfd.readouterr()
    code = main(["fit", "causal-lm", *_flags(tmp_path, tiny_tokenizer_dir, "split", 8), *fp32,
                 "--checkpoint.resume", "auto"])
    err = capfd.readouterr().err
    assert code != 0
    assert "lacks offloaded_tensors/rank00/" in err and "fresh process" in err, err[-2000:]


def test_a_users_file_with_weight_buffers_under_the_largest_parameter_is_refused_in_one_line(
        tmp_path, tiny_tokenizer_dir, aio_built):
    """The buffers NVMe-offloaded weights pass through must hold a whole parameter (a rank's share): a user's
    DeepSpeed file that sets them smaller is refused before the model is built (DeepSpeed would assert there)."""
    _inputs(tmp_path, HELD)
    ds = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "swap")},
        "offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "swap"), "buffer_size": 1000}}}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    flags = _flags(tmp_path, tiny_tokenizer_dir, "small", 2)
    flags = flags[:flags.index("--strategy.zero_stage")]  # the file decides the stage and the offloads
    out = zerotrain_cmd(["fit", "causal-lm", *flags, "--strategy.deepspeed_config", str(tmp_path / "ds.json")],
                        cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-3000:]
    line = out.stderr.strip().splitlines()[-1]
    assert "zero_optimization.offload_param.buffer_size is 1000, under a rank's share of the model's largest " \
           "parameter (2,048 elements)" in line, out.stderr[-3000:]
