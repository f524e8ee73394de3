"""`zerotrain benchmark`: one fit per strategy, a JSON and a Markdown table, failures reported per row."""

from __future__ import annotations

import json
import os
import time

import pytest
from helpers import fake_probe, zerotrain_cmd

pytestmark = pytest.mark.slow  # every test starts `python -m zerotrain benchmark`


def test_sweep_writes_json_and_markdown(tmp_path):
    out = zerotrain_cmd(["benchmark", "toy", "--strategies", "zero0,ddp", "--out", str(tmp_path / "b"),
                         "--profile", "2", "--trainer.max_steps", "6", "--trainer.num_workers", "0",
                         "--trainer.warmup_steps_excluded", "1"], cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "b" / "benchmark.json").read_text())
    assert [r["strategy"] for r in result["rows"]] == ["zero0", "ddp"]
    for row in result["rows"]:
        assert "error" not in row and row["throughput_measured_steps"] == 3 and row["throughput_tokens_per_s"] > 0
        assert row["command"].startswith("zerotrain fit toy")
        # The fields every row carries (issue: recipe, dims, parameters, GPU, strategy, speed, memory, status).
        assert row["recipe"] == "toy" and row["model"] == {"width": 32, "dropout": 0.1}
        assert row["n_params"] == 8 * 32 + 32 + 32 * 8 + 8 and row["n_gpus"] == 1 and row["gpu"] == "cpu"
        assert row["precision"] == "fp32" and row["micro_batch_size"] == 8 and row["seq_len"] == 1.0
        assert row["tokens_per_s"] > 0 and row["peak_host_mem_gib"] > 0 and row["status"] == "ok"
        assert row["commit"] == result["environment"]["commit"] and len(row["commit"]) >= 7
        assert row["profile"]["steps"] == 2 and row["profile"]["cpu_ms_per_step"] > 0
        # The memory model's peaks next to the measured ones, from one probe of the sweep's workload
        # (on a CPU the device's memory is the host's: all of it is predicted as host memory).
        assert row["predicted_gpu_mem_gib"] == 0.0 and row["predicted_host_mem_gib"] > 0.1
        assert row["predicted_activations"].startswith("measured")
        assert (tmp_path / "b" / f"profile_{row['strategy']}_1gpu.md").read_text().startswith("Profile of 2 steps")
    assert (tmp_path / "b" / "benchmark.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (tmp_path / "b" / "benchmark.md").read_text()
    assert "| zero0 | 1 |" in table and "| ddp | 1 |" in table and result["environment"]["versions"]["torch"] in table
    assert "predicted host (GiB)" in table and json.loads((tmp_path / "b" / "probe.json").read_text())["device"] == "cpu"
    assert "[zerotrain]" in (tmp_path / "b" / "runs" / "toy-ddp-1gpu" / "fit.log").read_text()  # the fit's own log


def test_a_failed_fit_is_a_row_with_its_reason(tmp_path):
    out = zerotrain_cmd(["benchmark", "toy", "--strategies", "zero0", "--out", str(tmp_path / "b"),
                         "--trainer.max_steps", "0"], cwd=tmp_path)
    assert out.returncode == 1
    row = json.loads((tmp_path / "b" / "benchmark.json").read_text())["rows"][0]
    assert "--trainer.max_steps" in row["error"]
    # The probe cannot run such a config either: no prediction, and the row says why.
    assert row["predicted_gpu_mem_gib"] is None and "--trainer.max_steps" in row["predicted_activations"]


def test_unknown_strategy_names_the_flag(tmp_path):
    out = zerotrain_cmd(["benchmark", "toy", "--strategies", "zero9"], cwd=tmp_path)
    assert out.returncode == 2 and "--strategies" in out.stderr and "Traceback" not in out.stderr


def test_predictions_from_an_earlier_probe_file_and_a_bad_one_named(tmp_path):
    """--probe FILE: the rows are predicted from a probe taken before (a big model's takes minutes), the
    same figures the memory model gives in-process from that file; a file that is no probe is one line."""
    from zerotrain.plan.benchmark import predicted

    probe = fake_probe(device="cpu")
    (tmp_path / "p.json").write_text(json.dumps(probe.to_dict()))
    args = ["--trainer.max_steps", "3", "--trainer.num_workers", "0", "--trainer.warmup_steps_excluded", "1"]
    out = zerotrain_cmd(["benchmark", "toy", "--strategies", "ddp", "--out", str(tmp_path / "b"),
                         "--probe", str(tmp_path / "p.json"), *args], cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "b" / "benchmark.json").read_text())
    row = result["rows"][0]
    from zerotrain.plan.strategies import STRATEGIES

    want = predicted("toy", [*args, *STRATEGIES["ddp"].flags(), "--launch.nproc_per_node", "1"], "ddp", probe)
    assert want["predicted_host_mem_gib"] > 0
    assert row["predicted_host_mem_gib"] == pytest.approx(want["predicted_host_mem_gib"])
    assert result["probe"] == str(tmp_path / "p.json") and not (tmp_path / "b" / "probe.json").exists()

    (tmp_path / "bad.json").write_text("{}")
    bad = zerotrain_cmd(["benchmark", "toy", "--strategies", "ddp", "--out", str(tmp_path / "c"),
                         "--probe", str(tmp_path / "bad.json"), *args], cwd=tmp_path)
    assert bad.returncode == 2 and "--probe" in bad.stderr and "Traceback" not in bad.stderr


