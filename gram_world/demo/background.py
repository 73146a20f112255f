"""The baseline rows' evaluation runs (rows with no meta-trained file: CLIP, CoOp, VPT, joint) in one
background process while CHC and meta-training run, so the core that CHC leaves idle does work.

A run gives the same record wherever it runs (its seed fixes everything; one torch thread per process);
the evaluation stage skips the runs finished here, like any cached run, and does the rest.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path
from typing import Optional

from ..lifeline import die_with_parent
from .pool import log
from .settings import DemoSettings, method_row
from .stages import EvalJob, eval_jobs, init_eval_worker, run_eval_job


def baseline_jobs(world, out: Path, settings: DemoSettings) -> list[EvalJob]:
    """The evaluation runs that need no meta-trained file and are not done yet, costliest first."""
    jobs = [j for j in eval_jobs(world, {}, settings) if not method_row(j.key).variant and not j.path(out).is_file()]
    return sorted(jobs, key=lambda j: -j.cost)


def _background_main(parent_pid: int, jobs: list, model: str, weights: str, settings, out: str, stop) -> None:
    die_with_parent(parent_pid, init_eval_worker, (model, weights, settings, out))
    for job in jobs:
        if stop.is_set():
            return
        try:
            run_eval_job(job)
        except Exception as exc:  # the evaluation stage runs it again and reports the error there
            log(f"background run {job.key} on {job.dataset} seed {job.seed} failed ({exc}); left to the evaluation")
            return


class BackgroundRuns:
    """One spawned process working through :func:`baseline_jobs` until :meth:`finish`."""

    def __init__(self, process, stop, jobs: list, out: Path):
        self.process, self.stop, self.jobs, self.out = process, stop, jobs, out

    @classmethod
    def start(cls, world, weights: Path, model: str, out: Path, settings: DemoSettings) -> Optional["BackgroundRuns"]:
        """Start the process; ``None`` when there is nothing to do or ``settings.jobs`` < 2 (one process
        asked for: nothing runs beside the main one)."""
        jobs = baseline_jobs(world, out, settings)
        if settings.jobs < 2 or not jobs:
            return None
        ctx = mp.get_context("spawn")
        stop = ctx.Event()
        process = ctx.Process(
            target=_background_main,
            args=(os.getpid(), jobs, model, str(weights), settings, str(out), stop),
            name="demo-baseline-runs",
            daemon=True,
        )
        process.start()
        log(f"{len(jobs)} baseline evaluation runs start in the background beside CHC and meta-training")
        return cls(process, stop, jobs, out)

    def finish(self, wait: bool = True) -> int:
        """Stop after the run in progress (``wait``) or at once; returns how many runs were finished."""
        self.stop.set()
        if not wait:
            self.process.terminate()
        self.process.join()
        done = sum(j.path(self.out).is_file() for j in self.jobs)
        log(f"{done} of {len(self.jobs)} baseline evaluation runs finished in the background")
        return done
