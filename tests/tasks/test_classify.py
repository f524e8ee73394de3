"""The classify recipe on tiny random BERT, RoBERTa and DistilBERT made here from configs: training, exact
resume, label names saved with the model, the exported folder loading with the same logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import REPO, train_log

from zerotrain.errors import DataError
from zerotrain.tasks.classify import ClassifyConfig, ClassifyTask
from zerotrain.train.loop import fit

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=80, pad_token_id=1, bos_token_id=0, eos_token_id=2, hidden_dropout_prob=0.0,
             attention_probs_dropout_prob=0.0, initializer_range=0.1)
CONFIGS = {
    "bert": dict(SMALL, model_type="bert"),
    "roberta": dict(SMALL, model_type="roberta"),
    "distilbert": dict(model_type="distilbert", vocab_size=64, dim=32, hidden_dim=64, n_layers=2, n_heads=4,
                       max_position_embeddings=80, pad_token_id=1, dropout=0.0, attention_dropout=0.0,
                       seq_classif_dropout=0.0, initializer_range=0.1),
}
GOOD, BAD = ["good", "great", "wonderful", "loved", "fun"], ["bad", "awful", "terrible", "hated", "boring"]


def _review(i: int) -> tuple[str, str]:
    words = GOOD if i % 2 else BAD
    return f"the movie was {words[i % 5]} and {words[(i + 2) % 5]}", "positive" if i % 2 else "negative"


@pytest.fixture()
def files(tmp_path, tiny_tokenizer_dir):
    for name, config in CONFIGS.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(config))
    rows = [dict(zip(("text", "label"), _review(i))) for i in range(40)]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "val.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:8]) + "\n")
    return tmp_path, tiny_tokenizer_dir


def config(tmp_path: Path, tok: Path, model: str = "roberta", run_name: str = "run", steps: int = 8,
           **strategy) -> ClassifyConfig:
    cfg = ClassifyConfig()
    cfg.model.init, cfg.model.config, cfg.model.tokenizer = "random", str(tmp_path / f"{model}.json"), str(tok)
    cfg.data.train_path, cfg.data.val_path, cfg.data.max_length = str(tmp_path / "train.jsonl"), None, 32
    cfg.data.cache_dir = str(tmp_path / "cache")
    cfg.trainer.micro_batch_size, cfg.trainer.max_steps, cfg.trainer.log_every_steps = 4, steps, 1
    cfg.trainer.num_workers, cfg.trainer.output_dir, cfg.trainer.run_name = 0, str(tmp_path), run_name
    cfg.logging.progress_bar, cfg.logging.tensorboard = False, False
    cfg.optimizer.lr = 3e-3
    cfg.checkpoint.every_steps = 4
    for key, value in strategy.items():
        setattr(cfg.strategy, key, value)
    return cfg


FORMS = ["train.csv", "train.tsv", "train.parquet", "saved", "parts", "parts/*.jsonl"]


def _write_form(tmp_path: Path, form: str, rows: list[dict]) -> None:
    """The records as CSV, TSV, Parquet, a saved dataset or a folder of two JSON-lines files."""
    import csv

    import datasets

    if form.endswith((".csv", ".tsv")):
        with open(tmp_path / form, "w", newline="") as f:
            writer = csv.writer(f, delimiter="," if form.endswith(".csv") else "\t")
            writer.writerow(["text", "label"])
            writer.writerows([r["text"], r["label"]] for r in rows)
    elif form.endswith(".parquet"):
        pa = pytest.importorskip("pyarrow", reason="Parquet files are read through pyarrow, which is not installed")
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), tmp_path / form)
    elif form == "saved":
        datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    else:
        (tmp_path / "parts").mkdir()
        for i, part in enumerate((rows[:15], rows[15:])):
            (tmp_path / "parts" / f"{i}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))


def _examples(cfg: ClassifyConfig) -> list[tuple[list[int], int]]:
    train = ClassifyTask(cfg).build_datasets().train
    return [(list(train[i]["input_ids"]), int(train[i]["labels"])) for i in range(len(train))]


@pytest.mark.parametrize("form", FORMS)
def test_csv_tsv_parquet_a_saved_dataset_and_a_folder_give_the_jsonl_examples(files, form):
    tmp_path, tok = files
    rows = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    want = _examples(config(tmp_path, tok))
    assert len(want) == 40 and {y for _, y in want} == {0, 1}
    _write_form(tmp_path, form, rows)
    cfg = config(tmp_path, tok)
    cfg.data.train_path = str(tmp_path / form)
    assert _examples(cfg) == want
    assert cfg.data.label_names == ["negative", "positive"]


def test_a_second_build_reads_the_cached_tokens(files, monkeypatch):
    tmp_path, tok = files
    cfg = config(tmp_path, tok)
    cfg.data.val_path = str(tmp_path / "val.jsonl")
    first = ClassifyTask(cfg).build_datasets()
    assert len(list((tmp_path / "cache").glob("classify-*.arrow"))) == 2

    def boom(*args, **kwargs):
        raise AssertionError("tokenized again: the cache was not used")

    task = ClassifyTask(config(tmp_path, tok))
    task.cfg.data.val_path = str(tmp_path / "val.jsonl")
    monkeypatch.setattr(type(task.tokenizer), "__call__", boom)
    again = task.build_datasets()
    for a, b in ((first.train, again.train), (first.val, again.val)):
        assert [a[i] for i in range(len(a))] == [b[i] for i in range(len(b))]
    monkeypatch.undo()
    task = ClassifyTask(config(tmp_path, tok))
    task.cfg.data.max_length = 8  # another setting: another key, tokenized anew
    assert max(len(x["input_ids"]) for x in task.build_datasets().train) == 8


@pytest.mark.parametrize("body, where, message", [
    ("text,label\ngood,pos\nbad,\n", ":3", "missing field 'label' \\(keys: \\['text'\\]\\). Rename the field or set "
                                          "--data.label_field"),
    ("text,label\ngood,pos\n,neg\n", ":3", "missing field 'text' \\(keys: \\['label'\\]\\)"),
    ("text,label\ngood,pos\n\nbad,-1\n", ":4", "label -1 must be a class name or an integer >= 0 \\(--data.label_field\\)"),
    ("text,label\n", "", "no records"),
])
def test_a_bad_csv_row_is_named_by_its_line(files, body, where, message):
    tmp_path, tok = files
    (tmp_path / "bad.csv").write_text(body)
    cfg = config(tmp_path, tok)
    cfg.data.train_path = str(tmp_path / "bad.csv")
    with pytest.raises(DataError, match=f"^{tmp_path / 'bad.csv'}{where}: {message}"):
        ClassifyTask(cfg).build_datasets()


def test_csv_cells_are_text_digits_are_class_ids(files):
    """As Python's csv module reads them: "NA" is a text, digits are integer labels, an id past the classes fails."""
    tmp_path, tok = files
    (tmp_path / "ids.csv").write_text("text,label\nNA,1\ngood,0\nbad,2\n")
    cfg = config(tmp_path, tok)
    cfg.data.train_path = str(tmp_path / "ids.csv")
    task = ClassifyTask(cfg)
    assert task.label_names() == ["0", "1", "2"]
    assert [task.build_datasets().train[i]["labels"] for i in range(3)] == [1, 0, 2]


