"""DeepSpeed's universal-checkpoint converter and switch, the two internal entry points zerotrain's resharding uses."""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from typing import Any, Iterator


def convert_to_universal(input_folder: Path, output_folder: Path) -> None:
    """Convert the ZeRO checkpoint ``input_folder`` (one ``<dir>/<tag>``) into a universal checkpoint in
    ``output_folder`` with DeepSpeed's ``ds_to_universal.main``: one worker each for extraction and merging
    (the conversion is CPU-only and runs on one rank), strict checks, the universal-checkpoint info that
    non-Megatron models do not record injected. The namespace holds the converter's command-line options,
    which is the only way it takes them."""
    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(input_folder=str(input_folder), output_folder=str(output_folder), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    ds_to_universal.main(args)


@contextlib.contextmanager
def loading_universal(engine: Any) -> Iterator[None]:
    """DeepSpeed ``engine``'s ``load_universal_checkpoint`` switched on for the block only: DeepSpeed reads it at
    load time from its parsed config (a private attribute), so the run's JSON stays the run's."""
    config = engine._config
    before, config.load_universal_checkpoint = config.load_universal_checkpoint, True
    try:
        yield
    finally:
        config.load_universal_checkpoint = before
