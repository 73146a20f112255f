"""Run logs: a JSON-lines file, tensorboard scalars, and the tqdm bar.

``log.jsonl`` holds one record per line::

    {"kind": "train", "step": 12, "time_per_step": 0.41, "support_loss_before": ..., ...}
    {"kind": "val",   "step": 1000, "query_acc_before": ..., "query_acc_after": ..., ...}

Units: losses in nats (cross-entropy), accuracies as fractions in [0, 1], times in seconds.
On resume from step ``s`` the records after ``s`` (written by the killed process after its last
checkpoint) are dropped, so the log reads like one uninterrupted run.  Tensorboard does the
same through ``SummaryWriter(purge_step=s + 1)``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

from meta.infra.fileio import parse_json, write_text_atomic

LOG_NAME = "log.jsonl"


def read_log(path) -> list[dict]:
    """All well-formed records of a JSON-lines log: JSON objects with an integer ``step``; a torn last line,
    other values and lines nested deeper than :data:`meta.infra.fileio.MAX_NESTING` are ignored."""
    out = []
    p = Path(path)
    if not p.is_file():
        return out
    for line in p.read_text(errors="replace").splitlines():
        try:
            record = parse_json(line)
        except ValueError:  # malformed (json.JSONDecodeError) or nested too deeply
            continue
        if isinstance(record, dict) and isinstance(record.get("step", 0), int):
            out.append(record)
    return out


def truncate_log(path, last_step: int) -> int:
    """Keep records with ``step <= last_step`` (atomic rewrite); returns how many were dropped."""
    p = Path(path)
    if not p.is_file():
        return 0
    records = read_log(p)
    kept = [r for r in records if int(r.get("step", 0)) <= last_step]
    write_text_atomic(p, "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))
    return len(records) - len(kept)


def _clean(value):
    return str(value) if isinstance(value, float) and not math.isfinite(value) else value  # JSON has no NaN/inf


class RunLog:
    """Write metrics to ``run_dir/log.jsonl`` and (optionally) ``run_dir/tensorboard``."""

    def __init__(self, run_dir, start_step: int = 0, tensorboard: bool = True, fresh: bool = False):
        """``fresh``: a new run (drop everything a run killed before its first checkpoint logged)."""
        self.path = Path(run_dir) / LOG_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        truncate_log(self.path, -1 if fresh else start_step)
        self._fh = open(self.path, "a", encoding="utf-8")
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = 0 if fresh else start_step + 1
            self.writer = SummaryWriter(str(Path(run_dir) / "tensorboard"), purge_step=purge)

    def write(self, kind: str, step: int, metrics: dict) -> dict:
        record = {"kind": kind, "step": int(step), **{k: _clean(v) for k, v in metrics.items()}}
        self._fh.write(json.dumps(record, sort_keys=True) + "\n")
        self._fh.flush()
        if self.writer is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                    self.writer.add_scalar(f"{kind}/{key}", value, step)
        return record

    def flush(self) -> None:
        self._fh.flush()
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def progress_bar(total: int, initial: int, enabled: bool, desc: str):
    """A tqdm bar over outer steps (a no-op object when disabled)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, desc=desc, unit="step", dynamic_ncols=True)


def postfix(metrics: dict, keys=("query_loss_after", "query_acc_after", "loss", "acc")) -> Optional[dict]:
    return {k: f"{metrics[k]:.3f}" for k in keys if k in metrics}