def test_a_sweep_cut_short_keeps_the_rows_it_finished(tmp_path, monkeypatch):
    """The result files are rewritten after each row: a sweep killed during its second fit (a device
    call's time limit) still has the first row on disk."""
    from zerotrain.plan import benchmark

    calls = []

    def one(recipe, args, runs_dir, run_name, timeout_s, env):
        calls.append(run_name)
        if len(calls) == 2:
            raise KeyboardInterrupt  # what a time limit's signal does to the sweep
        return {"wall_s": 1.0, "command": "zerotrain fit toy", "nproc": 1, "tokens_per_s": 10.0}

    monkeypatch.setattr(benchmark, "run_one", one)
    with pytest.raises(KeyboardInterrupt):
        benchmark.run_sweep("toy", ["ddp", "zero0"], [1], tmp_path / "b", [], predict=False)
    rows = json.loads((tmp_path / "b" / "benchmark.json").read_text())["rows"]
    assert [r["strategy"] for r in rows] == ["ddp"] and "| ddp |" in (tmp_path / "b" / "benchmark.md").read_text()


def test_rounds_alternate_the_order_and_summarise_each_strategy_against_plain(tmp_path, monkeypatch):
    """--rounds 3: every fit three times, the second round in reverse order; the summary pairs each
    strategy with the plain engine of the same round (the tax is the median of those ratios) and says
    how far one strategy's own runs spread. A failed run is left out of the summary, not counted as 0."""
    from zerotrain.plan import benchmark

    seconds = {("ddp", 1): 0.010, ("zero0", 1): 0.011, ("ddp", 2): 0.020, ("zero0", 2): 0.021,
               ("ddp", 3): 0.012, ("zero0", 3): None}  # round 2 ran on a slower machine; zero0 r3 failed
    calls = []

    def one(recipe, args, runs_dir, run_name, timeout_s, env):
        name, rnd = run_name.split("-")[1], int(run_name.rsplit("-r", 1)[1])
        calls.append((name, rnd))
        s = seconds[(name, rnd)]
        row = {"wall_s": 1.0, "command": "zerotrain fit toy", "nproc": 1, "n_gpus": 1,
               "status": "ok" if s else "failed: boom", "throughput_sec_per_step": s}
        return row if s else {**row, "error": "boom"}

    monkeypatch.setattr(benchmark, "run_one", one)
    result = benchmark.run_sweep("toy", ["ddp", "zero0"], [1], tmp_path / "b", [], predict=False, rounds=3)
    assert calls == [("ddp", 1), ("zero0", 1), ("zero0", 2), ("ddp", 2), ("ddp", 3), ("zero0", 3)]
    assert [r["round"] for r in result["rows"]] == [1, 1, 2, 2, 3, 3]
    summary = {g["strategy"]: g for g in json.loads((tmp_path / "b" / "benchmark.json").read_text())["rounds"]}
    assert summary["ddp"]["rounds_ok"] == 3 and summary["ddp"]["tax_median"] is None
    assert summary["ddp"]["sec_per_step_median"] == pytest.approx(0.012)
    assert summary["ddp"]["spread"] == pytest.approx(1.0)  # 0.020 against 0.010
    z = summary["zero0"]
    assert z["rounds_ok"] == 2 and z["baseline"] == "ddp"
    assert z["tax_min"] == pytest.approx(0.05) and z["tax_max"] == pytest.approx(0.10)  # 0.021/0.020, 0.011/0.010
    assert z["tax_median"] == pytest.approx(0.075)
    table = (tmp_path / "b" / "benchmark.md").read_text()
    assert "| zero0 r3 | 1 | failed: boom |" in table and "Over 3 rounds" in table
    assert "| zero0 | 1 | 2 | 0.0160 | 0.0110 - 0.0210 | 90.9% | +7.5% vs ddp (+5.0%, +10.0%) |" in table


def test_rounds_must_be_positive(tmp_path):
    out = zerotrain_cmd(["benchmark", "toy", "--strategies", "ddp", "--rounds", "0"], cwd=tmp_path)
    assert out.returncode == 2 and "--rounds" in out.stderr and "Traceback" not in out.stderr


LAUNCHER = """
import signal, subprocess, sys, time
# A worker in a session of its own, as torchelastic starts them, that ignores SIGTERM (busy saving, say)
worker = subprocess.Popen([sys.executable, "-c",
                           "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"],
                          start_new_session=True)
print(worker.pid, flush=True)
print("launcher says why", file=sys.stderr, flush=True)
time.sleep(600)
"""


