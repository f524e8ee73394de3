"""What several test modules share: plain functions, classes and constants, no fixtures (those are in conftest.py).

Import it as ``from helpers import ...`` from any folder under tests/: pyproject.toml's ``pythonpath`` puts
tests/ on ``sys.path`` (see conftest.py). Test modules never import each other; what two of them need lives here.

* where things are: :data:`REPO`, :data:`SHARED_DATA`;
* the command a user runs: :func:`zerotrain_cmd`, :func:`run_python`, :func:`start_zerotrain`,
  :func:`popen_zerotrain`, :func:`wait_for_rows`;
* small inputs made in the test, never downloaded: :func:`make_tokenizer`, :data:`WORDS`, :func:`write_reviews`,
  :data:`LLAMA`, :func:`lora_fit_args`, :func:`fake_probe`;
* toy runs and what they leave: :func:`toy_config`, :func:`train_log`, :func:`write_run`, :func:`imdb_task`;
* :class:`RecordOps`, the aten ops a block of code runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
"""The repository root (this file is ``REPO/tests/helpers.py``)."""
SHARED_DATA = REPO.parent / "shared" / "data"
"""The real data sets beside the clone, for the tests marked ``data`` (the ``shared_data`` fixture)."""
LAUNCHER_VARS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}
"""torchrun's variables, which a process started by a test must not inherit (see :func:`run_python`)."""

RUNNING: dict[str, pytest.Item] = {}
"""The test being set up or run (set by conftest.py's hooks), for the ``slow`` marker check of the functions
below that start a process."""


# --- the command a user runs ---------------------------------------------------------------------------------

def run_python(argv: list[str], cwd: Path, timeout: int = 600, **env_extra: str) -> subprocess.CompletedProcess:
    """Run ``python ARGV`` in a fresh process that imports this checkout's zerotrain; stdout and stderr captured.

    In-process fits earlier in the session set torchrun's variables for their group of one;
    they are dropped, so a command with --launch.nproc_per_node N starts its N workers itself.
    The test that calls it must be marked ``slow`` (a fresh process pays for importing torch).
    """
    return subprocess.run([sys.executable, *argv], cwd=cwd, env=child_env(argv, env_extra), capture_output=True,
                          text=True, timeout=timeout)


def zerotrain_cmd(args: list[str], cwd: Path, timeout: int = 600, **env_extra: str) -> subprocess.CompletedProcess:
    """Run ``python -m zerotrain ARGS`` as a user would (see :func:`run_python`)."""
    return run_python(["-m", "zerotrain", *args], cwd, timeout, **env_extra)


def start_zerotrain(args: list[str], cwd: Path, **env_extra: str) -> subprocess.Popen:
    """``python -m zerotrain ARGS`` started in the background, for a test that acts on the job while it runs.

    Its stdout and stderr go to ``cwd/stdout.txt`` and ``cwd/stderr.txt`` (files, not pipes, which a long
    run fills while nobody reads them). Same environment and marker check as :func:`run_python`.
    """
    argv = ["-m", "zerotrain", *args]
    with open(cwd / "stdout.txt", "w") as out, open(cwd / "stderr.txt", "w") as err:
        return subprocess.Popen([sys.executable, *argv], cwd=cwd, env=child_env(argv, env_extra), stdout=out,
                                stderr=err)


def popen_zerotrain(args: list[str], cwd: Path) -> subprocess.Popen:
    """``python -m zerotrain ARGS`` started in the background with its stdout and stderr on pipes (text), read
    with ``communicate()`` once the test has signalled it. For runs that print little (no progress bar):
    a pipe nobody reads stops the run once it is full. Same environment and marker check as :func:`run_python`."""
    argv = ["-m", "zerotrain", *args]
    return subprocess.Popen([sys.executable, *argv], cwd=cwd, env=child_env(argv, {}), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_for_rows(metrics: Path, proc: subprocess.Popen, rows: int = 3, timeout: float = 120) -> None:
    """Return once the run's ``metrics.jsonl`` has ``rows`` lines; fail the test, with the run's stderr, when
    the process ends first or ``timeout`` seconds pass (a bound on the wait, not a measurement)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= rows:
            return
        time.sleep(0.1)
    out, err = proc.communicate(timeout=30) if proc.poll() is not None else ("", "")
    pytest.fail(f"the run logged no steps (exit {proc.poll()}): {err[-2000:]}")


def child_env(argv: list[str], env_extra: dict[str, str]) -> dict[str, str]:
    """The environment of a process a test starts: this one's, without torchrun's variables, with this
    checkout's src/ first on PYTHONPATH (the GPU machine's packages come through PYTHONPATH too), offline.
    Fails the running test when it is not marked ``slow``."""
    item = RUNNING.get("item")
    if item is not None and item.get_closest_marker("slow") is None:
        pytest.fail(f"{item.nodeid} starts `python {' '.join(map(str, argv[:2]))} ...`: mark it @pytest.mark.slow",
                    pytrace=False)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    pythonpath = os.pathsep.join(p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH")) if p)
    env.update(PYTHONPATH=pythonpath, HF_HUB_OFFLINE="1", **env_extra)
    return env


# --- small inputs made in the test -----------------------------------------------------------------------------

WORDS = (
    "the a movie film was great good bad awful terrible wonderful plot acting story actor boring "
    "fun loved hated and but not very really i it this of to in is".split()
)
"""The vocabulary of :func:`make_tokenizer`, besides the special tokens: text made of these words has no <unk>."""


def make_tokenizer(folder: Path):
    """A word-level tokenizer over :data:`WORDS` with RoBERTa's special tokens, saved as a Hugging Face folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "<pad>", "</s>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials + WORDS + ["<mask>"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
        mask_token="<mask>", cls_token="<s>", sep_token="</s>",
    )
    fast.save_pretrained(folder)
    return fast


