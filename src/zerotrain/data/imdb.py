"""IMDB reviews: load a labelled split, cut the test split in halves, tokenise once, batch.

Sources, all read into ``(texts, labels)`` with label 0 = negative, 1 = positive:

* a folder holding ``{split}.jsonl.gz`` / ``{split}.jsonl`` / ``{split}.csv`` / ``{split}.parquet``
  (JSON lines and Parquet with ``text`` and ``label`` fields, CSV with a ``text,label`` header),
  such as the sample ``examples/data/imdb-sample`` in the repository;
* the original ``aclImdb/`` tree, ``<root>/{train,test}/{pos,neg}/*.txt`` (``<root>`` may also be
  the folder that contains ``aclImdb/``);
* one file whose name contains ``train`` or ``test`` (``data/imdb_train.csv``): the other split is
  the file with that word swapped; or a path with a ``{split}`` placeholder;
* a Hugging Face hub name (``stanfordnlp/imdb``), read through ``datasets.load_dataset``.

Tokenisation runs once over a split with the fast tokenizer's batched call and is cached on disk,
keyed by a hash of the texts, the tokenizer and ``max_len``, so the next run starts at once.
"""

from __future__ import annotations

import csv
import os
import re
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
from torch.utils.data import Dataset

from zerotrain.data.io import (
    atomic_file,
    fingerprint,
    load_hub_dataset,
    looks_local,
    open_text,
    read_jsonl,
)
from zerotrain.errors import DataError, UserError

LABEL_NAMES = ("negative", "positive")
_BR = re.compile(r"<br\s*/?>", re.IGNORECASE)
_SUFFIXES = (".jsonl.gz", ".jsonl", ".csv", ".parquet")
_LOCAL_EXAMPLE = (
    "DIR, a folder with train.jsonl.gz and test.jsonl.gz such as examples/data/imdb-sample in the zerotrain "
    "repository, or explicit files such as --data.path data/imdb_{split}.csv"
)


def clean_text(text: str) -> str:
    """Replace the HTML line breaks that the raw IMDB reviews contain with a space."""
    return _BR.sub(" ", text)


def _check_record(text: Any, label: Any, where: str) -> tuple[str, int]:
    if not isinstance(text, str):
        raise DataError(f"{where}: 'text' must be a string, got {type(text).__name__}")
    if isinstance(label, str) and label.strip().lstrip("-").isdigit():
        label = int(label)  # CSV cells are strings
    if isinstance(label, bool) or not isinstance(label, (int, np.integer)) or int(label) not in (0, 1):
        raise DataError(f"{where}: 'label' must be 0 (negative) or 1 (positive), got {label!r}")
    return clean_text(text), int(label)


def _read_jsonl(path: Path) -> tuple[list[str], list[int]]:
    texts, labels = [], []
    for lineno, record in read_jsonl(path):
        where = f"{path}:{lineno}"
        if not isinstance(record, dict) or "text" not in record or "label" not in record:
            raise DataError(f"{where}: each record needs 'text' and 'label' fields, got {str(record)[:80]!r}")
        text, label = _check_record(record["text"], record["label"], where)
        texts.append(text)
        labels.append(label)
    return texts, labels


def _read_csv(path: Path) -> tuple[list[str], list[int]]:
    texts, labels = [], []
    with open_text(path) as f:
        reader = csv.DictReader(f)
        try:
            if reader.fieldnames is None or not {"text", "label"} <= set(reader.fieldnames):
                raise DataError(f"{path}:1: the CSV header must name 'text' and 'label' columns, got {reader.fieldnames}")
            for row in reader:
                where = f"{path}:{reader.line_num}"
                if row.get("text") is None or row.get("label") in (None, ""):
                    raise DataError(f"{where}: each row needs 'text' and 'label' values")
                text, label = _check_record(row["text"], row["label"], where)
                texts.append(text)
                labels.append(label)
        except csv.Error as exc:
            raise DataError(f"{path}:{reader.line_num}: not valid CSV ({exc})") from None
    return texts, labels


