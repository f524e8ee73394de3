"""data.source: every local format reads to the same rows, errors name the row as its format counts it, and a
cached map is computed once per fingerprint."""

from __future__ import annotations

import json
import os

import pytest

from zerotrain.data import source
from zerotrain.errors import DataError

RECORDS = [{"input": "the movie", "target": "was good"}, {"input": "the plot", "target": "was bad"}]


@pytest.fixture()
def formats(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    (tmp_path / "r.json").write_text(json.dumps(RECORDS))
    (tmp_path / "r.csv").write_text("input,target\n" + "".join(f"{r['input']},{r['target']}\n" for r in RECORDS))
    pq.write_table(pa.Table.from_pylist(RECORDS), tmp_path / "r.parquet")
    datasets.Dataset.from_list(RECORDS).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "parts").mkdir()
    for i, r in enumerate(RECORDS):
        (tmp_path / "parts" / f"{i}.jsonl").write_text(json.dumps(r) + "\n")
    return tmp_path


@pytest.mark.parametrize("name", ["r.jsonl", "r.json", "r.csv", "r.parquet", "saved", "parts", "parts/*.jsonl"])
def test_every_form_of_a_source_reads_the_same_rows(formats, name):
    src = source.resolve(str(formats / name), "--data.train_path")
    ds = src.load(str(formats / "cache"))
    assert ds.to_list() == RECORDS
    assert src.rows_per_file == ([1, 1] if name.startswith("parts") else [2])


@pytest.mark.parametrize("name,where", [("r.jsonl", "r.jsonl:3"), ("r.json", "r.json: record 1"),
                                        ("r.csv", "r.csv:3"), ("r.parquet", "r.parquet: row 2")])
def test_a_missing_value_is_named_at_its_row(tmp_path, name, where):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [RECORDS[0], {"input": "the plot"}]
    path = tmp_path / name
    if name == "r.jsonl":
        path.write_text(json.dumps(rows[0]) + "\n\n" + json.dumps(rows[1]) + "\n")  # a blank line is no record
    elif name == "r.json":
        path.write_text(json.dumps(rows))
    elif name == "r.csv":
        path.write_text("input,target\nthe movie,was good\nthe plot,\n")
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    src = source.resolve(str(path), "--data.train_path")
    ds = src.load(None)
    with pytest.raises(DataError, match=f"^{tmp_path / where}: missing field 'target' \\(keys: \\['input'\\]\\)"):
        src.require_columns(ds.column_names, {"target": "--data.target_field"}, ds)


def test_a_cached_map_is_computed_once_and_a_changed_file_is_a_new_key(formats):
    cache = source.check_cache_dir(str(formats / "cache"))
    calls = []

    def lengths(batch):
        calls.append(len(batch["input"]))
        return {"n": [len(x) for x in batch["input"]]}

    def run():
        src = source.resolve(str(formats / "r.jsonl"), "--data.train_path")
        key = source.cache_key(src.identity(), "settings")
        cached = source.cached_dataset(cache, "test", key)
        if cached is not None:
            return cached, key
        return source.cached_map(src.load(str(cache)), lengths, key, cache, "test"), key

    first, key = run()
    again, same = run()
    assert same == key and again["n"] == first["n"] == [9, 8] and calls == [2]
    os.utime(formats / "r.jsonl", ns=(1, 1))  # same content, another modification time: not trusted
    _, other = run()
    assert other != key and calls == [2, 2]


@pytest.mark.parametrize("cut", ["half", "end marker"])
def test_a_cache_cut_short_is_read_again_never_trained_on(formats, cut, caplog):
    """A tokenized map or ``datasets``' parsed copy cut short (mid-batch: unreadable; at the end marker: it reads,
    maybe with rows missing) is deleted with one warning and made again; what the caller gets is whole."""
    cache = source.check_cache_dir(str(formats / "cache"))
    calls = []

    def lengths(batch):
        calls.append(len(batch["input"]))
        return {"n": [len(x) for x in batch["input"]]}

    def run():
        src = source.resolve(str(formats / "r.jsonl"), "--data.train_path")
        key = source.cache_key(src.identity(), "settings")
        return source.cached_dataset(cache, "test", key) or source.cached_map(src.load(str(cache)), lengths, key,
                                                                               cache, "test")

    def cut_short(file):
        size = file.stat().st_size
        file.write_bytes(file.read_bytes()[: size // 2 if cut == "half" else size - len(source.ARROW_STREAM_END)])

    assert run()["n"] == [9, 8] and calls == [2]
    (mapped,) = cache.glob("test-*.arrow")
    (parsed,) = (cache / "datasets").rglob("*.arrow")
    cut_short(mapped)
    cut_short(parsed)
    caplog.clear()
    assert run()["n"] == [9, 8] and calls == [2, 2]
    warnings = [r.getMessage() for r in caplog.records if r.name == "zerotrain"]
    assert len(warnings) == 2, warnings
    assert f"the tokenization cache {mapped} is damaged" in warnings[1] and "tokenizing again" in warnings[1]
    assert f"the cached copy of the data in {parsed.parent} is damaged" in warnings[0]
    assert not source._cut_short(mapped) and run()["n"] == [9, 8] and calls == [2, 2]


def test_a_bad_json_line_is_named_by_zerotrains_reader(tmp_path):
    (tmp_path / "b.jsonl").write_text(json.dumps(RECORDS[0]) + "\n{not json\n")
    with pytest.raises(DataError, match=r"b\.jsonl:2: not valid JSON"):
        source.resolve(str(tmp_path / "b.jsonl"), "--data.train_path").load(None)