def test_a_text_file_has_no_labels(files):
    tmp_path, tok = files
    (tmp_path / "plain.txt").write_text("the movie was good\n")
    cfg = config(tmp_path, tok)
    cfg.data.train_path = str(tmp_path / "plain.txt")
    with pytest.raises(DataError, match="text files hold no labels"):
        ClassifyTask(cfg).build_datasets()


@pytest.mark.parametrize("model", [pytest.param(m, marks=() if m == "roberta" else pytest.mark.slow)
                                   for m in CONFIGS])
def test_each_architecture_trains_and_its_export_loads_with_the_same_logits(files, model):
    from transformers import AutoModelForSequenceClassification

    from zerotrain.runtime.rundir import load_run

    tmp_path, tok = files
    cfg = config(tmp_path, tok, model, steps=30, backend="ddp")
    cfg.checkpoint.every_steps, cfg.optimizer.lr, cfg.trainer.micro_batch_size = 0, 2e-3, 8
    result = fit(ClassifyTask(cfg))
    log = train_log(result.run_dir)
    first, last = sum(log[s]["train_loss"] for s in (1, 2, 3)) / 3, sum(log[s]["train_loss"] for s in (28, 29, 30)) / 3
    assert last < first - 0.2, (first, last)

    folder = result.run_dir / "model"
    hf_model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    assert hf_model.config.id2label == {0: "negative", 1: "positive"}
    assert hf_model.config.label2id == {"negative": 0, "positive": 1}
    run = load_run(result.run_dir)
    x = torch.tensor([[0, 5, 6, 7, 8, 2]])
    with torch.no_grad():
        torch.testing.assert_close(hf_model(input_ids=x).logits, run.model(input_ids=x).logits)
    lines = run.task.predict(run.model, [_review(1)[0], _review(2)[0]])
    assert [line.split("\t")[0] in ("negative", "positive") for line in lines] == [True, True]


