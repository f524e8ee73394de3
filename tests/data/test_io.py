"""zerotrain.data.io and zerotrain.data.collate: one error format, atomic writes, fingerprints, padding."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from zerotrain.data import io as dio
from zerotrain.data.collate import IGNORE_INDEX, PadCollator
from zerotrain.data.imdb import load_split
from zerotrain.data.io import (
    atomic_file,
    atomic_write_bytes,
    atomic_write_text,
    fingerprint,
    load_hub_dataset,
    looks_local,
    open_text,
    read_json,
    read_jsonl,
    read_lines,
    write_json,
)
from zerotrain.data.sft import load_records
from zerotrain.data.text import read_text_lines
from zerotrain.errors import DataError, UserError

GOOD = '{"text": "fine", "label": 0, "input": "a", "target": "b"}'


def data_error(fn, *args, **kwargs) -> str:
    """The message of the one DataError ``fn`` raises; it must not chain a library traceback."""
    with pytest.raises(DataError) as err:
        fn(*args, **kwargs)
    assert err.value.__cause__ is None and (err.value.__context__ is None or err.value.__suppress_context__)
    return str(err.value)


# ---- reading ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("suffix, opener", [("", open), (".gz", gzip.open), (".xz", lzma.open), (".bz2", bz2.open)])
def test_read_lines_every_compression_splits_on_newline_only(tmp_path, suffix, opener):
    path = tmp_path / f"a.txt{suffix}"
    with opener(path, "wb") as f:
        f.write("\ufefffirst\r\nsecond \u0085 still second\n\nlast".encode("utf-8"))
    assert list(read_lines(path)) == [(1, "first\r"), (2, "second \u0085 still second"), (3, ""), (4, "last")]
    with open_text(path) as f:
        assert f.read() == "first\r\nsecond \u0085 still second\n\nlast"


@pytest.mark.parametrize(
    "reader",
    [
        pytest.param(lambda p: load_split(p, "train"), id="imdb"),
        pytest.param(load_records, id="sft"),
        pytest.param(lambda p: read_text_lines(str(p)), id="text"),
    ],
)
def test_every_reader_reports_bad_json_as_path_colon_line(tmp_path, reader):
    path = tmp_path / "train.jsonl"
    path.write_text(GOOD + "\n\n" + '{"text": "x", "label": 1' + "\n")
    msg = data_error(reader, path)
    assert msg.startswith(f"{path}:3: not valid JSON (")


@pytest.mark.parametrize("compress", [False, True])
def test_not_utf8_names_file_and_line(tmp_path, compress):
    path = tmp_path / ("r.jsonl.gz" if compress else "r.jsonl")
    body = (GOOD + "\n" + GOOD + "\n").encode() + b'{"text": "caf\xe9", "label": 1}\n'
    path.write_bytes(gzip.compress(body) if compress else body)
    for reader in (read_jsonl, lambda p: load_split(p, "train"), load_records):
        msg = data_error(lambda: list(reader(path)))
        assert msg.startswith(f"{path}:3: not UTF-8 text") and "Save the file as UTF-8" in msg


def test_binary_garbage_names_file_and_line(tmp_path):
    path = tmp_path / "train.txt"
    path.write_bytes(b"a fine line\n" + bytes(range(256)) * 4)
    msg = data_error(read_text_lines, str(path))
    assert msg.startswith(f"{path}:2: ") and "NUL byte" in msg and "UTF-8 text file" in msg
    utf16 = tmp_path / "u16.jsonl"
    utf16.write_text(GOOD + "\n", encoding="utf-16")
    assert data_error(lambda: list(read_jsonl(utf16))).startswith(f"{utf16}:1: ")


def test_gz_name_without_gzip_content(tmp_path):
    path = tmp_path / "train.jsonl.gz"
    path.write_text(GOOD + "\n")
    msg = data_error(load_split, tmp_path, "train")
    assert msg.startswith(f"{path}: not a gzip file") and "plain text" in msg and "Rename" in msg
    xz = tmp_path / "a.txt.xz"
    xz.write_bytes(b"\x00\xff\xfe garbage")
    assert data_error(read_text_lines, str(xz)).startswith(f"{xz}: not a xz file")
    empty = tmp_path / "e.jsonl.gz"
    empty.write_bytes(b"")
    assert "empty" in data_error(lambda: list(read_jsonl(empty)))


def test_compressed_content_without_the_suffix(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(gzip.compress((GOOD + "\n").encode()))
    msg = data_error(load_records, path)
    assert msg.startswith(f"{path}: the file is gzip-compressed") and "data.jsonl.gz" in msg


def test_truncated_gzip_names_file_and_line(tmp_path):
    path = tmp_path / "r.jsonl.gz"
    full = gzip.compress(("\n".join([GOOD] * 2000) + "\n").encode())
    path.write_bytes(full[: len(full) // 2])
    msg = data_error(lambda: list(read_jsonl(path)))
    assert msg.startswith(f"{path}:") and "gzip data is corrupt or truncated" in msg
    line = int(msg[len(str(path)) + 1:].split(":")[0])
    assert 1 <= line <= 2000


def test_open_text_and_read_json_errors(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok\n\xff\xfe\n")
    with pytest.raises(DataError, match=r"bad\.txt: not UTF-8 text"):
        with open_text(bad) as f:
            f.read()
    missing = tmp_path / "nope.jsonl"
    assert data_error(lambda: list(read_lines(missing))).startswith(f"{missing}: no such file")
    broken = tmp_path / "b.json"
    broken.write_text('{\n  "a": 1,\n  "b": \n}\n')
    assert data_error(read_json, broken, hint="Fix it").startswith(f"{broken}:4: not valid JSON (")
    (tmp_path / "ok.json.gz").write_bytes(gzip.compress(b'[{"input": "a", "target": "b"}]'))
    assert load_records(tmp_path / "ok.json.gz") == [{"input": "a", "target": "b"}]


# ---- local or hub ----------------------------------------------------------------------------------
def test_looks_local(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    for local in ("./x", "/abs/x", "~/x", "data", "data/imdb_train.csv", "corpus.txt.xz", "r.jsonl", "x.parquet"):
        assert looks_local(local), local
    for hub in ("roberta-base", "stanfordnlp/imdb", "wikitext:wikitext-2-raw-v1", "Qwen/Qwen2.5-0.5B"):
        assert not looks_local(hub), hub
    from zerotrain.data.tokenizer import looks_local as from_tokenizer

    assert from_tokenizer is looks_local


@pytest.fixture
def no_offline_env(monkeypatch):
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(dio, "_hub_reachable", None)
    return monkeypatch


def test_unreachable_hub_switches_offline_and_fails_fast(no_offline_env, capfd):
    no_offline_env.setattr(dio, "_probe_hub", lambda timeout: False)
    with pytest.raises(UserError) as err:
        load_hub_dataset("no-such-owner/no-such-data", "train", "--data.path", "data/x_{split}.jsonl")
    msg = str(err.value)
    assert msg.startswith("--data.path: ") and "Pass a local path instead, e.g. --data.path data/x_{split}.jsonl" in msg
    assert "offline" in msg
    assert os.environ["HF_HUB_OFFLINE"] == "1" and os.environ["HF_DATASETS_OFFLINE"] == "1"
    assert "Retry" not in capfd.readouterr().err


def test_offline_variables_decide_without_probing(no_offline_env):
    def probe(timeout):
        raise AssertionError("the hub should not be probed")

    no_offline_env.setattr(dio, "_probe_hub", probe)
    no_offline_env.setenv("HF_HUB_OFFLINE", "0")
    assert dio.hub_offline() is False
    no_offline_env.setenv("HF_DATASETS_OFFLINE", "1")
    assert dio.hub_offline() is True


# ---- atomic writes ---------------------------------------------------------------------------------
def test_atomic_writes_leave_no_temp_file(tmp_path):
    atomic_write_text(tmp_path / "a.txt", "héllo\n")
    atomic_write_bytes(tmp_path / "b.bin", b"\x00\x01")
    write_json(tmp_path / "sub" / "c.json", {"x": [1, 2]})
    assert (tmp_path / "a.txt").read_text(encoding="utf-8") == "héllo\n"
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    assert json.loads((tmp_path / "sub" / "c.json").read_text()) == {"x": [1, 2]}
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a.txt", "b.bin", "c.json", "sub"]
    assert (tmp_path / "a.txt").stat().st_mode & 0o644 == 0o644  # not mkstemp's 0600


def test_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "summary.json"
    write_json(path, {"step": 1})
    with pytest.raises(TypeError):
        write_json(path, {"step": 2, "bad": object()})
    with pytest.raises(RuntimeError):
        with atomic_file(path) as f:
            f.write(b'{"step": 3, "half')
            raise RuntimeError("disk full")
    assert json.loads(path.read_text()) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_rundir_write_json_uses_it(tmp_path):
    from zerotrain.runtime.rundir import write_json as rundir_write_json

    rundir_write_json(tmp_path / "env.json", {"path": Path("/x"), "n": 1})
    assert (tmp_path / "env.json").read_text() == '{\n  "path": "/x",\n  "n": 1\n}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["env.json"]


# ---- fingerprint -----------------------------------------------------------------------------------
def test_fingerprint_follows_the_tokenizer_vocabulary(tiny_tokenizer_dir, tmp_path):
    from helpers import make_tokenizer
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    same = make_tokenizer(tmp_path / "same")
    assert fingerprint(tok) == fingerprint(same) == fingerprint(AutoTokenizer.from_pretrained(str(tmp_path / "same")))
    tok("a call that leaves truncation state behind", truncation=True, max_length=3)
    assert fingerprint(tok) == fingerprint(same)
    same.add_tokens(["zebra"])
    assert fingerprint(tok) != fingerprint(same)
    # Same size, one word swapped.
    from tokenizers import Tokenizer

    spec = json.loads(tok.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    vocab["zebra"] = vocab.pop("boring")
    from transformers import PreTrainedTokenizerFast

    swapped = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), bos_token="<s>",
                                      eos_token="</s>", pad_token="<pad>", unk_token="<unk>", mask_token="<mask>")
    assert len(swapped) == len(tok) and fingerprint(swapped) != fingerprint(tok)


def test_fingerprint_parts_are_unambiguous():
    assert fingerprint(["ab", "c"]) != fingerprint(["a", "bc"])
    assert fingerprint("1") != fingerprint(1)
    assert fingerprint("a", "b") != fingerprint(["a", "b"]) != fingerprint("ab")
    assert fingerprint("x", 16) == fingerprint("x", 16) and len(fingerprint("x")) == 24
    with pytest.raises(TypeError):
        fingerprint(object())


# ---- the collator ----------------------------------------------------------------------------------
def test_collator_pairs_imdb_shape():
    collate = pickle.loads(pickle.dumps(PadCollator(pad_token_id=1, max_len=12)))
    batch = collate([(np.array([0, 5, 2], np.int32), 1), (np.arange(10), np.int64(0))])
    assert list(batch) == ["input_ids", "attention_mask", "labels"]
    assert all(t.dtype == torch.long for t in batch.values())
    assert batch["input_ids"].shape == (2, 12)  # 10 rounds to 16, capped at max_len
    assert batch["input_ids"][0].tolist() == [0, 5, 2] + [1] * 9
    assert batch["attention_mask"].sum(1).tolist() == [3, 10]
    assert batch["labels"].tolist() == [1, 0] and batch["labels"].shape == (2,)
    assert PadCollator(1)([(np.arange(10), 1)])["input_ids"].shape == (1, 16)
    assert PadCollator(1, max_len=7)([(np.arange(10), 1)])["input_ids"].shape == (1, 10)  # never below the longest


def test_collator_dicts_sft_shape():
    a = {"input_ids": [0, 5, 6, 2], "labels": [IGNORE_INDEX, IGNORE_INDEX, 6, 2]}
    b = {"input_ids": list(range(3, 13)), "labels": list(range(3, 13))}
    batch = PadCollator(pad_token_id=2)([a, b])
    assert list(batch) == ["input_ids", "attention_mask", "labels"]
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape == (2, 16)
    assert batch["input_ids"][0].tolist() == [0, 5, 6, 2] + [2] * 12
    assert batch["labels"][0].tolist() == [IGNORE_INDEX, IGNORE_INDEX, 6, 2] + [IGNORE_INDEX] * 12
    assert batch["attention_mask"][1].tolist() == [1] * 10 + [0] * 6
    # Other fields: sequences padded with 0, scalars stacked.
    extra = PadCollator(0, pad_to_multiple_of=1)([{"input_ids": [4, 4], "token_type_ids": [1], "id": 7}])
    assert extra["token_type_ids"].tolist() == [[1, 0]] and extra["id"].tolist() == [7]
    with pytest.raises(ValueError, match="pad token"):
        PadCollator(None)
