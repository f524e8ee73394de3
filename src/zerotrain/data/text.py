"""Plain text for masked-language-model training: documents from local data or the hub, tokenized, packed.

Documents are the non-blank lines of text files, or the non-blank ``--data.text_field`` values of records (JSON
lines, JSON, CSV/TSV, Parquet, a saved dataset), read through :mod:`zerotrain.data.source` (a file, glob or
folder), or of a hub dataset (``name[:config]``). Each document is tokenized once by ``Dataset.map`` into the cache
folder, under a fingerprint of the files, the field, the line limit and the tokenizer; a later run, or another
rank, reads the tokens back without reading the data.

Packing follows RoBERTa's FULL-SENTENCES scheme: documents are concatenated with ``</s>`` between them and cut into
blocks of ``max_seq_length - 2`` tokens, each wrapped as ``<s> ... </s>``. Every block is full, so batches need no
padding and no token is wasted on it; the tail shorter than a block is dropped. Packing runs on the cached token
column (vectorised, seconds for a large corpus), so the cache does not depend on the block length.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from zerotrain.data import source
from zerotrain.data.io import load_hub_dataset, looks_local
from zerotrain.data.masking import BlockMasker, mask_streamed
from zerotrain.data.streaming import StreamedRows, documents, first_columns, share_where, streamed_source
from zerotrain.errors import DataError, UserError

TOKENIZE_CHUNK_LINES = 1000
LOCAL_TEXT = ("a text file (.txt, .txt.xz, or .jsonl/.parquet with a 'text' field), such as "
              "examples/data/imdb-sample/train.jsonl.gz in the zerotrain repository")


# ---- documents ---------------------------------------------------------------------------------------------------
def _local_source(path: str, flag: str) -> source.Source:
    p = Path(path).expanduser()
    if not p.exists() and not any(c in path for c in "*?["):
        raise DataError(f"{flag}: {p}: no such file or folder. Pass {LOCAL_TEXT}, or a hub dataset name "
                        "such as wikitext:wikitext-2-raw-v1 when online")
    return source.resolve(path, flag)


def _column(src: source.Source, text_field: str) -> str:
    return "text" if src.builder == "text" else text_field


def _local_documents(src: source.Source, text_field: str, max_lines: Optional[int], cache_dir: Optional[str]):
    """The non-blank documents of ``src`` (the first ``max_lines`` of them), a one-column dataset. A file without
    a non-blank document, a missing field or a field that is not text is one error line naming the row."""
    import pyarrow as pa

    rows = src.load(cache_dir)
    column = _column(src, text_field)
    src.require_columns(rows.column_names, {column: "--data.text_field"}, rows)
    texts = rows.data.column(column)
    if not (pa.types.is_string(texts.type) or pa.types.is_large_string(texts.type)):
        value = rows[0][column]
        raise DataError(f"{src.where(0)}: {column!r} must be a string, got {type(value).__name__}; "
                        "set --data.text_field")
    keep: list[int] = []
    start = 0
    for file, n in zip(src.files, src.rows_per_file):
        found = 0
        for i, text in enumerate(texts.slice(start, n).to_pylist()):
            if max_lines is not None and len(keep) >= max_lines:
                break
            if text.strip():
                keep.append(start + i)
                found += 1
        if not found and (max_lines is None or len(keep) < max_lines):
            raise DataError(f"{file}: file is empty (no non-blank lines)")
        start += n
        if max_lines is not None and len(keep) >= max_lines:
            break
    docs = rows.select_columns([column])
    return (docs if column == "text" else docs.rename_column(column, "text")).select(keep)


def _hub_documents(name: str, split: str, text_field: str, max_lines: Optional[int], flag: str):
    ds = load_hub_dataset(name, split, flag, f"FILE, {LOCAL_TEXT}")
    if text_field not in ds.column_names:
        raise DataError(f"hub dataset {name!r} has no column {text_field!r} (columns: {ds.column_names})")
    keep = []
    for i, text in enumerate(ds[text_field]):
        if max_lines is not None and len(keep) >= max_lines:
            break
        if text.strip():
            keep.append(i)
    if not keep:
        raise DataError(f"hub dataset {name!r}, split {split!r}: no non-blank {text_field!r} values")
    # Hub text datasets keep each line's trailing "\n"; the packer puts </s> between documents instead.
    docs = ds.select_columns([text_field]).select(keep)
    return docs.map(lambda b: {"text": [t.rstrip("\n") for t in b[text_field]]}, batched=True,
                    remove_columns=[text_field], keep_in_memory=True)


def read_text_lines(
    path_or_name: str,
    split: str = "train",
    text_field: str = "text",
    max_lines: Optional[int] = None,
    flag: str = "--data.train_path",
    cache_dir: Optional[str] = None,
) -> list[str]:
    """Return the non-blank lines (documents) of a text source.

    ``path_or_name`` is a local data file (``.txt``/``.raw``: a document per line; ``.jsonl``, ``.json``,
    ``.csv``, ``.tsv``, ``.parquet``: the ``text_field`` of each record; optionally ``.gz``/``.xz``/``.bz2``),
    a glob, a folder of such files (read in name order), a saved dataset, or a Hugging Face hub dataset such as
    ``wikitext:wikitext-2-raw-v1`` (``name:config``), of which ``split`` is read. ``max_lines`` keeps only the
    first lines. ``flag`` names the option that holds ``path_or_name``, for the error message.
    """
    if max_lines is not None and max_lines < 1:
        raise ValueError(f"max_lines must be >= 1, got {max_lines}")
    if looks_local(path_or_name):
        src = _local_source(path_or_name, flag)
        return _local_documents(src, text_field, max_lines, cache_dir)["text"]
    return _hub_documents(path_or_name, split, text_field, max_lines, flag)["text"]


# ---- packing -----------------------------------------------------------------------------------------------------
def _joined(ids: np.ndarray, lengths: np.ndarray, eos: int) -> np.ndarray:
    """The documents' tokens (``ids``, concatenated; ``lengths`` each) with ``</s>`` after each one, int32."""
    flat = np.full(int(lengths.sum()) + len(lengths), eos, dtype=np.int32)  # the </s> after each document stays
    keep = np.ones(flat.shape[0], dtype=bool)
    keep[np.cumsum(lengths + 1) - 1] = False
    flat[keep] = ids
    return flat


