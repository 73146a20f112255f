"""Seed-averaged summaries of evaluator records: paper-style rows and accuracy-vs-epoch curves.

Conventions (CoOp ``parse_test_res.py``: ``np.mean`` and ``np.std`` over seeds, i.e. the
population standard deviation; issue 4: H is the harmonic mean of the *averaged* base and new
accuracies, as the paper's Table 1 reports it).  All numbers in percent.
"""
from __future__ import annotations

import statistics
from typing import Iterable, Sequence

from ..coop_data import harmonic_mean


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.pstdev(values) if len(values) > 1 else 0.0)


def _groups(records: Iterable[dict]) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for r in records:
        out.setdefault((r["protocol"], r["dataset"], r["method"]), []).append(r)
    return out


def summarise(records: Iterable[dict]) -> list[dict]:
    """One row per (protocol, dataset, method), in first-seen order.

    base-to-new rows: ``base_mean``, ``base_std``, ``new_mean``, ``new_std``, ``H`` (of the means);
    transfer rows: ``source_mean``/``_std``, ``targets`` ``{name: [mean, std]}``, ``target_mean``.
    Every row has ``protocol``, ``dataset``, ``method``, ``seeds``.
    """
    rows = []
    for (protocol, dataset, method), runs in _groups(records).items():
        row = {"protocol": protocol, "dataset": dataset, "method": method, "seeds": [r["seed"] for r in runs]}
        if protocol == "base2new":
            row["base_mean"], row["base_std"] = _mean_std([r["base"] for r in runs])
            row["new_mean"], row["new_std"] = _mean_std([r["new"] for r in runs])
            row["H"] = harmonic_mean(row["base_mean"], row["new_mean"])
        else:
            row["source_mean"], row["source_std"] = _mean_std([r["source"] for r in runs])
            names = list(runs[0]["targets"])
            row["targets"] = {n: list(_mean_std([r["targets"][n] for r in runs])) for n in names}
            row["target_mean"] = statistics.fmean(m for m, _ in row["targets"].values()) if names else None
        rows.append(row)
    return rows


def average_over_datasets(rows: Iterable[dict]) -> list[dict]:
    """The paper's "Average over datasets" rows for base-to-new summaries: per method, the mean
    of the dataset means of base and new, and H of those two averages."""
    by_method: dict[str, list[dict]] = {}
    for row in rows:
        if row["protocol"] == "base2new":
            by_method.setdefault(row["method"], []).append(row)
    out = []
    for method, group in by_method.items():
        base = statistics.fmean(r["base_mean"] for r in group)
        new = statistics.fmean(r["new_mean"] for r in group)
        out.append({"protocol": "base2new", "dataset": "Average", "method": method,
                    "datasets": [r["dataset"] for r in group], "base_mean": base, "new_mean": new,
                    "H": harmonic_mean(base, new)})
    return out


def epoch_curves(records: Iterable[dict], keys: Sequence[str] = ("base", "new", "H")) -> list[dict]:
    """Accuracy vs fine-tuning epoch (paper Fig. 3a), averaged over seeds.

    One entry per (protocol, dataset, method): ``epochs`` (0 = before training) and, per key,
    the seed mean at each epoch where every seed reported it.
    """
    curves = []
    for (protocol, dataset, method), runs in _groups(records).items():
        per_epoch: dict[int, list[dict]] = {}
        for r in runs:
            for row in r["history"]:
                if all(k in row for k in keys):
                    per_epoch.setdefault(row["epoch"], []).append(row)
        epochs = sorted(e for e, rows in per_epoch.items() if len(rows) == len(runs))
        entry = {"protocol": protocol, "dataset": dataset, "method": method, "epochs": epochs}
        for k in keys:
            entry[k] = [statistics.fmean(row[k] for row in per_epoch[e]) for e in epochs]
        curves.append(entry)
    return curves


def format_row(row: dict) -> str:
    """A one-line text rendering of a :func:`summarise` / :func:`average_over_datasets` row."""
    head = f"{row['dataset']:<20} {row['method']:<12}"
    if row["protocol"] == "base2new":
        if "base_std" in row:
            return (f"{head} base {row['base_mean']:.2f} ± {row['base_std']:.2f}  "
                    f"new {row['new_mean']:.2f} ± {row['new_std']:.2f}  H {row['H']:.2f}  (seeds {len(row['seeds'])})")
        return f"{head} base {row['base_mean']:.2f}  new {row['new_mean']:.2f}  H {row['H']:.2f}"
    targets = "  ".join(f"{n} {m:.2f}" for n, (m, _) in row["targets"].items())
    return (f"{head} source {row['source_mean']:.2f} ± {row['source_std']:.2f}  {targets}  "
            f"target mean {row['target_mean']:.2f}  (seeds {len(row['seeds'])})")
