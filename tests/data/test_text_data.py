from __future__ import annotations

import gzip
import json
import lzma

import pytest
import torch

from zerotrain.data import source
from zerotrain.data.text import load_packed, read_text_lines
from zerotrain.errors import DataError, UserError
from zerotrain.data.tokenizer import load_tokenizer

LINES = ["the movie was great", "", "i loved the plot\u0085 and the acting", "   ", "it was boring"]
EXPECTED = ["the movie was great", "i loved the plot\u0085 and the acting", "it was boring"]


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir):
    return load_tokenizer(str(tiny_tokenizer_dir))


@pytest.mark.parametrize("name", ["a.txt", "a.raw", "a.txt.xz", "a.txt.gz", "a.jsonl", "a.jsonl.gz"])
def test_reads_every_local_format_skipping_blank_lines(tmp_path, name):
    path = tmp_path / name
    if "jsonl" in name:
        body = "\n".join(json.dumps({"text": t, "label": 1}) if t.strip() else "" for t in LINES) + "\n"
    else:
        body = "\n".join(LINES) + "\n"
    opener = lzma.open if name.endswith(".xz") else gzip.open if name.endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        f.write(body)
    assert read_text_lines(str(path)) == EXPECTED
    assert read_text_lines(str(path), max_lines=2) == EXPECTED[:2]


def test_reads_a_folder_in_name_order(tmp_path):
    (tmp_path / "b.txt").write_text("second\n")
    (tmp_path / "a.txt").write_text("first\n")
    (tmp_path / "notes.md").write_text("ignored\n")
    assert read_text_lines(str(tmp_path)) == ["first", "second"]


def test_missing_and_empty_files_name_the_file(tmp_path):
    with pytest.raises(DataError, match="nope.txt"):
        read_text_lines(str(tmp_path / "nope.txt"))
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n\n")
    with pytest.raises(DataError, match="empty.txt.*empty"):
        read_text_lines(str(empty))


def test_bad_json_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n\n{"text": broken}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:3: not valid JSON"):
        read_text_lines(str(path))
    missing = tmp_path / "nofield.jsonl"
    missing.write_text('{"body": "x"}\n')
    with pytest.raises(DataError, match=r"nofield\.jsonl:1: .*'text'"):
        read_text_lines(str(missing))


def test_hub_name_offline_is_a_user_error_naming_the_flag(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    with pytest.raises(UserError, match=r"--data\.val_path.*Pass a local path"):
        read_text_lines("wikitext:wikitext-2-raw-v1", split="validation", flag="--data.val_path")


def test_pack_makes_full_wrapped_blocks(tmp_path, tok):
    lines = ["the movie was great", "i loved the plot", "it was boring and bad"] * 5
    T = 8
    (tmp_path / "train.txt").write_text("\n".join(lines) + "\n")
    blocks = load_packed(str(tmp_path / "train.txt"), tok, T)
    n_tokens = sum(len(tok(x, add_special_tokens=False)["input_ids"]) + 1 for x in lines)
    assert blocks.dtype == torch.int32
    assert blocks.shape == (n_tokens // (T - 2), T)
    assert (blocks[:, 0] == tok.bos_token_id).all() and (blocks[:, -1] == tok.eos_token_id).all()
    # The bodies are the </s>-joined documents, in order.
    stream = [t for x in lines for t in tok(x, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]
    assert blocks[:, 1:-1].reshape(-1).tolist() == stream[: blocks.shape[0] * (T - 2)]
    assert (blocks != tok.pad_token_id).all()


def test_cache_is_reused_without_tokenizing(tmp_path, tok, monkeypatch):
    path = tmp_path / "train.txt"
    path.write_text("\n".join(["the movie was great and i loved it"] * 20) + "\n")
    first = load_packed(str(path), tok, 8, cache_dir=str(tmp_path / "cache"))
    assert list((tmp_path / "cache").glob("mlm-*.arrow"))

    def boom(*args, **kwargs):
        raise AssertionError("the cache should have been used")

    monkeypatch.setattr(source.Source, "load", boom)  # the files are not even read
    monkeypatch.setattr(type(tok), "__call__", boom)
    again = load_packed(str(path), tok, 8, cache_dir=str(tmp_path / "cache"))
    assert torch.equal(first, again)


def test_text_shorter_than_a_block_is_a_data_error(tmp_path, tok):
    path = tmp_path / "short.txt"
    path.write_text("the movie\n")
    with pytest.raises(DataError, match="short.txt"):
        load_packed(str(path), tok, 64)
