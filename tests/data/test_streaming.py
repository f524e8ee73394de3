"""--data.streaming across processes: a share too small for a micro-batch, or a bad record in one share, ends every
process in one line, whoever started the processes."""

from __future__ import annotations

import json

import pytest
from helpers import zerotrain_cmd


def _review(i: int, label: str = "") -> dict:
    return {"text": f"the movie was {'good' if i % 2 else 'bad'} and fun", "label": label or ("pos" if i % 2 else "neg")}


def _classify_args(tmp_path, tokenizer, files: dict[str, list[dict]], steps: int, micro_batch: int = 2) -> list[str]:
    """`fit classify` streaming ``files`` (written into ``tmp_path/parts``) with a tiny random RoBERTa, DDP."""
    (tmp_path / "parts").mkdir()
    for name, rows in files.items():
        (tmp_path / "parts" / name).write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "roberta.json").write_text(json.dumps(dict(
        model_type="roberta", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, max_position_embeddings=80, pad_token_id=1, bos_token_id=0, eos_token_id=2)))
    return ["fit", "classify", "--model.init", "random", "--model.config", str(tmp_path / "roberta.json"),
            "--model.tokenizer", str(tokenizer), "--data.train_path", str(tmp_path / "parts"),
            "--data.streaming", "true", "--data.label_names", "[neg, pos]", "--data.max_length", "16",
            "--data.cache_dir", str(tmp_path / "cache"), "--trainer.micro_batch_size", str(micro_batch),
            "--trainer.max_steps", str(steps), "--trainer.num_workers", "0", "--trainer.output_dir", str(tmp_path),
            "--trainer.run_name", "run", "--strategy.backend", "ddp", "--launch.timeout_minutes", "2",
            "--logging.progress_bar", "false", "--logging.tensorboard", "false"]


def _start_ranks_by_hand(args: list[str], cwd, world_size: int = 2) -> list[tuple[int, str]]:
    """Each rank started as a scheduler starts it (RANK, WORLD_SIZE and MASTER_* set, no zerotrain launcher);
    (exit status, stderr) of each, in rank order. A rank still running after 5 minutes fails the test."""
    import socket
    import subprocess
    import sys

    from helpers import child_env

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = ["-m", "zerotrain", *args]
    procs = [subprocess.Popen([sys.executable, *argv], cwd=cwd, text=True, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE,
                              env=child_env(argv, {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world_size),
                                                   "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                                                   "MASTER_PORT": str(port)}))
             for r in range(world_size)]
    try:
        errs = [p.communicate(timeout=300)[1] for p in procs]
        return [(p.returncode, err) for p, err in zip(procs, errs)]
    finally:
        for p in procs:
            p.kill()


@pytest.mark.slow
def test_a_share_without_a_micro_batch_ends_every_process_in_one_line(tmp_path, tiny_tokenizer_dir):
    """Two files, two processes: each reads one file whole, and the second file holds one record for micro-batches
    of two. Process 0's share yields batches, process 1's none: both stop before the first step (no one waits in
    a collective) with the line naming process 1 and what to do."""
    rows = [_review(i) for i in range(21)]
    args = _classify_args(tmp_path, tiny_tokenizer_dir, {"a.jsonl": rows[:20], "b.jsonl": rows[20:]}, steps=2)
    out = zerotrain_cmd([*args, "--launch.nproc_per_node", "2"], cwd=tmp_path, timeout=420)
    assert out.returncode == 2, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if "--data.streaming" in line]
    assert len(lines) == 1, out.stderr[-3000:]
    assert "share of process(es) 1 of 2" in lines[0] and "more files or rows than processes" in lines[0], lines[0]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]


@pytest.mark.slow
def test_a_bad_record_in_one_share_ends_ranks_a_scheduler_started_in_one_line(tmp_path, tiny_tokenizer_dir):
    """Ranks started without zerotrain's launcher (srun, a Kubernetes pod per rank), which stops no rank when
    another fails: a label outside --data.label_names in the first chunk of rank 1's share ends both ranks before
    the first step, status 2, with the line naming the record said once (by rank 0), instead of rank 0 waiting in
    the step's all-reduce and rank 1 saying nothing."""
    good = [_review(i) for i in range(20)]
    args = _classify_args(tmp_path, tiny_tokenizer_dir, {"a.jsonl": good, "b.jsonl": [_review(0, "maybe"), *good]},
                          steps=2)
    ended = _start_ranks_by_hand(args, tmp_path)
    said = [line for _, err in ended for line in err.splitlines() if "label 'maybe'" in line]
    assert [code for code, _ in ended] == [2, 2], ended
    assert len(said) == 1 and said[0].startswith("zerotrain fit: error: ") and "record 0" in said[0], ended
    assert not any("Traceback" in err for _, err in ended), ended


@pytest.mark.slow
def test_a_bad_record_met_later_is_said_by_the_rank_that_read_it(tmp_path, tiny_tokenizer_dir):
    """Past the first chunk (1000 records), a bad record ends the rank that read it, which says why, while the
    others end as having lost it; under zerotrain's launcher one line says it."""
    good = [_review(i) for i in range(20)]
    args = _classify_args(tmp_path, tiny_tokenizer_dir,
                          {"a.jsonl": good * 60, "b.jsonl": [*(good * 50), _review(0, "maybe"), *good]}, steps=40,
                          micro_batch=50)
    ended = _start_ranks_by_hand(args, tmp_path)
    assert [code for code, _ in ended] == [4, 2], ended
    assert "another rank ended" in ended[0][1] and "label 'maybe'" not in ended[0][1], ended
    assert [line for line in ended[1][1].splitlines() if "label 'maybe'" in line and "record 1000" in line], ended
    out = zerotrain_cmd([*args, "--launch.nproc_per_node", "2"], cwd=tmp_path, timeout=420)
    said = [line for line in out.stderr.splitlines() if "label 'maybe'" in line]
    assert out.returncode == 2 and len(said) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]


def test_documents_skip_missing_and_blank_values_and_name_a_record_that_is_not_text():
    from zerotrain.data.streaming import documents
    from zerotrain.errors import DataError

    def where(i):
        return f"corpus.jsonl: record {i}"

    assert documents(["a b", None, "  ", "c"], [0, 1, 2, 3], "text", where) == ["a b", "c"]
    with pytest.raises(DataError, match=r"^corpus.jsonl: record 7: 'text' must be a string, got int; "
                                        r"set --data.text_field$"):
        documents(["a", 5], [6, 7], "text", where)
