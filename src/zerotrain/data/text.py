"""Plain text for language-model training: read lines from local files or the hub, tokenize, pack.

Packing follows RoBERTa's FULL-SENTENCES scheme: documents (lines) are concatenated with ``</s>``
between them and cut into blocks of ``max_seq_length - 2`` tokens, each wrapped as ``<s> ... </s>``.
Every block is full, so batches need no padding and no token is wasted on it; the tail shorter than a
block is dropped. Packed blocks are cached on disk because tokenizing a large corpus takes minutes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import torch

from zerotrain.data.io import (
    atomic_file,
    fingerprint,
    load_hub_dataset,
    looks_local,
    read_jsonl,
    read_lines,
)
from zerotrain.errors import DataError, UserError

TEXT_SUFFIXES = (".txt", ".txt.xz", ".txt.gz", ".txt.bz2", ".raw")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.xz", ".jsonl.bz2")
PARQUET_SUFFIXES = (".parquet",)
SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES
TOKENIZE_CHUNK_LINES = 1000
_CACHE_FORMAT = 1  # bump when the packing changes, so old caches are not reused
LOCAL_TEXT = ("a text file (.txt, .txt.xz, or .jsonl/.parquet with a 'text' field), such as "
              "examples/data/imdb-sample/train.jsonl.gz in the zerotrain repository")


def _read_parquet(path: Path, text_field: str, max_lines: Optional[int]) -> list[str]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises its own ArrowInvalid / OSError kinds for a damaged file
        raise DataError(f"{path}: not a readable Parquet file ({type(exc).__name__}: {str(exc).splitlines()[0]})") \
            from None
    if text_field not in table.column_names:
        raise DataError(f"{path}: no column {text_field!r} (columns: {table.column_names}); set --data.text_field")
    lines: list[str] = []
    for row, value in enumerate(table.column(text_field).to_pylist(), 1):
        if max_lines is not None and len(lines) >= max_lines:
            break
        if not isinstance(value, str):
            raise DataError(f"{path}: row {row}: {text_field!r} must be a string, got {type(value).__name__}")
        if value.strip():
            lines.append(value)
    return lines


def _read_file(path: Path, text_field: str, max_lines: Optional[int]) -> list[str]:
    if path.name.endswith(PARQUET_SUFFIXES):
        return _read_parquet(path, text_field, max_lines)
    is_jsonl = path.name.endswith(JSONL_SUFFIXES)
    lines: list[str] = []
    records = read_jsonl(path) if is_jsonl else read_lines(path)
    try:
        for lineno, value in records:
            if max_lines is not None and len(lines) >= max_lines:
                break
            if is_jsonl:
                if not isinstance(value, dict) or not isinstance(value.get(text_field), str):
                    raise DataError(f"{path}:{lineno}: no string field {text_field!r}; set --data.text_field")
                value = value[text_field]
            if value.strip():
                lines.append(value)
    finally:
        records.close()  # closes the file at once when max_lines stops early
    return lines


def _local_files(path: Path, flag: str) -> list[Path]:
    if not path.exists():
        raise DataError(f"{flag}: {path}: no such file or folder. Pass {LOCAL_TEXT}, or a hub dataset name "
                        "such as wikitext:wikitext-2-raw-v1 when online")
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(SUFFIXES))
        if not files:
            raise DataError(f"{flag}: {path}: folder holds no {', '.join(SUFFIXES)} files")
        return files
    if not path.name.endswith(SUFFIXES):
        raise DataError(f"{flag}: {path}: unsupported file type; use one of {', '.join(SUFFIXES)}")
    return [path]


def read_text_lines(
    path_or_name: str,
    split: str = "train",
    text_field: str = "text",
    max_lines: Optional[int] = None,
    flag: str = "--data.train_path",
) -> list[str]:
    """Return the non-blank lines (documents) of a text source.

    ``path_or_name`` is a local ``.txt``, ``.txt.xz``, ``.txt.gz``, ``.raw``, ``.jsonl`` or
    ``.jsonl.gz`` file (JSON Lines: the ``text_field`` of each record), a folder of such files (read in
    name order), or a Hugging Face hub dataset such as ``wikitext:wikitext-2-raw-v1`` (``name:config``),
    of which ``split`` is read. ``max_lines`` keeps only the first lines. ``flag`` names the option
    that holds ``path_or_name``, for the error message.
    """
    if max_lines is not None and max_lines < 1:
        raise ValueError(f"max_lines must be >= 1, got {max_lines}")
    if looks_local(path_or_name):
        lines: list[str] = []
        for file in _local_files(Path(path_or_name).expanduser(), flag):
            left = None if max_lines is None else max_lines - len(lines)
            if left == 0:
                break
            got = _read_file(file, text_field, left)
            if not got:
                raise DataError(f"{file}: file is empty (no non-blank lines)")
            lines.extend(got)
        return lines
    return _read_hub(path_or_name, split, text_field, max_lines, flag)


def _read_hub(name: str, split: str, text_field: str, max_lines: Optional[int], flag: str) -> list[str]:
    ds = load_hub_dataset(name, split, flag, f"FILE, {LOCAL_TEXT}")
    if text_field not in ds.column_names:
        raise DataError(f"hub dataset {name!r} has no column {text_field!r} (columns: {ds.column_names})")
    lines = []
    for text in ds[text_field]:
        if max_lines is not None and len(lines) >= max_lines:
            break
        # Hub text datasets keep each line's trailing "\n"; the packer puts </s> between documents instead.
        text = text.rstrip("\n")
        if text.strip():
            lines.append(text)
    if not lines:
        raise DataError(f"hub dataset {name!r}, split {split!r}: no non-blank {text_field!r} values")
    return lines


def _cache_path(cache_dir: str, source_key: str | list[str], tokenizer, max_seq_length: int) -> Path:
    """``source_key`` is a string naming the source, or the lines themselves (hashed by content)."""
    key = fingerprint("packed", _CACHE_FORMAT, source_key, tokenizer, max_seq_length)
    return Path(cache_dir).expanduser() / f"packed-{key}-T{max_seq_length}.npy"


def _source_key(path_or_name: str, split: str, text_field: str, max_lines: Optional[int], flag: str) -> str:
    """Identity of a text source without reading it: path, size and mtime of each local file."""
    parts = [f"split={split}", f"field={text_field}", f"max_lines={max_lines}"]
    if looks_local(path_or_name):
        for file in _local_files(Path(path_or_name).expanduser(), flag):
            st = file.stat()
            parts.append(f"{file.resolve()}:{st.st_size}:{st.st_mtime_ns}")
    else:
        parts.append(f"hub:{path_or_name}")
    return "|".join(parts)


def tokenize_and_pack(
    lines: list[str],
    tokenizer,
    max_seq_length: int,
    cache_dir: Optional[str] = None,
    cache_key: Optional[str] = None,
) -> torch.Tensor:
    """Tokenize ``lines`` and pack them into full blocks: returns an int32 tensor (N, max_seq_length).

    Each block is ``<s>`` + ``max_seq_length - 2`` tokens of the ``</s>``-joined documents + ``</s>``.
    With ``cache_dir``, the result is saved there under a key made of ``cache_key`` (default: the
    lines' content), the tokenizer's vocabulary and ``max_seq_length``, and loaded instead of re-tokenizing.
    """
    if max_seq_length < 3:
        raise ValueError(f"max_seq_length must be >= 3 (<s>, a token, </s>), got {max_seq_length}")
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    if bos is None or eos is None:
        raise UserError("--data.tokenizer: the tokenizer needs bos (<s>) and eos (</s>) tokens for MLM packing")
    cache_file = None
    if cache_dir is not None:
        cache_file = _cache_path(cache_dir, list(lines) if cache_key is None else cache_key, tokenizer, max_seq_length)
        if cache_file.is_file():
            return torch.from_numpy(np.load(cache_file))

    pieces: list[np.ndarray] = []
    for start in range(0, len(lines), TOKENIZE_CHUNK_LINES):
        ids = tokenizer(lines[start:start + TOKENIZE_CHUNK_LINES], add_special_tokens=False,
                        return_attention_mask=False)["input_ids"]
        lengths = np.fromiter((len(x) + 1 for x in ids), dtype=np.int64, count=len(ids))
        flat = np.full(int(lengths.sum()), eos, dtype=np.int32)  # the </s> after each document stays
        ends = np.cumsum(lengths) - 1
        flat_ids = np.fromiter((t for x in ids for t in x), dtype=np.int32, count=int(lengths.sum()) - len(ids))
        keep = np.ones(flat.shape[0], dtype=bool)
        keep[ends] = False
        flat[keep] = flat_ids
        pieces.append(flat)
    stream = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)

    body = max_seq_length - 2
    n = stream.shape[0] // body
    blocks = np.empty((n, max_seq_length), dtype=np.int32)
    blocks[:, 0] = bos
    blocks[:, -1] = eos
    blocks[:, 1:-1] = stream[: n * body].reshape(n, body)

    if cache_file is not None:
        with atomic_file(cache_file) as f:  # ranks or runs sharing the cache never read half a file
            np.save(f, blocks)
    return torch.from_numpy(blocks)


def load_packed(
    path_or_name: str,
    tokenizer,
    max_seq_length: int,
    split: str = "train",
    text_field: str = "text",
    max_lines: Optional[int] = None,
    cache_dir: Optional[str] = None,
    flag: str = "--data.train_path",
) -> torch.Tensor:
    """:func:`read_text_lines` then :func:`tokenize_and_pack`, with a cache keyed on the files' path,
    size and mtime, so that a cached corpus is not even read again. Raises DataError when the text is
    too short to fill one block."""
    key = _source_key(path_or_name, split, text_field, max_lines, flag)
    if cache_dir is not None:
        cached = _cache_path(cache_dir, key, tokenizer, max_seq_length)
        if cached.is_file():
            return torch.from_numpy(np.load(cached))
    lines = read_text_lines(path_or_name, split=split, text_field=text_field, max_lines=max_lines, flag=flag)
    blocks = tokenize_and_pack(lines, tokenizer, max_seq_length, cache_dir=cache_dir, cache_key=key)
    if blocks.shape[0] == 0:
        raise DataError(f"{path_or_name} ({flag}): the text is shorter than one block of {max_seq_length} tokens; "
                        "use more text or a smaller --model.max_seq_length")
    return blocks

