"""zerotrain.engines.ds_private.patches: DeepSpeed patches applied only on the versions they were verified on, and undone."""

from __future__ import annotations

import pytest
from helpers import toy_config, train_log

from zerotrain.engines.ds_private import patches
from zerotrain.tasks.toy import ToyTask
from zerotrain.train.loop import fit


def test_each_patch_declares_what_versions_gain_and_upstream():
    names = [p.name for p in patches.PATCHES]
    assert len(names) == len(set(names))
    for p in patches.PATCHES:
        assert p.verified_versions and all(v.count(".") == 2 for v in p.verified_versions), p.name
        assert p.target in ("optimizer", "engine"), p.name
        assert p.what and p.gain and p.upstream, p.name


def test_only_a_verified_version_gets_patches():
    """The check is a pure function of the version string: an exact release listed, nothing else."""
    verified = patches.PATCHES[0].verified_versions[0]
    assert patches.patches_for(verified) == tuple(p for p in patches.PATCHES if verified in p.verified_versions)
    assert patches.unverified_line(verified) is None
    for other in ("0.16.0", "0.18.2", "0.19.6", f"{verified}+local", "", None):
        assert patches.patches_for(other) == ()
        line = patches.unverified_line(other)
        assert line == (f"DeepSpeed {other} is not among the versions zerotrain's optimisations were verified on "
                        f"({verified}): running DeepSpeed's own code")


def _fit_recording_patches(tmp_path, name, monkeypatch, version, **strategy):
    """A toy fit whose engine applies the patches for DeepSpeed ``version``; returns the Applied and the engine."""
    import zerotrain.engines.deepspeed as ds_engine

    seen = []

    def recording(engine):
        applied = patches.apply_patches(engine, version=version)
        seen.append((applied, engine))
        return applied

    monkeypatch.setattr(ds_engine, "apply_patches", recording)
    fit(ToyTask(toy_config(tmp_path, name, gradient_clipping=0.05, **strategy)))
    assert len(seen) == 1
    return seen[0]


@pytest.mark.parametrize("stage", [0, 1])
def test_an_unlisted_version_runs_deepspeeds_own_code_and_says_so_once(tmp_path, monkeypatch, capfd, stage):
    applied, engine = _fit_recording_patches(tmp_path, "old", monkeypatch, "0.18.2", zero_stage=stage)
    assert applied.names == []
    out = capfd.readouterr()
    lines = [line for line in (out.out + out.err).splitlines() if "not among the versions" in line]
    assert len(lines) == 1 and lines[0].endswith(patches.unverified_line("0.18.2"))
    patched = {"unscale_and_clip_grads", "get_grad_norm_direct", "scaled_global_norm", "_update_model_bit16_weights",
               "reduce_ready_partitions_and_remove_grads", "complete_grad_norm_calculation_for_cpu_offload"}
    assert not patched & set(vars(engine.optimizer))  # every method is the class's, DeepSpeed's own
    assert sorted(train_log(tmp_path / "old")) == list(range(1, 9))


@pytest.mark.skipif(not patches.patches_for(patches.installed_version()),
                    reason="applies the patches, which only the versions they were verified on take")
@pytest.mark.parametrize("stage", [1, 2])
def test_each_patch_is_undone_to_deepspeeds_own_methods(tmp_path, monkeypatch, stage):
    """On the verified version, ZeRO-1/2 on one rank gets its optimizer patches as instance methods; undone, the
    instance holds none of them (the class's methods are found again) and ZeRO-2's gradient hooks are back."""
    applied, engine = _fit_recording_patches(tmp_path, f"z{stage}", monkeypatch, patches.VERIFIED[0],
                                             zero_stage=stage)
    opt = engine.optimizer
    expected = {"zero12_clip_without_sync": "unscale_and_clip_grads", "zero12_norm_one_launch": "get_grad_norm_direct",
                "zero12_one_group_norm": "scaled_global_norm", "zero12_rebind_only_moved": "_update_model_bit16_weights",
                "zero12_one_rank_no_reduction": "reduce_ready_partitions_and_remove_grads"}
    assert set(expected) <= set(applied.names)
    for name, method in expected.items():
        assert method in vars(opt), name
    assert opt._grad_acc_hooks == []
    applied.undo()
    assert applied.names == []
    for method in expected.values():
        assert method not in vars(opt)
        assert getattr(opt, method).__func__ is getattr(type(opt), method)
    if stage == 2:  # DeepSpeed's per-parameter hooks, made again by its own method
        assert len(opt._grad_acc_hooks) == len(list(engine.module.parameters()))
    else:
        assert opt._grad_acc_hooks == []
