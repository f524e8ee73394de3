"""--data.streaming across processes: shares too small for a micro-batch end every process in one line."""

from __future__ import annotations

import json

import pytest
from helpers import zerotrain_cmd


@pytest.mark.slow
def test_a_share_without_a_micro_batch_ends_every_process_in_one_line(tmp_path, tiny_tokenizer_dir):
    """Two files, two processes: each reads one file whole, and the second file holds one record for micro-batches
    of two. Process 0's share yields batches, process 1's none: both stop before the first step (no one waits in
    a collective) with the line naming process 1 and what to do."""
    rows = [{"text": f"the movie was {'good' if i % 2 else 'bad'} and fun", "label": "pos" if i % 2 else "neg"}
            for i in range(21)]
    (tmp_path / "parts").mkdir()
    (tmp_path / "parts" / "a.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:20]) + "\n")
    (tmp_path / "parts" / "b.jsonl").write_text(json.dumps(rows[20]) + "\n")
    (tmp_path / "roberta.json").write_text(json.dumps(dict(
        model_type="roberta", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, max_position_embeddings=80, pad_token_id=1, bos_token_id=0, eos_token_id=2)))
    args = ["fit", "classify", "--model.init", "random", "--model.config", str(tmp_path / "roberta.json"),
            "--model.tokenizer", str(tiny_tokenizer_dir), "--data.train_path", str(tmp_path / "parts"),
            "--data.streaming", "true", "--data.label_names", "[neg, pos]", "--data.max_length", "16",
            "--data.cache_dir", str(tmp_path / "cache"), "--trainer.micro_batch_size", "2", "--trainer.max_steps", "2",
            "--trainer.num_workers", "0", "--trainer.output_dir", str(tmp_path), "--trainer.run_name", "run",
            "--strategy.backend", "ddp", "--launch.nproc_per_node", "2", "--launch.timeout_minutes", "2",
            "--logging.progress_bar", "false", "--logging.tensorboard", "false"]
    out = zerotrain_cmd(args, cwd=tmp_path, timeout=420)
    assert out.returncode == 2, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if "--data.streaming" in line]
    assert len(lines) == 1, out.stderr[-3000:]
    assert "share of process(es) 1 of 2" in lines[0] and "more files or rows than processes" in lines[0], lines[0]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]


def test_documents_skip_missing_and_blank_values_and_name_a_record_that_is_not_text():
    from zerotrain.data.streaming import documents
    from zerotrain.errors import DataError

    def where(i):
        return f"corpus.jsonl: record {i}"

    assert documents(["a b", None, "  ", "c"], [0, 1, 2, 3], "text", where) == ["a b", "c"]
    with pytest.raises(DataError, match=r"^corpus.jsonl: record 7: 'text' must be a string, got int; "
                                        r"set --data.text_field$"):
        documents(["a", 5], [6, 7], "text", where)
