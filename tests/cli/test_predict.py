"""``zerotrain predict`` for every recipe, through rundir.load_run and Task.predict.

Fast tests use run folders written the way a fit leaves them (hparams.json + Task.export); the slow
ones train tiny mlm, lora and imdb runs through the real loop first.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import WORDS, imdb_task, write_run, zerotrain_cmd

from zerotrain.cli import main
from zerotrain.errors import UserError
from zerotrain.runtime.rundir import load_run
from zerotrain.tasks.mlm import MLMConfig, MLMDataConfig, MLMModelConfig, MLMTask
from zerotrain.tasks.toy import ToyConfig, ToyTask

LLAMA = {
    "model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 128, "vocab_size": 64,
    "bos_token_id": 0, "pad_token_id": 1, "eos_token_id": 2, "initializer_range": 0.1,
}


def _out_lines(capsys) -> list[list[str]]:
    # Not strip(): a prediction may be empty (a continuation that starts with EOS), the line then starts with a tab.
    return [line.split("\t") for line in capsys.readouterr().out.rstrip("\n").split("\n")]


def _fill_mask(line: str) -> list[list[tuple[str, float]]]:
    """``tok p, tok p | tok p, ...`` -> per mask, the (token, probability) candidates."""
    groups = []
    for group in line.split(" | "):
        pairs = [item.rsplit(" ", 1) for item in group.split(", ")]
        groups.append([(tok, float(p)) for tok, p in pairs])
    return groups


def _greedy(model, tok, prompt_ids: list[int], n: int) -> str:
    """Greedy decoding by hand (no KV cache, no generate()): the reference for the lora prediction."""
    ids = list(prompt_ids)
    new = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]  # (V,)
            nxt = int(logits.argmax())
            if nxt == tok.eos_token_id:
                break
            ids.append(nxt)
            new.append(nxt)
    return tok.decode(new, skip_special_tokens=True)


# ---- imdb ----------------------------------------------------------------------------------

def test_imdb_prints_label_probability_and_snippet(tmp_path, tiny_tokenizer_dir, capsys):
    task = imdb_task(tiny_tokenizer_dir)
    torch.manual_seed(0)
    model = task.build_model().eval()
    run = write_run(tmp_path / "imdb.run", task, model)
    texts = ["a great movie<br />loved it", "awful boring plot " * 10]
    (tmp_path / "more.txt").write_text("good\n\nbad\n")
    assert main(["predict", str(run), *texts, "--file", str(tmp_path / "more.txt")]) == 0
    lines = _out_lines(capsys)
    expected = task.classify(model, texts + ["good", "bad"])
    assert [label for label, _, _ in lines] == [label for label, _ in expected]
    assert [float(p) for _, p, _ in lines] == pytest.approx([p for _, p in expected], abs=5e-4)
    assert [s for _, _, s in lines] == ["a great movie<br />loved it", ("awful boring plot " * 10)[:57] + "...",
                                        "good", "bad"]


# ---- mlm -----------------------------------------------------------------------------------

@pytest.fixture()
def mlm_run(tmp_path, tiny_tokenizer_dir):
    cfg = MLMConfig(model=MLMModelConfig(num_layers=1, num_heads=2, h_dim=16, ff_dim=32, max_seq_length=16),
                    data=MLMDataConfig(train_path="unused.txt", tokenizer=str(tiny_tokenizer_dir)))
    task = MLMTask(cfg)
    torch.manual_seed(0)
    model = task.build_model().eval()
    return write_run(tmp_path / "mlm.run", task, model), task, model


def _check_fill_mask(line: str, text: str, task: MLMTask, model, k: int) -> None:
    tok = task.tokenizer
    ids = torch.tensor([tok(text)["input_ids"]])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids))["logits"][0]  # (T, V)
    positions = (ids[0] == tok.mask_token_id).nonzero().flatten().tolist()
    groups = _fill_mask(line)
    assert len(groups) == len(positions) >= 1
    for pos, group in zip(positions, groups):
        probs, top = logits[pos].softmax(-1).topk(k)
        assert [t for t, _ in group] == [tok.decode([j]).strip() for j in top.tolist()]
        assert [p for _, p in group] == pytest.approx(probs.tolist(), abs=5e-4)


def test_mlm_fills_every_mask_with_the_top_k(mlm_run, capsys):
    run, task, model = mlm_run
    texts = ["the movie was <mask>", "<mask> acting and a <mask> plot"]
    assert main(["predict", str(run), *texts, "--top_k", "3"]) == 0
    lines = _out_lines(capsys)
    assert [snippet for _, snippet in lines] == texts
    for (line, _), text in zip(lines, texts):
        _check_fill_mask(line, text, task, model, k=3)
    assert [len(g) for g in _fill_mask(lines[1][0])] == [3, 3]


@pytest.mark.slow  # runs `python -m zerotrain predict`
def test_mlm_refuses_a_text_without_mask_and_a_bad_top_k(mlm_run):
    run, _, _ = mlm_run
    loaded = load_run(run)
    with pytest.raises(UserError, match=r"^text 2 has no <mask>: write <mask> where") as info:
        loaded.task.predict(loaded.model, ["a <mask>", "no mask here"])
    assert "\n" not in str(info.value)
    with pytest.raises(UserError, match=r"^text 1 is 17 tokens long .* 16 .*--model\.max_seq_length"):
        loaded.task.predict(loaded.model, ["<mask> " + "a " * 14])
    out = zerotrain_cmd(["predict", str(run), "the <mask>", "--top_k", "0"], cwd=run.parent)
    assert out.returncode == 2 and out.stderr.strip() == "zerotrain predict: error: --top_k must be >= 1, got 0"


# ---- lora ----------------------------------------------------------------------------------

@pytest.fixture()
def lora_run(tmp_path, tiny_tokenizer_dir):
    from zerotrain.tasks.lora import LoRAConfig, LoRATask

    (tmp_path / "llama.json").write_text(json.dumps(LLAMA))
    cfg = LoRAConfig()
    cfg.model.init, cfg.model.config, cfg.model.tokenizer = "random", str(tmp_path / "llama.json"), str(tiny_tokenizer_dir)
    cfg.model.lora_r = 4
    cfg.data.train_path, cfg.data.template = "unused.jsonl", "review: {input} ->{target}"
    cfg.precision.dtype = "fp32"
    task = LoRATask(cfg)
    torch.manual_seed(cfg.trainer.seed)  # as the loop does just before building the model
    model = task.build_model()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:  # a trained adapter: lora_B is no longer zero
                p.normal_(0.0, 0.5)
    model.eval()
    return write_run(tmp_path / "lora.run", task, model), task, model


def test_lora_load_run_is_base_plus_adapter(lora_run):
    run, _, model = lora_run
    loaded = load_run(run)
    ids = torch.randint(3, 36, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(input_ids=ids).logits, model(input_ids=ids).logits)


def test_lora_generates_greedily_from_the_template(lora_run, capsys):
    run, task, model = lora_run
    texts = ["great movie", "the plot was bad"]
    assert main(["predict", str(run), *texts, "--max_new_tokens", "6"]) == 0
    lines = _out_lines(capsys)
    assert len(lines) == len(texts), lines  # zip() below would stop at the shorter one
    tok = task.tokenizer
    for (generated, snippet), text in zip(lines, texts):
        assert snippet == text
        prompt = [tok.bos_token_id] + tok(f"review: {text} ->", add_special_tokens=False)["input_ids"]
        expected = _greedy(model, tok, prompt, 6)
        assert generated == expected
        assert len(tok(generated, add_special_tokens=False)["input_ids"]) <= 6


def test_lora_adapter_missing(lora_run):
    run, _, _ = lora_run
    shutil.rmtree(run / "model" / "adapter")
    with pytest.raises(UserError, match=r"adapter_config\.json is missing: the run did not finish exporting"):
        load_run(run)


# ---- errors --------------------------------------------------------------------------------

@pytest.mark.slow  # runs `python -m zerotrain predict`
def test_a_recipe_without_predictions_says_so(tmp_path):
    task = ToyTask(ToyConfig())
    run = write_run(tmp_path / "toy.run", task, task.build_model())
    out = zerotrain_cmd(["predict", str(run), "anything"], cwd=tmp_path)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip() == (f"zerotrain predict: error: {run} is a run of the toy recipe, which has nothing to "
                                  f"predict (zerotrain predict knows imdb, mlm, lora, causal-lm and classify); its weights are in {run}/model, "
                                  f"or write them with zerotrain export {run}")


@pytest.mark.slow  # runs `python -m zerotrain predict`
def test_moved_tokenizer_asks_for_tokenizer_and_works_with_it(tmp_path, tiny_tokenizer_dir, capsys):
    tok = tmp_path / "tokenizer"
    shutil.copytree(tiny_tokenizer_dir, tok)
    task = imdb_task(tok)
    model = task.build_model().eval()
    run = write_run(tmp_path / "imdb.run", task, model)
    shutil.rmtree(tok)
    out = zerotrain_cmd(["predict", str(run), "good"], cwd=tmp_path)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert str(tok) in out.stderr and "Pass its new place: --tokenizer DIR" in out.stderr
    assert main(["predict", str(run), "good", "--tokenizer", str(tiny_tokenizer_dir)]) == 0
    assert _out_lines(capsys)[0][0] in ("positive", "negative")


@pytest.mark.parametrize("argv,message", [
    (["RUN"], "give texts as arguments or --file TEXTS.txt"),
    (["RUN", "x", "--file", "nope.txt"], "--file: nope.txt not found"),
    (["RUN", "x", "--max_new_tokens", "-1"], "--max_new_tokens must be >= 1, got -1"),
    (["nowhere", "x"], "run folder nowhere does not exist"),
])
def test_cli_errors_are_one_line(tmp_path, capsys, argv, message):
    task = ToyTask(ToyConfig())
    run = write_run(tmp_path / "toy.run", task, task.build_model())
    argv = [str(run) if a == "RUN" else a for a in argv]
    assert main(["predict", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


# ---- real runs -----------------------------------------------------------------------------

TEXT = "the movie was great and i loved the plot but the acting was bad\nit was a very boring film\nthis story is fun\n"


@pytest.mark.slow
def test_predict_on_a_trained_mlm_run(tmp_path, tiny_tokenizer_dir, capsys):
    (tmp_path / "train.txt").write_text(TEXT * 30)
    out = zerotrain_cmd(
        ["fit", "mlm", "--model.num_layers", "1", "--model.num_heads", "2", "--model.h_dim", "16", "--model.ff_dim",
         "32", "--model.max_seq_length", "16", "--data.train_path", str(tmp_path / "train.txt"), "--data.tokenizer",
         str(tiny_tokenizer_dir), "--data.cache_dir", "null", "--trainer.max_steps", "3", "--trainer.micro_batch_size",
         "4", "--trainer.num_workers", "0", "--trainer.device", "cpu", "--trainer.output_dir", str(tmp_path),
         "--trainer.run_name", "mlm", "--logging.progress_bar", "false"], cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    run = tmp_path / "mlm"
    loaded = load_run(run)
    assert loaded.recipe == "mlm" and loaded.cfg.model.h_dim == 16
    capsys.readouterr()
    texts = ["the movie was <mask>", "it was a <mask> <mask> film"]
    assert main(["predict", str(run), *texts]) == 0
    lines = _out_lines(capsys)
    assert [s for _, s in lines] == texts
    for (line, _), text in zip(lines, texts):
        _check_fill_mask(line, text, loaded.task, loaded.model, k=5)


@pytest.mark.slow
def test_predict_on_a_trained_lora_run(tmp_path, tiny_tokenizer_dir, capsys):
    (tmp_path / "llama.json").write_text(json.dumps(LLAMA))
    # One answer for every input: a few steps teach it, so the prediction shows what was learned.
    records = [{"input": f"{WORDS[i % 20]} {WORDS[(i * 7) % 20]}", "target": "great movie great movie"}
               for i in range(32)]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    out = zerotrain_cmd(
        ["fit", "lora", "--model.init", "random", "--model.config", str(tmp_path / "llama.json"), "--model.tokenizer",
         str(tiny_tokenizer_dir), "--model.lora_r", "4", "--data.train_path", str(tmp_path / "train.jsonl"),
         "--data.max_length", "32", "--precision.dtype", "fp32", "--optimizer.lr", "1e-2",
         "--trainer.micro_batch_size", "4", "--trainer.max_steps", "8", "--trainer.num_workers", "0",
         "--trainer.device", "cpu", "--trainer.output_dir", str(tmp_path), "--trainer.run_name", "lora",
         "--logging.progress_bar", "false"], cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    run = tmp_path / "lora"

    # The reference: the run's seeded base model, with peft's own loader for the adapter.
    from peft import PeftModel

    loaded = load_run(run)
    task = loaded.task
    torch.manual_seed(loaded.cfg.trainer.seed)
    reference = PeftModel.from_pretrained(task._load_base(), str(run / "model" / "adapter")).eval()
    assert any(v.abs().sum() > 0 for k, v in reference.state_dict().items() if "lora_B" in k), "training moved lora_B"
    ids = torch.randint(3, 36, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(input_ids=ids).logits, reference(input_ids=ids).logits)

    capsys.readouterr()
    texts = [records[0]["input"], "a boring plot"]
    assert main(["predict", str(run), *texts, "--max_new_tokens", "5"]) == 0
    tok = task.tokenizer
    lines = _out_lines(capsys)
    assert len(lines) == len(texts), lines  # zip() below would stop at the shorter one
    for (generated, snippet), text in zip(lines, texts):
        assert snippet == text
        prompt = [tok.bos_token_id] + tok(f"{text}\n", add_special_tokens=False)["input_ids"]
        assert generated == _greedy(reference, tok, prompt, 5)
        assert generated and set(generated.split()) <= {"great", "movie"}, generated


@pytest.mark.slow
def test_predict_on_a_trained_imdb_run(tmp_path, tiny_tokenizer_dir, capsys):
    """The weights the loop exported (ZeRO-2) are what load_run loads; the CLI prints their classification."""
    from safetensors.torch import load_file

    rows = [{"text": f"{w} movie and {w} plot", "label": int(w in ('great', 'good', 'fun'))}
            for w in ("great", "bad", "good", "awful", "fun", "boring") * 4]
    data = tmp_path / "imdb"
    data.mkdir()
    for split in ("train", "test"):
        (data / f"{split}.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = zerotrain_cmd(
        ["fit", "imdb", "--model.embed_dim", "16", "--model.hidden_dim", "32", "--model.num_heads", "2",
         "--model.num_layers", "1", "--model.max_len", "16", "--data.path", str(data), "--data.tokenizer",
         str(tiny_tokenizer_dir), "--data.cache_dir", "null", "--strategy.zero_stage", "2", "--trainer.max_steps", "2",
         "--trainer.micro_batch_size", "4", "--trainer.num_workers", "0", "--trainer.device", "cpu",
         "--trainer.output_dir", str(tmp_path), "--trainer.run_name", "imdb", "--logging.progress_bar", "false"],
        cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    run = tmp_path / "imdb"
    loaded = load_run(run)
    exported = {k.removeprefix("module."): v for k, v in load_file(str(run / "model" / "model.safetensors")).items()}
    state = loaded.model.state_dict()
    assert exported.keys() == state.keys()
    for key, value in exported.items():
        torch.testing.assert_close(state[key], value.float(), rtol=0, atol=0)
    capsys.readouterr()
    assert main(["predict", str(run), "great movie", "awful plot"]) == 0
    expected = loaded.task.classify(loaded.model, ["great movie", "awful plot"])
    assert [(label, pytest.approx(float(p), abs=5e-4)) for label, p, _ in _out_lines(capsys)] == expected
