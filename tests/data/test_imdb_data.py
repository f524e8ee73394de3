"""IMDB loading (every local format), cleaning, the seeded split, tokenisation cache, collate, errors."""

from __future__ import annotations

import csv
import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from zerotrain.data.collate import PadCollator
from zerotrain.data.imdb import (
    balanced_subset,
    load_split,
    split_test_in_halves,
    tokenize_reviews,
)
from zerotrain.errors import DataError, UserError

RECORDS = [
    {"text": "a great movie<br /><br />loved it", "label": 1},
    {"text": "awful plot \u0085 boring acting", "label": 0},  # U+0085 must not split the line
    {"text": "good fun", "label": 1},
]
EXPECTED_TEXTS = ["a great movie  loved it", "awful plot \u0085 boring acting", "good fun"]


def write_jsonl(path: Path, records, gz: bool = False) -> Path:
    # ensure_ascii=False on purpose: the raw U+0085 must survive, as a reader using splitlines() would break it
    content = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    if gz:
        with gzip.open(path, "wt", encoding="utf-8", newline="") as f:
            f.write(content)
    else:
        path.write_text(content, encoding="utf-8", newline="")
    return path


def write_csv(path: Path, records) -> Path:
    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["text", "label"])
        w.writeheader()
        w.writerows(records)
    return path


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir):
    from zerotrain.data.tokenizer import load_tokenizer

    return load_tokenizer(str(tiny_tokenizer_dir))


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.gz", "csv", "parquet"])
def test_folder_formats(tmp_path, fmt):
    path = tmp_path / f"train.{fmt}"
    if fmt.startswith("jsonl"):
        write_jsonl(path, RECORDS, gz=fmt.endswith("gz"))
    elif fmt == "csv":
        write_csv(path, RECORDS)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(RECORDS), path)
    texts, labels = load_split(tmp_path, "train")
    assert texts == EXPECTED_TEXTS
    assert labels == [1, 0, 1]


def test_aclimdb_tree_and_file_template(tmp_path):
    root = tmp_path / "aclImdb"
    for split in ("train", "test"):
        for pol, text in (("pos", "great<br />film"), ("neg", "bad film")):
            (root / split / pol).mkdir(parents=True)
            for i in (10, 2):
                (root / split / pol / f"{i}_7.txt").write_text(f"{text} {i}", encoding="utf-8")
    for source in (root, tmp_path):  # the tree itself or the folder containing aclImdb/
        texts, labels = load_split(source, "test")
        assert labels == [0, 0, 1, 1]
        assert texts == ["bad film 2", "bad film 10", "great film 2", "great film 10"]

    write_csv(tmp_path / "reviews_test.csv", RECORDS[:1])
    assert load_split(str(tmp_path / "reviews_{split}.csv"), "test")[1] == [1]
    write_csv(tmp_path / "reviews_train.csv", RECORDS)
    assert load_split(tmp_path / "reviews_train.csv", "test")[0] == [EXPECTED_TEXTS[0]]


@pytest.mark.parametrize(
    "line, problem",
    [
        ('{"text": "no label"}', "label"),
        ('{"label": 1}', "text"),
        ('{"text": "x", "label": 2}', "label"),
        ('{"text": "x", "label": 1', "not valid JSON"),
    ],
)
def test_bad_records_name_file_and_line(tmp_path, line, problem):
    path = tmp_path / "train.jsonl"
    path.write_text('{"text": "fine", "label": 0}\n' + line + "\n")
    with pytest.raises(DataError) as err:
        load_split(tmp_path, "train")
    assert f"{path}:2: " in str(err.value) and problem in str(err.value)


def test_bad_csv_label_and_empty_split(tmp_path):
    write_csv(tmp_path / "train.csv", [{"text": "ok", "label": 1}, {"text": "bad", "label": 5}])
    with pytest.raises(DataError, match=r"train\.csv:3: .*label"):
        load_split(tmp_path, "train")
    (tmp_path / "test.jsonl").write_text("\n")
    with pytest.raises(DataError, match=r"test\.jsonl: .*empty"):
        load_split(tmp_path, "test")
    with pytest.raises(DataError, match="no validation split"):
        load_split(tmp_path, "validation")


def test_hub_name_offline_says_what_to_pass(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match=r"--data.path DIR, a folder with train\.jsonl\.gz and test\.jsonl\.gz such as examples/data/imdb-sample"):
        load_split("no-such-owner/no-such-imdb", "train")


def test_split_test_in_halves():
    val, test = split_test_in_halves(101, seed=3)
    assert set(val).isdisjoint(test) and sorted(val + test) == list(range(101))
    assert abs(len(val) - len(test)) <= 1
    assert (val, test) == split_test_in_halves(101, seed=3)
    assert val != split_test_in_halves(101, seed=4)[0]
    assert val != sorted(val)  # shuffled: the first batches of a label-sorted file mix both classes


def test_balanced_subset():
    labels = [0] * 50 + [1] * 50  # sorted by label, as the IMDB files are
    idx = balanced_subset(labels, 10, seed=0)
    assert len(set(idx)) == 10 and sum(labels[i] for i in idx) == 5
    assert idx == balanced_subset(labels, 10, seed=0)
    assert balanced_subset(labels, None, seed=0) == list(range(100))


def test_tokenize_truncates_and_caches(tmp_path, tok, monkeypatch):
    texts = ["great " * 50, "bad movie"]
    ids = tokenize_reviews(texts, tok, max_len=16, cache_dir=tmp_path)
    assert [len(x) for x in ids] == [16, 4]
    assert ids[0][0] == tok.bos_token_id and ids[0][-1] == tok.eos_token_id  # </s> kept after truncation
    assert ids[0].dtype == np.int32
    files = list(tmp_path.glob("imdb-tokens-*.npz"))
    assert len(files) == 1

    # The second call must read the cache, not tokenise.
    def fail(*a, **k):
        raise AssertionError("tokenizer called despite a cache hit")

    monkeypatch.setattr(type(tok), "__call__", fail)
    again = tokenize_reviews(texts, tok, max_len=16, cache_dir=tmp_path)
    assert len(again) == len(ids) and all(np.array_equal(a, b) for a, b in zip(ids, again))
    monkeypatch.undo()
    tokenize_reviews(texts, tok, max_len=8, cache_dir=tmp_path)  # other max_len: other key
    tokenize_reviews(texts[:1], tok, max_len=16, cache_dir=tmp_path)  # other texts: other key
    assert len(list(tmp_path.glob("imdb-tokens-*.npz"))) == 3


def test_collate_pads_to_multiple_of_8():
    batch = PadCollator(pad_token_id=1)([(np.array([0, 5, 2], np.int32), 1),
                                         (np.array([0, 5, 6, 7, 8, 9, 10, 11, 12, 2]), 0)])
    assert batch["input_ids"].shape == (2, 16)
    assert batch["attention_mask"].sum(1).tolist() == [3, 10]
    assert batch["input_ids"][0, 3:].eq(1).all() and batch["attention_mask"][0, 3:].eq(0).all()
    assert batch["labels"].tolist() == [1, 0]
    capped = PadCollator(pad_token_id=1, max_len=12)([(np.arange(10), 1)])
    assert capped["input_ids"].shape == (1, 12)
