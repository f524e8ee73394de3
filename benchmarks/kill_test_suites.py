"""The kill test's other figures: signals, damaged checkpoints, crafted pickles, links out of a run folder, full disks.

``benchmarks/kill_test.py --suites ...`` calls :func:`run_suites`; each suite returns ``{"passed", "total", "cases"}``
(one entry per case: its name, whether it held, and what was seen). Two kinds of suite:

* the cases the test suite already holds (signals, links, full disks, the pickles of ``predict`` and of a
  resharded ZeRO-3 resume, the ``keep_last`` case) are run as those tests, through pytest, so each case is
  written once; a case holds when its test passes;
* damaged checkpoints and crafted pickles are enumerated here over every file of a real checkpoint of every
  engine (the tests keep one or two examples of each): every file truncated, cut to nothing, deleted, with a
  byte flipped or bytes appended, and every way the marker can be wrong; a crafted pickle (its ``__reduce__``
  would create a file) in place of every file, the marker edited to match, read by ``fit --checkpoint.resume
  auto`` and by ``zerotrain export``.

:func:`write_outputs` writes the Markdown table and the PNG beside the JSON.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Suites that are tests already: pytest node ids (a parametrized test counts each of its cases).
TEST_SUITES = {
    "signals": [
        "tests/runtime/test_preemption.py::test_signal_saves_at_the_next_step_and_the_resume_is_exact",
        "tests/runtime/test_preemption.py::test_a_second_signal_exits_at_once_but_a_forwarded_copy_does_not",
        "tests/runtime/test_preemption.py::test_outside_the_training_loop_a_signal_acts_at_once",
        "tests/runtime/test_preemption.py::test_sigterm_to_the_command_saves_and_exits_75",
        "tests/runtime/test_preemption.py::test_a_signal_after_the_workers_saved_does_not_change_the_exit_status",
    ],
    "symlinks": [
        "tests/checkpoint/test_untrusted_files.py::test_a_link_out_of_a_pre_created_run_folder_is_refused_and_nothing_is_written_there",
        "tests/checkpoint/test_untrusted_files.py::test_a_link_out_of_a_trained_run_is_refused_on_resume_and_export",
        "tests/checkpoint/test_untrusted_files.py::test_a_run_folder_that_is_a_link_is_refused",
        "tests/checkpoint/test_untrusted_files.py::test_files_written_in_place_are_opened_without_following_links",
        "tests/checkpoint/test_untrusted_files.py::test_a_run_name_that_is_not_one_folder_name_is_refused",
    ],
    "disk_full": [
        "tests/checkpoint/test_checkpoint.py::test_full_disk_is_one_line_and_keeps_the_previous_checkpoint",
        "tests/checkpoint/test_checkpoint.py::test_preflight_refuses_a_checkpoint_that_cannot_fit",
        "tests/metrics/test_tracking.py::test_a_full_disk_while_logging_is_one_line_and_leaves_whole_lines",
        "tests/metrics/test_tracking.py::test_tensorboard_events_are_written_whole_or_not_at_all",
        "tests/train/test_run_end.py::test_a_full_disk_at_the_final_export_is_one_line_and_leaves_no_half_model",
        "tests/train/test_run_end.py::test_a_full_disk_during_zerotrain_export_is_one_line_and_leaves_nothing",
    ],
    "pickle_tests": [
        "tests/checkpoint/test_untrusted_files.py::test_resume_of_a_crafted_zero3_checkpoint_runs_no_code",
        "tests/checkpoint/test_untrusted_files.py::test_predict_of_a_lora_run_with_a_pickled_adapter_is_one_line",
        "tests/checkpoint/test_checkpoint.py::test_crafted_train_state_does_not_run_code",
    ],
    "keep_last": [
        "tests/checkpoint/test_untrusted_files.py::test_a_damaged_checkpoint_skipped_by_resume_is_moved_aside_and_saved_again",
    ],
}
# The symlink layouts the figure counts: the parametrized cases of the first symlink test.
LINK_LAYOUT_TEST = TEST_SUITES["symlinks"][0]

ENGINES = {"zero0": {"zero_stage": 0}, "zero2": {"zero_stage": 2}, "zero3": {"zero_stage": 3},
           "plain": {"backend": "ddp"}}
FILE_DAMAGES = ("truncated", "emptied", "deleted", "byte-flipped", "appended")
MARKER_DAMAGES = ("no file list", "empty file list", "not JSON", "cut short", "a size that is no number",
                  "a name outside the folder", "an unlisted file")


def run_tests(suite: str, work: Path) -> dict:
    """Run a suite's tests through pytest; one case per test (per parameter set)."""
    xml = work / f"{suite}.xml"
    env = {k: v for k, v in os.environ.items() if k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                                "MASTER_PORT"}}
    env["PYTHONPATH"] = str(REPO / "src")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
                           *TEST_SUITES[suite]], cwd=REPO, env=env, capture_output=True, text=True)
    cases = []
    if xml.is_file():
        for case in ET.parse(xml).getroot().iter("testcase"):
            failed = case.find("failure") is not None or case.find("error") is not None
            skipped = case.find("skipped") is not None
            cases.append({"case": f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}",
                          "held": not failed and not skipped,
                          "seen": "skipped" if skipped else ("failed" if failed else "passed")})
    if not cases:
        cases.append({"case": "pytest", "held": False, "seen": proc.stdout[-2000:] + proc.stderr[-2000:]})
    return _summary(cases)


