"""Load a Hugging Face tokenizer from a local folder or a hub name, with a clear error offline."""

from __future__ import annotations

from pathlib import Path

from zerotrain.data.io import hub_offline, looks_local
from zerotrain.errors import UserError

__all__ = ["load_tokenizer", "looks_local"]

LOCAL_TOKENIZER = ("a folder with tokenizer.json (or vocab.json + merges.txt), such as examples/data/roberta-tokenizer "
                   "in the zerotrain repository")
"""What to pass instead of a tokenizer that failed: the RoBERTa tokenizer ships with the repository."""


def load_tokenizer(name_or_path: str, flag: str = "--data.tokenizer"):
    """Return a fast tokenizer from a local folder (``tokenizer.json`` or ``vocab.json`` + ``merges.txt``)
    or a hub name such as ``roberta-base``.

    ``flag`` names the option that holds ``name_or_path``, so the error message can say what to pass.
    A hub name with no network fails within seconds (offline mode, see :func:`zerotrain.data.io.hub_offline`);
    a tokenizer already in the local cache still loads.
    """
    from transformers import AutoTokenizer

    path = Path(name_or_path).expanduser()
    local = looks_local(name_or_path)
    if local and not path.is_dir():
        raise UserError(f"{flag}: tokenizer folder {name_or_path!r} does not exist. Pass {LOCAL_TOKENIZER}, "
                        "or a hub name such as roberta-base when online")
    if not local:
        hub_offline()
    try:
        tok = AutoTokenizer.from_pretrained(str(path) if local else name_or_path)
    except (OSError, ValueError) as exc:
        where = f"folder {name_or_path!r}" if local else f"hub name {name_or_path!r}"
        raise UserError(
            f"{flag}: could not load a tokenizer from the {where} "
            f"({type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}). "
            f"Offline, pass {LOCAL_TOKENIZER}"
        ) from None
    check_encodes_text(tok, name_or_path, flag)
    return tok


PROBE = "The movie was good, and the acting was great."
"""An English sentence any text tokenizer splits into several ordinary tokens."""


def check_encodes_text(tok, name_or_path: str, flag: str) -> None:
    """Refuse a tokenizer that turns text into special tokens only.

    A folder holding only ``config.json`` loads as a tokenizer of five special tokens: every text
    becomes ``<s></s>`` (or ``<unk>`` runs) and training "succeeds" on nothing. Two distinct ordinary
    tokens in :data:`PROBE` is the least a tokenizer that can encode text gives.
    """
    try:
        ids = tok(PROBE, add_special_tokens=False)["input_ids"]
    except Exception as exc:  # a tokenizer without a vocabulary may raise instead of returning nothing
        ids, detail = [], f" ({type(exc).__name__})"
    else:
        detail = ""
    ordinary = set(ids) - set(tok.all_special_ids)
    if len(ordinary) < 2:
        raise UserError(
            f"{flag}: the tokenizer in {name_or_path!r} cannot encode text: {PROBE!r} becomes "
            f"{len(ordinary)} ordinary token(s){detail} (vocabulary of {len(tok)}). Pass {LOCAL_TOKENIZER}"
        )


def with_pad_token(tok, name_or_path: str, flag: str):
    """``tok`` with a pad token: its own, else its EOS token (GPT-style tokenizers have none; padded positions are
    masked, so EOS there changes nothing learnt and needs no new embedding row). A tokenizer with neither is one
    line naming ``flag``: batches of texts of different lengths cannot be padded."""
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise UserError(f"{flag}: {name_or_path!r} has no pad token and no EOS token to pad with: use a tokenizer "
                            "that has one (pad_token in its tokenizer_config.json)")
        tok.pad_token = tok.eos_token
    return tok
