"""Text + label records for sequence classification: check them, map label names to ids.

Records come through :mod:`zerotrain.data.source` (JSON lines, a JSON list, CSV/TSV with a header, Parquet, or a
saved dataset; a file, a glob or a folder): each holds a text field and a label field (``--data.text_field``,
``--data.label_field``). A label is an integer class id or a class name; names get ids in sorted order, unless
``--data.label_names`` fixes the order. Every error is one line naming the row as its format counts it
(:meth:`Source.where`) and the flag to set.

The checks run on the columns (Arrow) to find the first faulty row, then that row alone is looked at in Python, so
a large file costs one pass over its label column, and the message is the one a record-by-record reader would give
for the first bad record.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

from zerotrain.data import source
from zerotrain.data.streaming import RowMaker
from zerotrain.errors import DataError


def normalise_label(label: Any) -> Any:
    """A label as the classes are counted: digit strings (CSV cells of a mixed column) become ints."""
    if isinstance(label, str) and label.strip().lstrip("-").isdigit():
        return int(label)
    return label


def _label_ok(label: Any) -> bool:
    label = normalise_label(label)
    if label is None or label == "":
        return False
    return not (isinstance(label, bool) or not isinstance(label, (int, str)) or (isinstance(label, int) and label < 0))


def check_record(where: str, record: Any, text_field: str, label_field: str) -> tuple[str, Any]:
    """(text, label) of one record, or the one-line :class:`DataError` for it, prefixed with ``where``."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected an object, got {type(record).__name__}")
    keys = sorted(k for k, v in record.items() if v is not None)
    for field_name, flag in ((text_field, "--data.text_field"), (label_field, "--data.label_field")):
        if record.get(field_name) in (None, ""):
            raise DataError(f"{where}: missing field {field_name!r} (keys: {keys}). Rename the field or set {flag}")
    text, label = record[text_field], normalise_label(record[label_field])
    if not isinstance(text, str):
        raise DataError(f"{where}: field {text_field!r} must be a string, got {type(text).__name__}")
    if not _label_ok(label):
        raise DataError(f"{where}: label {label!r} must be a class name or an integer >= 0 (--data.label_field)")
    return text, label


def checked_labels(src: source.Source, dataset: Any, text_field: str = "text", label_field: str = "label") -> list:
    """The labels of ``dataset`` (rows of ``src``), every row checked: a text and a label present, the text a
    string, the label a class name or an integer >= 0. The first faulty row is one error naming it."""
    import pyarrow as pa
    import pyarrow.compute as pc

    columns = dataset.column_names
    src.require_columns(columns, {text_field: "--data.text_field", label_field: "--data.label_field"})
    texts = dataset.with_format("arrow")[text_field]
    if pa.types.is_string(texts.type) or pa.types.is_large_string(texts.type):
        first_text = pc.index(pc.fill_null(pc.equal(texts, ""), True), True).as_py()  # null or empty: missing
    else:
        first_text = 0 if len(texts) else -1  # a column of one type: no row holds a string
    labels = dataset[label_field]
    first_label = next((i for i, label in enumerate(labels) if not _label_ok(label)), -1)
    bad = [i for i in (first_text, first_label) if i >= 0]
    if bad:
        row = min(bad)
        check_record(src.where(row), dataset[row], text_field, label_field)
    return [normalise_label(label) for label in labels]


def read_labelled(path: str | Path, text_field: str = "text", label_field: str = "label",
                  max_records: Optional[int] = None, flag: str = "--data.train_path",
                  cache_dir: Optional[str] = None) -> tuple[list[str], list[Any]]:
    """(texts, labels) of a split (any form :func:`zerotrain.data.source.resolve` reads); labels are ints or
    strings as the data has them (digit strings become ints)."""
    src = source.resolve(str(path), flag)
    if src.builder == "text":
        raise no_labels_in_text(src)
    dataset = src.load(cache_dir)
    if max_records:
        dataset = dataset.select(range(min(max_records, len(dataset))))
    labels = checked_labels(src, dataset, text_field, label_field)
    return dataset[text_field], labels


def no_labels_in_text(src: source.Source) -> DataError:
    return DataError(f"{src.flag}: {src.path}: text files hold no labels; pass records with a text and a label "
                     "field (.jsonl, .json, .csv, .tsv, .parquet) or a saved dataset")


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
    return [_class_id(label, index, f"{source}: record {i}") for i, label in enumerate(labels)]


def _class_id(label: Any, index: dict[str, int], where: str) -> int:
    if isinstance(label, int) and 0 <= label < len(index):
        return label
    if isinstance(label, str) and label in index:
        return index[label]
    raise DataError(f"{where}: label {label!r} is not one of the {len(index)} classes "
                    f"{list(index)[:10]} (the training file's labels, or --data.label_names)")


def labelled_rows(tokenizer, text_field: str, label_field: str, names: Sequence[str], max_length: int,
                  where) -> RowMaker:
    """Records (columns) -> ``{input_ids, labels}`` rows, each record checked as :func:`check_record` checks it
    and its label mapped to a class id of ``names``; ``where(index)`` names a record in errors. For a streamed
    split, whose records are seen only a chunk at a time."""
    def make(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        index = {name: c for c, name in enumerate(names)}
        texts, ids = [], []
        for k, i in enumerate(indices):
            record = {name: batch[name][k] for name in batch}
            text, label = check_record(where(i), record, text_field, label_field)
            texts.append(text)
            ids.append(_class_id(label, index, where(i)))
        tokens = tokenizer(texts, truncation=True, max_length=max_length, return_attention_mask=False)["input_ids"]
        return {"input_ids": tokens, "labels": ids}
    return make
