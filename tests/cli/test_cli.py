"""The ``zerotrain`` command line: user mistakes end in one clear line and a non-zero exit, never a traceback.

The CLI runs as a subprocess, as a user runs it. Every subprocess this module needs is started at
once by one fixture (two at a time), since each pays for importing torch and DeepSpeed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers import REPO

from zerotrain.tasks import registry as recipes
from zerotrain.config import StrategyConfig, TrainerConfig
from zerotrain.errors import UserError

SRC = REPO / "src"
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
CONFIG_RECIPES = {"mlm_": "mlm", "imdb_": "imdb", "lora_": "lora", "causal_lm_": "causal-lm", "classify_": "classify"}
"""Which recipe parses each shipped YAML, by file-name prefix."""

# name -> (argv after `zerotrain`, words the one error line must hold). "{tmp}" and "{tok}" are filled in.
FIT = ["--trainer.max_steps", "1", "--trainer.output_dir", "{tmp}/runs", "--trainer.num_workers", "0",
       "--trainer.device", "cpu", "--logging.progress_bar", "false", "--logging.tensorboard", "false"]
MLM = ["fit", "mlm", "--data.cache_dir", "{tmp}/cache", "--model.num_layers", "1", "--model.h_dim", "16",
       "--model.num_heads", "2", "--model.ff_dim", "16", "--model.max_seq_length", "8", *FIT]
ERRORS = {
    "unknown_flag": (["fit", "toy", "--no.such.flag", "1"], ["unrecognized arguments", "--no.such.flag"]),
    "unknown_recipe": (["fit", "no_such_recipe", "--trainer.max_steps", "1"], ["unknown recipe", "'no_such_recipe'"]),
    "unknown_subcommand": (["no_such_subcommand"], ["unknown subcommand", "'no_such_subcommand'"]),
    "param_offload_stage2": (
        ["fit", "toy", "--strategy.offload_param", "cpu", "--strategy.zero_stage", "2", *FIT],
        ["--strategy.offload_param", "stage 3", "--strategy.zero_stage is 2"]),
    "user_json_fp16_and_bf16": (
        ["fit", "toy", "--strategy.deepspeed_config", "{tmp}/fp16_bf16.json", *FIT], ["fp16.enabled", "bf16.enabled"]),
    "user_json_batch_rule": (
        ["fit", "toy", "--strategy.deepspeed_config", "{tmp}/batch.json", *FIT],
        ["train_batch_size = 100", "4 x 2 x 1 = 8"]),
    "mlm_missing_data_file": (
        [*MLM, "--data.train_path", "/nonexistent.txt", "--data.tokenizer", "{tok}"], ["/nonexistent.txt"]),
    "mlm_tokenizer_offline": (
        [*MLM, "--data.train_path", "{tmp}/train.txt", "--data.tokenizer", "roberta-base"],
        ["--data.tokenizer", "'roberta-base'"]),
    "mlm_empty_data_file": (
        [*MLM, "--data.train_path", "{tmp}/empty.txt", "--data.tokenizer", "{tok}"], ["{tmp}/empty.txt", "empty"]),
    "output_dir_under_a_file": (
        ["fit", "toy", *FIT, "--trainer.output_dir", "{tmp}/train.txt/runs"],
        ["--trainer.output_dir", "{tmp}/train.txt/runs"]),
}
OK = {
    "help": ["--help"],
    "doctor_json": ["doctor", "--json"],
}


def _fill(items: list[str], tmp: Path, tok: Path) -> list[str]:
    return [s.replace("{tmp}", str(tmp)).replace("{tok}", str(tok)) for s in items]


@pytest.fixture(scope="module")
def cli(tmp_path_factory, tiny_tokenizer_dir) -> dict[str, tuple[subprocess.CompletedProcess, list[str]]]:
    """Run every command of ERRORS and OK; name -> (finished process, filled expected words)."""
    tmp = tmp_path_factory.mktemp("cli")
    (tmp / "fp16_bf16.json").write_text(
        '{"fp16": {"enabled": true}, "bf16": {"enabled": true}, "train_batch_size": "auto"}')
    (tmp / "batch.json").write_text(
        '// explicit numbers that break the batch rule\n'
        '{"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "train_batch_size": 100}')
    (tmp / "train.txt").write_text("the movie was great and the plot was fun\n" * 20)
    (tmp / "empty.txt").write_text("\n\n")
    (tmp / "hf_home").mkdir()
    # In-process fits elsewhere in the session set torchrun's variables for their group of one; drop them.
    launcher_vars = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}
    env = {
        **{k: v for k, v in os.environ.items() if k not in launcher_vars},
        "PYTHONPATH": os.pathsep.join([str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp / "hf_home"),  # nothing cached: roberta-base cannot come from a local cache
        "TOKENIZERS_PARALLELISM": "false",
        "CUDA_VISIBLE_DEVICES": "",
        "OMP_NUM_THREADS": "1",
    }
    commands = {name: (_fill(argv, tmp, tiny_tokenizer_dir), _fill(words, tmp, tiny_tokenizer_dir))
                for name, (argv, words) in ERRORS.items()}
    commands.update({name: (argv, []) for name, argv in OK.items()})

    def run(argv: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "zerotrain", *argv], cwd=tmp, env=env, capture_output=True,
                              text=True, timeout=300)

    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(run, argv) for name, (argv, _) in commands.items()}
        return {name: (futures[name].result(), commands[name][1]) for name in commands}


@pytest.mark.slow  # the cli fixture runs `python -m zerotrain` subprocesses
@pytest.mark.parametrize("name", list(ERRORS))
def test_user_error_is_one_clear_line(cli, name):
    proc, words = cli[name]
    where = f"\n--- stderr ---\n{proc.stderr[-3000:]}\n--- stdout ---\n{proc.stdout[-2000:]}"
    assert proc.returncode != 0, where
    assert "Traceback" not in proc.stderr, where
    lines = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1, where
    for word in words:
        assert word in lines[0], f"{word!r} not in the error line {lines[0]!r}{where}"


@pytest.mark.slow  # the cli fixture runs `python -m zerotrain` subprocesses
@pytest.mark.parametrize("name", [n for n in ERRORS if n.startswith(("param_", "user_json", "mlm_", "output_"))])
def test_user_error_exits_2_and_says_only_that(cli, name):
    # A UserError from the library: status 2, and the error line is all of stderr.
    proc, _ = cli[name]
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.slow  # the cli fixture runs `python -m zerotrain` subprocesses
def test_top_level_help(cli):
    proc, _ = cli["help"]
    assert proc.returncode == 0, proc.stderr
    for sub in ("fit", "doctor", "predict"):
        assert any(line.split()[:1] == [sub] for line in proc.stdout.splitlines()), proc.stdout


def test_fit_recipe_help_shows_field_docstrings(capsys):
    # In this process: the parser is the one a subprocess would build, without paying for a second torch import.
    from zerotrain.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["fit", "toy", "--help"])
    assert exit_.value.code in (0, None)
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps help text
    assert "--strategy.zero_stage" in text
    assert "ZeRO stage: 0 (off)" in text
    assert "--trainer.max_steps" in text and "Train for this many optimizer steps" in text
    assert "--model.width" in text and "Hidden width of the MLP" in text


@pytest.mark.slow  # the cli fixture runs `python -m zerotrain` subprocesses
def test_doctor_json(cli):
    proc, _ = cli["doctor_json"]
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)  # stdout must be JSON alone, whatever DeepSpeed logs
    assert {"versions", "gpus", "compilers"} <= set(info)
    assert info["versions"]["torch"]


# --- config files: defaults < --config FILE < flags --------------------------------------------------------------

def test_config_file_then_flags(tmp_path):
    from zerotrain.cli.fit import parse_config

    yaml = tmp_path / "run.yaml"
    yaml.write_text("trainer:\n  max_steps: 7\noptimizer:\n  lr: 0.5\n  betas: [0.8, 0.9]\n")
    cfg = parse_config("toy", ["--config", str(yaml)])
    assert cfg.trainer.max_steps == 7
    assert cfg.optimizer.lr == 0.5 and tuple(cfg.optimizer.betas) == (0.8, 0.9)

    cfg = parse_config("toy", ["--config", str(yaml), "--trainer.max_steps", "9"])
    assert cfg.trainer.max_steps == 9
    assert cfg.optimizer.lr == 0.5  # the file still sets what the flags leave alone
    # Untouched fields keep their defaults, and the sections are the typed dataclasses.
    assert isinstance(cfg.trainer, TrainerConfig) and isinstance(cfg.strategy, StrategyConfig)
    assert dataclasses.replace(cfg.trainer, max_steps=None) == TrainerConfig()
    assert cfg.strategy == StrategyConfig()
    assert cfg.optimizer.eps == 1e-8 and cfg.model.width == 32
    cfg.validate()


OLD_FLAGS = [
    (["--strategy.precision", "bf16"], "--strategy.precision moved: use --precision.dtype bf16"),
    (["--strategy.initial_scale_power=12"], "--strategy.initial_scale_power moved: use --precision.initial_scale_power 12"),
    (["--strategy.loss_scale_window", "10"], "--strategy.loss_scale_window moved: use --precision.loss_scale_window 10"),
    (["--strategy.hysteresis", "3"], "--strategy.hysteresis moved: use --precision.hysteresis 3"),
    (["--strategy.min_loss_scale", "2"], "--strategy.min_loss_scale moved: use --precision.min_loss_scale 2"),
    (["--strategy.compile", "true"], "--strategy.compile moved: use --compile.enabled true"),
    (["--strategy.compile_scope", "stack"], "--strategy.compile_scope moved: use --compile.scope stack"),
    (["--strategy.compile_mode", "reduce-overhead"], "--strategy.compile_mode moved: use --compile.mode reduce-overhead"),
    (["--strategy.activation_checkpointing", "true"],
     "--strategy.activation_checkpointing moved: use --activation_checkpointing.enabled true"),
]


@pytest.mark.parametrize("argv, line", OLD_FLAGS, ids=[a[0].split("=")[0] for a, _ in OLD_FLAGS])
def test_an_old_flag_names_the_new_one(argv, line):
    from zerotrain.config import MOVED
    from zerotrain.config.flags import parse_config

    assert len(OLD_FLAGS) == len(MOVED)
    with pytest.raises(UserError) as err:
        parse_config("toy", ["--trainer.max_steps", "1", *argv])
    assert str(err.value) == line
    new = line.split("use ", 1)[1].split()
    parse_config("toy", ["--trainer.max_steps", "1", *new])  # and the new one is a flag


def test_an_old_config_key_names_the_new_one(tmp_path):
    from zerotrain.config.flags import parse_config

    old = tmp_path / "old.yaml"
    old.write_text("strategy:\n  zero_stage: 1\n  precision: fp32\n  compile: true\n")
    with pytest.raises(UserError) as err:
        parse_config("toy", ["--config", str(old), "--trainer.max_steps", "1"])
    assert str(err.value) == f"--config {old}: strategy.precision moved: use precision.dtype (write precision: {{dtype: fp32}})"
    new = tmp_path / "new.yaml"
    new.write_text("strategy:\n  zero_stage: 1\nprecision: {dtype: fp32}\ncompile: {enabled: true}\n")
    cfg = parse_config("toy", [f"--config={new}", "--trainer.max_steps", "1"])
    assert (cfg.strategy.zero_stage, cfg.precision.dtype, cfg.compile.enabled) == (1, "fp32", True)


def test_defaults_without_a_file():
    from zerotrain.cli.fit import parse_config
    from zerotrain.tasks.toy import ToyConfig

    cfg = parse_config("toy", [])
    assert type(cfg) is ToyConfig
    assert cfg == ToyConfig()


def test_every_shipped_config_has_a_recipe():
    assert CONFIGS, "no YAML under configs/"
    for path in CONFIGS:
        assert any(path.name.startswith(p) for p in CONFIG_RECIPES), (
            f"{path.name}: no recipe for it in CONFIG_RECIPES; add its prefix so a test parses it")


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_config_parses_and_validates(path, monkeypatch):
    from zerotrain.cli.fit import parse_config

    recipe = next((r for p, r in CONFIG_RECIPES.items() if path.name.startswith(p)), None)
    if recipe is None:
        pytest.fail(f"{path.name}: no recipe in CONFIG_RECIPES")
    monkeypatch.chdir(REPO)  # paths in the shipped configs are relative to the repository root
    cfg = parse_config(recipe, ["--config", str(path)])
    assert type(cfg) is recipes.get(recipe).config_class
    assert cfg.validate() is cfg
    # What the file sets is what the config holds (a typo'd key would have failed the parse).
    import yaml

    raw = yaml.safe_load(path.read_text())
    for section, values in raw.items():
        for key, value in values.items():
            got = getattr(getattr(cfg, section), key)
            assert (list(got) if isinstance(got, tuple) else got) == value, f"{section}.{key}"


def test_permission_denied_anywhere_is_one_line_naming_the_path(tmp_path):
    """A PermissionError that names its path, raised directly or as the cause of a library's own error (datasets,
    transformers), ends the command as a user error naming the path; one without a path stays a bug."""
    from zerotrain.cli import _collective_failures_as_rank_lost

    def wrapped(error: Exception):
        def run(argv):
            raise error
        return _collective_failures_as_rank_lost(run)

    denied = PermissionError(13, "Permission denied", str(tmp_path / "data"))
    with pytest.raises(UserError, match=r"data: permission denied: give this user access to it"):
        wrapped(denied)([])
    try:
        raise ValueError("could not list the files") from denied
    except ValueError as library_error:
        with pytest.raises(UserError, match=re.escape(str(tmp_path / "data"))):
            wrapped(library_error)([])
    with pytest.raises(PermissionError):
        wrapped(PermissionError("no path"))([])


@pytest.mark.skipif(os.geteuid() == 0, reason="runs as root, and root reads every file and folder: a folder without "
                    "read permission cannot be made")
def test_data_folder_without_read_permission(tmp_path, capsys):
    from zerotrain.cli import main

    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.txt").write_text("the movie was good\n")
    folder.chmod(0)
    try:
        code = main(["fit", "mlm", "--trainer.max_steps", "1", "--trainer.device", "cpu", "--trainer.num_workers", "0",
                     "--trainer.output_dir", str(tmp_path / "runs"), "--data.train_path", str(folder),
                     "--data.cache_dir", str(tmp_path / "c"), "--data.tokenizer",
                     str(REPO / "examples" / "data" / "roberta-tokenizer"), "--model.num_layers", "1", "--model.h_dim",
                     "16", "--model.num_heads", "2", "--model.ff_dim", "16", "--model.max_seq_length", "8"])
    finally:
        folder.chmod(0o755)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and str(folder) in err[0] and "permission denied" in err[0], err
