"""zerotrain under Ray Train (:mod:`zerotrain.ray`), on a local Ray cluster of two CPU workers started here.

One Ray fit, with a failure in it: the toy recipe on two workers over Gloo (DeepSpeed ZeRO-2), whose rank 1
dies (SIGKILL) in step 5 of its first attempt. Ray's ``FailureConfig`` restarts the worker group, each worker
resumes from ``ray.train.get_checkpoint()``, and the run ends with the weights of a plain uninterrupted
two-process zerotrain run, bit for bit. The metrics and checkpoints Ray holds came through ``ray.train.report``.
One fit covers both the uninterrupted path (steps 1-4) and the restart: starting a Ray cluster and its workers
is most of the cost, and CI's time is short.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import REPO, zerotrain_cmd

from zerotrain.tasks.toy import ToyTask

FIT = ["--trainer.max_steps", "6", "--trainer.micro_batch_size", "8", "--trainer.log_every_steps", "2",
       "--checkpoint.every_steps", "2", "--trainer.num_workers", "0", "--trainer.device", "cpu",
       "--strategy.zero_stage", "2", "--logging.progress_bar", "false", "--logging.tensorboard", "false",
       "--trainer.export", "false"]

DIES_AT_CALL = 5
"""The training micro-batch (one per step here) in which rank 1 of the first attempt kills itself: after the
step-4 checkpoint was reported."""


class DiesOnce(ToyTask):
    """The toy recipe, whose rank 1 kills itself with SIGKILL at :data:`DIES_AT_CALL` once per output folder (a
    file there says it did): the failure a lost node or the out-of-memory killer makes."""

    def training_step(self, model, batch):
        if model.training and os.environ.get("RANK") == "1":
            self.calls = getattr(self, "calls", 0) + 1
            died = Path(self.cfg.trainer.output_dir) / "rank1-died"
            if self.calls == DIES_AT_CALL and not died.exists():
                died.touch()
                os.kill(os.getpid(), signal.SIGKILL)
        return super().training_step(model, batch)


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster of 2 CPUs, no dashboard, no usage report; its workers import this checkout's zerotrain
    and this module (for :class:`DiesOnce`)."""
    ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'zerotrain[ray]'")
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "RAY_USAGE_STATS_ENABLED", "RAY_raylet_start_wait_time_s")}
    # The workers inherit the environment of the cluster started here: no runtime_env, so Ray's prestarted
    # workers are used as they are.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "src"), str(REPO / "tests"), saved["PYTHONPATH"])
                                               if p)
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    # On a busy 2-core machine the node's agents (Python processes) can take longer to start than Ray's node
    # waits for them (30 s by default), and the node then fails: a longer wait, and a second start below.
    os.environ["RAY_raylet_start_wait_time_s"] = "180"
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True)
    except Exception as exc:  # noqa: BLE001  (Ray raises a bare Exception when its node does not come up)
        if "timed out during startup" not in str(exc):
            raise
        ray.shutdown()
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True)  # a busy machine: once more
    try:
        yield
    finally:
        ray.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from zerotrain.checkpoint.export import checkpoint_tensors
    from zerotrain.checkpoint.weights import materialise

    return materialise(checkpoint_tensors(folder))


@pytest.mark.slow  # a Ray cluster, a Ray fit of two workers started twice, a two-process zerotrain run
def test_a_ray_run_restarted_after_a_lost_worker_ends_with_the_weights_of_a_plain_run(ray_cluster, tmp_path, capfd):
    from zerotrain.ray import trainer

    plain = zerotrain_cmd(["fit", "toy", *FIT, "--trainer.output_dir", str(tmp_path), "--trainer.run_name", "plain",
                           "--launch.nproc_per_node", "2"], cwd=tmp_path)
    assert plain.returncode == 0, plain.stderr[-3000:]

    out = tmp_path / "ray_runs"
    result = trainer(f"{__name__}:DiesOnce", FIT + ["--trainer.output_dir", str(out)], num_workers=2,
                     storage_path=str(tmp_path / "ray_storage"), name="lost_worker", max_failures=1).fit()
    assert result.error is None
    assert (out / "rank1-died").exists()  # the first attempt lost a worker
    stored = tmp_path / "ray_storage" / "lost_worker"
    # The restarted group resumed, not started over: from the last checkpoint Ray held, in Ray's storage, or, where
    # Ray had registered none of the first attempt's reports when the worker died, from the run folder's newest
    # (zerotrain.ray's documented fallback). Ray forwards the workers' output to the driver in the background: the
    # line can arrive after fit() returns, so the test waits for it a while.
    resumed = re.compile(rf"resumed from ({re.escape(str(stored))}/checkpoint_|"
                         rf"{re.escape(str(out / 'lost_worker' / 'checkpoints'))}/step)")
    said, deadline = "", time.monotonic() + 30
    while not resumed.search(said) and time.monotonic() < deadline:
        logs = capfd.readouterr()
        said += logs.out + logs.err
        time.sleep(0.5)
    assert resumed.search(said), said[-3000:]

    # What Ray holds came through ray.train.report: the newest --checkpoint.keep_last (2) checkpoints with the
    # metrics of their steps; the last one is step 6's.
    assert result.metrics["step"] == 6 and "train_loss" in result.metrics and "val_mse" in result.metrics
    held = sorted(m["step"] for _, m in result.best_checkpoints)  # [4, 6], or [6] where the first attempt's never registered
    assert held in ([4, 6], [6]), held
    final = Path(result.checkpoint.path)
    assert final.parent == stored

    # ZeRO-2 over Gloo, resumed with its RNG states: the same bits as the uninterrupted run.
    theirs, ours = _weights(tmp_path / "plain" / "checkpoints" / "step00000006"), _weights(final)
    assert sorted(theirs) == sorted(ours)
    for name in theirs:
        assert torch.equal(theirs[name], ours[name]), name
    # The run folder is Ray's run name; its own final checkpoint is the one Ray copied.
    mine = _weights(out / "lost_worker" / "checkpoints" / "step00000006")
    assert all(torch.equal(mine[name], ours[name]) for name in ours)


def test_without_ray_the_entry_says_which_extra_installs_it(monkeypatch):
    from zerotrain import ray as zray
    from zerotrain.errors import UserError

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError, as where it is not installed
    monkeypatch.setitem(sys.modules, "ray.train", None)
    with pytest.raises(UserError) as err:
        zray.trainer("toy", [])
    assert str(err.value) == "zerotrain.ray needs Ray Train, which is not installed: pip install 'zerotrain[ray]'"
