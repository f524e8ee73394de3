"""Load a Hugging Face tokenizer from a local folder or a hub name, with a clear error offline."""

from __future__ import annotations

from pathlib import Path

from zerotrain.data.io import hub_offline, looks_local
from zerotrain.errors import UserError

__all__ = ["load_tokenizer", "looks_local"]


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
        raise UserError(f"{flag}: tokenizer folder {name_or_path!r} does not exist. Pass a folder with tokenizer.json "
                        "(or vocab.json + merges.txt), e.g. ../shared/data/roberta-tokenizer")
    if not local:
        hub_offline()
    try:
        return AutoTokenizer.from_pretrained(str(path) if local else name_or_path)
    except (OSError, ValueError) as exc:
        where = f"folder {name_or_path!r}" if local else f"hub name {name_or_path!r}"
        raise UserError(
            f"{flag}: could not load a tokenizer from the {where} "
            f"({type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}). "
            "Offline, pass a local folder with tokenizer.json (or vocab.json + merges.txt), "
            f"e.g. {flag} ../shared/data/roberta-tokenizer"
        ) from None
