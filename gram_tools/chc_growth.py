"""How each CHC stage grows with the corpus: ``python -m gram_tools.chc_growth --pairs 10000 100000``.

For every size ``N`` a fresh subprocess generates ``N`` synthetic pairs (:mod:`gram_tools.synthetic`) and
runs CHC with ``configs/meta/chc_cc3m.yaml`` (the CC3M settings: ``FIT_SAMPLE`` 200 k, 5-d UMAP,
``MIN_CLUSTER_SIZE`` 100, 3 domains) on the tiny test CLIP, so the CLIP stages (image features, pair
filter) are NOT at real size here: their real-size cost per image is linear by construction (batched
forward passes) and is given from ViT-B/16 FLOPs by :mod:`gram_tools.plan`.  Per stage it records the
seconds and items of the pipeline's own ``timings.json`` and the process's peak resident memory inside
the stage's time window (``VmRSS`` sampled every 50 ms, with the process's CPU seconds, which the growth
laws use: wall time on a shared machine follows the load; numba's compilation of UMAP / HDBSCAN is paid
before the run, untimed), then fits ``seconds = c * N^p`` in log-log space
(and ``peak RSS = a + b * N``: the process's fixed base - torch, the sentence model - dominates it)
for every stage and extrapolates to CC3M's 3.1 M pairs (by the law, or by scaling the largest run linearly
where that gives more: ``extrapolate_seconds``; stages shorter than 1 s keep wall seconds, below the
sampler's resolution).  ``umap_hdbscan_fit`` runs on
``min(N_unique, FIT_SAMPLE)`` captions, so its extrapolation uses the fitted law at ``FIT_SAMPLE``.
JSON last; ``--out`` writes it for the planner (``--add`` keeps the sizes stored there and measures more).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import numpy as np

from meta.infra.cli_errors import int_flag_problem
from meta.infra.fileio import write_json_atomic

CC3M_PAIRS = 3.1e6
DEFAULT_OUT = "docs/chc_growth_cpu.json"
CONFIG = "configs/meta/chc_cc3m.yaml"
# Stages whose input is capped by CHC.TOPICS.FIT_SAMPLE.
SAMPLED_STAGES = ("umap_hdbscan_fit",)
# umap-learn optimises the embedding for 500 epochs up to 10,000 points and 200 above (umap/umap_.py,
# simplicial_set_embedding): the fitting stage's law is fitted on the runs above that switch only.
UMAP_EPOCH_SWITCH = 10000
CPU_RESOLUTION_S = 1.0


def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def measure_size(n_pairs: int, work: Path, text_dtype: str, seed: int = 0) -> dict:
    """Run CHC on ``n_pairs`` generated pairs; per-stage seconds, items and peak RSS (MiB)."""
    import torch

    from gram_tools.synthetic import write_synthetic_shards
    from meta.chc import pipeline
    from meta.config import load_meta_cfg

    torch.set_num_threads(1)
    from meta.chc.topics import fit_sample_clusters

    warm = np.random.default_rng(1).normal(size=(600, 384)).astype(np.float32)  # numba compiles here, untimed
    fit_sample_clusters(warm / np.linalg.norm(warm, axis=1, keepdims=True), 5, 15, 0.0, "cosine", "random", 20, 0, 0)
    data = work / f"data_{n_pairs}"
    shutil.rmtree(work / f"chc_{n_pairs}", ignore_errors=True)  # CHC resumes cached stages: start from scratch
    write_synthetic_shards(data, n_pairs=n_pairs, seed=seed)
    cfg = load_meta_cfg(
        CONFIG,
        [
            "MODEL.BACKBONE",
            "GRAM-Test-Tiny",
            "CHC.OUTPUT_DIR",
            str(work / f"chc_{n_pairs}"),
            "CHC.INPUT.SHARDS",
            str([str(data / "shard-*.tar")]),
            "CHC.TEXT.DTYPE",
            text_dtype,
            "MODEL.DEVICE",
            "cpu",
        ],
    )
    samples: list[tuple[float, int, float]] = []
    stop = threading.Event()

    def sample() -> None:  # wall clock, resident KiB, CPU seconds of the whole process
        while not stop.is_set():
            samples.append((time.time(), _rss_kib(), time.process_time()))
            time.sleep(0.05)

    ends: dict[str, float] = {}
    original = pipeline.ChcRun._timed

    def timed(self, name: str, seconds: float, items: int) -> None:  # measurement hook, this process only
        ends[name] = time.time()
        original(self, name, seconds, items)

    pipeline.ChcRun._timed = timed
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        pipeline.run_chc(cfg, show_progress=False)
    finally:
        stop.set()
        thread.join()
        pipeline.ChcRun._timed = original
    timings = json.loads((Path(cfg.CHC.OUTPUT_DIR) / "timings.json").read_text())
    stages = {}
    for name, t in timings.items():
        if name not in ends:
            continue
        lo, hi = ends[name] - t["seconds"] - 0.05, ends[name] + 0.05
        inside = [kib for ts, kib, _ in samples if lo <= ts <= hi] or [0]
        before = [kib for ts, kib, _ in samples if ts < lo]
        # before the first stage's window there is no sample: the sampler's first one (the run's start) is the base,
        # not 0 (that counted the imports, the numba warm-up and the data generation in the first stage)
        cpu_lo = [c for ts, _, c in samples if ts <= lo] or [samples[0][2]]
        cpu_hi = [c for ts, _, c in samples if ts <= hi]
        stages[name] = {
            "seconds": t["seconds"],
            "items": t["items"],
            "peak_rss_mib": round(max(inside) / 1024, 1),
            "rss_before_mib": round((before[-1] if before else 0) / 1024, 1),
            "cpu_seconds": round(cpu_hi[-1] - cpu_lo[-1], 2) if cpu_hi else None,
        }
    return {"pairs": n_pairs, "stages": stages, "load_avg_1min": round(os.getloadavg()[0], 2), "text_dtype": text_dtype}


def power_law(ns: list[float], ys: list[float]) -> Optional[dict]:
    """Least squares ``log y = log c + p log n``; ``None`` with fewer than two positive points."""
    pts = [(n, y) for n, y in zip(ns, ys) if n > 0 and y > 0]
    if len(pts) < 2 or len({n for n, _ in pts}) < 2:
        return None
    x = np.log([n for n, _ in pts])
    y = np.log([v for _, v in pts])
    p, logc = np.polyfit(x, y, 1)
    return {"c": float(math.exp(logc)), "p": float(p)}


def linear_law(ns: list[float], ys: list[float]) -> Optional[dict]:
    """Least squares ``y = intercept + slope * n`` (resident memory: a fixed base plus what grows)."""
    if len(set(ns)) < 2:
        return None
    slope, intercept = np.polyfit(np.asarray(ns, float), np.asarray(ys, float), 1)
    return {"intercept": float(intercept), "slope": float(slope)}


def predict(law: dict, n: float) -> float:
    """``c * n^p`` (a power law) or ``intercept + slope * n`` (a linear law)."""
    if "slope" in law:
        return law["intercept"] + law["slope"] * n
    return law["c"] * n ** law["p"]


def extrapolate_seconds(law: Optional[dict], items_measured: float, seconds_measured: float, items: float) -> dict:
    """Seconds at ``items``: the fitted power law, or the largest run scaled linearly when that is more.

    A measured exponent below 1 comes from fixed costs that the small runs still show (model loading, the
    sampler's resolution), not from a per-item cost that shrinks, so the law would under-predict far
    beyond the runs; scaling the largest run proportionally is the bound then.  Returns ``target_seconds``
    and ``extrapolation`` (which rule gave it).
    """
    if law is None:
        return {"target_seconds": None, "extrapolation": None}
    by_law = predict(law, items)
    linear = seconds_measured * items / items_measured
    if by_law >= linear:
        return {"target_seconds": round(by_law, 1), "extrapolation": "power law"}
    return {"target_seconds": round(linear, 1), "extrapolation": "largest run x items ratio (fitted p < 1)"}


def fit_growth(runs: list[dict], fit_sample: int, target: float = CC3M_PAIRS) -> dict:
    """Per stage: growth exponent of seconds, linear law of peak RSS against items, values at ``target`` pairs.

    At ``target`` pairs every stage is taken to have one item per pair (the upper bound: the generated
    captions repeat, ``items_per_pair`` records the measured ratio); the fitting stage's items stop at ``fit_sample``.
    """
    out = {}
    names = dict.fromkeys(name for r in runs for name in r["stages"])
    for name in names:
        rows = [r for r in runs if name in r["stages"]]
        if name in SAMPLED_STAGES and sum(r["stages"][name]["items"] > UMAP_EPOCH_SWITCH for r in rows) >= 2:
            rows = [r for r in rows if r["stages"][name]["items"] > UMAP_EPOCH_SWITCH]
        items = [r["stages"][name]["items"] for r in rows]
        # CPU seconds of the process inside the stage's window when recorded: on a shared machine the wall
        # time follows the load (measured: 10 k / 30 k / 100 k runs at load 6.9 / 4.6 / 3.4), CPU time much less
        # (CPU seconds come from 50 ms samples: a stage under CPU_RESOLUTION_S wall seconds keeps its wall time)
        time_key = (
            "cpu_seconds"
            if all(
                r["stages"][name].get("cpu_seconds") and r["stages"][name]["seconds"] >= CPU_RESOLUTION_S for r in rows
            )
            else "seconds"
        )
        secs = [r["stages"][name][time_key] for r in rows]
        mem = [r["stages"][name]["peak_rss_mib"] for r in rows]
        t_law, m_law = power_law(items, secs), linear_law(items, mem)
        per_pair = items[-1] / rows[-1]["pairs"]
        # one item per pair: the generator repeats captions (0.36 unique per pair at 300 k pairs, falling with N),
        # a web corpus's alt-texts mostly do not, so the measured ratio would under-count; this is the upper bound
        target_items = target
        if name in SAMPLED_STAGES:
            target_items = min(target_items, fit_sample)
        entry = {
            "items": items,
            "seconds": secs,
            "time": time_key,
            "peak_rss_mib": mem,
            "items_per_pair": round(per_pair, 4),
            "target_pairs": target,
            "target_items": round(target_items),
            "seconds_law": t_law,
            "rss_law": m_law,
        }
        entry.update(extrapolate_seconds(t_law, items[-1], secs[-1], target_items))
        entry["target_peak_rss_mib"] = None if m_law is None else round(predict(m_law, target_items), 1)
        out[name] = entry
    return out


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gram_tools.chc_growth", description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, nargs="+", default=[10000, 100000])
    p.add_argument("--text-dtype", default="bf16", choices=("fp32", "bf16"))
    p.add_argument("--work", default=".cache/chc_growth")
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--refit", action="store_true", help="refit the growth laws of the runs stored in --out")
    p.add_argument(
        "--add", action="store_true", help="keep the runs stored in --out (other sizes), measure --pairs and refit all"
    )
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    problem = int_flag_problem(args, {"pairs": 1, "one": 1})
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    work = Path(args.work)
    if args.one is not None:
        print(json.dumps(measure_size(args.one, work, args.text_dtype)))
        return 0
    runs = []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    if args.refit or args.add:
        if not Path(args.out).is_file():
            print(f"error: --{'refit' if args.refit else 'add'}: no such file {args.out}", file=sys.stderr)
            return 2
        stored = json.loads(Path(args.out).read_text())
        runs = [r for r in stored["runs"] if args.refit or r["pairs"] not in args.pairs]
        args.text_dtype = stored["settings"]["text_dtype"]
    for n in [] if args.refit else sorted(args.pairs):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "gram_tools.chc_growth",
                "--one",
                str(n),
                "--work",
                str(work),
                "--text-dtype",
                args.text_dtype,
            ],
            capture_output=True,
            text=True,
            env=env,
        )
        if proc.returncode != 0:
            print(f"error: CHC on {n} pairs failed: {proc.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
            return 1
        run = json.loads(proc.stdout.strip().splitlines()[-1])
        runs.append(run)
        for name, s in run["stages"].items():
            print(
                f"N={n:8d} {name:26s} {s['items']:8d} items {s['seconds']:9.2f} s  peak RSS {s['peak_rss_mib']} MiB"
                f" (load {run['load_avg_1min']})",
                flush=True,
            )
    runs.sort(key=lambda r: r["pairs"])
    from meta.config import load_meta_cfg

    fit_sample = int(load_meta_cfg(CONFIG).CHC.TOPICS.FIT_SAMPLE)
    result = {
        "runs": runs,
        "growth": fit_growth(runs, fit_sample),
        "settings": {
            "config": CONFIG,
            "backbone": "GRAM-Test-Tiny (CLIP stages not at real size)",
            "text_dtype": args.text_dtype,
            "threads": 1,
            "fit_sample": fit_sample,
            "timing": "measured on a shared 2-core VM, one run per size",
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
    }
    for name, g in result["growth"].items():
        law = g["seconds_law"]
        print(
            f"{name:26s} time ~ items^{law['p']:.2f} -> {g['target_seconds']} s at {g['target_items']} items"
            f" ({g['extrapolation']})"
            if law
            else f"{name:26s} (no fit)",
            flush=True,
        )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(args.out, result, indent=1)
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
