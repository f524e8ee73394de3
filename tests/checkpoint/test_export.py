"""``zerotrain export``: checkpoints of every engine back to one set of weights, on CPU.

The reference is what the fit itself exported at its last step (``RUN_DIR/model``, from the live
engine): the export of the final checkpoint, read back from files alone, must hold the same tensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import LLAMA, WORDS, lora_fit_args, toy_config, write_reviews, zerotrain_cmd
from safetensors.torch import load_file

from zerotrain.cli import main
from zerotrain.errors import UserError
from zerotrain.checkpoint.export import export_run
from zerotrain.train.loop import fit
from zerotrain.runtime.rundir import load_run
from zerotrain.tasks.mlm import MLMConfig, MLMTask
from zerotrain.tasks.toy import ToyTask

ENGINES = {"zero0": {"zero_stage": 0}, "zero1": {"zero_stage": 1}, "zero2": {"zero_stage": 2},
           "zero3": {"zero_stage": 3}, "ddp": {"backend": "ddp"}}


def _toy_run(tmp_path: Path, name: str, **strategy) -> Path:
    cfg = toy_config(tmp_path, name, **strategy)
    cfg.trainer.max_steps = 4
    cfg.checkpoint.every_steps = 2  # checkpoints at steps 2 and 4
    return fit(ToyTask(cfg)).run_dir


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


@pytest.fixture(scope="module")
def toy_runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("toy_runs")
    return {name: _toy_run(root, name, **strategy) for name, strategy in ENGINES.items()}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_export_of_the_last_checkpoint_is_the_trained_model(toy_runs, engine, capsys):
    run = toy_runs[engine]
    out = run.parent / f"{engine}-export"
    assert main(["export", str(run), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert f"exported step 4 of {run} (safetensors, fp32) to {out}" in printed
    assert printed[0].startswith("export: wrote ") and "/model/model.safetensors (2.21 kB of 2.21 kB)" in printed[0]
    _same(load_file(out / "model" / "model.safetensors"), load_file(run / "model" / "model.safetensors"))
    info = json.loads((out / "export.json").read_text())
    assert info["step"] == 4 and info["checkpoint"].endswith("step00000004") and info["recipe"] == "toy"
    # The folder is a run folder to load_run (and zerotrain predict): same outputs as the run's own export.
    x = torch.randn(3, 8)
    torch.testing.assert_close(load_run(out).model(x), load_run(run).model(x), rtol=0, atol=0)
    assert not list(out.parent.glob(f".{out.name}.partial-*"))  # no staging folder left behind


def test_a_smaller_shard_size_is_told_only_when_it_changes_the_files():
    """No host has 4,000 TB free, so shards are cut to a quarter of its free memory: worth a line for a model
    bigger than that, and nothing for one that is a single file either way (the toy runs' 2.21 kB)."""
    from zerotrain.checkpoint.weights import _shard_size_for_host

    lines: list[str] = []
    smaller = _shard_size_for_host("1000TB", lines.append, total_bytes=10**15)
    assert smaller < 10**15 and len(lines) == 1 and "of host memory free: shards of" in lines[0]
    lines.clear()
    assert _shard_size_for_host("1000TB", lines.append, total_bytes=2210) == smaller and lines == []


def test_an_older_step_and_bf16(toy_runs):
    run = toy_runs["zero2"]
    result = export_run(run, step=2, dtype="bf16")
    assert result.out_dir == run / "export" / "step00000002-bf16"
    older = load_file(result.out_dir / "model" / "model.safetensors")
    final = load_file(run / "model" / "model.safetensors")
    assert {t.dtype for t in older.values()} == {torch.bfloat16}
    assert not torch.equal(older["0.weight"].float(), final["0.weight"].bfloat16().float())  # step 2 is not step 4


def test_missing_step_lists_the_steps_there_are(toy_runs):
    with pytest.raises(UserError, match=r"^--step 3: .*step00000003 does not exist\. Complete checkpoints of this "
                                        r"run are at steps: 2, 4$"):
        export_run(toy_runs["zero0"], step=3)


def test_shards_past_max_shard_size_with_the_hf_index(toy_runs, tmp_path):
    run = toy_runs["zero3"]
    result = export_run(run, out=tmp_path / "sharded", max_shard_size=600)  # bytes: 0.weight alone is 1 KiB
    model_dir = result.out_dir / "model"
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2 and all(s.startswith("model-0000") for s in shards)
    merged = {}
    for shard in shards:
        merged.update(load_file(model_dir / shard))
    _same(merged, load_file(run / "model" / "model.safetensors"))


def test_a_sharded_export_is_what_load_run_reads(toy_runs, tmp_path):
    run = toy_runs["zero2"]
    out = export_run(run, out=tmp_path / "sharded", max_shard_size=600).out_dir
    assert (out / "model" / "model.safetensors.index.json").is_file()
    assert not (out / "model" / "model.safetensors").exists()
    x = torch.randn(3, 8)
    torch.testing.assert_close(load_run(out).model(x), load_run(run).model(x), rtol=0, atol=0)


def test_a_fit_exports_a_big_model_shard_by_shard_saying_so(tmp_path, monkeypatch, capsys):
    """The end of a run writes a model past the shard size as Hugging Face's shards, one at a time, with
    a line per shard; the run folder loads as before."""
    import zerotrain.tasks.base

    monkeypatch.setattr(zerotrain.tasks.base, "DEFAULT_MAX_SHARD_SIZE", 600)  # bytes: 0.weight alone is 1 KiB
    run = _toy_run(tmp_path, "big", zero_stage=2)
    index = json.loads((run / "model" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[zerotrain] export: wrote")]
    assert len(shards) >= 2 and len(lines) == len(shards)
    done = [float(line.rsplit("(", 1)[1].split()[0]) for line in lines]  # "(1.06 kB of 3.17 kB)": kB here
    assert all(" kB of " in line for line in lines) and done == sorted(done) and len(set(done)) == len(done)
    total = index["metadata"]["total_size"]
    assert lines[-1].endswith(f"({total / 1e3:.2f} kB of {total / 1e3:.2f} kB)")
    final = export_run(run, out=tmp_path / "from_checkpoint").out_dir  # the last checkpoint, written apart
    x = torch.randn(3, 8)
    torch.testing.assert_close(load_run(run).model(x), load_run(final).model(x), rtol=0, atol=0)
    # The export's own time and host memory, apart from the training's lifetime peak
    summary = json.loads((run / "summary.json").read_text())
    assert summary["export_s"] > 0 and 0 < summary["export_host_rss_before_gib"] <= summary["export_host_rss_peak_gib"]


def test_shards_shrink_to_a_quarter_of_the_free_host_memory_saying_so():
    """A big run's optimizer can fill the host (5B under CPU offload: 120 of 125 GiB): a 5 GB shard, on the
    host twice while it is written, would not fit, so shards follow the free memory, never below 64 MiB."""
    from types import SimpleNamespace
    from unittest import mock

    from zerotrain.checkpoint.weights import _shard_size_for_host

    from zerotrain.checkpoint.weights import parse_size

    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2**31 and parse_size(600) == 600
    assert parse_size("1.5MB") == 1_500_000 and parse_size("1000") == 1000
    assert parse_size("5e9") == 5 * 10**9 and parse_size("100B") == 100 and parse_size(5e9) == 5 * 10**9
    with pytest.raises(ValueError):
        parse_size("five gigabytes")
    lines: list[str] = []
    with mock.patch("psutil.virtual_memory", return_value=SimpleNamespace(available=100 * 10**9)):
        assert _shard_size_for_host("5GB", lines.append) == 5 * 10**9 and not lines
    with mock.patch("psutil.virtual_memory", return_value=SimpleNamespace(available=6 * 10**9)):
        assert _shard_size_for_host("5GB", lines.append) == 1.5e9
    assert lines == ["6.00 GB of host memory free: shards of 1.50 GB instead of 5.00 GB"]
    with mock.patch("psutil.virtual_memory", return_value=SimpleNamespace(available=10**8)):
        assert _shard_size_for_host("5GB", None) == 2**26


def test_refuses_a_folder_that_holds_files(toy_runs, tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("mine")
    with pytest.raises(UserError, match=r"^--out: .*taken already exists and is not an empty folder\. Pass a new"):
        export_run(toy_runs["ddp"], out=tmp_path / "taken")
    assert (tmp_path / "taken" / "x").read_text() == "mine"


def test_a_bad_max_shard_size_is_one_line(toy_runs, capsys):
    assert main(["export", str(toy_runs["ddp"]), "--max_shard_size", "big"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--max_shard_size must be a positive size such as 5GB, 500MB or 2GiB, got 'big'" in err[0]


def test_hf_format_is_for_recipes_with_a_hugging_face_model(toy_runs):
    with pytest.raises(UserError, match=r"^--format hf: only the mlm, causal-lm and classify recipes .* is a toy run"):
        export_run(toy_runs["ddp"], fmt="hf")


# ---- mlm -> transformers ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def mlm_run(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    tmp = tmp_path_factory.mktemp("mlm")
    lines = [" ".join(WORDS[(i * k) % len(WORDS)] for k in range(1, 12)) for i in range(80)]
    (tmp / "train.txt").write_text("\n".join(lines) + "\n")
    cfg = MLMConfig()
    cfg.model.num_layers, cfg.model.num_heads, cfg.model.h_dim, cfg.model.ff_dim = 2, 2, 16, 32
    cfg.model.max_seq_length, cfg.model.dropout = 16, 0.0
    cfg.data.train_path, cfg.data.tokenizer, cfg.data.cache_dir = str(tmp / "train.txt"), str(tiny_tokenizer_dir), None
    cfg.strategy.zero_stage = 3  # the tied decoder weight goes through ZeRO-3's partitioned checkpoint
    cfg.optimizer.lr = 1e-2
    cfg.trainer.micro_batch_size, cfg.trainer.max_steps, cfg.trainer.num_workers = 4, 3, 0
    cfg.trainer.output_dir, cfg.trainer.run_name = str(tmp), "mlm"
    cfg.logging.progress_bar = False
    return fit(MLMTask(cfg)).run_dir


def test_mlm_hf_folder_gives_zerotrains_logits(mlm_run, tmp_path):
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    out = export_run(mlm_run, out=tmp_path / "hf", fmt="hf").out_dir
    hf = AutoModelForMaskedLM.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    assert type(hf).__name__ == "RobertaForMaskedLM"
    ours = load_run(mlm_run).model
    texts = ["the movie was <mask> and the plot was fun", "i <mask> it"]
    batch = tok(texts, padding=True, return_tensors="pt")  # (2, T), the second right-padded
    assert batch["attention_mask"][1].sum() < batch["attention_mask"].shape[1]
    with torch.no_grad():
        theirs = hf(**batch).logits  # (2, T, V)
        mine = ours(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])["logits"]  # (2, T, V)
    real = batch["attention_mask"].bool()  # padded queries differ by design (RoBERTa gives pads position padding_idx)
    torch.testing.assert_close(theirs[real], mine[real], rtol=1e-4, atol=1e-4)
    assert theirs[real].argmax(-1).tolist() == mine[real].argmax(-1).tolist()


def test_mlm_safetensors_export_predicts_like_the_run(mlm_run, tmp_path, capsys):
    out = tmp_path / "st"
    assert main(["export", str(mlm_run), "--out", str(out)]) == 0
    capsys.readouterr()
    for folder in (mlm_run, out):
        assert main(["predict", str(folder), "the movie was <mask>", "--top_k", "3"]) == 0
    run_line, export_line = capsys.readouterr().out.splitlines()
    assert run_line == export_line and run_line.endswith("\tthe movie was <mask>")


# ---- imdb and lora ---------------------------------------------------------------------------

def test_imdb_export_is_what_predict_reads(tmp_path, tiny_tokenizer_dir, capsys):
    import random

    from zerotrain.tasks.imdb import IMDBConfig, IMDBTask, SentimentModelConfig

    data = write_reviews(tmp_path / "imdb", {"train": 64, "test": 32}, random.Random(0))
    cfg = IMDBConfig(model=SentimentModelConfig(embed_dim=16, hidden_dim=32, num_heads=2, num_layers=1, max_len=32))
    cfg.data.path, cfg.data.tokenizer, cfg.data.cache_dir = str(data), str(tiny_tokenizer_dir), None
    cfg.strategy.zero_stage = 1
    cfg.trainer.micro_batch_size, cfg.trainer.max_steps, cfg.trainer.num_workers = 8, 2, 0
    cfg.trainer.output_dir, cfg.trainer.run_name = str(tmp_path / "runs"), "imdb"
    cfg.logging.progress_bar = False
    run = fit(IMDBTask(cfg)).run_dir
    out = export_run(run).out_dir
    assert out == run / "export" / "step00000002"
    capsys.readouterr()
    texts = ["a wonderful film , loved it", "boring and awful"]
    for folder in (run, out):
        assert main(["predict", str(folder), *texts]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == lines[2:] and len(lines) == 4


@pytest.mark.slow  # a LoRA fit through `python -m zerotrain` with 2 ZeRO-3 ranks
def test_lora_two_rank_zero3_export_gives_adapter_and_merged_model(tmp_path, tiny_tokenizer_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    (tmp_path / "llama.json").write_text(json.dumps(dict(LLAMA, vocab_size=64)))
    records = [{"input": f"{WORDS[i % 20]} {WORDS[(i * 7) % 20]}", "target": WORDS[(i * 3) % 20]} for i in range(32)]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    fitted = zerotrain_cmd(lora_fit_args(tmp_path, tiny_tokenizer_dir, stage=3, nproc=2), cwd=tmp_path)
    assert fitted.returncode == 0, fitted.stderr[-3000:]
    run = tmp_path / "run"
    exported = zerotrain_cmd(["export", str(run), "--out", str(tmp_path / "exp")], cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr[-3000:]
    model_dir = tmp_path / "exp" / "model"
    # The adapter equals the one the fit wrote from its live engine at the end.
    _same(load_file(model_dir / "adapter" / "adapter_model.safetensors"),
          load_file(run / "model" / "adapter" / "adapter_model.safetensors"))
    merged = AutoModelForCausalLM.from_pretrained(model_dir / "merged").eval()
    adapted = load_run(run).model
    assert isinstance(adapted, PeftModel)
    x = torch.tensor([[0, 5, 9, 13, 7]])
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=x).logits, adapted(input_ids=x).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # two ZeRO-3 ranks through `python -m zerotrain`
def test_two_rank_zero3_checkpoint_exports_like_the_fit(tmp_path):
    args = ["fit", "toy", "--strategy.zero_stage", "3", "--trainer.max_steps", "3", "--trainer.micro_batch_size", "4",
            "--trainer.num_workers", "0", "--trainer.output_dir", str(tmp_path), "--trainer.run_name", "r",
            "--logging.progress_bar", "false", "--launch.nproc_per_node", "2"]
    fitted = zerotrain_cmd(args, cwd=tmp_path)
    assert fitted.returncode == 0, fitted.stderr[-3000:]
    assert len(list((tmp_path / "r" / "checkpoints" / "step00000003").glob("*_optim_states.pt"))) == 2
    exported = zerotrain_cmd(["export", str(tmp_path / "r"), "--out", str(tmp_path / "e")], cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert exported.stderr == ""  # DeepSpeed's progress lines and bars are not the user's to read
    _same(load_file(tmp_path / "e" / "model" / "model.safetensors"),
          load_file(tmp_path / "r" / "model" / "model.safetensors"))
