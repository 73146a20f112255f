"""Dassl-layout run folders as files: end-of-run log markers, accuracy lines, checkpoint names, run info.

One reader for a ``train.py`` output folder without Dassl: the benchmark runner, the results parser and the GRAM
trainers' checkpoints (``trainers/gram/dassl_checkpoint.py`` writes the names defined here).

Facts (KaiyangZhou/Dassl.pytorch ``dassl/engine/trainer.py``, ``dassl/utils/torchtools.py``; CoOp
``parse_test_res.py``):

* a training log ends with ``Finish training`` (Dassl >= 0.6.1; MaPLe's parser still waits for the
  older ``Finished training``), then the test result block; an ``--eval-only`` log has only the
  block, which starts with ``=> result``; the accuracy line is ``* accuracy: X%``;
* checkpoints are ``<dir>/<model name>/model.pth.tar-<epoch>`` with a ``checkpoint`` file naming
  the last one;
* the benchmark runner writes ``gram_run.txt`` (``hash``, ``mode`` train|eval, ``pid``, ``arg`` lines).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional, Union

END_SIGNAL = {"train": "Finish training", "eval": "=> result"}
ACCURACY = re.compile(r"\* accuracy: ([\.\deE+-]+)%")  # CoOp parse_test_res.py L127-130
CHECKPOINT_PREFIX = "model.pth.tar-"
LAST_POINTER = "checkpoint"
RUN_INFO = "gram_run.txt"
LOG = "log.txt"
DASSL_LOG = re.compile(r"^log\.txt(-\d{4}-\d{2}-\d{2}-\d{2}-\d{2}-\d{2})?$")  # log.txt, log.txt-<rerun time>
_CKPT_EPOCH = re.compile(re.escape(CHECKPOINT_PREFIX) + r"(\d+)")

PathLike = Union[str, Path]


class LogProblem(Exception):
    """A run whose log is missing or has no result after its end signal (one-line message)."""


def checkpoint_name(epoch: int) -> str:
    """File name of the checkpoint after ``epoch`` (1-based) epochs: ``model.pth.tar-<epoch>``."""
    return f"{CHECKPOINT_PREFIX}{int(epoch)}"


def read_run_info(run_dir: PathLike) -> dict[str, str]:
    """The single-valued lines of ``gram_run.txt`` (``hash``, ``mode``, ``pid``, ...); {} when absent."""
    path = Path(run_dir) / RUN_INFO
    info: dict[str, str] = {}
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            name, _, value = line.partition(" ")
            if name != "arg":
                info.setdefault(name, value.strip())
    return info


def run_mode(run_dir: PathLike, default: str) -> str:
    """``train`` or ``eval``: the ``mode`` line of ``gram_run.txt``, else ``default``."""
    mode = read_run_info(run_dir).get("mode", "")
    return mode if mode in END_SIGNAL else default


def read_accuracy(log_path: PathLike, mode: str) -> float:
    """Accuracy in % of one log: the last ``* accuracy:`` after the first end-signal line."""
    log_path = Path(log_path)
    if not log_path.is_file():
        raise LogProblem(f"missing log {log_path}")
    signal = END_SIGNAL[mode]
    seen_end, value = False, None
    with open(log_path, "r", errors="replace") as f:
        for line in f:
            line = line.strip()
            if line == signal:
                seen_end = True
            match = ACCURACY.search(line)
            if match and seen_end:
                value = float(match.group(1))
    if not seen_end:
        raise LogProblem(f"unfinished run: {log_path} has no '{signal}' line ({mode} log)")
    if value is None:
        raise LogProblem(f"no result: {log_path} has '{signal}' but no '* accuracy:' line after it")
    return value


def newest_log(run_dir: Path) -> tuple[Path, int]:
    """``(log to read, number of Dassl logs)`` of a run folder: the newest of ``log.txt`` and its reruns'
    ``log.txt-<time>`` by modification time (ties: the later name; ``log.txt`` sorts first).  Without any
    log: ``(run_dir / "log.txt", 0)``, which the reader reports as missing."""
    logs = []
    if not run_dir.is_dir():
        return run_dir / LOG, 0
    for path in run_dir.iterdir():
        if DASSL_LOG.match(path.name) and path.is_file():
            logs.append((path.stat().st_mtime_ns, path.name, path))
    return (max(logs)[2], len(logs)) if logs else (run_dir / "log.txt", 0)


def log_finished(run_dir: PathLike, mode: str) -> bool:
    """True when the run's newest Dassl log (:func:`newest_log`) holds a result after its end signal (what the
    parser will read)."""
    try:
        read_accuracy(newest_log(Path(run_dir))[0], mode)
    except LogProblem:
        return False
    return True


def last_checkpoint_epoch(run_dir: PathLike) -> Optional[int]:
    """The highest epoch among ``run_dir/<model>/checkpoint`` pointers, else among the
    ``model.pth.tar-<E>`` files themselves; None when there is none."""
    run_dir = Path(run_dir)
    epochs = []
    for pointer in sorted(run_dir.glob(f"*/{LAST_POINTER}")):
        if pointer.is_file():
            match = _CKPT_EPOCH.search(pointer.read_text(errors="replace"))
            if match:
                epochs.append(int(match.group(1)))
    if not epochs:
        for path in run_dir.glob(f"*/{CHECKPOINT_PREFIX}*"):
            suffix = path.name[len(CHECKPOINT_PREFIX) :]
            if path.is_file() and suffix.isdigit():
                epochs.append(int(suffix))
    return max(epochs) if epochs else None
