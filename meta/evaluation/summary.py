"""Seed-averaged summaries of evaluator records: paper-style rows and accuracy-vs-epoch curves.

Conventions (CoOp ``parse_test_res.py``): mean and population std over seeds; H of the *averaged* base and new
accuracies (paper Table 1).  The "Average over datasets" row averages each seed's accuracies over the datasets first
(only seeds every dataset has), then mean ± std over seeds and H of the two means.  All numbers in percent.
"""

from __future__ import annotations

import statistics
from typing import Iterable, Sequence

from meta.data.coop_data import harmonic_mean


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.pstdev(values) if len(values) > 1 else 0.0)


def method_key(record: dict) -> str:
    """A record's stable method key: its ``key`` field when a caller set one, else its ``method`` label."""
    return record.get("key", record["method"])


def _groups(records: Iterable[dict]) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for r in records:
        out.setdefault((r["protocol"], r["dataset"], method_key(r)), []).append(r)
    return out


def _seed_means(runs: Sequence[dict], value) -> dict[int, float]:
    """``{seed: mean of value(run) over that seed's runs}`` (one run per seed for one dataset;
    several - one per dataset - when averaging over datasets)."""
    per_seed: dict[int, list[float]] = {}
    for r in runs:
        per_seed.setdefault(r["seed"], []).append(value(r))
    return {seed: statistics.fmean(v) for seed, v in per_seed.items()}


def _head(protocol: str, dataset: str, runs: Sequence[dict]) -> dict:
    return {"protocol": protocol, "dataset": dataset, "key": method_key(runs[0]), "method": runs[0]["method"]}


def _row(protocol: str, dataset: str, runs: Sequence[dict]) -> dict:
    row = {**_head(protocol, dataset, runs), "seeds": sorted({r["seed"] for r in runs})}
    if protocol == "base2new":
        for k in ("base", "new"):
            row[f"{k}_mean"], row[f"{k}_std"] = _mean_std(list(_seed_means(runs, lambda r, k=k: r[k]).values()))
        row["H"] = harmonic_mean(row["base_mean"], row["new_mean"])
    else:
        row["source_mean"], row["source_std"] = _mean_std(list(_seed_means(runs, lambda r: r["source"]).values()))
        names = list(runs[0]["targets"])
        row["targets"] = {
            n: list(_mean_std(list(_seed_means(runs, lambda r, n=n: r["targets"][n]).values()))) for n in names
        }
        if names:
            per_seed = _seed_means(runs, lambda r: statistics.fmean(r["targets"][n] for n in names))
            row["target_mean"], row["target_std"] = _mean_std(list(per_seed.values()))
        else:
            row["target_mean"], row["target_std"] = None, None
    return row


def summarise(records: Iterable[dict], average: str = "") -> list[dict]:
    """One row per (protocol, dataset, method), in first-seen order, mean ± population std over seeds.

    base-to-new rows: ``base_mean``, ``base_std``, ``new_mean``, ``new_std``, ``H`` (of the means);
    transfer rows: ``source_mean``/``_std``, ``targets`` ``{name: [mean, std]}``, ``target_mean``/``target_std`` (each
    seed's accuracies averaged over the targets first).  Every row has ``protocol``, ``dataset``, ``key`` (the records'
    ``key`` field, else their method label), ``method`` (label) and ``seeds``.  Records are grouped by ``key``.

    ``average`` (e.g. ``"Average"``): also one row per base-to-new method under that name, by the module's "Average
    over datasets" rule (paper Table 1a).
    """
    records = list(records)
    rows = [_row(protocol, dataset, runs) for (protocol, dataset, _), runs in _groups(records).items()]
    if average:
        by_method: dict[str, list[dict]] = {}
        for r in records:
            if r["protocol"] == "base2new":
                by_method.setdefault(method_key(r), []).append(r)
        for runs in by_method.values():
            datasets = list(dict.fromkeys(r["dataset"] for r in runs))
            common = set.intersection(*({r["seed"] for r in runs if r["dataset"] == d} for d in datasets))
            kept = [r for r in runs if r["seed"] in common]
            if kept:
                rows.append(_row("base2new", average, kept) | {"datasets": datasets})
    return rows


def epoch_curves(records: Iterable[dict], keys: Sequence[str] = ("base", "new", "H"), average: str = "") -> list[dict]:
    """Accuracy vs fine-tuning epoch (paper Fig. 3a): mean and population std over seeds.

    One entry per (protocol, dataset, method): ``epochs`` (0 = before training), ``key``, ``method``
    and, per accuracy key k, ``k`` (seed means) and ``k_std`` at each epoch where every seed
    reported it.  ``average`` (a dataset name such as ``"Average"``): also one entry per method
    whose per-seed curve is first averaged over the datasets (epochs where every run reported).
    """
    records = list(records)

    def curve(protocol: str, dataset: str, runs: list[dict]) -> dict:
        per_epoch: dict[int, list[tuple[int, dict]]] = {}
        for r in runs:
            for row in r["history"]:
                if all(k in row for k in keys):
                    per_epoch.setdefault(row["epoch"], []).append((r["seed"], row))
        epochs = sorted(e for e, rows in per_epoch.items() if len(rows) == len(runs))
        entry = {**_head(protocol, dataset, runs), "epochs": epochs}
        for k in keys:
            stats = []
            for e in epochs:
                per_seed: dict[int, list[float]] = {}
                for seed, row in per_epoch[e]:
                    per_seed.setdefault(seed, []).append(row[k])
                stats.append(_mean_std([statistics.fmean(v) for v in per_seed.values()]))
            entry[k] = [m for m, _ in stats]
            entry[f"{k}_std"] = [sd for _, sd in stats]
        return entry

    curves = [curve(protocol, dataset, runs) for (protocol, dataset, _), runs in _groups(records).items()]
    if average:
        by_method: dict[tuple, list[dict]] = {}
        for r in records:
            by_method.setdefault((r["protocol"], method_key(r)), []).append(r)
        curves += [curve(protocol, average, runs) for (protocol, _), runs in by_method.items()]
    return curves


def format_row(row: dict) -> str:
    """A one-line text rendering of a :func:`summarise` row."""
    head = f"{row['dataset']:<20} {row['method']:<12}"
    if row["protocol"] == "base2new":
        return (
            f"{head} base {row['base_mean']:.2f} ± {row['base_std']:.2f}  "
            f"new {row['new_mean']:.2f} ± {row['new_std']:.2f}  H {row['H']:.2f}  (seeds {len(row['seeds'])})"
        )
    targets = "  ".join(f"{n} {m:.2f}" for n, (m, _) in row["targets"].items())
    return (
        f"{head} source {row['source_mean']:.2f} ± {row['source_std']:.2f}  {targets}  "
        f"target mean {row['target_mean']:.2f}  (seeds {len(row['seeds'])})"
    )