_POSITIVE = "great good wonderful loved fun".split()
_NEGATIVE = "bad awful terrible hated boring".split()
_FILLER = "the a movie film was plot acting story actor and it this".split()


def _reviews(n: int, rng: random.Random) -> list[dict]:
    """``n`` reviews alternating negative (label 0) and positive (1): filler words with two words of the label's
    sentiment, so a small model separates them; HTML line breaks as in IMDB."""
    rows = []
    for i in range(n):
        label = i % 2
        words = [rng.choice(_FILLER) for _ in range(rng.randint(4, 20))]
        for _ in range(2):
            words.insert(rng.randrange(len(words) + 1), rng.choice(_POSITIVE if label else _NEGATIVE))
        rows.append({"text": " ".join(words) + "<br /><br />", "label": label})
    return rows


def write_reviews(data: Path, sizes: dict[str, int], rng: random.Random) -> Path:
    """``data/<split>.jsonl`` (a new folder) with ``sizes[split]`` separable reviews in each, made from ``rng``
    in words of :data:`WORDS`; returns ``data``."""
    data.mkdir()
    for split, n in sizes.items():
        (data / f"{split}.jsonl").write_text("\n".join(json.dumps(r) for r in _reviews(n, rng)) + "\n")
    return data


LLAMA = {
    "model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 128,
    "bos_token_id": 0, "pad_token_id": 1, "eos_token_id": 2, "initializer_range": 0.1,
}
"""A tiny Llama ``config.json`` without ``vocab_size`` (the test adds the size of its tokenizer)."""


def lora_fit_args(tmp_path: Path, tok: Path, stage: int, nproc: int) -> list[str]:
    """``fit lora`` arguments for the files of the ``lora_files`` fixture (``tmp_path/llama.json``,
    ``tmp_path/train.jsonl``) and tokenizer ``tok``: 4 fp32 steps of micro-batch 4 under ZeRO ``stage`` on
    ``nproc`` processes, one log row a step, the run in ``tmp_path/run``."""
    return ["fit", "lora", "--model.init", "random", "--model.config", str(tmp_path / "llama.json"),
            "--model.tokenizer", str(tok), "--model.lora_r", "4", "--data.train_path", str(tmp_path / "train.jsonl"),
            "--data.max_length", "32", "--strategy.zero_stage", str(stage), "--precision.dtype", "fp32",
            "--optimizer.lr", "5e-3", "--trainer.micro_batch_size", "4", "--trainer.max_steps", "4",
            "--trainer.log_every_steps", "1", "--trainer.num_workers", "0", "--trainer.output_dir", str(tmp_path),
            "--trainer.run_name", "run", "--launch.nproc_per_node", str(nproc), "--logging.progress_bar", "false"]


def fake_probe(device: str = "cuda", act_per_sample: float | None = None, ckpt_per_sample: float | None = None,
               gpu_total: float | None = None):
    """A :class:`zerotrain.plan.probe.Probe` with round numbers instead of measurements: 0.5 GiB of activations
    plus ``act_per_sample`` (default 1 GiB) per sample, ``ckpt_per_sample`` (default 0.25 GiB) with activation
    checkpointing, a GPU of ``gpu_total`` bytes (default 80 GiB) when ``device`` is "cuda"."""
    from zerotrain.plan.memory import GIB
    from zerotrain.plan.probe import Linear, Probe

    act_per_sample = 1 * GIB if act_per_sample is None else act_per_sample
    ckpt_per_sample = 0.25 * GIB if ckpt_per_sample is None else ckpt_per_sample
    gpu_total = 80 * GIB if gpu_total is None else gpu_total
    return Probe(device=device, device_name="test", precision="bf16", method="test", seq_len=512,
                 activations={"off": Linear(0.5 * GIB, act_per_sample), "on": Linear(0.5 * GIB, ckpt_per_sample)},
                 forward_backward_s={"off": Linear(0.01, 0.002), "on": Linear(0.013, 0.0027)},
                 optimizer_step_s=0.003, host_base_bytes=2 * GIB,
                 gpu_total_bytes=gpu_total if device == "cuda" else None, gpu_context_bytes=0.5 * GIB,
                 h2d_bytes_per_s=20e9 if device == "cuda" else None)