def _read_parquet(path: Path) -> tuple[list[str], list[int]]:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    missing = {"text", "label"} - set(table.column_names)
    if missing:
        raise DataError(f"{path}: Parquet file lacks column(s) {sorted(missing)}; it needs 'text' and 'label'")
    texts, labels = [], []
    for i, (text, label) in enumerate(zip(table.column("text").to_pylist(), table.column("label").to_pylist())):
        t, l = _check_record(text, label, f"{path}: row {i + 1}")
        texts.append(t)
        labels.append(l)
    return texts, labels


def _read_file(path: Path) -> tuple[list[str], list[int]]:
    name = path.name.lower()
    if name.endswith(".parquet"):
        return _read_parquet(path)
    for compression in (".gz", ".xz", ".bz2"):  # text formats may be compressed
        name = name.removesuffix(compression)
    if name.endswith((".jsonl", ".json")):
        return _read_jsonl(path)
    if name.endswith(".csv"):
        return _read_csv(path)
    raise DataError(f"{path}: unknown format; use .jsonl, .jsonl.gz, .csv or .parquet")


def _read_aclimdb(root: Path, split: str) -> tuple[list[str], list[int]]:
    texts, labels = [], []
    for label, polarity in ((0, "neg"), (1, "pos")):
        folder = root / split / polarity
        if not folder.is_dir():
            raise DataError(f"{folder}: missing; an aclImdb tree needs {split}/pos and {split}/neg folders")

        def review_id(p: Path) -> tuple[int, str]:
            head = p.stem.split("_")[0]
            return (int(head) if head.isdigit() else -1, p.name)

        for p in sorted(folder.glob("*.txt"), key=review_id):
            with open_text(p, newline=None) as f:
                texts.append(clean_text(f.read()))
            labels.append(label)
    return texts, labels


def _is_aclimdb(root: Path) -> bool:
    return (root / "train" / "pos").is_dir() or (root / "test" / "pos").is_dir()


def _split_file(path: Path, split: str) -> Path:
    """``imdb_train.csv`` read for split ``test`` is ``imdb_test.csv``."""
    for word in ("train", "test"):
        if word in path.name:
            return path.with_name(path.name.replace(word, split, 1))
    if split == "train":
        return path
    raise UserError(
        f"--data.path {path}: a single file serves the train split only. Name the files <...>train<...> "
        f"and <...>test<...>, use a {{split}} placeholder, or pass a folder with {split}.jsonl.gz"
    )


def _load_hub(name: str, split: str) -> tuple[list[str], list[int]]:
    ds = load_hub_dataset(name, split, "--data.path", _LOCAL_EXAMPLE)
    if "text" not in ds.column_names or "label" not in ds.column_names:
        raise DataError(f"hub dataset {name!r} split {split!r}: needs 'text' and 'label' columns, has {ds.column_names}")
    texts, labels = [], []
    for i, (text, label) in enumerate(zip(ds["text"], ds["label"])):
        t, l = _check_record(text, label, f"hub dataset {name!r} split {split!r}: row {i + 1}")
        texts.append(t)
        labels.append(l)
    return texts, labels


def load_split(source: str | os.PathLike, split: str) -> tuple[list[str], list[int]]:
    """Read one labelled split (``train`` or ``test``) from a folder, a file, an aclImdb tree or the hub.

    Raises :class:`DataError` naming the file and line for malformed records, and for an empty split.
    """
    text_source = str(source)
    path = Path(text_source.replace("{split}", split)).expanduser()
    if not (looks_local(str(path)) or "{split}" in text_source):
        return _load_hub(text_source, split)

    if path.is_dir():
        if _is_aclimdb(path):
            where, (texts, labels) = path, _read_aclimdb(path, split)
        elif _is_aclimdb(path / "aclImdb"):
            where, (texts, labels) = path / "aclImdb", _read_aclimdb(path / "aclImdb", split)
        else:
            candidates = [path / f"{split}{suffix}" for suffix in _SUFFIXES]
            found = [c for c in candidates if c.is_file()]
            if not found:
                raise DataError(
                    f"{path}: no {split} split found; expected one of "
                    f"{', '.join(c.name for c in candidates)} or an aclImdb tree ({split}/pos, {split}/neg)"
                )
            where = found[0]
            texts, labels = _read_file(where)
    else:
        where = path if "{split}" in text_source else _split_file(path, split)
        if not where.is_file():
            raise DataError(f"{where}: file not found (the {split} split of --data.path {text_source})")
        texts, labels = _read_file(where)

    if not texts:
        raise DataError(f"{where}: the {split} split is empty (no records)")
    return texts, labels


