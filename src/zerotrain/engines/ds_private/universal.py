"""DeepSpeed's universal checkpoint: its converter and load switch (the internal entry points zerotrain's resharding
uses), and a writer of its files for state that DeepSpeed did not write (another engine's checkpoint).

The writer knows the layout DeepSpeed 0.19.8's ``load_universal_checkpoint`` reads (the one its own converter
writes; the key names are taken from ``deepspeed.checkpoint.constants``): ``zero/<parameter>/<state>.pt``, one file
per parameter and optimizer state, the tensor whole under ``"param"`` (the step bare); ``zero/optimizer_state.pt``,
the optimizer's settings (read by ZeRO-1/2 at its top level, by ZeRO-3 under ``"optimizer_state_dict"``, so both
are written); and the model-states file that DeepSpeed's loader opens for the schedule and step counters (named
by stage: ``mp_rank_00_model_states.pt``, ``zero_pp_rank_0_mp_rank_00_model_states.pt`` at stage 3; both are
written). It would be unnecessary with a public DeepSpeed API that writes a universal checkpoint from whole
per-parameter tensors.
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from typing import Any, Iterator

import torch

MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
"""The model-states files of a universal checkpoint, by the stage that reads them (ZeRO-0/1/2, ZeRO-3)."""


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


def write_parameter_state(folder: Path, name: str, state: str, value: torch.Tensor) -> None:
    """``folder/zero/<name>/<state>.pt``: ``state`` is ``fp32`` (the weights), an optimizer state such as ``exp_avg``,
    or ``step``; tensors whole, as DeepSpeed's converter writes them."""
    from deepspeed.checkpoint.constants import CAT_DIM, PARAM

    where = folder / "zero" / name
    where.mkdir(parents=True, exist_ok=True)
    torch.save(value if state == "step" else {PARAM: value.contiguous(), CAT_DIM: 0}, where / f"{state}.pt")


def write_run_states(folder: Path, param_groups: list[dict[str, Any]], step: torch.Tensor,
                     scheduler: dict[str, Any], global_steps: int, dp_world_size: int) -> None:
    """The files of ``folder`` beside the per-parameter ones: the optimizer's settings (``param_groups``, each
    without its ``params``, and the optimizer's ``step``) and the schedule's state with the step counters."""
    import deepspeed
    from deepspeed.checkpoint.constants import DS_VERSION, OPTIMIZER_STATE_DICT, PARAM_GROUPS

    groups = [{**g, "params": [i]} for i, g in enumerate(param_groups)]
    (folder / "zero").mkdir(parents=True, exist_ok=True)
    torch.save({DS_VERSION: deepspeed.__version__, PARAM_GROUPS: groups,
                OPTIMIZER_STATE_DICT: {"state": {i: {"step": step} for i in range(len(groups))}, PARAM_GROUPS: groups}},
               folder / "zero" / "optimizer_state.pt")
    states = {"module": None, "optimizer": None, "lr_scheduler": scheduler, "global_steps": global_steps,
              "skipped_steps": 0, "dp_world_size": dp_world_size, "mp_world_size": 1, DS_VERSION: deepspeed.__version__}
    for name in MODEL_STATES:
        torch.save(states, folder / name)


def saved_step(optimizer_state: Any) -> Any:
    """The optimizer's step as ``zero/optimizer_state.pt`` (loaded) holds it, where the per-parameter ``step.pt``
    is absent (DeepSpeed's converter writes none for ZeRO-3: its step is the flat group's); None if not there."""
    from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT

    try:
        return optimizer_state[OPTIMIZER_STATE_DICT]["state"][0]["step"]
    except (KeyError, IndexError, TypeError):
        return None
