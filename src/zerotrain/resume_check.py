"""Is a checkpoint one this run can continue? The recipe and model of the run that wrote it, checked first.

Resuming a run of another recipe or model size used to fail deep inside DeepSpeed's loader, with a
60-line traceback, after ``hparams.json`` had been rewritten. The run that wrote a checkpoint left its
config in ``hparams.json`` beside ``checkpoints/``; this compares it with the new run's before anything
is built or written. (Engine-level facts recorded in the checkpoint itself, such as ZeRO stage and
world size, are checked by :mod:`zerotrain.checkpoint` when it loads.)
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from zerotrain.errors import UserError

HARMLESS_MODEL_FIELDS = frozenset({"dropout", "lora_dropout", "merge_on_export", "init_from_mlm"})
"""Model settings that change no tensor's name or shape: a resume may change them."""


def check_resume_matches(checkpoint: Path, recipe: str, cfg: Any) -> None:
    """Raise a one-line :class:`UserError` when ``checkpoint`` was written by a run of another recipe or
    with other model settings than ``cfg`` (the ``--model.*`` flags that change tensors' names or shapes)."""
    hparams = checkpoint.parent.parent / "hparams.json"
    try:
        saved = json.loads(hparams.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # nothing to compare with (a checkpoint copied alone): the engine's loader decides
    if not isinstance(saved, dict):
        return
    theirs = saved.get("recipe")
    if theirs is not None and theirs != recipe:
        raise UserError(f"--checkpoint.resume: {checkpoint} was written by a {theirs} run, and this is a {recipe} "
                        f"run. Resume with zerotrain fit {theirs}, or start a new run (another --trainer.run_name)")
    model = getattr(cfg, "model", None)
    old = saved.get("model")
    if not (dataclasses.is_dataclass(model) and isinstance(old, dict)):
        return
    now = json.loads(json.dumps(dataclasses.asdict(model), default=str))  # tuples as lists, as the file has them
    changed = [f"--model.{k} {now[k]} (the checkpoint's run had {old[k]})" for k in now
               if k in old and k not in HARMLESS_MODEL_FIELDS and now[k] != old[k]]
    if changed:
        raise UserError(f"--checkpoint.resume: {checkpoint} holds another model: {'; '.join(changed)}. Pass the "
                        "run's own model flags (its hparams.json has them) or start a new run")