def split_test_in_halves(n: int, seed: int) -> tuple[list[int], list[int]]:
    """Shuffle ``range(n)`` with ``seed`` and cut it in two: (validation indices, test indices).

    The tutorial's protocol: IMDB has no validation split, so half of the test reviews serve for
    model selection and the other half for the final number. Disjoint, covering, reproducible.
    The halves stay shuffled: the IMDB files are sorted by label, so an evaluation cut short
    (``--trainer.eval_max_batches``) would otherwise see one class only.
    """
    order = np.random.default_rng(seed).permutation(n)
    half = n // 2
    return order[:half].tolist(), order[half:].tolist()


def balanced_subset(labels: Sequence[int], k: Optional[int], seed: int) -> list[int]:
    """Indices of ``k`` examples drawn with ``seed``, half from each class where possible (all if k is None).

    The IMDB files are sorted by label, so taking the first ``k`` lines would give one class only.
    """
    n = len(labels)
    if k is None or k >= n:
        return list(range(n))
    rng = np.random.default_rng(seed)
    labels_arr = np.asarray(labels)
    by_class = [rng.permutation(np.flatnonzero(labels_arr == c)) for c in (0, 1)]
    want = [k // 2, k - k // 2]
    # If one class is short, the other fills in.
    if len(by_class[0]) < want[0]:
        want = [len(by_class[0]), k - len(by_class[0])]
    elif len(by_class[1]) < want[1]:
        want = [k - len(by_class[1]), len(by_class[1])]
    picked = np.concatenate([by_class[0][: want[0]], by_class[1][: want[1]]])
    return sorted(picked.tolist())


def tokenize_reviews(
    texts: Sequence[str],
    tokenizer: Any,
    max_len: int,
    cache_dir: Optional[str | os.PathLike] = None,
    batch_size: int = 1000,
) -> list[np.ndarray]:
    """Token ids of each text as int32 arrays, truncated to ``max_len`` including ``<s>``/``</s>``.

    With ``cache_dir``, the result is stored in ``<cache_dir>/imdb-tokens-<hash>.npz``, the hash
    covering the texts' content, the tokenizer (its full serialised form) and ``max_len``; a second
    call with the same inputs reads the file instead of tokenising.
    """
    cache_file = None
    if cache_dir is not None:
        key = fingerprint("imdb-tokens", list(texts), tokenizer, max_len)
        cache_file = Path(cache_dir).expanduser() / f"imdb-tokens-{key}.npz"
        if cache_file.is_file():
            try:
                with np.load(cache_file) as data:
                    flat, offsets = data["ids"], data["offsets"]
                return [flat[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]
            except (OSError, KeyError, ValueError):
                pass  # a damaged cache file is rebuilt below

    out: list[np.ndarray] = []
    for start in range(0, len(texts), batch_size):
        enc = tokenizer(
            list(texts[start : start + batch_size]),
            truncation=True,
            max_length=max_len,
            add_special_tokens=True,
            return_attention_mask=False,
        )
        out.extend(np.asarray(ids, dtype=np.int32) for ids in enc["input_ids"])

    if cache_file is not None:
        offsets = np.zeros(len(out) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([len(x) for x in out])
        flat = np.concatenate(out) if out else np.zeros(0, dtype=np.int32)
        with atomic_file(cache_file) as f:  # a crashed or concurrent run never leaves half a cache
            np.savez(f, ids=flat, offsets=offsets)
    return out


class ReviewDataset(Dataset):
    """Tokenised reviews; item ``i`` is ``(token_ids: int32 array, label: int)``."""

    def __init__(self, token_ids: Sequence[np.ndarray], labels: Sequence[int]):
        if len(token_ids) != len(labels):
            raise ValueError(f"{len(token_ids)} token sequences but {len(labels)} labels")
        self.token_ids = list(token_ids)
        self.labels = list(labels)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return self.token_ids[i], self.labels[i]