def _summary(cases: list[dict]) -> dict:
    return {"passed": sum(c["held"] for c in cases), "total": len(cases), "cases": cases}


def _tests_on_path() -> None:
    for path in (str(REPO / "src"), str(REPO / "tests")):
        if path not in sys.path:
            sys.path.insert(0, path)


def _fit(out: Path, name: str, engine: str, steps: int, resume: bool = False):
    from helpers import toy_config

    from zerotrain.tasks.toy import ToyTask
    from zerotrain.train.loop import fit

    cfg = toy_config(out, name, **ENGINES[engine])
    cfg.trainer.max_steps, cfg.logging.tensorboard = steps, False
    cfg.checkpoint.every_steps, cfg.checkpoint.keep_last = 2, 3
    if resume:
        cfg.checkpoint.resume = "auto"
    return fit(ToyTask(cfg))


def _quiet():
    """In-process fits log to stderr; the harness keeps its own output short."""
    return contextlib.redirect_stderr(io.StringIO())


def _damage(folder: Path, target: str, how: str) -> None:
    from zerotrain.checkpoint.layout import MARKER

    path = folder / target
    if how == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif how == "emptied":
        path.write_bytes(b"")
    elif how == "deleted":
        path.unlink()
    elif how == "byte-flipped":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    elif how == "appended":
        with open(path, "ab") as f:
            f.write(b"\0" * 64)
    else:  # the marker
        marker = folder / MARKER
        meta = json.loads(marker.read_text())
        if how == "no file list":
            del meta["files"]
        elif how == "empty file list":
            meta["files"] = {}
        elif how == "a size that is no number":
            first = min(meta["files"])
            meta["files"][first]["bytes"] = "many"
        elif how == "a name outside the folder":
            meta["files"]["../outside.pt"] = {"bytes": 1}
        elif how == "an unlisted file":
            (folder / "extra_optim_states.pt").write_bytes(b"\0" * 16)
        if how == "not JSON":
            marker.write_text("{not json")
        elif how == "cut short":
            marker.write_text(marker.read_text()[:20])
        else:
            marker.write_text(json.dumps(meta))