def test_a_timed_out_fit_is_stopped_with_its_workers(tmp_path):
    """A trial or sweep fit past its time limit: the launcher and its workers (own session, SIGTERM ignored)
    are all gone when the call returns, within the grace period, and the output up to then is kept."""
    import sys

    import psutil

    from zerotrain.plan.benchmark import run_bounded

    (tmp_path / "launcher.py").write_text(LAUNCHER)
    t0 = time.perf_counter()
    code, out, err, timed_out = run_bounded([sys.executable, str(tmp_path / "launcher.py")], timeout_s=5, grace_s=1)
    assert timed_out and code != 0 and time.perf_counter() - t0 < 30
    worker = int(out.split()[0])
    assert "launcher says why" in err
    assert not psutil.pid_exists(worker) or psutil.Process(worker).status() == psutil.STATUS_ZOMBIE


def test_a_fit_with_no_timed_step_is_a_row_that_says_so(tmp_path):
    """Every step within --trainer.warmup_steps_excluded (session 26's one-epoch warm-up fits): the fit has no
    throughput, and the sweep's line for it says why instead of failing to format the missing figures."""
    out = zerotrain_cmd(["benchmark", "toy", "--strategies", "ddp", "--out", str(tmp_path / "b"), "--predict", "false",
                         "--trainer.max_steps", "3", "--trainer.num_workers", "0",
                         "--trainer.warmup_steps_excluded", "5"], cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ddp x 1: no timed steps (every step was within --trainer.warmup_steps_excluded)" in out.stdout
    row = json.loads((tmp_path / "b" / "benchmark.json").read_text())["rows"][0]
    assert row["status"] == "ok" and row.get("throughput_sec_per_step") is None and row["tokens_per_s"] is None
    assert "| ddp | 1 | - |" in (tmp_path / "b" / "benchmark.md").read_text()


def test_a_fit_killed_by_sigkill_names_the_kill_not_its_last_line():
    """A fit the kernel's out-of-memory killer ends prints nothing of its own: the row says it was killed and
    what to try, not the progress line it happened to print last."""
    import sys

    from zerotrain.plan.benchmark import _failure, run_bounded

    script = "import os, signal; print('[zerotrain] 6 optimizer steps', flush=True); os.kill(os.getpid(), signal.SIGKILL)"
    code, out, err, timed_out = run_bounded([sys.executable, "-c", script], timeout_s=60)
    assert not timed_out and code == -9
    reason = _failure(err or out, code)
    assert reason.startswith("killed by SIGKILL") and "--strategy.offload_pin_memory false" in reason
    assert _failure("[zerotrain] 6 optimizer steps", 137).startswith("killed by SIGKILL")  # a shell's 128 + 9
    assert _failure("Traceback\nzerotrain fit: error: --data.path: no such file", 2) == \
        "zerotrain fit: error: --data.path: no such file"


def test_a_timed_out_fit_is_a_row_that_says_it_timed_out(tmp_path):
    """run_bounded marks a timeout with the code -1, which is not a signal: the row says the fit timed out."""
    from zerotrain.plan.benchmark import run_one

    row = run_one("toy", ["--trainer.max_steps", "5", "--trainer.device", "cpu"], tmp_path / "runs", "slow", timeout_s=1)
    assert row["status"].startswith("failed: timed out after 1 s"), row["status"]


@pytest.mark.slow
def test_a_sweep_killed_from_outside_leaves_what_its_fit_had_said(tmp_path):
    """A deadline that kills the sweep and its fit together (one process group) would take the fit's output with the
    sweep's temp files: the spool keeps it beside the runs. A fit that ends leaves no spool behind."""
    import signal
    import subprocess
    import sys

    from helpers import child_env
    from zerotrain.plan.benchmark import run_bounded

    def said() -> list[str]:
        return [f.read_text() for f in tmp_path.glob("trial.output.*/stdout")]

    fit = "import time; print('step 1 finished', flush=True); time.sleep(120)"
    sweep = (f"import sys; from pathlib import Path; from zerotrain.plan.benchmark import run_bounded; "
             f"run_bounded([sys.executable, '-c', {fit!r}], 300, spool=Path({str(tmp_path / 'trial.output')!r}))")
    proc = subprocess.Popen([sys.executable, "-c", sweep], env=child_env(["-c", sweep], {}), start_new_session=True)
    deadline = time.monotonic() + 60
    while said() != ["step 1 finished\n"]:
        assert time.monotonic() < deadline and proc.poll() is None, f"the fit's line never reached the spool: {said()}"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert said() == ["step 1 finished\n"]

    code, out, _, _ = run_bounded([sys.executable, "-c", "print('all steps')"], 60, spool=tmp_path / "done.output")
    assert code == 0 and out == "all steps\n" and not list(tmp_path.glob("done.output*"))
    # A folder that cannot be made (a file stands in its way): the temp folder serves
    (tmp_path / "a_file").write_text("")
    code, out, _, _ = run_bounded([sys.executable, "-c", "print('ran')"], 60, spool=tmp_path / "a_file" / "x.output")
    assert code == 0 and out == "ran\n"
