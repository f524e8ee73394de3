"""predict() on a fake run folder: hparams.json (recipe + config) + model/model.safetensors, as a training run leaves them."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from zerotrain.data.collate import PadCollator
from zerotrain.data.imdb import tokenize_reviews
from zerotrain.errors import UserError
from zerotrain.tasks.imdb import IMDBConfig, IMDBTask, SentimentModelConfig, predict


@pytest.fixture()
def run_dir(tmp_path, tiny_tokenizer_dir):
    cfg = IMDBConfig(model=SentimentModelConfig(embed_dim=32, hidden_dim=64, num_heads=4, num_layers=1, max_len=16))
    cfg.data.tokenizer = str(tiny_tokenizer_dir)
    torch.manual_seed(0)
    task = IMDBTask(cfg)
    model = task.build_model().eval()
    run = tmp_path / "imdb.run"
    (run / "model").mkdir(parents=True)
    (run / "hparams.json").write_text(json.dumps({"recipe": "imdb", **dataclasses.asdict(cfg)}))
    task.export(model, model.state_dict(), run / "model")
    return run, task, model


def test_predict_matches_model_softmax(run_dir):
    run, task, model = run_dir
    texts = ["a great movie<br />loved it", "awful boring plot " * 10, "good"]
    got = predict(run, texts)
    ids = tokenize_reviews([t.replace("<br />", " ") for t in texts], task.tokenizer, max_len=16)
    batch = PadCollator(task.tokenizer.pad_token_id, max_len=16)([(x, 0) for x in ids])
    with torch.no_grad():
        probs = model(batch["input_ids"], batch["attention_mask"])["logits"].softmax(-1)
    assert len(got) == 3
    for (label, p), row in zip(got, probs):
        assert label in ("negative", "positive") and 0.0 <= p <= 1.0
        k = 1 if label == "positive" else 0
        assert p == pytest.approx(float(row[k]), abs=1e-5) and p >= 0.5


def test_predict_missing_files_say_what_to_do(run_dir, tmp_path):
    run, _, _ = run_dir
    with pytest.raises(UserError, match="does not exist"):
        predict(tmp_path / "nope", ["x"])
    (run / "model" / "model.safetensors").unlink()
    with pytest.raises(UserError, match=r"model\.safetensors is missing"):
        predict(run, ["x"])
    (run / "hparams.json").unlink()
    with pytest.raises(UserError, match=r"hparams\.json is missing"):
        predict(run, ["x"])