def damaged_checkpoints(work: Path) -> dict:
    """Every damage to every file of the newest checkpoint of each engine: the resume must not load it (it falls
    back to the step before and moves the damaged one aside), and training must then pass it and finish."""
    _tests_on_path()
    from zerotrain.checkpoint.layout import (
        MARKER,
        complete_checkpoints,
        problem,
        read_marker,
    )

    cases = []
    for engine in ENGINES:
        root = work / f"damage-{engine}"
        with _quiet():
            base = _fit(root, "base", engine, 4).run_dir
        newest = complete_checkpoints(base / "checkpoints")[-1]
        files = sorted(read_marker(newest)["files"])
        plans = [(name, how) for name in files for how in FILE_DAMAGES] + [(MARKER, how) for how in MARKER_DAMAGES]
        for i, (target, how) in enumerate(plans):
            name = f"case{i:03d}"
            shutil.copytree(base, root / name, symlinks=True)
            folder = root / name / "checkpoints" / newest.name
            _damage(folder, target, how)
            found = problem(folder, checksums=True)
            seen, held = found or "not detected", False
            if found is not None:
                try:
                    with _quiet():
                        final = _fit(root, name, engine, 6, resume=True).final_step
                    aside = [p.name for p in (root / name / "checkpoints").iterdir() if ".damaged-" in p.name]
                    intact = all(problem(p, checksums=True) is None
                                 for p in complete_checkpoints(root / name / "checkpoints"))
                    held = final == 6 and len(aside) == 1 and intact
                    if not held:
                        seen = f"resume: final step {final}, set aside {aside}, all kept intact: {intact}"
                except Exception as exc:  # a traceback here is a finding, recorded as one
                    seen = f"resume raised {type(exc).__name__}: {str(exc)[:300]}"
            cases.append({"case": f"{engine}: {target} {how}", "held": held, "seen": seen[:300]})
            shutil.rmtree(root / name, ignore_errors=True)
    return _summary(cases)


