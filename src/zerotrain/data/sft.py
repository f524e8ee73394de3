"""Supervised fine-tuning data: prompt/target records -> token ids with the prompt masked out of the loss.

A record is a JSON object with an input field and a target field. The template joins them
(default ``"{input}\\n{target}"``); the part of the template before ``{target}``, filled with the
input, is the *prompt*. The model is trained to produce the target given the prompt, so the prompt
positions get the label -100 (ignored by the loss) unless ``train_on_inputs`` is set.

Prompt and target are tokenised separately and concatenated, rather than tokenising the joined
text once: a BPE tokenizer may merge the last prompt character with the first target character,
and then "the first len(prompt_ids) tokens" would no longer be exactly the prompt, so the mask
would cover part of the answer (or leave part of the prompt unmasked).

Shuffling is the training loop's sampler's job (it is seeded and checkpointed); nothing here
reorders records.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zerotrain.data.collate import IGNORE_INDEX
from zerotrain.data.io import read_json, read_jsonl
from zerotrain.errors import DataError


def load_records(path: str | Path, input_field: str = "input", target_field: str = "target") -> list[dict]:
    """Read prompt/target records from a JSON file (a list of objects) or JSON lines (``.jsonl``, ``.jsonl.gz``).

    Every record must be an object holding ``input_field`` and ``target_field``. Errors are
    :class:`~zerotrain.errors.DataError` naming the file and the line (JSON lines: ``{path}:{line}: ...``)
    or the record (a JSON list: ``{path}: record {i}: ...``).
    """
    records = read_records(path)
    for where, record in records:
        if not isinstance(record, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
        for field_name, flag in ((input_field, "--data.input_field"), (target_field, "--data.target_field")):
            if field_name not in record:
                raise DataError(
                    f"{where}: missing field {field_name!r} (keys: {sorted(record)}). "
                    f"Rename the field or set {flag}"
                )
            if not isinstance(record[field_name], str):
                raise DataError(
                    f"{where}: field {field_name!r} must be a string, got {type(record[field_name]).__name__}"
                )
    return [record for _, record in records]


def read_records(path: str | Path) -> list[tuple[str, Any]]:
    """``(where, record)`` for every record of a JSON lines file (``.jsonl``/``.ndjson``, compressed or not) or a
    JSON file holding one list; ``where`` names the file and line (``{path}:{line}``) or record
    (``{path}: record {i}``) for the caller's errors. A missing or empty file is a one-line :class:`DataError`."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: data file not found. Check --data.train_path / --data.val_path")
    name = path.name.lower()
    for compression in (".gz", ".xz", ".bz2"):
        name = name.removesuffix(compression)
    if name.endswith((".jsonl", ".ndjson")):
        records = [(f"{path}:{line}", record) for line, record in read_jsonl(path)]
    else:
        data = read_json(path, hint="A .json file must hold one list of objects; use .jsonl for one object per line")
        if not isinstance(data, list):
            raise DataError(f"{path}: expected a JSON list of objects, got {type(data).__name__}")
        records = [(f"{path}: record {i}", record) for i, record in enumerate(data)]
    if not records:
        raise DataError(f"{path}: no records (the file is empty)")
    return records


def split_template(template: str) -> tuple[str, str]:
    """Split a template at ``{target}`` into (prompt part, suffix part)."""
    if "{input}" not in template or "{target}" not in template:
        raise DataError(f"template {template!r} must contain {{input}} and {{target}} (--data.template)")
    head, _, tail = template.partition("{target}")
    if "{input}" not in head:
        raise DataError(f"template {template!r}: {{input}} must come before {{target}} (--data.template)")
    return head, tail


def _adds_bos(tokenizer) -> bool:
    """Whether the tokenizer puts BOS first when asked for special tokens (Llama, RoBERTa do; GPT-2 does not)."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return False
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return len(ids) > 0 and ids[0] == bos


def build_example(
    record: dict,
    tokenizer,
    template: str = "{input}\n{target}",
    max_length: int = 512,
    train_on_inputs: bool = False,
    index: int = 0,
    input_field: str = "input",
    target_field: str = "target",
    length_flag: str = "--data.max_length",
) -> dict[str, list[int]]:
    """Tokenise one record into ``input_ids`` and ``labels`` (-100 on the prompt unless ``train_on_inputs``).

    The sequence is [BOS] + prompt + target (+ EOS when it fits in ``max_length``), cut to
    ``max_length``. ``index`` is the record's position, used in error messages, which name ``length_flag``
    as the flag that sets ``max_length``.
    """
    head, tail = split_template(template)
    # str.replace, not str.format: inputs may contain braces (code, JSON) that format would choke on
    prompt_text = head.replace("{input}", record[input_field])
    target_text = record[target_field] + tail.replace("{input}", record[input_field])

    prompt_ids = list(tokenizer(prompt_text, add_special_tokens=False)["input_ids"])
    target_ids = list(tokenizer(target_text, add_special_tokens=False)["input_ids"])
    if _adds_bos(tokenizer):
        prompt_ids = [tokenizer.bos_token_id] + prompt_ids

    input_ids = prompt_ids + target_ids
    prompt_labels = list(prompt_ids) if train_on_inputs else [IGNORE_INDEX] * len(prompt_ids)
    labels = prompt_labels + target_ids

    eos = tokenizer.eos_token_id
    if len(input_ids) < max_length and eos is not None:
        # EOS is labelled so that the model learns where the answer stops
        input_ids.append(eos)
        labels.append(eos)
    input_ids, labels = input_ids[:max_length], labels[:max_length]

    if all(label == IGNORE_INDEX for label in labels):
        raise DataError(
            f"record {index}: no target token is left after truncating to max_length={max_length} "
            f"(the prompt alone has {len(prompt_ids)} tokens). Raise {length_flag} or shorten the input"
        )
    return {"input_ids": input_ids, "labels": labels}


def build_examples(
    records: list[dict],
    tokenizer,
    template: str = "{input}\n{target}",
    max_length: int = 512,
    train_on_inputs: bool = False,
    input_field: str = "input",
    target_field: str = "target",
    source: str = "",
    length_flag: str = "--data.max_length",
) -> list[dict[str, list[int]]]:
    """:func:`build_example` over a list; ``source`` (the file) is prefixed to error messages."""
    examples = []
    for i, record in enumerate(records):
        try:
            examples.append(build_example(record, tokenizer, template, max_length, train_on_inputs, i,
                                          input_field, target_field, length_flag))
        except DataError as exc:
            raise DataError(f"{source}: {exc}" if source else str(exc)) from None
    return examples

