"""Causal-LM data: raw text packed into rows, chat records rendered, and prompt/response examples packed.

Three sources become the same examples, ``{"input_ids", "labels"}`` (labels -100 where the loss skips):

* raw text (pre-training): every document (a line of a ``.txt``, a record's text field) is
  ``[BOS] tokens [EOS]``; all labels count;
* prompt/response records (:mod:`zerotrain.data.sft`): the prompt is masked;
* chat records, a ``messages`` list of ``{"role", "content"}``, rendered with the tokenizer's chat template: only
  the assistant turns count.

:func:`pack` then fills rows of exactly ``seq_len`` tokens with whole examples. Each example's positions start
at 0 (``position_ids``), and the first label of each example is -100, so no token learns to predict the next
document from the last one. transformers reads restarting positions without an attention mask as packed
sequences and keeps attention within each (its packed-sequence mask, for the models that build their mask with
``transformers.masking_utils``); the recipe says in its log which applies. Text longer than a row is cut into
row-long pieces, each its own sequence.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from zerotrain.data.collate import IGNORE_INDEX
from zerotrain.data.sft import build_example
from zerotrain.data.streaming import RowMaker, documents
from zerotrain.errors import DataError



class PackedRows(Dataset):
    """Rows of ``seq_len`` tokens: ``input_ids``, ``labels``, ``position_ids`` (N, T) and ``tokens`` (N,), the
    non-padding tokens of each row."""

    def __init__(self, input_ids: np.ndarray, labels: np.ndarray, position_ids: np.ndarray, tokens: np.ndarray):
        self.input_ids, self.labels, self.position_ids, self.tokens = input_ids, labels, position_ids, tokens

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {"input_ids": self.input_ids[i], "labels": self.labels[i], "position_ids": self.position_ids[i],
                "tokens": self.tokens[i]}


def collate_packed(rows: Sequence[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    """Stack packed rows (all ``seq_len`` long) into long tensors; picklable, for DataLoader workers."""
    batch = {key: torch.as_tensor(np.stack([r[key] for r in rows]), dtype=torch.long)
             for key in ("input_ids", "labels", "position_ids")}  # (B, T) each
    batch["tokens"] = torch.as_tensor([int(r["tokens"]) for r in rows], dtype=torch.long)  # (B,)
    return batch


def pack(examples: Sequence[dict[str, Sequence[int]]], seq_len: int, pad_token_id: int,
         split_long: bool = True) -> PackedRows:
    """Pack ``examples`` in order into rows of ``seq_len`` tokens (a new row when the next example does not fit).

    An example longer than a row is cut into row-long pieces (``split_long``; else refused by the caller's
    truncation). The rest of a row is padding: pad tokens, labels -100, positions counting on from 0 (a sequence
    of its own that attends only to itself). The first label of each example is -100.
    """
    pieces: list[tuple[list[int], list[int]]] = []
    for ex in examples:
        ids, labels = list(ex["input_ids"]), list(ex["labels"])
        for start in range(0, len(ids), seq_len if split_long else max(len(ids), 1)):
            piece_ids, piece_labels = ids[start:start + seq_len], labels[start:start + seq_len]
            if len(piece_ids) >= 2:
                pieces.append((piece_ids, [IGNORE_INDEX] + piece_labels[1:]))
    rows_ids, rows_labels, rows_pos, rows_tokens = [], [], [], []
    cur_ids: list[int] = []
    cur_labels: list[int] = []
    cur_pos: list[int] = []

    def close() -> None:
        n = len(cur_ids)
        if n == 0:
            return
        pad = seq_len - n
        rows_ids.append(cur_ids + [pad_token_id] * pad)
        rows_labels.append(cur_labels + [IGNORE_INDEX] * pad)
        rows_pos.append(cur_pos + list(range(pad)))
        rows_tokens.append(n)

    for ids, labels in pieces:
        if len(cur_ids) + len(ids) > seq_len:
            close()
            cur_ids, cur_labels, cur_pos = [], [], []
        cur_ids += ids
        cur_labels += labels
        cur_pos += list(range(len(ids)))
    close()
    if not rows_ids:
        return PackedRows(np.zeros((0, seq_len), np.int32), np.zeros((0, seq_len), np.int32),
                          np.zeros((0, seq_len), np.int32), np.zeros(0, np.int32))
    return PackedRows(np.asarray(rows_ids, dtype=np.int32), np.asarray(rows_labels, dtype=np.int32),
                      np.asarray(rows_pos, dtype=np.int32), np.asarray(rows_tokens, dtype=np.int32))


def text_examples(docs: Sequence[str], tokenizer, batch: int = 1000) -> list[dict[str, list[int]]]:
    """Each document as ``[BOS] tokens [EOS]`` (BOS when the tokenizer has one), every label counting."""
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    out = []
    for start in range(0, len(docs), batch):
        for ids in tokenizer(list(docs[start:start + batch]), add_special_tokens=False,
                             return_attention_mask=False)["input_ids"]:
            ids = ([bos] if bos is not None else []) + list(ids) + ([eos] if eos is not None else [])
            out.append({"input_ids": ids, "labels": list(ids)})
    return out


# ---- chat records ----------------------------------------------------------------------------------
def render_chat(tokenizer, messages: list[dict[str, str]], prompt: bool, where: str) -> list[int]:
    """The token ids of ``messages`` through the tokenizer's chat template. The template is the user's code (Jinja,
    run sandboxed): whatever it raises on this conversation (its own ``raise_exception``, a division by zero, a
    refused attribute) is a :class:`DataError` naming ``where``, not a traceback."""
    try:
        out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=prompt, return_dict=False)
    except Exception as exc:
        why = " ".join(str(exc).split())[:200]
        raise DataError(f"{where}: the chat template fails on this conversation ({type(exc).__name__}: {why}); fix "
                        "the template (--data.chat_template) or the record") from None
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)


def chat_example(messages: list[dict[str, str]], tokenizer, max_length: int, train_on_inputs: bool,
                 where: str) -> dict[str, list[int]]:
    """One conversation through the chat template; labels only on the assistant turns (all with
    ``train_on_inputs``). Each turn's span is what rendering up to it adds to rendering the conversation before
    it with the generation prompt, so the template's own assistant header stays masked."""
    def render(upto: list[dict[str, str]], prompt: bool) -> list[int]:
        return render_chat(tokenizer, upto, prompt, where)

    ids: list[int] = []
    labels: list[int] = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(messages[:i], prompt=True) if i else []
        full = render(messages[:i + 1], prompt=False)
        if full[:len(ids)] != ids or full[:len(before)] != before or len(before) < len(ids):
            raise DataError(f"{where}: the chat template does not render this conversation turn by turn (a later "
                            "turn changes earlier tokens), so the prompt cannot be masked; use prompt/response "
                            "records (--data.format sft) or another --data.chat_template")
        prompt_part = before[len(ids):]
        ids += prompt_part
        labels += list(prompt_part) if train_on_inputs else [IGNORE_INDEX] * len(prompt_part)
        answer = full[len(before):]
        ids += answer
        labels += answer
    ids, labels = ids[:max_length], labels[:max_length]
    if all(label == IGNORE_INDEX for label in labels):
        raise DataError(f"{where}: no assistant token is left after truncating to {max_length} tokens. Raise "
                        "--data.seq_len or shorten the conversation")
    return {"input_ids": ids, "labels": labels}