def crafted_pickles(work: Path) -> dict:
    """A crafted pickle in place of every file of a checkpoint of each engine, its marker edited to match (so
    only weights-only loading stops it), read by a resume and by ``zerotrain export``: the code never runs."""
    _tests_on_path()
    import torch
    from helpers import Evil

    from zerotrain.checkpoint.layout import MARKER, complete_checkpoints, read_marker
    from zerotrain.cli import main
    from zerotrain.errors import UserError

    cases = []
    for engine in ENGINES:
        root = work / f"pickle-{engine}"
        with _quiet():
            base = _fit(root, "base", engine, 2).run_dir
        (newest,) = complete_checkpoints(base / "checkpoints")
        for target in sorted(n for n in read_marker(newest)["files"] if n.endswith((".pt", ".bin", ".pkl"))):
            for command in ("fit --checkpoint.resume auto", "export"):
                name = f"c{len(cases):03d}"
                shutil.copytree(base, root / name, symlinks=True)
                folder = root / name / "checkpoints" / newest.name
                ran = root / f"{name}-code-ran"
                evil = {"module": Evil(ran), "optimizer_state_dict": Evil(ran)}
                path = folder / target
                if "optim" in target:
                    path.write_bytes(pickle.dumps(evil))
                else:
                    torch.save(evil, path)
                meta = json.loads((folder / MARKER).read_text())
                meta["files"][target] = {"bytes": path.stat().st_size,
                                         "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
                (folder / MARKER).write_text(json.dumps(meta))
                try:
                    with _quiet() as err:
                        if command == "export":
                            status = main(["export", str(root / name)])
                        else:
                            _fit(root, name, engine, 4, resume=True)
                            status = 0
                    seen = f"exit {status}: {err.getvalue().strip().splitlines()[-1:]}"
                except UserError as exc:
                    status, seen = 2, f"refused: {str(exc)[:200]}"
                except Exception as exc:  # a traceback is a finding, not a harness failure
                    status, seen = 1, f"raised {type(exc).__name__}: {str(exc)[:200]}"
                held = not ran.exists() and status == 2
                if ran.exists():
                    seen = "THE CODE RAN; " + seen
                cases.append({"case": f"{engine}: {target} read by {command}", "held": held, "seen": seen[:300]})
                shutil.rmtree(root / name, ignore_errors=True)
    return _summary(cases)


SUITES = {
    "damage": damaged_checkpoints,
    "pickle": crafted_pickles,
    **{name: (lambda work, name=name: run_tests(name, work)) for name in TEST_SUITES},
}


def run_suites(names: list[str]) -> dict:
    results = {}
    with tempfile.TemporaryDirectory(prefix="zerotrain-trust-") as tmp:
        for name in names:
            work = Path(tmp) / name
            work.mkdir()
            results[name] = SUITES[name](work)
            print(name, f"{results[name]['passed']}/{results[name]['total']}", flush=True)
    if "symlinks" in results:
        layouts = [c for c in results["symlinks"]["cases"] if LINK_LAYOUT_TEST.split("::")[1] in c["case"]]
        results["symlinks"]["layouts"] = {"passed": sum(c["held"] for c in layouts), "total": len(layouts)}
    return results


def versions() -> dict:
    import platform

    out = {"python": platform.python_version(), "machine": f"{platform.machine()}, {os.cpu_count()} CPUs"}
    for module in ("torch", "deepspeed", "zerotrain"):
        try:
            out[module] = __import__(module).__version__
        except Exception as exc:
            out[module] = f"not importable: {type(exc).__name__}"
    try:
        out["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                       text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
        out["commit"] += " (with uncommitted changes)" if dirty else ""
    except OSError:
        out["commit"] = "unknown"
    return out


FIGURES = [  # (key in the report, what it counts)
    ("kill", "kill -9 at random moments, resumed bitwise equal"),
    ("signals", "signal cases: saved and exit 75 (second signals included)"),
    ("damage", "damaged checkpoints detected, moved aside, run finished"),
    ("keep_last", "a damaged checkpoint does not count in keep_last"),
    ("pickle", "crafted pickles in checkpoints: no code ran, exit 2"),
    ("pickle_tests", "crafted pickles: predict, ZeRO-3 resume, train state (tests)"),
    ("symlinks", "links out of a run folder: refused, nothing written outside"),
    ("disk_full", "full disk at each write site: one line, nothing half-written"),
]


def figures(report: dict) -> list[tuple[str, str, int, int]]:
    """(key, what, held, total) for every figure the report holds."""
    rows = []
    total = report.get("total")
    if total and total.get("kills"):
        held = total["kills"] if total["bitwise_equal"] and total["resumes_ok"] == total["resumes"] else 0
        rows.append(("kill", FIGURES[0][1], held, total["kills"]))
    for key, what in FIGURES[1:]:
        if key in report.get("suites", {}):
            rows.append((key, what, report["suites"][key]["passed"], report["suites"][key]["total"]))
    return rows


def write_outputs(report: dict, out: Path) -> None:
    """``out`` (JSON) is written by the caller; this writes ``out.md`` and ``out.png`` beside it."""
    rows = figures(report)
    lines = [f"# {report['what']}", "", f"Command: `{report['command']}`", "",
             "| | |", "|---|---|", *[f"| {k} | {v} |" for k, v in report["versions"].items()], "",
             "| figure | held | of | |", "|---|---|---|---|",
             *[f"| {what} | {held} | {total} | {'all' if held == total else 'NOT ALL'} |"
               for _, what, held, total in rows]]
    if "configs" in report:
        lines += ["", "| kill -9 configuration | kills | during a save | resumes that trained on | corrupt | bitwise equal"
                  " | seconds |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {name} | {r['kills']} | {r['kills_during_save']} | {r['resumes_ok']}/{r['resumes']} | "
                  f"{r['corrupt_checkpoints']} | {'yes' if r['bitwise_equal'] else 'NO'} | {r.get('seconds', '')} |"
                  for name, r in report["configs"].items()]
    for key, suite in report.get("suites", {}).items():
        lines += ["", f"## {key}: {suite['passed']}/{suite['total']}", ""]
        lines += [f"- {'held' if c['held'] else 'FAILED'}: {c['case']}" + ("" if c["held"] else f" ({c['seen']})")
                  for c in suite["cases"]]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(rows) + 1.2))
    labels = [f"{what}\n{held}/{total}" for _, what, held, total in rows]
    ax.barh(labels, [held / total if total else 0 for _, _, held, total in rows], color="tab:green")
    ax.barh(labels, [(total - held) / total if total else 0 for _, _, held, total in rows],
            left=[held / total if total else 0 for _, _, held, total in rows], color="tab:red")
    ax.set_xlim(0, 1)
    ax.set_xlabel("share of cases that held (green) and that did not (red)")
    ax.invert_yaxis()
    ax.tick_params(axis="y", labelsize=7)
    ax.set_title(f"zerotrain {report['versions'].get('commit', '')}, {report['versions'].get('machine', '')}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    plt.close(fig)