STRATEGIES = {"zero0": dict(zero_stage=0), "zero1": dict(zero_stage=1), "zero2": dict(zero_stage=2),
              "zero3": dict(zero_stage=3), "plain": dict(backend="ddp")}


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == "zero1" else pytest.mark.slow)
                                  for n in STRATEGIES])
def test_resume_is_exact(files, name):
    tmp_path, tok = files
    strategy = STRATEGIES[name]
    straight = fit(ClassifyTask(config(tmp_path, tok, run_name="straight", **strategy)))
    fit(ClassifyTask(config(tmp_path, tok, run_name="split", steps=4, **strategy)))
    again = config(tmp_path, tok, run_name="split", **strategy)
    again.checkpoint.resume = "auto"
    resumed = fit(ClassifyTask(again))
    a, b = train_log(straight.run_dir), train_log(resumed.run_dir)
    assert sorted(a) == sorted(b) == list(range(1, 9))
    for step in range(1, 9):
        assert b[step]["train_loss"] == a[step]["train_loss"], f"step {step}: loss differs after resume"


def test_integer_labels_and_a_label_outside_the_classes(files):
    tmp_path, tok = files
    (tmp_path / "ints.jsonl").write_text("".join(json.dumps({"text": "good", "label": i % 3}) + "\n" for i in range(6)))
    cfg = config(tmp_path, tok)
    cfg.data.train_path = str(tmp_path / "ints.jsonl")
    task = ClassifyTask(cfg)
    assert task.label_names() == ["0", "1", "2"]
    assert [x["labels"] for x in task.build_datasets().train] == [0, 1, 2, 0, 1, 2]
    cfg = config(tmp_path, tok)
    cfg.data.val_path = str(tmp_path / "ints.jsonl")
    with pytest.raises(DataError, match=r"ints.jsonl: record 2: label 2 is not one of the 2 classes"):
        ClassifyTask(cfg).build_datasets()


