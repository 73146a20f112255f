#!/usr/bin/env python
"""Paper-style result tables from the logs the benchmark scripts write.

    python scripts/parse_results.py OUTPUT_ROOT [--out DIR] [--strict]

Reads (layout of scripts/base2new.sh, xd.sh, xdomain.sh):
  OUTPUT_ROOT/base2new/train_base/<dataset>/shots_<K>/<method>/seed<S>/log.txt   base accuracy
  OUTPUT_ROOT/base2new/test_new/<dataset>/shots_<K>/<method>/seed<S>/log.txt     new accuracy
  OUTPUT_ROOT/xd/train_imagenet/shots_<K>/<method>/seed<S>/log.txt                source (ImageNet)
  OUTPUT_ROOT/{xd,xdomain}/test/<target>/shots_<K>/<method>/seed<S>/log.txt       targets
and the base-to-new layout of CoOp's and MaPLe's own scripts (scripts/cocoop/base2new_*.sh,
scripts/maple/base2new_*.sh), whose runs are grouped by trainer + config as method ``<TRAINER>/<CFG>``:
  OUTPUT_ROOT/base2new/{train_base,test_new}/<dataset>/shots_<K>/<TRAINER>/<CFG>/seed<S>/log.txt

The accuracy of a log is the last ``* accuracy: X%`` line after its end signal, as CoOp's
``parse_test_res.py`` does: Dassl's ``Finish training`` for training logs and ``=> result`` for
``--eval-only`` logs (MaPLe's copy waits for "Finished training", which Dassl >= 0.6.1 no longer
prints: ``dassl/engine/trainer.py`` in KaiyangZhou/Dassl.pytorch).  Whether a folder is a training or an eval-only run
is read from the ``mode`` line of its ``gram_run.txt`` (written by the scripts; zsclip's base runs
are eval-only) and otherwise inferred from the folder (``train_*`` = training).  A run folder run again
holds several logs: Dassl never overwrites ``log.txt`` but writes the rerun's log to
``log.txt-<%Y-%m-%d-%H-%M-%S>`` (``setup_logger`` in ``dassl/utils/logger.py``).  The newest of them by
modification time is read (equal times: the later name), and a note on stderr names the log read.

Statistics are those of ``meta.evaluation.summary`` (the demo's too), over the seeds that have
both a base and a new run: per dataset, mean +- std over seeds (population std, ``np.std`` as
CoOp) of base and new, and H = harmonic mean of the *averaged* base and new; the Average row
averages each seed's accuracies over the datasets (seeds every dataset has), then mean +- std over
seeds, and its H is the harmonic mean of the two means (the convention of CoCoOp's Table 1).  Writes markdown, CSV and
a bar plot of H to ``--out``
(default OUTPUT_ROOT/tables) and prints the markdown.  Missing or unfinished runs are listed on
stderr, naming the file; ``--strict`` then exits with status 1.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from meta.data import coop_data  # noqa: E402
from meta.evaluation.summary import summarise  # noqa: E402
from meta.infra.dassl_runs import LogProblem, newest_log, read_accuracy, run_mode  # noqa: E402  (the runner's reader too)
from meta.method import methods as method_table  # noqa: E402

# Paper / CoOp order (meta.data.coop_data's dataset list); other names follow alphabetically.
DATASET_ORDER = list(coop_data.STANDARD_KEYS)
METHOD_ORDER = list(method_table.methods())  # the method table's order; row names: method_table.label (paper's rows)
DATASET_LABEL = {x.config_key: x.title for x in coop_data.STANDARD_LAYOUTS}  # the paper's column names
AVERAGE = "Average"
SEED_DIR = re.compile(r"^seed(-?\d+)$")
SHOTS_DIR = re.compile(r"^shots_(-?\d+)$")


@dataclass(frozen=True)
class RunKey:
    """One (table, shots, method, dataset, side) cell; ``side`` is base/new/source/target."""

    table: str
    shots: int
    method: str
    dataset: str
    side: str


def _order(name: str, order: list[str]) -> tuple[int, str]:
    return (order.index(name), name) if name in order else (len(order), name)


def _seed_dirs(method_dir: Path):
    for d in sorted(method_dir.iterdir()):
        m = SEED_DIR.match(d.name)
        if d.is_dir() and m:
            yield int(m.group(1)), d


def _has_seed_dirs(folder: Path) -> bool:
    return any(SEED_DIR.match(d.name) and d.is_dir() for d in folder.iterdir())


def _shots_method_dirs(parent: Path):
    """Yield (shots, method, method_dir) for every folder holding ``seed<S>/`` runs under ``parent/shots_<K>/``.

    Our scripts write ``shots_<K>/<method>/seed<S>``; CoOp's and MaPLe's write
    ``shots_<K>/<TRAINER>/<CFG>/seed<S>``, reported as method ``<TRAINER>/<CFG>``.
    """
    if not parent.is_dir():
        return
    for shots_dir in sorted(parent.iterdir()):
        m = SHOTS_DIR.match(shots_dir.name)
        if not (shots_dir.is_dir() and m):
            continue
        for method_dir in sorted(d for d in shots_dir.iterdir() if d.is_dir()):
            if _has_seed_dirs(method_dir):
                yield int(m.group(1)), method_dir.name, method_dir
                continue
            for cfg_dir in sorted(d for d in method_dir.iterdir() if d.is_dir()):
                if _has_seed_dirs(cfg_dir):
                    yield int(m.group(1)), f"{method_dir.name}/{cfg_dir.name}", cfg_dir


def collect(root: Path, notes: list[str] | None = None) -> tuple[dict[RunKey, dict[int, float]], list[str]]:
    """Accuracies ``{RunKey: {seed: acc%}}`` under ``root`` and the list of problems found.

    ``notes``, when given, receives one line per run folder holding several Dassl logs, naming the one read.
    """
    results: dict[RunKey, dict[int, float]] = defaultdict(dict)
    problems: list[str] = []
    seeds_seen: dict[tuple, dict[str, dict[int, Path]]] = defaultdict(lambda: defaultdict(dict))

    def visit(key: RunKey, method_dir: Path, default_mode: str) -> None:
        for seed, run_dir in _seed_dirs(method_dir):
            seeds_seen[(key.table, key.shots, key.method, key.dataset)][key.side][seed] = run_dir
            log, n_logs = newest_log(run_dir)
            if n_logs > 1 and notes is not None:
                notes.append(f"{run_dir}: {n_logs} Dassl logs (reruns), read the newest: {log.name}")
            try:
                results[key][seed] = read_accuracy(log, run_mode(run_dir, default_mode))
            except LogProblem as err:
                problems.append(str(err))

    for side, sub, mode in (("base", "train_base", "train"), ("new", "test_new", "eval")):
        parent = root / "base2new" / sub
        if parent.is_dir():
            for ds_dir in sorted(p for p in parent.iterdir() if p.is_dir()):
                for shots, method, method_dir in _shots_method_dirs(ds_dir):
                    visit(RunKey("base2new", shots, method, ds_dir.name, side), method_dir, mode)
    for shots, method, method_dir in _shots_method_dirs(root / "xd" / "train_imagenet"):
        for table in ("xd", "xdomain"):
            if (root / table / "test").is_dir():
                visit(RunKey(table, shots, method, "imagenet", "source"), method_dir, "train")
    for table in ("xd", "xdomain"):
        parent = root / table / "test"
        if parent.is_dir():
            for ds_dir in sorted(p for p in parent.iterdir() if p.is_dir()):
                for shots, method, method_dir in _shots_method_dirs(ds_dir):
                    visit(RunKey(table, shots, method, ds_dir.name, "target"), method_dir, "eval")
    # A base run without its new run (or the reverse) is reported, naming the expected file.
    for (table, shots, method, dataset), sides in seeds_seen.items():
        if table != "base2new":
            continue
        for have, lack, sub in (("base", "new", "test_new"), ("new", "base", "train_base")):
            for seed in sorted(set(sides[have]) - set(sides[lack])):
                expected = root / "base2new" / sub / dataset / f"shots_{shots}" / method / f"seed{seed}" / "log.txt"
                problems.append(f"missing {lack} run: {expected}")
    # A source (ImageNet) run without one of its target runs is reported the same way.
    expected_targets = {"xd": coop_data.CROSS_DATASET_TARGETS, "xdomain": coop_data.CROSS_DOMAIN_TARGETS}
    for (table, shots, method, dataset), sides in seeds_seen.items():
        if table not in expected_targets or dataset != coop_data.TRANSFER_SOURCE:
            continue
        for seed in sorted(sides["source"]):
            for target in expected_targets[table]:
                if seed not in seeds_seen.get((table, shots, method, target), {}).get("target", {}):
                    expected = root / table / "test" / target / f"shots_{shots}" / method / f"seed{seed}" / "log.txt"
                    problems.append(f"missing target run: {expected}")
    return dict(results), problems


@dataclass
class Stat:
    """Mean and population std (%) over ``n`` seeds."""

    mean: float
    std: float
    n: int

    def fmt(self) -> str:
        return f"{self.mean:.2f} ± {self.std:.2f}"


def base2new_records(results: dict[RunKey, dict[int, float]], shots: int) -> list[dict]:
    """One ``meta.evaluation.summary`` record per (method, dataset, seed) with both a base and a new run."""
    records = []
    for k in results:
        if k.table != "base2new" or k.shots != shots or k.side != "base":
            continue
        base, new = results[k], results.get(RunKey("base2new", shots, k.method, k.dataset, "new"), {})
        records += [
            {
                "protocol": "base2new",
                "dataset": k.dataset,
                "key": k.method,
                "method": method_table.label(k.method),
                "seed": seed,
                "base": base[seed],
                "new": new[seed],
            }
            for seed in sorted(set(base) & set(new))
        ]
    return records


def base2new_rows(results: dict[RunKey, dict[int, float]], shots: int, method: str) -> list[dict]:
    """Rows ``{dataset, base, new, H}`` (Average first) for one method and shot count.

    Statistics are ``meta.evaluation.summary.summarise``'s over the seeds that have both runs
    (an unpaired run is reported by :func:`collect`); the Average row is its "Average over datasets".
    """
    records = [r for r in base2new_records(results, shots) if r["key"] == method]
    averages, rows = [], []
    for row in summarise(records, average=AVERAGE):
        n = len(row["seeds"])
        out = {
            "dataset": row["dataset"],
            "base": Stat(row["base_mean"], row["base_std"], n),
            "new": Stat(row["new_mean"], row["new_std"], n),
            "H": row["H"],
        }
        if "datasets" in row:  # the average row
            k = len(row["datasets"])
            averages.append(
                out | {"dataset": f"Average over {k} dataset{'s' if k > 1 else ''}", "average": True, "datasets": k}
            )
        else:
            rows.append(out)
    return averages + sorted(rows, key=lambda r: _order(r["dataset"], DATASET_ORDER))


def _cell(s: Stat | None) -> str:
    return "–" if s is None else s.fmt()


def write_base2new(results, out: Path, stem_prefix: str = "base2new") -> list[Path]:
    """Markdown, CSV and H bar plot per shot count; returns the files written."""
    written: list[Path] = []
    shot_counts = sorted({k.shots for k in results if k.table == "base2new"})
    for shots in shot_counts:
        methods = sorted(
            {k.method for k in results if k.table == "base2new" and k.shots == shots},
            key=lambda m: _order(m, METHOD_ORDER),
        )
        per_method = {m: base2new_rows(results, shots, m) for m in methods}
        # markdown: one table per dataset (Average first), methods as rows - the layout of Table 1
        by_dataset: dict[str, list[tuple[str, dict]]] = defaultdict(list)
        for m in methods:
            for row in per_method[m]:
                key = "Average" if row.get("average") else row["dataset"]
                by_dataset[key].append((m, row))
        order = sorted(by_dataset, key=lambda d: (-1, d) if d == "Average" else _order(d, DATASET_ORDER))
        lines = [
            f"# Base-to-new generalisation, {shots} shots",
            "",
            "Base/New: mean ± std over seeds (%); H: harmonic mean of the mean Base and New.",
            "",
        ]
        for ds in order:
            title = next((r["dataset"] for _, r in by_dataset[ds] if r.get("average")), ds)
            lines += [
                f"## {title if ds == 'Average' else DATASET_LABEL.get(ds, ds)}",
                "",
                "| Method | Base | New | H | seeds (base/new) |",
                "|---|---|---|---|---|",
            ]
            for m, r in by_dataset[ds]:
                avg = bool(r.get("average"))
                h = f"{r['H']:.2f}" if r["H"] is not None else "–"
                seeds = f"{r['base'].n if r['base'] else 0}/{r['new'].n if r['new'] else 0}"
                if avg:
                    seeds = f"{r['base'].n} (on all {r['datasets']} dataset{'s' if r['datasets'] > 1 else ''})"
                lines.append(f"| {method_table.label(m)} | {_cell(r['base'])} | {_cell(r['new'])} | {h} | {seeds} |")
            lines.append("")
        md = out / f"{stem_prefix}_shots{shots}.md"
        md.write_text("\n".join(lines))
        csv_path = out / f"{stem_prefix}_shots{shots}.csv"
        with open(csv_path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(
                [
                    "shots",
                    "method",
                    "dataset",
                    "base_mean",
                    "base_std",
                    "base_seeds",
                    "new_mean",
                    "new_std",
                    "new_seeds",
                    "H",
                ]
            )
            for m in methods:
                for r in per_method[m]:
                    b, n = r["base"], r["new"]
                    w.writerow(
                        [
                            shots,
                            m,
                            "average" if r.get("average") else r["dataset"],
                            _num(b and b.mean),
                            _num(b and b.std),
                            b.n if b else 0,
                            _num(n and n.mean),
                            _num(n and n.std),
                            n.n if n else 0,
                            _num(r["H"]),
                        ]
                    )
        png = out / f"{stem_prefix}_shots{shots}_H.png"
        _bar_plot(per_method, png, f"Base-to-new H, {shots} shots")
        written += [md, csv_path, png]
    return written


def _num(x) -> str:
    if x is None or (isinstance(x, float) and np.isnan(x)):
        return ""
    return f"{x:.4f}"


def _bar_plot(per_method: dict[str, list[dict]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels: list[str] = []
    for rows in per_method.values():
        for r in rows:
            name = "Average" if r.get("average") else r["dataset"]
            if r["H"] is not None and name not in labels:
                labels.append(name)
    labels.sort(key=lambda d: (-1, d) if d == "Average" else _order(d, DATASET_ORDER))
    x = np.arange(len(labels))
    width = 0.8 / max(1, len(per_method))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(labels) + 2), 4.0))
    for i, (method, rows) in enumerate(per_method.items()):
        h = {("Average" if r.get("average") else r["dataset"]): r["H"] for r in rows}
        ax.bar(
            x + i * width - 0.4 + width / 2,
            [h.get(lbl) or 0.0 for lbl in labels],
            width,
            label=method_table.label(method),
        )
    ax.set_xticks(x)
    ax.set_xticklabels([DATASET_LABEL.get(lbl, lbl) for lbl in labels], rotation=30, ha="right")
    ax.set_ylabel("H (%)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def transfer_row(results: dict[RunKey, dict[int, float]], table: str, shots: int, method: str) -> dict | None:
    """``meta.evaluation.summary``'s row of one method's transfer runs: source and per-target mean ± std
    and the target average (each seed's targets averaged first), over the seeds that have the source
    run and every target run the method has (a seed missing one is reported by :func:`collect`)."""
    source = results.get(RunKey(table, shots, method, "imagenet", "source"), {})
    targets = {
        k.dataset: v
        for k, v in results.items()
        if (k.table, k.shots, k.method, k.side) == (table, shots, method, "target")
    }
    names = sorted(targets, key=lambda d: _order(d, DATASET_ORDER))
    seeds = set(source).intersection(*(set(v) for v in targets.values()))
    records = [
        {
            "protocol": table,
            "dataset": "imagenet",
            "key": method,
            "method": method_table.label(method),
            "seed": seed,
            "source": source[seed],
            "targets": {t: targets[t][seed] for t in names},
        }
        for seed in sorted(seeds)
    ]
    return summarise(records)[0] if records else None


def write_transfer(results, table: str, out: Path) -> list[Path]:
    """Cross-dataset / cross-domain tables: methods as rows, source then targets then target average."""
    written: list[Path] = []
    for shots in sorted({k.shots for k in results if k.table == table}):
        keys = [k for k in results if k.table == table and k.shots == shots]
        methods = sorted({k.method for k in keys}, key=lambda m: _order(m, METHOD_ORDER))
        targets = sorted({k.dataset for k in keys if k.side == "target"}, key=lambda d: _order(d, DATASET_ORDER))
        cols = ["ImageNet (source)", *[DATASET_LABEL.get(t, t) for t in targets], "Average (targets)"]
        title = "Cross-dataset transfer" if table == "xd" else "Cross-domain generalisation"
        lines = [
            f"# {title}, ImageNet {shots} shots",
            "",
            "Accuracy (%): mean ± std over seeds (those with the source and every target run).",
            "",
            "| Method | " + " | ".join(cols) + " |",
            "|---" * (len(cols) + 1) + "|",
        ]
        csv_rows = []
        for m in methods:
            row = transfer_row(results, table, shots, m)
            src = Stat(row["source_mean"], row["source_std"], len(row["seeds"])) if row else None
            tgt = [
                Stat(*row["targets"][t], len(row["seeds"])) if row and t in row["targets"] else None for t in targets
            ]
            avg = (
                Stat(row["target_mean"], row["target_std"], len(row["seeds"]))
                if row and list(row["targets"]) == targets
                else None
            )  # only over every target
            cells = [_cell(src), *[_cell(s) for s in tgt], _cell(avg)]
            lines.append(f"| {method_table.label(m)} | " + " | ".join(cells) + " |")
            for name, s in [("imagenet", src), *zip(targets, tgt), ("target_average", avg)]:
                csv_rows.append([shots, m, name, _num(s and s.mean), _num(s and s.std), s.n if s else 0])
        md = out / f"{table}_shots{shots}.md"
        md.write_text("\n".join(lines) + "\n")
        csv_path = out / f"{table}_shots{shots}.csv"
        with open(csv_path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["shots", "method", "dataset", "mean", "std", "seeds"])
            w.writerows(csv_rows)
        written += [md, csv_path]
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output_root", type=Path, help="the OUTPUT root the scripts wrote to")
    parser.add_argument("--out", type=Path, default=None, help="where tables go (default OUTPUT_ROOT/tables)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a run is missing or unfinished")
    args = parser.parse_args(argv)
    root = args.output_root
    if not root.is_dir():
        print(f"output root not found: {root}", file=sys.stderr)
        return 2
    notes: list[str] = []
    results, problems = collect(root, notes)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    for p in problems:
        print(f"WARNING: {p}", file=sys.stderr)
    if not results:
        print(
            f"no finished runs under {root} (expected base2new/, xd/ or xdomain/ as this repository's or "
            f"CoOp's/MaPLe's scripts write them)",
            file=sys.stderr,
        )
        return 1
    out = args.out or (root / "tables")
    os.makedirs(out, exist_ok=True)
    written = (
        write_base2new(results, out) + write_transfer(results, "xd", out) + write_transfer(results, "xdomain", out)
    )
    for path in written:
        if path.suffix == ".md":
            print(path.read_text())
    print("Wrote: " + ", ".join(str(p) for p in written))
    return 1 if (args.strict and problems) else 0


if __name__ == "__main__":
    sys.exit(main())