# --- toy runs and what they leave ------------------------------------------------------------------------------

def toy_config(tmp_path: Path, run_name: str, **strategy):
    """A toy run in ``tmp_path/run_name``: 48 examples, micro-batch 8 and 2 accumulation steps (3 optimizer
    steps an epoch, so resumes land mid-epoch), 8 steps, a log row every step, a StepLR in steps.
    ``strategy`` sets ``--strategy.KEY`` fields (``precision`` sets ``--precision.dtype``)."""
    from zerotrain.tasks.toy import ToyConfig

    cfg = ToyConfig()
    cfg.data.num_examples = 48
    cfg.trainer.micro_batch_size = 8
    cfg.trainer.max_steps = 8
    cfg.trainer.log_every_steps = 1
    cfg.trainer.num_workers = 0
    cfg.trainer.output_dir = str(tmp_path)
    cfg.trainer.run_name = run_name
    cfg.logging.progress_bar = False
    cfg.strategy.gradient_accumulation_steps = 2
    # StepLR in steps: the schedule has state to restore but does not depend on max_steps.
    cfg.scheduler.name, cfg.scheduler.step_unit, cfg.scheduler.step_size, cfg.scheduler.gamma = "step", "steps", 3, 0.5
    cfg.optimizer.lr = 1e-2
    for key, value in strategy.items():
        if key == "precision":  # its own section since the config split
            cfg.precision.dtype = value
            continue
        assert hasattr(cfg.strategy, key), f"--strategy.{key} does not exist"
        setattr(cfg.strategy, key, value)
    return cfg


def train_log(run_dir: Path) -> dict[int, dict]:
    """The training rows of ``run_dir/metrics.jsonl`` (those with a ``train_loss``) by step."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "train_loss" in r}


def write_run(run: Path, task, model) -> Path:
    """A run folder as ``zerotrain fit`` leaves it: hparams.json (recipe + config), model/ from Task.export,
    an empty checkpoints/. Returns ``run``."""
    (run / "checkpoints").mkdir(parents=True)
    (run / "hparams.json").write_text(json.dumps({"recipe": task.name, **task.cfg.to_dict()}, indent=2))
    task.export(model, model.state_dict(), run / "model")
    return run


def imdb_task(tokenizer: Path):
    """An IMDB task with a tiny sentiment model (max_len 16) and the tokenizer folder ``tokenizer``."""
    from zerotrain.tasks.imdb import IMDBConfig, IMDBTask, SentimentModelConfig

    cfg = IMDBConfig(model=SentimentModelConfig(embed_dim=32, hidden_dim=64, num_heads=4, num_layers=1, max_len=16))
    cfg.data.tokenizer = str(tokenizer)
    return IMDBTask(cfg)


class RecordOps(TorchDispatchMode):
    """The aten ops run inside ``with RecordOps() as rec:``, in order, in ``rec.ops``."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


class Evil:
    """Unpickling this creates ``path``: what a crafted checkpoint file would do instead."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@contextlib.contextmanager
def file_size_limit(limit: int):
    """Writes past ``limit`` bytes of any file fail in the kernel (RLIMIT_FSIZE: write(2) returns EFBIG, which
    zerotrain treats as a full disk, as it does ENOSPC). Real failing writes, without privileges, a small
    filesystem or a fake file object. SIGXFSZ, which would end the process, is ignored meanwhile."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def tiny_llama_lm(tmp_path: Path, tok: Path, run: str, steps: int):
    """A ``CausalLMConfig`` of the tiny ``LLAMA`` (``tmp_path/llama.json``, sized to ``tok``) trained on 48 short lines of
    ``WORDS`` (``tmp_path/train.txt``): micro-batch 2 of 32 tokens, ``steps`` steps logged each, lr 1e-2, into
    ``tmp_path/run``; the caller sets the strategy and the checkpoints."""
    from zerotrain.tasks.causal_lm import CausalLMConfig

    (tmp_path / "llama.json").write_text(json.dumps(dict(LLAMA, vocab_size=64)))
    (tmp_path / "train.txt").write_text(
        "\n".join(" ".join(WORDS[(i * 7 + j * 3) % 12] for j in range(4 + i % 5)) for i in range(48)) + "\n")
    cfg = CausalLMConfig()
    cfg.model.init, cfg.model.config, cfg.model.tokenizer = "random", str(tmp_path / "llama.json"), str(tok)
    cfg.data.train_path, cfg.data.seq_len, cfg.data.cache_dir = str(tmp_path / "train.txt"), 32, str(tmp_path / "c")
    cfg.trainer.micro_batch_size, cfg.trainer.max_steps, cfg.trainer.log_every_steps = 2, steps, 1
    cfg.trainer.num_workers, cfg.trainer.output_dir, cfg.trainer.run_name = 0, str(tmp_path), run
    cfg.logging.progress_bar, cfg.logging.tensorboard, cfg.optimizer.lr = False, False, 1e-2
    return cfg
