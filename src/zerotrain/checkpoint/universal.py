"""Resuming on another process count: a ZeRO checkpoint as DeepSpeed's universal checkpoint, converted once and cached.

ZeRO-1/2/3 shard the optimizer states (and, at stage 3, the parameters) by rank, so a checkpoint of
N processes cannot be loaded by M of them as it is. DeepSpeed's universal checkpoint stores every
parameter's states whole; zerotrain converts a step folder into one the first time a run resumes
from it on another process count, and keeps it beside the checkpoint for the next time.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Optional

from zerotrain.checkpoint.layout import (
    checkpoint_bytes,
    listing_problem,
    read_marker,
    seal,
)
from zerotrain.data.io import atomic_write_text, fsync_dir
from zerotrain.engines.ds_private.safe_load import ds_safe_globals
from zerotrain.engines.ds_private.universal import convert_to_universal
from zerotrain.errors import UserError
from zerotrain.runtime import rundir
from zerotrain.train.state import weights_only_torch_load

log = logging.getLogger("zerotrain")

UNIVERSAL = "universal"
"""Subfolder of a step folder holding its universal checkpoint (DeepSpeed's ``<dir>/<tag>/`` layout, tag ``universal``)."""
UNIVERSAL_MARKER = "UNIVERSAL.json"


def universal_checkpoint(folder: Path, verify: bool = True) -> Path:
    """``folder``'s ZeRO state as a DeepSpeed universal checkpoint, ``folder/universal``: converted once, then cached.

    Runs on one rank (the caller uses :func:`~zerotrain.runtime.collectives.run_on_main`, so a failure
    reaches every rank as one line); the conversion is CPU-only. It is DeepSpeed's own
    converter (:func:`zerotrain.engines.ds_private.universal.convert_to_universal`), written into ``folder/.universal.tmp/`` and
    renamed into place only when complete, with its own marker (:data:`UNIVERSAL_MARKER`: every
    file's size and, with ``verify``, sha256; fsynced before the rename), so the cache is complete
    or absent like the checkpoint itself. A cached copy is checked against its marker and
    reused; a damaged one is converted again. Every ``torch.load`` of the conversion is
    weights-only with the engine's allow-list (a crafted file runs no code).
    """
    import contextlib
    import io

    out = folder / UNIVERSAL
    if (out / UNIVERSAL_MARKER).is_file():
        damage = _listing_problem(out, UNIVERSAL_MARKER, verify)
        if damage is None:
            log.info("using the universal checkpoint cached in %s", out)
            return out
        log.warning("the cached universal checkpoint %s is damaged (%s): converting again", out, damage)
    work = folder / ".universal.tmp"
    for stale in (out, work):
        shutil.rmtree(stale, ignore_errors=True)  # no marker (a killed conversion) or damaged
    meta = read_marker(folder)
    log.info("converting %s (written by %s process(es)) to a universal checkpoint in %s", folder,
             meta.get("world_size"), out)

    chatter = io.StringIO()  # the converter prints progress bars and banners
    try:
        with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter), \
                weights_only_torch_load(folder, ds_safe_globals()):
            convert_to_universal(folder, work / UNIVERSAL)
        files = seal(work / UNIVERSAL, 0, 1, verify)
        atomic_write_text(work / UNIVERSAL / UNIVERSAL_MARKER,
                          json.dumps({"format": 1, "source": folder.name, "source_world_size": meta.get("world_size"),
                                      "files": files}, indent=1))
        fsync_dir(work / UNIVERSAL)
        os.rename(work / UNIVERSAL, out)
        fsync_dir(folder)
    except UserError:
        raise
    except Exception as exc:
        detail = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        if rundir.is_space_error(exc):
            raise rundir.space_error("the universal checkpoint", folder, checkpoint_bytes(folder)) from None
        raise UserError(f"--checkpoint.resume: converting {folder} to a universal checkpoint (to resume on another "
                        f"process count) failed ({detail}). Start it with {meta.get('world_size')} processes") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def _listing_problem(folder: Path, marker: str, checksums: bool) -> Optional[str]:
    """What is wrong with ``folder`` against the file listing in its ``marker`` (None: nothing). One rank."""
    try:
        files = json.loads((folder / marker).read_text()).get("files")
    except (OSError, ValueError, AttributeError) as exc:
        return f"{folder / marker} cannot be read ({exc})"
    return listing_problem(folder, files, checksums, marker=folder / marker)
