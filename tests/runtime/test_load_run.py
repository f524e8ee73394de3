"""rundir.load_run: a finished run folder back to its task and trained model, and one-line errors when it cannot be."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import imdb_task, write_run

from zerotrain.errors import UserError
from zerotrain.runtime.rundir import LoadedRun, load_run
from zerotrain.tasks.imdb import IMDBTask
from zerotrain.tasks.toy import ToyConfig, ToyTask


@pytest.fixture()
def toy_run(tmp_path):
    task = ToyTask(ToyConfig())
    torch.manual_seed(0)
    model = task.build_model().eval()
    return write_run(tmp_path / "toy.run", task, model), model


@pytest.fixture()
def imdb_run(tmp_path, tiny_tokenizer_dir):
    tok = tmp_path / "tokenizer"
    shutil.copytree(tiny_tokenizer_dir, tok)  # a copy the tests may move away
    task = imdb_task(tok)
    torch.manual_seed(0)
    model = task.build_model().eval()
    return write_run(tmp_path / "imdb.run", task, model), model


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        torch.testing.assert_close(sa[key], sb[key], rtol=0, atol=0, msg=key)


def test_toy_round_trip(toy_run):
    run, model = toy_run
    loaded = load_run(run)
    assert isinstance(loaded, LoadedRun) and loaded.recipe == "toy" and loaded.run_dir == run
    assert isinstance(loaded.task, ToyTask) and isinstance(loaded.cfg, ToyConfig) and loaded.task.cfg is loaded.cfg
    assert not loaded.model.training and next(loaded.model.parameters()).device.type == "cpu"
    _same_weights(loaded.model, model)
    x = torch.randn(4, 8)
    torch.testing.assert_close(loaded.model(x), model(x))


def test_imdb_round_trip_keeps_the_config(imdb_run):
    run, model = imdb_run
    loaded = load_run(str(run))  # a str works as well as a Path
    assert isinstance(loaded.task, IMDBTask)
    assert loaded.cfg.model.embed_dim == 32 and loaded.cfg.model.max_len == 16
    assert loaded.cfg.optimizer.betas == (0.9, 0.999)  # JSON lists back to the typed tuple
    _same_weights(loaded.model, model)


def test_a_run_saved_in_the_old_layout_loads_and_exports(toy_run, tmp_path):
    """hparams.json of a run made before precision, compile and activation checkpointing had sections of their own
    (they were strategy fields) loads with the same settings, for predict and export alike."""
    run, model = toy_run
    hparams = json.loads((run / "hparams.json").read_text())
    old = {k: v for k, v in hparams.items() if k not in ("precision", "compile", "activation_checkpointing")}
    old["strategy"] = {**hparams["strategy"], "precision": "bf16", "initial_scale_power": 12, "loss_scale_window": 500,
                       "hysteresis": 3, "min_loss_scale": 0.25, "compile": True, "compile_scope": "stack",
                       "compile_mode": "reduce-overhead", "activation_checkpointing": True}
    (run / "hparams.json").write_text(json.dumps(old))
    cfg = load_run(run).cfg
    assert (cfg.precision.dtype, cfg.precision.initial_scale_power, cfg.precision.loss_scale_window,
            cfg.precision.hysteresis, cfg.precision.min_loss_scale) == ("bf16", 12, 500, 3, 0.25)
    assert (cfg.compile.enabled, cfg.compile.scope, cfg.compile.mode) == (True, "stack", "reduce-overhead")
    assert cfg.activation_checkpointing.enabled is False  # load_run turns it off for inference
    assert cfg.strategy == ToyConfig().strategy

    from zerotrain.config import upgrade_layout
    from zerotrain.runtime.rundir import read_run

    _, read, raw = read_run(run)
    assert read.activation_checkpointing.enabled is True and raw == upgrade_layout(old)
    assert upgrade_layout(hparams) is hparams  # the current layout is left as it is
    assert old["strategy"]["precision"] == "bf16"  # and the caller's dict is not changed


def test_a_wrapped_models_module_prefix_is_dropped(toy_run):
    """Weights exported from a wrapped module (DDP/DeepSpeed keys ``module.x``) load all the same."""
    from safetensors.torch import load_file, save_file

    run, model = toy_run
    path = run / "model" / "model.safetensors"
    save_file({f"module.{k}": v for k, v in load_file(str(path)).items()}, str(path))
    _same_weights(load_run(run).model, model)


def test_loading_leaves_the_callers_random_streams_alone(toy_run):
    run, _ = toy_run
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    load_run(run)
    torch.testing.assert_close(torch.rand(3), expected)


def test_overrides_replace_saved_settings(imdb_run, tiny_tokenizer_dir):
    run, model = imdb_run
    loaded = load_run(run, {"data.tokenizer": str(tiny_tokenizer_dir), "model.dropout": 0.0})
    assert loaded.cfg.data.tokenizer == str(tiny_tokenizer_dir) and loaded.cfg.model.dropout == 0.0
    # "tokenizer" names the recipe's own tokenizer setting (data.tokenizer here).
    assert load_run(run, {"tokenizer": str(tiny_tokenizer_dir)}).cfg.data.tokenizer == str(tiny_tokenizer_dir)
    _same_weights(loaded.model, model)


def test_activation_checkpointing_is_off_for_inference(imdb_run):
    run, _ = imdb_run
    hparams = json.loads((run / "hparams.json").read_text())
    hparams["activation_checkpointing"]["enabled"] = True
    (run / "hparams.json").write_text(json.dumps(hparams))
    assert load_run(run).cfg.activation_checkpointing.enabled is False


def _error(run_dir, *args, **kwargs) -> str:
    with pytest.raises(UserError) as info:
        load_run(run_dir, *args, **kwargs)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def test_not_a_run_folder(tmp_path, toy_run):
    run, _ = toy_run
    message = _error(tmp_path / "nope")
    assert "nope" in message and "does not exist" in message and "run" in message
    message = _error(run / "model")  # the model folder, not the run folder
    assert "hparams.json is missing" in message and "not a zerotrain run folder" in message
    assert f"its parent {run} is one" in message


def test_model_not_exported_yet(toy_run):
    run, _ = toy_run
    (run / "model" / "model.safetensors").unlink()
    message = _error(run)
    assert "model.safetensors is missing" in message and "did not finish exporting" in message
    shutil.rmtree(run / "model")
    message = _error(run)
    assert str(run / "model") in message and "did not finish exporting" in message


def test_weights_that_do_not_fit(toy_run):
    run, _ = toy_run
    hparams = json.loads((run / "hparams.json").read_text())
    hparams["model"]["width"] = 16
    (run / "hparams.json").write_text(json.dumps(hparams))
    message = _error(run)
    assert "model.safetensors does not fit" in message and "hparams.json" in message


def test_hparams_of_an_unknown_recipe(toy_run):
    run, _ = toy_run
    hparams = json.loads((run / "hparams.json").read_text())
    (run / "hparams.json").write_text(json.dumps(dict(hparams, recipe="mystery")))
    message = _error(run)
    assert "'mystery'" in message and "not registered" in message and "toy" in message and "import" in message
    (run / "hparams.json").write_text(json.dumps({k: v for k, v in hparams.items() if k != "recipe"}))
    assert "names no recipe" in _error(run)
    (run / "hparams.json").write_text("{not json")
    assert "hparams.json cannot be read as JSON" in _error(run)
    hparams["model"]["colour"] = "blue"  # a field this version does not have
    (run / "hparams.json").write_text(json.dumps(hparams))
    message = _error(run)
    assert "does not match the toy recipe's config" in message and "colour" in message


def test_a_moved_tokenizer_asks_for_tokenizer(imdb_run, tiny_tokenizer_dir):
    run, model = imdb_run
    tok = Path(json.loads((run / "hparams.json").read_text())["data"]["tokenizer"])
    shutil.rmtree(tok)
    message = _error(run)
    assert str(tok) in message and "data.tokenizer" in message and "--tokenizer" in message
    _same_weights(load_run(run, {"tokenizer": str(tiny_tokenizer_dir)}).model, model)


def test_bad_overrides_and_devices(toy_run):
    run, _ = toy_run
    assert "override 'model.colour'" in _error(run, {"model.colour": "blue"})
    assert "override 'width'" in _error(run, {"width": 3})
    assert "--device 'abacus'" in _error(run, device="abacus")


@pytest.mark.slow
def test_round_trip_of_a_real_toy_fit(tmp_path):
    """What the training loop itself exports loads back into the same weights."""
    from zerotrain.train.loop import fit

    cfg = ToyConfig()
    cfg.data.num_examples = 32
    cfg.trainer.micro_batch_size, cfg.trainer.max_steps, cfg.trainer.num_workers = 8, 3, 0
    cfg.trainer.output_dir, cfg.trainer.run_name = str(tmp_path), "toy"
    cfg.logging.progress_bar = False
    cfg.strategy.zero_stage = 1
    result = fit(ToyTask(cfg))

    loaded = load_run(result.run_dir)
    assert loaded.recipe == "toy" and loaded.cfg.trainer.max_steps == 3 and loaded.cfg.strategy.zero_stage == 1
    from safetensors.torch import load_file

    exported = load_file(str(result.run_dir / "model" / "model.safetensors"))
    state = loaded.model.state_dict()
    assert {k.removeprefix("module.") for k in exported} == set(state)
    for key, value in exported.items():
        torch.testing.assert_close(state[key.removeprefix("module.")], value.float(), rtol=0, atol=0)