def _blocks(stream: np.ndarray, bos: int, eos: int, max_seq_length: int) -> np.ndarray:
    body = max_seq_length - 2
    n = stream.shape[0] // body
    blocks = np.empty((n, max_seq_length), dtype=np.int32)
    blocks[:, 0] = bos
    blocks[:, -1] = eos
    blocks[:, 1:-1] = stream[: n * body].reshape(n, body)
    return blocks


def _special_ids(tokenizer, max_seq_length: int) -> tuple[int, int]:
    if max_seq_length < 3:
        raise ValueError(f"max_seq_length must be >= 3 (<s>, a token, </s>), got {max_seq_length}")
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    if bos is None or eos is None:
        raise UserError("--data.tokenizer: the tokenizer needs bos (<s>) and eos (</s>) tokens for MLM packing")
    return bos, eos


def _pack_column(tokens: Any, bos: int, eos: int, max_seq_length: int) -> torch.Tensor:
    """Blocks from a dataset whose ``input_ids`` column holds each document's tokens."""
    import pyarrow.compute as pc

    column = tokens.data.column("input_ids")
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)
    ids = pc.list_flatten(column).to_numpy(zero_copy_only=False).astype(np.int32, copy=False)
    return torch.from_numpy(_blocks(_joined(ids, lengths, eos), bos, eos, max_seq_length))


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
    """The documents of ``path_or_name`` (see :func:`read_text_lines`) tokenized and packed into full blocks, an
    int32 tensor (N, max_seq_length). The tokens are cached in ``cache_dir`` under a key of the files' path,
    size and modification time (a hub dataset: its name and split), the field, ``max_lines`` and the tokenizer, so a
    cached corpus is not even read again. Raises DataError when the text is too short to fill one block."""
    bos, eos = _special_ids(tokenizer, max_seq_length)
    local = looks_local(path_or_name)
    src = _local_source(path_or_name, flag) if local else None
    identity = src.identity() if src is not None else f"hub:{path_or_name}:{split}"
    column = _column(src, text_field) if src is not None else text_field
    cache = source.check_cache_dir(cache_dir)
    key = source.cache_key("mlm-documents", identity, column, max_lines, tokenizer)
    tokens = source.cached_dataset(cache, "mlm", key)
    if tokens is None:
        if src is not None:
            docs = _local_documents(src, text_field, max_lines, None if cache is None else str(cache))
        else:
            docs = _hub_documents(path_or_name, split, text_field, max_lines, flag)

        def tokenize(batch: dict[str, list]) -> dict[str, list]:
            ids = tokenizer(batch["text"], add_special_tokens=False, return_attention_mask=False)["input_ids"]
            return {"input_ids": [np.asarray(x, dtype=np.int32) for x in ids]}

        tokens = source.cached_map(docs, tokenize, key, cache, "mlm", batch_size=TOKENIZE_CHUNK_LINES)
    blocks = _pack_column(tokens, bos, eos, max_seq_length)
    if blocks.shape[0] == 0:
        raise DataError(f"{path_or_name} ({flag}): the text is shorter than one block of {max_seq_length} tokens; "
                        "use more text or a smaller --model.max_seq_length")
    return blocks


# ---- a streamed split --------------------------------------------------------------------------------------------
def streamed_blocks(path: str, tokenizer, max_seq_length: int, masker: BlockMasker, seed: int,
                    text_field: str = "text", max_lines: Optional[int] = None, cache_dir: Optional[str] = None,
                    flag: str = "--data.train_path") -> StreamedRows:
    """The documents of local ``path`` read as they are trained on (``--data.streaming``): each chunk of
    :data:`TOKENIZE_CHUNK_LINES` records tokenized, packed into full blocks as :func:`load_packed` packs the whole
    corpus (a chunk's tail shorter than a block is dropped), and masked (:func:`~zerotrain.data.masking.mask_streamed`)."""
    if not looks_local(path):
        raise UserError(f"{flag}: --data.streaming reads local files; {path!r} is a hub dataset name. Pass "
                        f"{LOCAL_TEXT}, or drop --data.streaming")
    src = _local_source(path, flag)
    bos, eos = _special_ids(tokenizer, max_seq_length)
    column = _column(src, text_field)
    where = share_where(src)

    def make(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        docs = documents(batch[column], indices, column, where)
        ids = tokenizer(docs, add_special_tokens=False, return_attention_mask=False)["input_ids"] if docs else []
        lengths = np.asarray([len(x) for x in ids], dtype=np.int64)
        flat = np.asarray([t for x in ids for t in x], dtype=np.int32)
        blocks = torch.from_numpy(_blocks(_joined(flat, lengths, eos), bos, eos, max_seq_length))
        return mask_streamed(blocks, masker, seed)

    keep = (lambda r: isinstance(r[column], str) and bool(r[column].strip())) if max_lines is not None else None
    rows = streamed_source(src, cache_dir, make, TOKENIZE_CHUNK_LINES, keep, max_lines)  # refuses a saved dataset
    if src.builder != "text":
        src.require_columns(first_columns(src, cache_dir), {column: "--data.text_field"})
    return rows
