"""The IMDB recipe through the real loop and engine on CPU, then `zerotrain predict` on the run it left."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from helpers import REPO, write_reviews

from zerotrain.cli import main as cli_main
from zerotrain.errors import UserError
from zerotrain.runtime.rundir import load_run
from zerotrain.train.loop import fit
from zerotrain.tasks.imdb import IMDBConfig, IMDBTask, SentimentModelConfig

def test_imdb_learns_a_separable_set_and_predicts(tmp_path, tiny_tokenizer_dir, capsys):
    rng = random.Random(0)
    data = write_reviews(tmp_path / "imdb", {"train": 384, "test": 128}, rng)
    cfg = IMDBConfig(model=SentimentModelConfig(embed_dim=32, hidden_dim=64, num_heads=4, num_layers=1,
                                                max_len=32, dropout=0.0))
    cfg.data.path, cfg.data.tokenizer, cfg.data.cache_dir = str(data), str(tiny_tokenizer_dir), None
    cfg.data.bucket_by_length = True
    cfg.optimizer.lr = 3e-3
    cfg.strategy.zero_stage = 2
    cfg.trainer.micro_batch_size, cfg.trainer.epochs, cfg.trainer.num_workers = 16, 3, 0
    cfg.trainer.output_dir, cfg.trainer.run_name = str(tmp_path / "runs"), "imdb"
    cfg.logging.progress_bar = False
    result = fit(IMDBTask(cfg))

    assert result.final_step == 3 * (384 // 16)
    assert result.metrics["test_reviews"] == 64  # the seeded half of the test split
    assert result.metrics["test_acc"] > 0.9, result.metrics
    assert 0.0 <= result.metrics["throughput_data_wait_frac"] <= 1.0

    capsys.readouterr()
    assert cli_main(["predict", str(result.run_dir), "a wonderful film , loved it", "boring and awful"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split("\t")[0] for line in lines] == ["positive", "negative"]


def test_a_run_folder_travels(tmp_path, tiny_tokenizer_dir, monkeypatch, capsys):
    """A quickstart-like fit started from the repository folder, with its shipped sample and tokenizer named by
    relative paths, is moved to another place and read from a third: predict, export and load_run all work,
    because the run keeps its own tokenizer; a tokenizer of another vocabulary is named as the cause."""
    monkeypatch.chdir(REPO)
    cfg = IMDBConfig(model=SentimentModelConfig(embed_dim=16, hidden_dim=32, num_heads=2, num_layers=1,
                                                max_len=32, dropout=0.0))
    cfg.data.path, cfg.data.tokenizer = "examples/data/imdb-sample", "examples/data/roberta-tokenizer"
    cfg.data.max_train_samples, cfg.data.max_eval_samples, cfg.data.cache_dir = 64, 16, None
    cfg.strategy.zero_stage = 0
    cfg.trainer.micro_batch_size, cfg.trainer.max_steps, cfg.trainer.num_workers = 16, 2, 0
    cfg.trainer.output_dir, cfg.trainer.run_name = str(tmp_path / "runs"), "imdb"
    cfg.logging.progress_bar = False
    run = fit(IMDBTask(cfg)).run_dir
    assert (run / "tokenizer" / "tokenizer.json").is_file()
    config = json.loads((run / "model" / "config.json").read_text())
    assert config["recipe"] == "imdb" and config["vocab_size"] == 50265 and config["model"]["embed_dim"] == 16
    texts = ["a wonderful film, loved it", "boring and awful"]
    capsys.readouterr()
    assert cli_main(["predict", str(run), *texts]) == 0
    before = capsys.readouterr().out

    moved = tmp_path / "elsewhere" / "moved-run"
    moved.parent.mkdir()
    shutil.move(str(run), str(moved))
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # "examples/data/roberta-tokenizer", as hparams.json records it, is not here
    assert not Path(json.loads((moved / "hparams.json").read_text())["data"]["tokenizer"]).exists()

    assert cli_main(["predict", str(moved), *texts]) == 0
    assert capsys.readouterr().out == before
    assert cli_main(["export", str(moved), "--out", str(tmp_path / "exported")]) == 0
    assert (tmp_path / "exported" / "tokenizer" / "tokenizer.json").is_file()
    capsys.readouterr()
    assert cli_main(["predict", str(tmp_path / "exported"), *texts]) == 0
    assert capsys.readouterr().out == before
    loaded = load_run(moved)
    assert loaded.task.predict(loaded.model, texts) == [line.rsplit("\t", 1)[0] for line in before.splitlines()]

    with pytest.raises(UserError) as info:
        load_run(moved, {"tokenizer": str(tiny_tokenizer_dir)})
    message = str(info.value)
    assert message.startswith(f"the tokenizer {str(tiny_tokenizer_dir)!r} (data.tokenizer) has ") and "50265" in message
    assert "--tokenizer DIR" in message and "\n" not in message
