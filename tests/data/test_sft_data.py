"""Prompt masking, truncation, EOS, padding and error messages of zerotrain.data.sft."""

from __future__ import annotations

import gzip
import json

import pytest

from zerotrain.data.collate import IGNORE_INDEX, PadCollator
from zerotrain.data.sft import build_example, build_examples, load_records
from zerotrain.errors import DataError


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


REC = {"input": "the movie was", "target": "really very good"}


def test_prompt_masked_target_labelled_eos_appended(tok):
    ex = build_example(REC, tok, max_length=64)
    prompt = [tok.bos_token_id] + ids(tok, "the movie was")
    target = ids(tok, "really very good")
    assert ex["input_ids"] == prompt + target + [tok.eos_token_id]
    assert ex["labels"] == [IGNORE_INDEX] * len(prompt) + target + [tok.eos_token_id]
    assert tok.unk_token_id not in ex["input_ids"]


def test_eos_only_when_room(tok):
    n = 1 + 3 + 3  # BOS + prompt + target
    exact = build_example(REC, tok, max_length=n)  # fits without EOS: no EOS
    assert len(exact["input_ids"]) == n and exact["input_ids"][-1] != tok.eos_token_id
    roomy = build_example(REC, tok, max_length=n + 1)
    assert roomy["input_ids"][-1] == tok.eos_token_id and roomy["labels"][-1] == tok.eos_token_id


def test_truncation_keeps_prompt_and_part_of_target(tok):
    ex = build_example(REC, tok, max_length=5)
    assert len(ex["input_ids"]) == len(ex["labels"]) == 5
    assert ex["labels"][:4] == [IGNORE_INDEX] * 4
    assert ex["labels"][4] == ids(tok, "really")[0]
    assert tok.eos_token_id not in ex["input_ids"]


def test_train_on_inputs_labels_everything(tok):
    ex = build_example(REC, tok, max_length=64, train_on_inputs=True)
    assert ex["labels"] == ex["input_ids"]


def test_template_suffix_and_braces_in_input(tok):
    rec = {"input": "i {loved} it", "target": "good"}
    ex = build_example(rec, tok, template="this {input} is {target} and", max_length=64)
    prompt = [tok.bos_token_id] + ids(tok, "this i {loved} it is ")
    assert ex["labels"][: len(prompt)] == [IGNORE_INDEX] * len(prompt)
    assert ex["labels"][len(prompt):] == ids(tok, "good and") + [tok.eos_token_id]


def test_target_truncated_to_nothing_names_record(tok):
    with pytest.raises(DataError, match=r"record 7.*--data.max_length"):
        build_example(REC, tok, max_length=4, index=7)
    with pytest.raises(DataError, match=r"data.jsonl: record 1"):
        build_examples([{"input": "a", "target": "b"}, REC], tok, max_length=4, source="data.jsonl")
    # train_on_inputs: prompt tokens are targets too, so nothing is lost
    assert build_example(REC, tok, max_length=4, train_on_inputs=True)["labels"][0] == tok.bos_token_id


def test_collator_pads_right_to_multiple_of_8(tok):
    a = build_example(REC, tok, max_length=64)
    b = build_example({"input": "fun", "target": "good"}, tok, max_length=64)
    batch = PadCollator(tok.pad_token_id, pad_to_multiple_of=8)([a, b])
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape == (2, 8)
    nb = len(b["input_ids"])
    assert batch["input_ids"][1, :nb].tolist() == b["input_ids"]
    assert (batch["input_ids"][1, nb:] == tok.pad_token_id).all()
    assert (batch["labels"][1, nb:] == IGNORE_INDEX).all()
    assert batch["attention_mask"][1].tolist() == [1] * nb + [0] * (8 - nb)
    long = build_example({"input": "the " * 8, "target": "good"}, tok, max_length=64)  # 1+8+1+1 = 11
    assert PadCollator(tok.pad_token_id)([long])["input_ids"].shape == (1, 16)


def test_load_json_jsonl_and_gz(tmp_path):
    recs = [{"input": "a", "target": "b"}, {"input": "c", "target": "d", "extra": 1}]
    (tmp_path / "r.json").write_text(json.dumps(recs))
    (tmp_path / "r.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n\n")
    with gzip.open(tmp_path / "r.jsonl.gz", "wt") as f:
        f.write("\n".join(json.dumps(r) for r in recs))
    for name in ("r.json", "r.jsonl", "r.jsonl.gz"):
        assert load_records(tmp_path / name) == recs
    assert load_records(tmp_path / "r.json", input_field="target", target_field="input") == recs


def test_missing_field_names_file_and_record(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"input": "a", "target": "b"}\n{"prompt": "a", "target": "b"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: missing field 'input'.*--data.input_field"):
        load_records(path)
    jpath = tmp_path / "bad.json"
    jpath.write_text(json.dumps([{"input": "a", "target": "b"}] * 3 + [{"input": "x"}]))
    with pytest.raises(DataError, match=r"bad\.json: record 3: missing field 'target'"):
        load_records(jpath)


def test_malformed_empty_and_missing_files(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"input": "a", "target": "b"}\n{"input": "a", \n')
    with pytest.raises(DataError, match=r"broken\.jsonl:2: not valid JSON"):
        load_records(path)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match=r"empty\.jsonl: no records"):
        load_records(tmp_path / "empty.jsonl")
    (tmp_path / "empty.json").write_text("")
    with pytest.raises(DataError, match=r"empty\.json: the file is empty"):
        load_records(tmp_path / "empty.json")
    (tmp_path / "broken.json").write_text('[{"input": "a",')
    with pytest.raises(DataError, match=r"broken\.json:1: not valid JSON.*one list of objects"):
        load_records(tmp_path / "broken.json")
    with pytest.raises(DataError, match=r"nope\.jsonl: data file not found"):
        load_records(tmp_path / "nope.jsonl")
