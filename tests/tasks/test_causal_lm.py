"""The causal-lm recipe on tiny random Hugging Face models made here from configs: packing, training under
every engine, exact resume, the exported folder, SFT and chat data, LoRA through the same recipe."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import REPO, WORDS, train_log, zerotrain_cmd

from zerotrain.data.collate import IGNORE_INDEX
from zerotrain.data.lm import collate_packed, pack
from zerotrain.tasks.causal_lm import CausalLMConfig, CausalLMTask
from zerotrain.train.loop import fit

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=128, bos_token_id=0, pad_token_id=1, eos_token_id=2)
CONFIGS = {
    "llama": dict(SMALL, model_type="llama", num_key_value_heads=2),
    "qwen2": dict(SMALL, model_type="qwen2", num_key_value_heads=2),
    "mistral": dict(SMALL, model_type="mistral", num_key_value_heads=2),
    "gpt2": dict(model_type="gpt2", vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=128, bos_token_id=0,
                 eos_token_id=2),
    "gpt_neox": dict(SMALL, model_type="gpt_neox"),
}
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} \n{% endfor %}"
                 "{% if add_generation_prompt %}assistant : {% endif %}")


def _sentence(i: int, n: int = 6) -> str:
    return " ".join(WORDS[(i * 7 + j * 3) % 12] for j in range(n))


@pytest.fixture()
def files(tmp_path, tiny_tokenizer_dir):
    for name, config in CONFIGS.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(config))
    (tmp_path / "train.txt").write_text("\n".join(_sentence(i, 4 + i % 5) for i in range(48)) + "\n")
    (tmp_path / "val.txt").write_text("\n".join(_sentence(i + 100, 5) for i in range(8)) + "\n")
    records = [{"input": _sentence(i, 3), "target": _sentence(i + 1, 2)} for i in range(24)]
    (tmp_path / "sft.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    chats = [{"messages": [{"role": "user", "content": _sentence(i, 3)},
                           {"role": "assistant", "content": _sentence(i + 2, 2)}]} for i in range(24)]
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps(r) for r in chats) + "\n")
    return tmp_path, tiny_tokenizer_dir


def config(tmp_path: Path, tok: Path, model: str = "llama", run_name: str = "run", steps: int = 8,
           **strategy) -> CausalLMConfig:
    cfg = CausalLMConfig()
    cfg.model.init, cfg.model.config, cfg.model.tokenizer = "random", str(tmp_path / f"{model}.json"), str(tok)
    cfg.data.train_path, cfg.data.val_path = str(tmp_path / "train.txt"), str(tmp_path / "val.txt")
    cfg.data.seq_len, cfg.data.cache_dir = 32, str(tmp_path / "cache")
    cfg.trainer.micro_batch_size, cfg.trainer.max_steps, cfg.trainer.log_every_steps = 2, steps, 1
    cfg.trainer.eval_every_steps = 0
    cfg.trainer.num_workers, cfg.trainer.output_dir, cfg.trainer.run_name = 0, str(tmp_path), run_name
    cfg.logging.progress_bar, cfg.logging.tensorboard = False, False
    cfg.optimizer.lr = 1e-2
    cfg.checkpoint.every_steps = 4
    for key, value in strategy.items():
        setattr(cfg.strategy, key, value)
    return cfg





def test_pack_restarts_positions_and_masks_each_documents_first_label():
    examples = [{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}, {"input_ids": [8, 9], "labels": [IGNORE_INDEX, 9]},
                {"input_ids": list(range(10, 17)), "labels": list(range(10, 17))}]
    rows = pack(examples, seq_len=6, pad_token_id=1)
    assert rows.input_ids.tolist() == [[5, 6, 7, 8, 9, 1], [10, 11, 12, 13, 14, 15]]
    assert rows.position_ids.tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]]
    assert rows.labels.tolist() == [[-100, 6, 7, -100, 9, -100], [-100, 11, 12, 13, 14, 15]]
    assert rows.tokens.tolist() == [5, 6]  # the one-token piece [16] left over is no example: dropped


@pytest.mark.parametrize("model", list(CONFIGS))
def test_a_packed_document_sees_only_itself(files, model):
    """The logits of a document packed after another equal those of the document alone: positions restart and
    attention stays within it."""
    tmp_path, tok = files
    task = CausalLMTask(config(tmp_path, tok, model))
    torch.manual_seed(0)
    m = task.build_model().eval()
    rows = pack([{"input_ids": [0, 5, 6, 7, 2], "labels": [0] * 5}, {"input_ids": [0, 9, 10, 11, 12, 2],
                                                                       "labels": [0] * 6}], 16, 1)
    batch = collate_packed([rows[0]])
    with torch.no_grad():
        packed = task._forward(m, batch, labels=False).logits[0, 5:11]
        alone = m(input_ids=torch.tensor([[0, 9, 10, 11, 12, 2]]), use_cache=False).logits[0]
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_without_the_document_mask_a_row_is_one_causal_sequence(files, attention):
    """--data.document_mask false: a document packed after another sees it (positions run on over the row), as
    one unpacked sequence of the row's tokens does; --model.attn_implementation reaches the model."""
    tmp_path, tok = files
    cfg = config(tmp_path, tok)
    cfg.data.document_mask, cfg.model.attn_implementation = False, attention
    task = CausalLMTask(cfg)
    torch.manual_seed(0)
    m = task.build_model().eval()
    assert m.config._attn_implementation == attention
    rows = pack([{"input_ids": [0, 5, 6, 7, 2], "labels": [0] * 5}, {"input_ids": [0, 9, 10, 11, 12, 2],
                                                                       "labels": [0] * 6}], 16, 1)
    batch = collate_packed([rows[0]])
    with torch.no_grad():
        row = task._forward(m, batch, labels=False).logits[0, :11]
        whole = m(input_ids=batch["input_ids"][:, :11], use_cache=False).logits[0]
        alone = m(input_ids=torch.tensor([[0, 9, 10, 11, 12, 2]]), use_cache=False).logits[0]
    torch.testing.assert_close(row, whole, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(row[5:11], alone, rtol=1e-3, atol=1e-4)

@pytest.mark.parametrize("model", [pytest.param(m, marks=() if m == "llama" else pytest.mark.slow) for m in CONFIGS])
def test_each_architecture_trains_and_its_export_loads_with_the_same_logits(files, model):
    from transformers import AutoModelForCausalLM

    from zerotrain.runtime.rundir import load_run

    tmp_path, tok = files
    cfg = config(tmp_path, tok, model, steps=6, backend="ddp")
    cfg.checkpoint.every_steps, cfg.data.val_path = 0, None
    result = fit(CausalLMTask(cfg))
    log = train_log(result.run_dir)
    assert log[6]["train_loss"] < log[1]["train_loss"] - 0.3, (log[1], log[6])

    folder = result.run_dir / "model"
    assert (folder / "generation_config.json").is_file() and (folder / "tokenizer.json").is_file()
    hf_model = AutoModelForCausalLM.from_pretrained(folder).eval()
    run = load_run(result.run_dir)
    x = torch.tensor([[0, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        torch.testing.assert_close(hf_model(input_ids=x).logits, run.model(input_ids=x).logits)
    assert len(run.task.predict(run.model, ["the movie"], max_new_tokens=4)) == 1


STRATEGIES = {"zero0": dict(zero_stage=0), "zero1": dict(zero_stage=1), "zero2": dict(zero_stage=2),
              "zero3": dict(zero_stage=3), "plain": dict(backend="ddp")}


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == "zero2" else pytest.mark.slow)
                                  for n in STRATEGIES])
def test_resume_is_exact(files, name):
    tmp_path, tok = files
    strategy = STRATEGIES[name]
    straight = fit(CausalLMTask(config(tmp_path, tok, run_name="straight", **strategy)))
    fit(CausalLMTask(config(tmp_path, tok, run_name="split", steps=4, **strategy)))
    again = config(tmp_path, tok, run_name="split", **strategy)
    again.checkpoint.resume = "auto"
    resumed = fit(CausalLMTask(again))
    a, b = train_log(straight.run_dir), train_log(resumed.run_dir)
    assert sorted(a) == sorted(b) == list(range(1, 9))
    for step in range(1, 9):
        assert b[step]["train_loss"] == a[step]["train_loss"], f"step {step}: loss differs after resume"
    assert a[8]["train_loss"] < a[1]["train_loss"]


@pytest.mark.parametrize("fmt,pack_rows", [("sft", True), ("sft", False), ("chat", True)])
def test_sft_and_chat_mask_the_prompt(files, fmt, pack_rows):
    tmp_path, tok = files
    cfg = config(tmp_path, tok)
    cfg.data.train_path = str(tmp_path / f"{fmt}.jsonl")
    cfg.data.val_path = None
    cfg.data.pack = pack_rows
    cfg.data.chat_template = CHAT_TEMPLATE
    task = CausalLMTask(cfg)
    train = task.build_datasets().train
    assert task._format(cfg.data.train_path) == fmt  # found from the records (format auto)
    batch = task.collator()([train[0], train[1]])
    targets = batch["labels"] != IGNORE_INDEX
    assert 0 < int(targets.sum()) < int((batch["input_ids"] != task.tokenizer.pad_token_id).sum())
    # The first record's target words are learned, its prompt words are not.
    first = task.tokenizer(_sentence(0, 3), add_special_tokens=False)["input_ids"]
    answer = task.tokenizer(_sentence(1 if fmt == "sft" else 2, 2), add_special_tokens=False)["input_ids"]
    labels = batch["labels"][0].tolist()
    ids = batch["input_ids"][0].tolist()
    start = next(i for i in range(len(ids)) if ids[i:i + len(first)] == first)
    assert all(label == IGNORE_INDEX for label in labels[start:start + len(first)])
    end = next(i for i in range(start, len(ids)) if ids[i:i + len(answer)] == answer)
    assert labels[end:end + len(answer)] == answer


def test_lora_through_the_recipe_exports_the_merged_model(files):
    from transformers import AutoModelForCausalLM

    tmp_path, tok = files
    cfg = config(tmp_path, tok, steps=4, backend="ddp")
    cfg.model.lora.r, cfg.model.lora.target_modules = 4, ["q_proj", "v_proj"]
    cfg.optimizer.lr = 5e-2
    task = CausalLMTask(cfg)
    result = fit(task)
    folder = result.run_dir / "model"
    assert (folder / "adapter" / "adapter_config.json").is_file()
    merged = AutoModelForCausalLM.from_pretrained(folder).eval()
    from zerotrain.runtime.rundir import load_run

    run = load_run(result.run_dir)
    x = torch.tensor([[0, 5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=x).logits, run.model(input_ids=x).logits, rtol=1e-4, atol=1e-5)
    lora = task.lora_settings()
    assert lora is not None and lora.r == 4


def test_flops_per_token_counts_weights_and_attention(files):
    tmp_path, tok = files
    task = CausalLMTask(config(tmp_path, tok))
    model = task.build_model()
    embedding = model.get_input_embeddings().weight.numel()
    n = sum(p.numel() for p in model.parameters()) - embedding  # the lookup is no matmul; the head is untied
    assert task.flops_per_token(model) == 6 * n + 12 * 2 * 32 * 32


def unkept(tmp_path: Path) -> Path:
    """A DeepSpeed file under which ZeRO-3 partitions every weight: by default it keeps those under 1e5 elements, all of
    a tiny model's, whole on every rank, and a gather of them is no collective."""
    path = tmp_path / "zero3_no_persistent.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}))
    return path


def two_rank_zero3_fit(tmp_path: Path, tok: Path, model: str, run_name: str, steps: int, *extra: str) -> list[str]:
    """``zerotrain fit causal-lm`` of the ``files`` fixture's ``model`` on two ZeRO-3 ranks, as a user types it."""
    return ["fit", "causal-lm", "--model.init", "random", "--model.config", str(tmp_path / f"{model}.json"),
            "--model.tokenizer", str(tok), "--data.train_path", str(tmp_path / "train.txt"), "--data.seq_len", "32",
            "--data.cache_dir", str(tmp_path / "cache"), "--strategy.zero_stage", "3", "--trainer.micro_batch_size",
            "2", "--trainer.max_steps", str(steps), "--trainer.num_workers", "0", "--trainer.output_dir", str(tmp_path),
            "--trainer.run_name", run_name, "--launch.nproc_per_node", "2", "--logging.progress_bar", "false", *extra]


@pytest.mark.slow
def test_two_processes_train_under_zero3(files):
    tmp_path, tok = files
    args = two_rank_zero3_fit(tmp_path, tok, "llama", "two", 6, "--optimizer.lr", "1e-2",
                              "--trainer.log_every_steps", "1")
    out = zerotrain_cmd(args, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    log = train_log(tmp_path / "two")
    assert log[6]["train_loss"] < log[1]["train_loss"]
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(tmp_path / "two" / "model").config.model_type == "llama"


@pytest.mark.data
@pytest.mark.slow
def test_gutenberg_slice_pretrains(shared_data, tmp_path, tiny_tokenizer_dir):
    """A tiny random Llama on the first Gutenberg lines, with the shipped RoBERTa tokenizer: the loss falls."""
    from zerotrain.data.text import read_text_lines

    lines = read_text_lines(str(shared_data / "gutenberg" / "train.txt.xz"), max_lines=400)
    (tmp_path / "train.txt").write_text("\n".join(lines) + "\n")
    cfg = config(tmp_path, REPO / "examples" / "data" / "roberta-tokenizer", steps=12, backend="ddp")
    cfg.model.config = str(REPO / "configs" / "tiny_llama_config.json")
    cfg.data.val_path, cfg.data.seq_len = None, 64
    cfg.trainer.micro_batch_size = 4
    result = fit(CausalLMTask(cfg))
    log = train_log(result.run_dir)
    assert log[12]["train_loss"] < log[1]["train_loss"]


@pytest.mark.parametrize("lora", [False, True])
def test_export_format_hf_writes_a_checkpoint_as_the_run_writes_its_model(files, lora):
    """``zerotrain export --format hf`` of the last checkpoint gives the folder the finished run wrote itself."""
    from transformers import AutoModelForCausalLM

    from zerotrain.checkpoint.export import export_run

    tmp_path, tok = files
    cfg = config(tmp_path, tok, steps=4, backend="ddp")
    cfg.data.val_path = None
    if lora:
        cfg.model.lora.r, cfg.model.lora.target_modules = 4, ["q_proj", "v_proj"]
    result = fit(CausalLMTask(cfg))
    out = export_run(result.run_dir, out=tmp_path / "hf", fmt="hf")
    assert "config.json" in out.files and "generation_config.json" in out.files
    x = torch.tensor([[0, 5, 6, 7, 8]])
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    finished = AutoModelForCausalLM.from_pretrained(result.run_dir / "model").eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=x).logits, finished(input_ids=x).logits)


def test_streamed_resume_continues_at_the_exact_row(files):
    """--data.streaming: a run stopped after 4 steps and resumed logs bitwise the losses of one that never stopped,
    across the end of the stream (the epoch turns at step 6 or so), and the checkpoint holds the stream's offset."""
    tmp_path, tok = files

    def streamed(run_name, steps):
        cfg = config(tmp_path, tok, run_name=run_name, steps=steps, zero_stage=2)
        cfg.data.streaming, cfg.data.val_path = True, None
        return cfg

    straight = fit(CausalLMTask(streamed("straight", 10)))
    fit(CausalLMTask(streamed("split", 4)))
    saved = json.loads(next((tmp_path / "split").glob("checkpoints/step00000004/*.json")).read_text())
    assert saved.get("stream_offset") and saved["stream_offset"][1] > 0, saved
    again = streamed("split", 10)
    again.checkpoint.resume = "auto"
    resumed = fit(CausalLMTask(again))
    a, b = train_log(straight.run_dir), train_log(resumed.run_dir)
    assert sorted(a) == sorted(b) == list(range(1, 11))
    for step in range(1, 11):
        assert b[step]["train_loss"] == a[step]["train_loss"], f"step {step}: loss differs after a streamed resume"


def test_a_run_predicts_and_exports_after_its_pretrained_model_folder_is_gone(files, capsys):
    """predict and export rebuild the model from the run's own model/config.json, not from --model.name_or_path."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from zerotrain.checkpoint.export import export_run
    from zerotrain.cli import main
    from zerotrain.runtime.rundir import load_run

    tmp_path, tok = files
    source = tmp_path / "pretrained"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**CONFIGS["llama"])).save_pretrained(source)
    cfg = config(tmp_path, tok, steps=2, backend="ddp")
    cfg.model.init, cfg.model.config, cfg.model.name_or_path = "pretrained", None, str(source)
    cfg.checkpoint.every_steps, cfg.data.val_path = 2, None
    result = fit(CausalLMTask(cfg))
    source.rename(tmp_path / "moved")
    capsys.readouterr()

    assert main(["predict", str(result.run_dir), "the movie", "--max_new_tokens", "3"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].endswith("\tthe movie")
    out = export_run(result.run_dir, out=tmp_path / "hf", fmt="hf")
    x = torch.tensor([[0, 5, 6, 7, 8]])
    exported = AutoModelForCausalLM.from_pretrained(out.out_dir).eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=x).logits, load_run(result.run_dir).model(input_ids=x).logits)


@pytest.mark.parametrize("tag", ["{% break %}", "{% continue %}", "{% generation %}{% endgeneration %}"])
def test_a_chat_template_with_transformers_own_tags_is_taken(files, tag):
    """Loop controls and ``{% generation %}`` (the assistant-mask tag) are Jinja that transformers renders: the
    template is accepted before any record is read, and renders a conversation."""
    tmp_path, tok = files
    cfg = config(tmp_path, tok)
    cfg.data.chat_template = ("{% for m in messages %}{{ m['content'] }} {% if loop.index > 5 %}" + tag
                              + "{% endif %}{% endfor %}")
    rendered = CausalLMTask(cfg)._chat_tokenizer().apply_chat_template(
        [{"role": "user", "content": _sentence(0, 3)}], tokenize=False)
    assert rendered.strip() == _sentence(0, 3)


@pytest.mark.parametrize("model", ["gpt2", pytest.param("llama", marks=pytest.mark.slow)])
def test_a_zero3_export_reads_the_weights_one_shard_at_a_time_and_writes_what_save_pretrained_writes(
        files, model, monkeypatch):
    """Under ZeRO-3 the end-of-run export gathers each tensor when its shard is written, never the whole model:
    between two shards written, exactly the next shard's tensors were read. The folder holds the tensors of the
    run's last checkpoint (exported from its files apart), under the names and with the config ``save_pretrained``
    writes for them (tied copies left out: GPT-2 ties its output layer to its embedding)."""
    import deepspeed
    import safetensors.torch
    from transformers import AutoModelForCausalLM

    import zerotrain.models.hf
    from zerotrain.checkpoint.export import export_run
    from zerotrain.checkpoint.weights import GatheredStateDict

    events: list[tuple[str, object]] = []
    read, save = GatheredStateDict.__getitem__, safetensors.torch.save_file
    monkeypatch.setattr(GatheredStateDict, "__getitem__", lambda self, k: events.append(("read", k)) or read(self, k))
    monkeypatch.setattr(safetensors.torch, "save_file",
                        lambda shard, path, **kw: events.append(("save", set(shard))) or save(shard, path, **kw))
    monkeypatch.setattr(zerotrain.models.hf, "DEFAULT_MAX_SHARD_SIZE", 20_000)  # bytes: several shards
    gather = deepspeed.zero.GatheredParameters
    monkeypatch.setattr(deepspeed.zero, "GatheredParameters",
                        lambda params, **kw: events.append(("gather", len(params))) or gather(params, **kw))
    tmp_path, tok = files
    cfg = config(tmp_path, tok, model, steps=2, zero_stage=3, deepspeed_config=str(unkept(tmp_path)))
    cfg.checkpoint.every_steps, cfg.data.val_path = 0, None
    result = fit(CausalLMTask(cfg))

    events = events[next(i for i, (kind, _) in enumerate(events) if kind == "read"):]  # the export's
    # Every tensor read was gathered on its own: the weights are all partitioned here
    gathers = [n for kind, n in events if kind == "gather"]
    assert gathers and set(gathers) == {1} and len(gathers) == sum(kind == "read" for kind, _ in events)
    events = [e for e in events if e[0] != "gather"]
    saves = [i for i, (kind, _) in enumerate(events) if kind == "save"]
    assert len(saves) >= 3
    start = 0
    for i in saves:
        assert {name for _, name in events[start:i]} == events[i][1], "a shard's tensors were read apart from it"
        start = i + 1
    folder = result.run_dir / "model"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    written = {**{k: v for shard in sorted(set(index["weight_map"].values()))
                  for k, v in safetensors.torch.load_file(folder / shard).items()}}
    # The same weights from the final checkpoint's files (fp32: the 16-bit weights are the fp32 masters), written by
    # transformers' own save_pretrained
    export_run(result.run_dir, out=tmp_path / "from_checkpoint", fmt="hf")
    reference = tmp_path / "reference"
    AutoModelForCausalLM.from_pretrained(tmp_path / "from_checkpoint").save_pretrained(reference)
    expected = safetensors.torch.load_file(reference / "model.safetensors")
    assert sorted(written) == sorted(expected)
    for name in expected:
        torch.testing.assert_close(written[name], expected[name], rtol=0, atol=0, msg=name)
    ours, theirs = (json.loads((f / "config.json").read_text()) for f in (folder, reference))
    assert {k: v for k, v in ours.items() if k != "transformers_version"} == \
        {k: v for k, v in theirs.items() if k != "transformers_version"}


@pytest.mark.slow  # two ZeRO-3 ranks through `python -m zerotrain`
def test_a_two_rank_zero3_run_exports_its_model_as_its_last_checkpoint_exports(files):
    """With two ranks, rank 0 writes the Hugging Face folder while the other rank joins each tensor's gather (every
    weight partitioned: a rank that did not join would leave rank 0 in its all-gather): the folder holds what
    ``zerotrain export --format hf`` makes of the last checkpoint (GPT-2: tied weights)."""
    from transformers import AutoModelForCausalLM

    tmp_path, tok = files
    args = two_rank_zero3_fit(tmp_path, tok, "gpt2", "r", 3, "--strategy.deepspeed_config", str(unkept(tmp_path)))
    fitted = zerotrain_cmd(args, cwd=tmp_path)
    assert fitted.returncode == 0, fitted.stderr[-3000:]
    assert "[zerotrain] export: wrote" in fitted.stderr and "gathered whole" not in fitted.stderr  # a shard at a time
    exported = zerotrain_cmd(["export", str(tmp_path / "r"), "--out", str(tmp_path / "e"), "--format", "hf"],
                             cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr[-3000:]
    x = torch.tensor([[0, 5, 6, 7, 8, 9]])
    finished = AutoModelForCausalLM.from_pretrained(tmp_path / "r" / "model").eval()
    from_checkpoint = AutoModelForCausalLM.from_pretrained(tmp_path / "e").eval()
    with torch.no_grad():
        torch.testing.assert_close(finished(input_ids=x).logits, from_checkpoint(input_ids=x).logits, rtol=0, atol=0)
