"""Text + label records for sequence classification: read, check, map label names to ids.

A record holds a text field and a label field (``--data.text_field``, ``--data.label_field``): JSON lines
(``.jsonl``, gzip/xz allowed), a JSON list (``.json``), CSV with a header, or Parquet. A label is an integer
class id or a class name; names get ids in sorted order, unless ``--data.label_names`` fixes the order. Every
error is one line naming the file, the line (or row) and the flag to set.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Optional, Sequence

from zerotrain.data.io import open_text, read_json, read_jsonl
from zerotrain.errors import DataError


def _rows(path: Path) -> list[tuple[str, Any]]:
    name = path.name.lower()
    if name.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as exc:  # pyarrow's own error kinds for a damaged file
            raise DataError(f"{path}: not a readable Parquet file ({type(exc).__name__})") from None
        return [(f"{path}: row {i + 1}", r) for i, r in enumerate(table.to_pylist())]
    for compression in (".gz", ".xz", ".bz2"):
        name = name.removesuffix(compression)
    if name.endswith((".jsonl", ".ndjson")):
        return [(f"{path}:{line}", r) for line, r in read_jsonl(path)]
    if name.endswith(".json"):
        data = read_json(path, hint="A .json file must hold one list of objects; use .jsonl for one object per line")
        if not isinstance(data, list):
            raise DataError(f"{path}: expected a JSON list of objects, got {type(data).__name__}")
        return [(f"{path}: record {i}", r) for i, r in enumerate(data)]
    if name.endswith(".csv"):
        with open_text(path) as f:
            reader = csv.DictReader(f)
            try:
                return [(f"{path}:{reader.line_num}", row) for row in reader]
            except csv.Error as exc:
                raise DataError(f"{path}:{reader.line_num}: not valid CSV ({exc})") from None
    raise DataError(f"{path}: unknown format; use .jsonl, .jsonl.gz, .json, .csv or .parquet")


def read_labelled(path: str | Path, text_field: str = "text", label_field: str = "label",
                  max_records: Optional[int] = None) -> tuple[list[str], list[Any]]:
    """(texts, raw labels) of a file; labels are ints or strings as the file has them (CSV digits become ints)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(f"{path}: data file not found. Check --data.train_path / --data.val_path")
    rows = _rows(path)
    if not rows:
        raise DataError(f"{path}: no records (the file is empty)")
    texts, labels = [], []
    for where, record in rows[:max_records] if max_records else rows:
        if not isinstance(record, dict):
            raise DataError(f"{where}: expected an object, got {type(record).__name__}")
        for field_name, flag in ((text_field, "--data.text_field"), (label_field, "--data.label_field")):
            if record.get(field_name) in (None, ""):
                raise DataError(f"{where}: missing field {field_name!r} (keys: {sorted(record)}). "
                                f"Rename the field or set {flag}")
        text, label = record[text_field], record[label_field]
        if not isinstance(text, str):
            raise DataError(f"{where}: field {text_field!r} must be a string, got {type(text).__name__}")
        if isinstance(label, str) and label.strip().lstrip("-").isdigit():
            label = int(label)  # CSV cells are strings
        if isinstance(label, bool) or not isinstance(label, (int, str)) or (isinstance(label, int) and label < 0):
            raise DataError(f"{where}: label {label!r} must be a class name or an integer >= 0 (--data.label_field)")
        texts.append(text)
        labels.append(label)
    return texts, labels


def label_names(labels: Sequence[Any], given: Optional[Sequence[str]] = None) -> list[str]:
    """The class names, in id order: ``given``; else for integer labels ``"0"`` .. ``str(max)``; else the sorted
    distinct names."""
    if given:
        return [str(name) for name in given]
    if all(isinstance(label, int) for label in labels):
        return [str(i) for i in range(max(labels) + 1)]
    if any(isinstance(label, int) for label in labels):
        raise DataError("labels mix class names and integers; use one kind, or list the names in order with "
                        "--data.label_names")
    return sorted(set(labels))


def label_ids(labels: Sequence[Any], names: Sequence[str], source: str) -> list[int]:
    """Each label's class id; a name not among ``names`` or an id out of range is one error naming ``source``."""
    index = {name: i for i, name in enumerate(names)}
    ids = []
    for i, label in enumerate(labels):
        if isinstance(label, int) and 0 <= label < len(names):
            ids.append(label)
            continue
        if isinstance(label, str) and label in index:
            ids.append(index[label])
            continue
        raise DataError(f"{source}: record {i}: label {label!r} is not one of the {len(names)} classes "
                        f"{list(names)[:10]} (the training file's labels, or --data.label_names)")
    return ids
