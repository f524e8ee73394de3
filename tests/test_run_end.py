"""The last step is as safe as any other: its checkpoint is written before the final evaluation, test and export."""

from __future__ import annotations

import pytest
from test_fit import toy_config

from zerotrain.checkpoint.layout import complete_checkpoints, read_marker
from zerotrain.tasks.toy import ToyTask
from zerotrain.train.loop import fit


class EvaluationFails(ToyTask):
    """A toy task whose evaluation breaks: what a failure (or a second Ctrl-C) after the last step meets."""

    def eval_step(self, model, batch):
        raise RuntimeError("evaluation broke")


def test_a_failure_in_the_final_evaluation_keeps_the_final_checkpoint(tmp_path):
    cfg = toy_config(tmp_path, "end", zero_stage=0)
    cfg.trainer.max_steps = 3
    with pytest.raises(RuntimeError, match="evaluation broke"):
        fit(EvaluationFails(cfg))
    (final,) = complete_checkpoints(tmp_path / "end" / "checkpoints")
    assert read_marker(final)["step"] == 3
    again = toy_config(tmp_path, "end", zero_stage=0)
    again.trainer.max_steps, again.checkpoint.resume, again.trainer.evaluate = 3, "auto", False
    assert fit(ToyTask(again)).final_step == 3  # nothing left to train: the trained state was kept
