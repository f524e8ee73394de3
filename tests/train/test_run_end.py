"""The end of a run loses nothing: the last step's checkpoint is written before the final evaluation, test and
export, and a full disk at the export is one line that leaves no half-written model behind.

The full disk is real: RLIMIT_FSIZE makes the kernel refuse writes past a size (EFBIG), as a full disk refuses
them (ENOSPC); no filesystem is filled and no writer is faked."""

from __future__ import annotations

import pytest
from helpers import file_size_limit, toy_config

from zerotrain.checkpoint.layout import complete_checkpoints, read_marker
from zerotrain.errors import UserError
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


class ExportOnAFullDisk(ToyTask):
    """The toy task, its export run where the kernel refuses writes past 1 kB (the weights are 2.2 kB)."""

    def export(self, model, state_dict, out_dir):
        with file_size_limit(1000):
            super().export(model, state_dict, out_dir)


def test_a_full_disk_at_the_final_export_is_one_line_and_leaves_no_half_model(tmp_path):
    cfg = toy_config(tmp_path, "full", zero_stage=0)
    cfg.trainer.max_steps = 2
    with pytest.raises(UserError, match=r"^no space left to write the exported model in .*full \(.* free\)") as err:
        fit(ExportOnAFullDisk(cfg))  # safetensors' own error: "File too large (os error 27)"
    assert "\n" not in str(err.value)
    run = tmp_path / "full"
    assert not (run / "model").exists() and not list(run.glob(".model.partial-*"))
    assert complete_checkpoints(run / "checkpoints")  # the trained state was saved before


def test_a_full_disk_during_zerotrain_export_is_one_line_and_leaves_nothing(tmp_path):
    from zerotrain.checkpoint.export import export_run

    cfg = toy_config(tmp_path, "done", zero_stage=0)
    cfg.trainer.max_steps, cfg.trainer.export = 2, False
    run = fit(ToyTask(cfg)).run_dir
    with file_size_limit(1000), pytest.raises(UserError, match=r"^no space left to write the export in "):
        export_run(run, out=tmp_path / "exported")
    assert not (tmp_path / "exported").exists() and not list(tmp_path.glob(".exported.partial-*"))


@pytest.mark.slow
@pytest.mark.parametrize("max_steps,profiled", [(2, False), (3, True)])
def test_a_run_that_ends_inside_its_profiled_steps_exits_cleanly(tmp_path, max_steps, profiled):
    """The warm-up ends at step 2: one profiled step needs a third. A run of 2 steps profiles nothing and says
    so, instead of leaving torch's profiler running, which crashed the process at exit (status 139)."""
    from conftest import zerotrain_cmd

    out = zerotrain_cmd(["fit", "toy", "--trainer.max_steps", str(max_steps), "--trainer.profile_steps", "1",
                         "--trainer.device", "cpu", "--trainer.num_workers", "0", "--logging.progress_bar", "false",
                         "--trainer.output_dir", str(tmp_path), "--trainer.run_name", "p"], cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "p" / "profile.json").is_file() == profiled
    assert ("no profile written" in out.stderr) != profiled