# ---- rows from a chunk of records (the datasets path: Dataset.map and the streamed split) -------------------------
_HERE = "\x00here\x00"
PACK_CHUNK = 1000
"""Records per chunk: one Dataset.map batch, or one read of a streamed split. Packing stays within a chunk, so a
chunk's rows depend on that chunk alone (what makes a streamed resume exact); it wastes at most one part-filled row
per chunk."""


def rows_of(examples: list[dict[str, list[int]]], seq_len: int, pad_token_id: int, packed: bool) -> dict[str, list]:
    """Examples as columns of rows: packed into ``seq_len`` rows (``input_ids``, ``labels``, ``position_ids``,
    ``tokens``), or as they are (``input_ids``, ``labels``)."""
    if not packed:
        return {"input_ids": [e["input_ids"] for e in examples], "labels": [e["labels"] for e in examples]}
    rows = pack(examples, seq_len, pad_token_id)
    return {"input_ids": rows.input_ids.tolist(), "labels": rows.labels.tolist(),
            "position_ids": rows.position_ids.tolist(), "tokens": rows.tokens.tolist()}


def text_rows(column: str, tokenizer, seq_len: int, pad_token_id: int, where) -> RowMaker:
    """Raw documents (non-blank values of ``column``) -> packed rows. ``where(index)`` names a record in errors."""
    def make(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        docs = documents(batch[column], indices, column, where)
        return rows_of(text_examples(docs, tokenizer), seq_len, pad_token_id, packed=True)
    return make


def sft_rows(tokenizer, template: str, seq_len: int, train_on_inputs: bool, input_field: str, target_field: str,
             pad_token_id: int, packed: bool, where, length_flag: str) -> RowMaker:
    """Prompt/response records -> rows (the prompt masked), as :func:`zerotrain.data.sft.build_example` makes them."""
    def make(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        examples = []
        for k, i in enumerate(indices):
            record = {name: batch[name][k] for name in batch}
            for name, flag in ((input_field, "--data.input_field"), (target_field, "--data.target_field")):
                if record.get(name) is None:
                    keys = sorted(n for n, v in record.items() if v is not None)
                    raise DataError(f"{where(i)}: missing field {name!r} (keys: {keys}). Rename the field or set {flag}")
                if not isinstance(record[name], str):
                    raise DataError(f"{where(i)}: field {name!r} must be a string, got {type(record[name]).__name__}")
            try:
                examples.append(build_example(record, tokenizer, template, seq_len, train_on_inputs, i, input_field,
                                              target_field, length_flag))
            except DataError as exc:
                raise DataError(f"{where(i)}: {str(exc).removeprefix(f'record {i}: ')}") from None
        return rows_of(examples, seq_len, pad_token_id, packed)
    return make


def chat_rows(get_tokenizer: Callable[[], Any], field: str, seq_len: int, train_on_inputs: bool, pad_token_id: int,
              packed: bool, where) -> RowMaker:
    """Chat records (``field``: a list of {role, content}) -> rows, only the assistant turns learned.
    ``get_tokenizer()`` (the tokenizer with its chat template) is asked for once a chunk's records passed their
    checks, so a record's fault is named before a missing template."""
    def make(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        chats = []
        for messages, i in zip(batch[field], indices):
            if not isinstance(messages, list) or not messages:
                keys = sorted(n for n in batch if batch[n][indices.index(i)] is not None)
                raise DataError(f"{where(i)}: no list of messages in field {field!r} (keys: {keys}). "
                                "Rename the field or set --data.messages_field")
            # Arrow gives every message every key seen in the file; the ones a message lacks are None.
            messages = [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in messages]
            for m in messages:
                if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                    raise DataError(f"{where(i)}: each message must be an object with string 'role' and 'content', "
                                    f"got {str(m)[:80]!r}")
            if not any(m["role"] == "assistant" for m in messages):
                raise DataError(f"{where(i)}: the conversation has no 'assistant' message, so nothing to learn")
            chats.append((messages, i))
        tokenizer = get_tokenizer()
        examples = []
        for messages, i in chats:
            try:  # where(i) may read the file: only for an error
                examples.append(chat_example(messages, tokenizer, seq_len, train_on_inputs, _HERE))
            except DataError as exc:
                raise DataError(str(exc).replace(_HERE, where(i), 1)) from None
        return rows_of(examples, seq_len, pad_token_id, packed)
    return make
