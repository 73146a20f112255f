"""scripts/parse_results.py on a run folder holding Dassl's rerun logs (``log.txt`` + ``log.txt-<time>``)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("parse_results", REPO / "scripts" / "parse_results.py")
pr = importlib.util.module_from_spec(_spec)
sys.modules["parse_results"] = pr  # dataclasses look their module up while the file executes
_spec.loader.exec_module(pr)

RERUN = "log.txt-2026-01-02-03-04-05"  # the name Dassl's setup_logger gives a second run's log


def train_log(acc: float, finished: bool = True) -> str:
    end = f"Finish training\nEvaluate on the *test* set\n=> result\n* total: 100\n* accuracy: {acc}%\n"
    return "Loading trainer: GRAM_CoOp\nepoch [1/2] batch [1/1] loss 1.0\n" + (end if finished else "")


def eval_log(acc: float) -> str:
    return f"Evaluate on the *test* set\n=> result\n* total: 100\n* accuracy: {acc}%\n"


def _write(path: Path, text: str, mtime: int) -> None:
    path.write_text(text)
    os.utime(path, ns=(mtime * 10**9, mtime * 10**9))


def tree(tmp_path: Path, logs: dict) -> Path:
    """One base/new pair (caltech101, coop, seed 1); ``logs`` = {file name: (text, mtime s)} of the base run."""
    base = tmp_path / "base2new/train_base/caltech101/shots_16/coop/seed1"
    new = tmp_path / "base2new/test_new/caltech101/shots_16/coop/seed1"
    base.mkdir(parents=True), new.mkdir(parents=True)
    _write(new / "log.txt", eval_log(50.0), 1_700_000_000)
    for name, (text, mtime) in logs.items():
        _write(base / name, text, mtime)
    return base


def _base_acc(results) -> float:
    return results[pr.RunKey("base2new", 16, "coop", "caltech101", "base")][1]


def test_the_newest_log_by_modification_time_is_read_and_named(tmp_path):
    base = tree(tmp_path, {"log.txt": (train_log(60.0), 1_700_000_000), RERUN: (train_log(70.0), 1_700_000_100)})
    notes: list = []
    results, problems = pr.collect(tmp_path, notes)
    assert _base_acc(results) == 70.0 and problems == []
    assert notes == [f"{base}: 2 Dassl logs (reruns), read the newest: {RERUN}"]
    assert pr.newest_log(base) == (base / RERUN, 2)


def test_modification_time_not_the_name_decides(tmp_path):
    base = tree(tmp_path, {"log.txt": (train_log(60.0), 1_700_000_200), RERUN: (train_log(70.0), 1_700_000_100)})
    results, _ = pr.collect(tmp_path)
    assert _base_acc(results) == 60.0 and pr.newest_log(base) == (base / "log.txt", 2)


def test_files_that_are_not_dassl_logs_are_ignored(tmp_path):
    logs = {
        "log.txt": (train_log(60.0), 1_700_000_000),
        RERUN: (train_log(70.0), 1_700_000_100),
        "log.txt-backup": (train_log(99.0), 1_700_000_900),
        "log.txt.bak": (train_log(98.0), 1_700_000_900),
    }
    base = tree(tmp_path, logs)
    results, _ = pr.collect(tmp_path)
    assert _base_acc(results) == 70.0 and pr.newest_log(base)[1] == 2


def test_an_unfinished_newest_log_is_reported_naming_it(tmp_path, capsys):
    base = tree(
        tmp_path, {"log.txt": (train_log(60.0), 1_700_000_000), RERUN: (train_log(70.0, finished=False), 1_700_000_100)}
    )
    results, problems = pr.collect(tmp_path)
    assert pr.RunKey("base2new", 16, "coop", "caltech101", "base") not in results
    assert any(str(base / RERUN) in p and "unfinished" in p for p in problems)
    assert pr.main([str(tmp_path), "--strict"]) == 1
    err = capsys.readouterr().err
    assert f"note: {base}: 2 Dassl logs (reruns), read the newest: {RERUN}" in err


def test_a_single_log_gives_no_note(tmp_path):
    tree(tmp_path, {"log.txt": (train_log(60.0), 1_700_000_000)})
    notes: list = []
    results, problems = pr.collect(tmp_path, notes)
    assert _base_acc(results) == 60.0 and notes == [] and problems == []


def test_the_runner_counts_a_run_finished_by_its_newest_log(tmp_path):
    """The benchmark runner (meta.infra.dassl_runs.log_finished) reads the same log as the parser: a crashed first
    run followed by a finished rerun is finished; the reverse is not."""
    from meta.infra.dassl_runs import log_finished

    done = tree(
        tmp_path / "a", {"log.txt": (train_log(60.0, False), 1_700_000_000), RERUN: (train_log(70.0), 1_700_000_100)}
    )
    assert log_finished(done, "train")
    crashed = tree(
        tmp_path / "b", {"log.txt": (train_log(60.0), 1_700_000_000), RERUN: (train_log(70.0, False), 1_700_000_100)}
    )
    assert not log_finished(crashed, "train")
    assert not log_finished(tmp_path / "missing", "train")