@pytest.mark.data
@pytest.mark.slow
def test_imdb_slice_fine_tunes_a_tiny_roberta(shared_data, tmp_path, files):
    """The real IMDB records (jsonl.gz, text/label) with the shipped RoBERTa tokenizer and a tiny random RoBERTa."""
    config_file = tmp_path / "roberta-50k.json"
    config_file.write_text(json.dumps(dict(CONFIGS["roberta"], vocab_size=50265, max_position_embeddings=136)))
    cfg = config(tmp_path, REPO / "examples" / "data" / "roberta-tokenizer", steps=10, backend="ddp")
    cfg.model.config = str(config_file)
    from zerotrain.data.labelled import read_labelled

    # The file is sorted by label: a slice of 100 reviews of each, interleaved, through the recipe's own reader.
    texts, labels = read_labelled(shared_data / "imdb" / "train.jsonl.gz")
    picked = [i for c in (0, 1) for i in [j for j, y in enumerate(labels) if y == c][:100]]
    picked = [picked[k // 2 + (k % 2) * 100] for k in range(200)]
    (tmp_path / "imdb.jsonl").write_text("".join(json.dumps({"text": texts[i], "label": labels[i]}) + "\n"
                                                 for i in picked))
    cfg.data.train_path, cfg.data.max_length = str(tmp_path / "imdb.jsonl"), 128
    cfg.data.label_names = ["negative", "positive"]
    cfg.checkpoint.every_steps = 0
    result = fit(ClassifyTask(cfg))
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(result.run_dir / "model")
    assert model.config.id2label == {0: "negative", 1: "positive"}
    assert set(train_log(result.run_dir)) == set(range(1, 11))


def test_export_format_hf_and_predict_from_the_exported_run(files, capsys):
    from transformers import AutoModelForSequenceClassification

    from zerotrain.checkpoint.export import export_run
    from zerotrain.cli import predict

    tmp_path, tok = files
    cfg = config(tmp_path, tok, steps=4, backend="ddp")
    result = fit(ClassifyTask(cfg))
    export_run(result.run_dir, out=tmp_path / "hf", fmt="hf")
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf").eval()
    assert model.config.id2label == {0: "negative", 1: "positive"}
    assert json.loads((result.run_dir / "hparams.json").read_text())["data"]["label_names"] == ["negative", "positive"]
    (tmp_path / "train.jsonl").unlink()  # the classes come from hparams.json, not the training file
    export_run(result.run_dir, out=tmp_path / "plain")  # a run folder: hparams.json + model/
    capsys.readouterr()
    assert predict.run([str(tmp_path / "plain"), "the movie was good"]) == 0
    label, prob, text = capsys.readouterr().out.strip().splitlines()[-1].split("\t")
    x = torch.tensor([ClassifyTask(cfg).tokenizer("the movie was good")["input_ids"]])
    with torch.no_grad():
        p = model(input_ids=x).logits.softmax(-1)[0]
    assert (label, prob, text) == (model.config.id2label[int(p.argmax())], f"{float(p.max()):.3f}", "the movie was good")


def test_streamed_resume_continues_at_the_exact_record(files):
    """--data.streaming: a run stopped after 4 steps and resumed logs bitwise the losses of one that never stopped,
    across the end of the stream (20 records, 5 micro-batches a pass), and the checkpoint holds the offset."""
    tmp_path, tok = files

    def streamed(run_name, steps):
        cfg = config(tmp_path, tok, run_name=run_name, steps=steps, zero_stage=1)
        cfg.data.streaming, cfg.data.label_names, cfg.data.max_train_samples = True, ["negative", "positive"], 20
        return cfg

    straight = fit(ClassifyTask(streamed("straight", 8)))
    fit(ClassifyTask(streamed("split", 4)))
    saved = json.loads(next((tmp_path / "split").glob("checkpoints/step00000004/*.json")).read_text())
    assert saved.get("stream_offset") == [0, 16], saved
    again = streamed("split", 8)
    again.checkpoint.resume = "auto"
    resumed = fit(ClassifyTask(again))
    a, b = train_log(straight.run_dir), train_log(resumed.run_dir)
    assert sorted(a) == sorted(b) == list(range(1, 9))
    for step in range(1, 9):
        assert b[step]["train_loss"] == a[step]["train_loss"], f"step {step}: loss differs after a streamed resume"


def test_streaming_needs_the_class_names(files):
    tmp_path, tok = files
    cfg = config(tmp_path, tok)
    cfg.data.streaming = True
    with pytest.raises(Exception, match=r"--data.label_names.*--data.streaming"):
        cfg.validate()
