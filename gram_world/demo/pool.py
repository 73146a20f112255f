"""The demo's process pool: a function over tasks in spawned worker processes with one progress bar
fed by what the workers write, and the demo's log line."""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import time
from typing import Callable, Optional

from tqdm import tqdm

from meta.infra import products

from ..lifeline import die_with_parent

# products computed in worker processes since the demo started ({calls, seconds, gflop}; gram_world.demo.profile)
WORKER_PRODUCTS = {"calls": 0, "seconds": 0.0, "gflop": 0.0}


def _counted(fn: Callable, task):
    """``fn(task)`` in a worker, with the products it computed: ``(result, {calls, seconds, gflop})``."""
    before = products.usage()
    result = fn(task)
    return result, {k: v - before[k] for k, v in products.usage().items()}


def log(msg: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run_with_progress(
    fn: Callable,
    tasks: list,
    jobs: int,
    total: int,
    done: Callable[[], int],
    desc: str,
    unit: str,
    initializer: Optional[Callable] = None,
    initargs: tuple = (),
) -> list:
    """``fn`` over ``tasks`` in ``jobs`` spawned processes (in-process when 1) with one tqdm bar.

    The workers die with this process, ``kill -9`` included (:func:`gram_world.lifeline.die_with_parent`).

    ``done()`` counts finished work (polled every 2 s from files the workers write);
    ``initializer(*initargs)`` prepares each process once (in-process too).
    """
    bar = tqdm(total=total, initial=done(), desc=desc, unit=unit, dynamic_ncols=True)
    try:
        if jobs <= 1:
            if initializer is not None:
                initializer(*initargs)
            results = []
            for task in tasks:
                results.append(fn(task))
                bar.n = done()
                bar.refresh()
            return results
        # workers end with this process even when it is killed (gram_world.lifeline.die_with_parent)
        with mp.get_context("spawn").Pool(
            jobs, initializer=die_with_parent, initargs=(os.getpid(), initializer, initargs)
        ) as pool:
            pending = pool.map_async(functools.partial(_counted, fn), tasks, chunksize=1)
            while not pending.ready():
                pending.wait(2.0)
                bar.n = done()
                bar.refresh()
            results = []
            for result, used in pending.get():
                results.append(result)
                for key, value in used.items():
                    WORKER_PRODUCTS[key] += value
            return results
    finally:
        bar.n = done()
        bar.close()
