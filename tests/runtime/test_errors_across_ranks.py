"""An error found on one rank ends every rank the same way: one line from rank 0, exit status 2.

``main_process_first`` / ``run_on_main`` pass a rank's error to the others; the CLI prints a
UserError on rank 0 only; ``spawn_local_workers`` returns the failed worker's status and adds
nothing to a UserError's line (no torchelastic banner).
"""

from __future__ import annotations

import json
import logging
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from helpers import run_python, zerotrain_cmd

from zerotrain.runtime.distributed import free_port

from zerotrain.runtime.collectives import main_process_first, run_on_main
from zerotrain.errors import DataError
from zerotrain.runtime.launcher import _restore_levels, _silence_torchelastic, describe_failure

# Two Gloo ranks on CPU: each scenario records, per rank, whether the block ran and what it raised.
TWO_RANKS = textwrap.dedent('''
    import json, os, sys, time

    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    from zerotrain.runtime.distributed import free_port

    from zerotrain.runtime.collectives import ask_others, main_process_first, run_on_main
    from zerotrain.errors import ConfigError, DataError


    def seen(exc):
        return {"type": f"{type(exc).__module__}.{type(exc).__qualname__}", "message": str(exc),
                "origin": getattr(exc, "zerotrain_origin_rank", None), "flag": getattr(exc, "flag", None)}


    def scenario(rank, fails_on, make_error):
        ran = False
        try:
            with main_process_first(rank == 0):
                ran = True
                if rank == fails_on:
                    raise make_error()
        except Exception as exc:
            return {"ran": ran, **seen(exc)}
        return {"ran": ran, "type": None}


    def fail_on_main():
        raise DataError("only rank 0 checks this")


    def served(rank, fail):
        """Rank 0 asks the others into two collectives of its own (as a ZeRO-3 export's gathers), then returns or
        fails."""
        asked = []

        def serve(request):
            asked.append(request)
            dist.all_reduce(torch.tensor([float(rank + 1)]))

        def fn():
            sums = []
            for request in ("first", "second"):
                ask_others(request)
                t = torch.tensor([float(rank + 1)])
                dist.all_reduce(t)
                sums.append(t.item())
            if fail:
                raise DataError("the disk filled after two tensors")
            return sums

        try:
            return {"result": run_on_main(fn, serve=serve), "served": asked}
        except Exception as exc:
            return {"served": asked, **seen(exc)}


    def worker(rank, port, out):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        res = {
            "data_error_on_0": scenario(rank, 0, lambda: DataError("/data/train.jsonl: line 3: not JSON")),
            "config_error_on_0": scenario(rank, 0, lambda: ConfigError("--data.path", "must be a file")),
            "value_error_on_0": scenario(rank, 0, lambda: ValueError("a bug")),
            "data_error_on_1": scenario(rank, 1, lambda: DataError("/data/val.jsonl is empty")),
        }
        marker = os.path.join(out, "rank0-was-here")
        with main_process_first(rank == 0):
            if rank == 0:
                time.sleep(0.5)
                open(marker, "w").close()
            res["saw_rank0_file"] = os.path.exists(marker)
        res["run_on_main"] = run_on_main(lambda: f"made by rank {dist.get_rank()}")
        try:
            run_on_main(fail_on_main)
        except Exception as exc:
            res["run_on_main_error"] = seen(exc)
        res["served"], res["served_then_failed"] = served(rank, False), served(rank, True)
        total = torch.ones(1)
        dist.all_reduce(total)  # the group is still in step after all of the above
        res["all_reduce"] = total.item()
        dist.destroy_process_group()
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(res, f)


    if __name__ == "__main__":
        mp.spawn(worker, args=(free_port(), sys.argv[1]), nprocs=2, join=True)
''')


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[int, dict]:
    folder = tmp_path_factory.mktemp("two_ranks")
    script = folder / "two_ranks.py"
    script.write_text(TWO_RANKS)
    proc = run_python([str(script), str(folder)], cwd=folder, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {rank: json.loads((folder / f"rank{rank}.json").read_text()) for rank in (0, 1)}


@pytest.mark.slow
def test_rank0_data_error_is_raised_on_rank1_without_running_its_block(two_ranks):
    expected = {"type": "zerotrain.errors.DataError", "message": "/data/train.jsonl: line 3: not JSON", "flag": None}
    assert two_ranks[0]["data_error_on_0"] == {"ran": True, "origin": None, **expected}
    assert two_ranks[1]["data_error_on_0"] == {"ran": False, "origin": 0, **expected}


@pytest.mark.slow
def test_config_error_keeps_its_class_message_and_flag(two_ranks):
    """ConfigError's __init__ takes (flag, message): it comes back without calling it, flag included."""
    expected = {"type": "zerotrain.errors.ConfigError", "message": "--data.path must be a file",
                "flag": "--data.path"}
    assert two_ranks[0]["config_error_on_0"] == {"ran": True, "origin": None, **expected}
    assert two_ranks[1]["config_error_on_0"] == {"ran": False, "origin": 0, **expected}


@pytest.mark.slow
def test_other_errors_keep_their_class_too(two_ranks):
    assert two_ranks[1]["value_error_on_0"] == {"ran": False, "type": "builtins.ValueError", "message": "a bug",
                                                "origin": 0, "flag": None}


@pytest.mark.slow
def test_an_error_on_another_rank_stops_rank0_too(two_ranks):
    """Rank 1's block fails after rank 0's succeeded: rank 0 raises it (and prints it in the CLI)."""
    expected = {"ran": True, "type": "zerotrain.errors.DataError", "message": "/data/val.jsonl is empty", "flag": None}
    assert two_ranks[0]["data_error_on_1"] == {**expected, "origin": 1}
    assert two_ranks[1]["data_error_on_1"] == {**expected, "origin": None}


@pytest.mark.slow
def test_rank0_runs_first_then_the_others_and_the_group_stays_in_step(two_ranks):
    assert [two_ranks[r]["saw_rank0_file"] for r in (0, 1)] == [True, True]
    assert [two_ranks[r]["run_on_main"] for r in (0, 1)] == ["made by rank 0"] * 2
    assert [two_ranks[r]["run_on_main_error"]["type"] for r in (0, 1)] == ["zerotrain.errors.DataError"] * 2
    assert two_ranks[1]["run_on_main_error"]["message"] == "only rank 0 checks this"
    assert [two_ranks[r]["all_reduce"] for r in (0, 1)] == [2.0, 2.0]


def _run_block(is_main: bool):
    ran = []
    with main_process_first(is_main):
        ran.append(True)
    return ran


def test_without_a_process_group_it_is_just_the_block():
    assert not dist.is_initialized()
    assert _run_block(True) == [True]
    error = DataError("x")
    with pytest.raises(DataError) as caught:
        with main_process_first(True):
            raise error
    assert caught.value is error
    assert run_on_main(lambda: 41 + 1) == 42


def test_in_a_group_of_one_it_is_just_the_block():
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        assert _run_block(True) == [True]
        with pytest.raises(DataError, match="^missing$"):
            with main_process_first(True):
                raise DataError("missing")
        assert run_on_main(lambda: "ok") == "ok"
    finally:
        dist.destroy_process_group()


# --- what spawn_local_workers reports, from torchelastic's failures -----------------------------------

def _failure(exitcode: int, local_rank: int, timestamp: int = 100, line: str | None = None):
    """What torchelastic's ProcessFailure holds; ``line``: the record the worker left (see launcher.ErrorFile)."""
    message = {"message": line, "errorCode": exitcode, "extraInfo": {"timestamp": str(timestamp)}} if line else ""
    return SimpleNamespace(exitcode=exitcode, local_rank=local_rank, timestamp=timestamp, message=message, pid=0,
                           signal_name=lambda: {-15: "SIGTERM", -9: "SIGKILL"}[exitcode])


def test_a_user_error_is_said_once_from_the_lowest_ranks_record():
    """Every rank raised it (rank 0 found it, or the others got it from rank 0): one line, whichever ranks
    left their record before torchelastic stopped the rest, and on a node without rank 0 too."""
    line = "zerotrain fit: error: /data/train.jsonl: file not found"
    assert describe_failure({0: _failure(2, 0, line=line), 1: _failure(-15, 1)}) == (line, 2)
    assert describe_failure({3: _failure(2, 1, line=line), 2: _failure(2, 0, line=line)}) == (line, 2)


def test_a_user_error_without_a_record_is_still_said_once():
    assert describe_failure({0: _failure(2, 0), 1: _failure(-15, 1)}) == (
        "zerotrain: rank 0 stopped on an error (exit status 2)", 2)


def test_a_crash_is_one_line_naming_the_first_rank_that_failed():
    failures = {0: _failure(-15, 0, timestamp=101), 1: _failure(1, 1, timestamp=100)}
    line, code = describe_failure(failures)
    assert code == 1 and "\n" not in line
    assert line.startswith("zerotrain: rank 1 (local rank 1) failed with exit status 1")


def test_a_killed_worker_returns_128_plus_the_signal():
    assert describe_failure({0: _failure(-9, 0), 1: _failure(-15, 1)}) == (
        "zerotrain: rank 0 (local rank 0) was killed by SIGKILL before its first step (out of memory?); the job "
        "stopped. No checkpoint: the workers had not started training", 137)


def test_torchelastic_loggers_are_muted_then_restored():
    logger = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    before = logger.level
    saved = _silence_torchelastic()
    assert logger.level > logging.CRITICAL
    assert logging.getLogger("torch.distributed.run").level > logging.CRITICAL
    _restore_levels(saved)
    assert logger.level == before


# --- end to end: python -m zerotrain with two workers -----------------------------------------------

def _fit_toy(tmp_path: Path, nproc: int, *flags: str):
    return zerotrain_cmd(["fit", "toy", "--trainer.max_steps", "2", "--trainer.device", "cpu",
                          "--launch.nproc_per_node", str(nproc), *flags], cwd=tmp_path, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_an_error_found_on_every_rank_after_init_is_one_line_and_status_2(tmp_path, nproc):
    """--checkpoint.resume is resolved by every rank once the process group is up."""
    missing = tmp_path / "no-such-run"
    proc = _fit_toy(tmp_path, nproc, "--trainer.output_dir", str(tmp_path / "runs"),
                    "--checkpoint.resume", str(missing))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "FAILED" not in proc.stderr  # torchelastic's banner
    assert [line for line in proc.stderr.splitlines() if "error:" in line] == [
        f"zerotrain fit: error: --checkpoint.resume: {missing} does not exist. Pass a run folder, one of its "
        "checkpoints/step* folders, or auto"
    ]


@pytest.mark.slow
def test_an_error_found_by_rank0_alone_after_init_is_one_line_and_status_2(tmp_path):
    afile = tmp_path / "a-file"
    afile.write_text("")
    proc = _fit_toy(tmp_path, 2, "--trainer.output_dir", str(afile / "runs"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1
    assert errors[0].startswith(f"zerotrain fit: error: --trainer.output_dir: cannot write to {afile / 'runs'}")


@pytest.mark.slow
def test_the_other_ranks_join_the_collectives_rank0_asks_for_and_share_its_error(two_ranks):
    """run_on_main's serve: each ask_others on rank 0 has the other ranks call serve(request) in order, which
    joins the collective rank 0 starts next; an error after them still reaches every rank."""
    assert two_ranks[0]["served"] == {"result": [3.0, 3.0], "served": []}
    assert two_ranks[1]["served"] == {"result": [3.0, 3.0], "served": ["first", "second"]}
    for rank in (0, 1):
        failed = two_ranks[rank]["served_then_failed"]
        assert failed["served"] == ([] if rank == 0 else ["first", "second"])
        assert (failed["type"], failed["message"]) == ("zerotrain.errors.DataError", "the disk filled after two tensors")
    assert [two_ranks[r]["all_reduce"] for r in (0, 1)] == [2.0, 2.0]
