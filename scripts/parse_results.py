#!/usr/bin/env python
"""Paper-style result tables from the logs the benchmark scripts write.

    python scripts/parse_results.py OUTPUT_ROOT [--out DIR] [--strict]
    python scripts/parse_results.py OUTPUT_ROOT --compare BASELINE METHOD [--compare C D ...] [--shots K]

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

``--compare BASELINE METHOD`` (repeatable) judges base-to-new runs as ``gram_world.study`` judges its claims, with
the datasets in the place of the study's worlds: per dataset, Base and New averaged over the seeds both methods
ran and H of those means; ΔH = H(METHOD) − H(BASELINE); the paired t-test over datasets, a 95 % bootstrap
interval and Holm over the pairs asked (``gram_tools.paired_stats``, the study's functions).  It prints the
table, each dataset's ΔH and the (dataset, seed) runs either side lacks, writes no file, and refuses in one line
(exit 2) a pair whose sides ran different shot counts or whose logs name different CLIP backbones.
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

from gram_tools.paired_stats import bootstrap_interval, holm, world_t_p  # noqa: E402  (the study's statistics)
from meta.data import coop_data  # noqa: E402
from meta.evaluation.summary import summarise  # noqa: E402
from meta.infra.dassl_runs import LogProblem, newest_log, read_accuracy, run_mode  # noqa: E402  (the runner's reader too)
from meta.method import methods as method_table  # noqa: E402
from meta.model.clip_weights import open_clip_name  # noqa: E402

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


def collect(
    root: Path, notes: list[str] | None = None, logs: dict[tuple[RunKey, int], Path] | None = None
) -> tuple[dict[RunKey, dict[int, float]], list[str]]:
    """Accuracies ``{RunKey: {seed: acc%}}`` under ``root`` and the list of problems found.

    ``notes``, when given, receives one line per run folder holding several Dassl logs, naming the one read;
    ``logs``, when given, receives ``{(RunKey, seed): the log read}`` for every run folder visited.
    """
    results: dict[RunKey, dict[int, float]] = defaultdict(dict)
    problems: list[str] = []
    seeds_seen: dict[tuple, dict[str, dict[int, Path]]] = defaultdict(lambda: defaultdict(dict))

    def visit(key: RunKey, method_dir: Path, default_mode: str) -> None:
        for seed, run_dir in _seed_dirs(method_dir):
            seeds_seen[(key.table, key.shots, key.method, key.dataset)][key.side][seed] = run_dir
            log, n_logs = newest_log(run_dir)
            if logs is not None:
                logs[(key, seed)] = log
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


# --------------------------------------------------------------------------------------------------
# --compare BASELINE METHOD: a user's runs judged like the project's study (gram_tools.paired_stats), with the
# datasets in the place of the study's worlds.

_CONFIG_LINE = re.compile(r"^( *)([A-Z][A-Z0-9_]*):(?: (.*))?$")
_DUMP_START, _DUMP_END = "** Config **", "Collecting env info"


class CompareRefused(ValueError):
    """A ``--compare`` pair that cannot be paired (one-line message naming the pair and what differs)."""


def recorded_clip(log: Path) -> str | None:
    """The CLIP architecture a Dassl log's config dump (``print_args`` of CoOp's and our ``train.py``) names:
    ``TRAINER.GRAM.MODEL_NAME`` when set, else ``MODEL.BACKBONE.NAME`` in open_clip's spelling ("ViT-B/16" ->
    "ViT-B-16"); None when the log holds no dump or the dump names neither."""
    if not log.is_file():
        return None
    keys: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    in_dump = False
    with open(log, errors="replace") as f:
        for line in f:
            line = line.rstrip("\n")
            if not in_dump:
                in_dump = line.strip() == _DUMP_START
                continue
            if line.startswith(_DUMP_END):
                break
            m = _CONFIG_LINE.match(line)
            if not m:
                continue
            indent, name, value = len(m.group(1)), m.group(2), m.group(3)
            while stack and stack[-1][0] >= indent:
                stack.pop()
            if value is None:
                stack.append((indent, name))
            else:
                keys[".".join([k for _, k in stack] + [name])] = value.strip()
    name = keys.get("TRAINER.GRAM.MODEL_NAME", "") or open_clip_name(keys.get("MODEL.BACKBONE.NAME", ""))
    return name or None


def paired_runs(results: dict[RunKey, dict[int, float]], shots: int, method: str) -> dict[str, dict[int, tuple]]:
    """``{dataset: {seed: (base %, new %)}}`` of one method's base-to-new runs that have both sides."""
    out: dict[str, dict[int, tuple]] = {}
    for k, base in results.items():
        if (k.table, k.shots, k.method, k.side) == ("base2new", shots, method, "base"):
            new = results.get(RunKey("base2new", shots, method, k.dataset, "new"), {})
            both = {seed: (base[seed], new[seed]) for seed in sorted(set(base) & set(new))}
            if both:
                out[k.dataset] = both
    return out


def _shot_counts(results: dict[RunKey, dict[int, float]], method: str) -> set[int]:
    return {k.shots for k in results if k.table == "base2new" and k.method == method}


def _missing(have: dict[str, dict[int, tuple]], lack: dict[str, dict[int, tuple]]) -> list[str]:
    """``dataset seed<S>`` of every paired run in ``have`` whose (dataset, seed) ``lack`` has not."""
    return [
        f"{d} seed{s}"
        for d in sorted(have, key=lambda d: _order(d, DATASET_ORDER))
        for s in sorted(have[d])
        if s not in lack.get(d, {})
    ]


def _check_clips(pair: str, sides: dict[str, list[str | None]], notes: list[str]) -> None:
    """Refuse a pair whose logs name more than one CLIP; note the logs that name none."""
    named = {m: sorted({c for c in clips if c}) for m, clips in sides.items()}
    if len(set().union(*named.values())) > 1:
        ran = "; ".join(f"{m} ran {', '.join(c) or 'an unrecorded CLIP'}" for m, c in named.items())
        raise CompareRefused(
            f"--compare {pair}: runs of different configs ({ran}; MODEL.BACKBONE.NAME or TRAINER.GRAM.MODEL_NAME "
            "in their logs' config dump); compare runs of one backbone"
        )
    unknown = sum(c is None for clips in sides.values() for c in clips)
    if unknown:
        total = sum(len(c) for c in sides.values())
        notes.append(f"--compare {pair}: {unknown} of {total} logs carry no Dassl config dump; backbone not checked")


def compare(
    results: dict[RunKey, dict[int, float]],
    pairs: list[tuple[str, str]],
    logs: dict[tuple[RunKey, int], Path] | None = None,
    shots: int | None = None,
    notes: list[str] | None = None,
) -> list[dict]:
    """One row per (pair, shot count): ``pairs`` = [(baseline, method)], ΔH = H(method) − H(baseline).

    Per dataset both methods ran: Base and New (%) averaged over the seeds both ran, H of those means.  Row:
    ``base``, ``new``, ``H`` = (baseline, method) means over the paired datasets (``H``: the mean of the datasets'
    H, so that its difference is ``mean_diff_H``), ``ci95`` (two-level bootstrap over datasets), ``p`` (paired
    t-test over datasets, None with fewer than two), ``p_holm`` (Holm over every row), ``per_dataset``
    {dataset: ΔH}, ``missing_from_baseline`` / ``missing_from_method`` (``dataset seed<S>`` one side lacks).
    ``logs`` ({(RunKey, seed): log}, :func:`collect`): every log's CLIP must agree within a pair.
    Raises :class:`CompareRefused` for a method without runs or sides of different shot counts or CLIPs."""
    notes = [] if notes is None else notes
    known = sorted({k.method for k in results if k.table == "base2new"}, key=lambda m: _order(m, METHOD_ORDER))
    rows = []
    for baseline, method in pairs:
        pair = f"{baseline} {method}"
        counts = {}
        for m in (baseline, method):
            counts[m] = _shot_counts(results, m)
            if not counts[m]:
                raise CompareRefused(
                    f"--compare {pair}: no base-to-new runs of method '{m}' (methods found: {', '.join(known)})"
                )
        if shots is not None:
            lacking = [m for m in (baseline, method) if shots not in counts[m]]
            if lacking:
                raise CompareRefused(
                    f"--compare {pair}: --shots {shots}: {lacking[0]} has runs at shots "
                    f"{', '.join(map(str, sorted(counts[lacking[0]])))} only"
                )
            shot_list = [shots]
        elif counts[baseline] != counts[method]:
            raise CompareRefused(
                f"--compare {pair}: runs of different shot counts ({baseline}: shots "
                f"{', '.join(map(str, sorted(counts[baseline])))}; {method}: shots "
                f"{', '.join(map(str, sorted(counts[method])))}); pass --shots K to pair one shot count both ran"
            )
        else:
            shot_list = sorted(counts[baseline])
        for k in shot_list:
            runs = {m: paired_runs(results, k, m) for m in (baseline, method)}
            if logs is not None:
                sides = {
                    m: [
                        recorded_clip(log)
                        for (key, _), log in logs.items()
                        if (key.table, key.shots, key.method) == ("base2new", k, m)
                    ]
                    for m in (baseline, method)
                }
                _check_clips(f"{pair} (shots {k})", sides, notes)
            rows.append(_compare_row(baseline, method, k, runs[baseline], runs[method]))
    for row, p in zip(rows, holm([r["p"] for r in rows])):
        row["p_holm"], row["family"] = p, sum(r["p"] is not None for r in rows)
    return rows


def _compare_row(baseline: str, method: str, shots: int, a: dict, b: dict) -> dict:
    """The statistics of one pair at one shot count from both sides' :func:`paired_runs`."""
    per_dataset: dict[str, dict] = {}
    for d in sorted(set(a) & set(b), key=lambda d: _order(d, DATASET_ORDER)):
        seeds = sorted(set(a[d]) & set(b[d]))
        if not seeds:
            continue
        cell = {}
        for side, runs in (("baseline", a[d]), ("method", b[d])):
            base = float(np.mean([runs[s][0] for s in seeds]))
            new = float(np.mean([runs[s][1] for s in seeds]))
            cell[side] = (base, new, coop_data.harmonic_mean(base, new))
        cell["seeds"] = seeds
        per_dataset[d] = cell
    groups = {d: [c["method"][2] - c["baseline"][2]] for d, c in per_dataset.items()}
    row: dict = {
        "baseline": baseline,
        "method": method,
        "shots": shots,
        "datasets": list(per_dataset),
        "per_dataset": {d: g[0] for d, g in groups.items()},
        "missing_from_baseline": _missing(b, a),
        "missing_from_method": _missing(a, b),
        "p": None,
        "mean_diff_H": None,
        "ci95": None,
    }
    for name, i in (("base", 0), ("new", 1), ("H", 2)):
        row[name] = tuple(
            float(np.mean([c[side][i] for c in per_dataset.values()])) if per_dataset else None
            for side in ("baseline", "method")
        )
    if groups:
        mean, lo, hi = bootstrap_interval(groups)
        row.update(mean_diff_H=mean, ci95=(lo, hi), p=world_t_p(groups))
    return row


def _pct(x: float | None, sign: bool = False) -> str:
    return "–" if x is None else (f"{x:+.2f}" if sign else f"{x:.2f}")


def _pval(p: float | None) -> str:
    return "–" if p is None else f"{p:.3g}"


def compare_markdown(rows: list[dict]) -> str:
    """The comparison table (one line per row of :func:`compare`), then each row's ΔH per dataset and the runs
    missing from either side."""
    family = rows[0]["family"] if rows else 0
    lines = [
        "# Paired comparison over datasets, base-to-new",
        "",
        "Per dataset: Base and New averaged over the seeds both methods ran, H of those means, ΔH = H(method) − "
        "H(baseline). Means over the datasets paired; p: paired t-test over datasets (the study's world t-test); "
        f"interval: 95 % bootstrap over datasets; Holm over the {family} row{'s' if family != 1 else ''} tested.",
        "",
        "| baseline → method | shots | datasets | Base | New | H | mean ΔH | 95 % interval | p | p Holm |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        means = [f"{_pct(r[k][0])} / {_pct(r[k][1])}" for k in ("base", "new", "H")]
        ci = "–" if r["ci95"] is None else f"[{r['ci95'][0]:+.2f}, {r['ci95'][1]:+.2f}]"
        name = f"{method_table.label(r['baseline'])} → {method_table.label(r['method'])}"
        lines.append(
            f"| {name} | {r['shots']} | {len(r['datasets'])} | {' | '.join(means)} | {_pct(r['mean_diff_H'], True)}"
            f" | {ci} | {_pval(r['p'])} | {_pval(r['p_holm'])} |"
        )
    lines.append("")
    for r in rows:
        lines.append(f"{r['baseline']} → {r['method']}, {r['shots']} shots:")
        deltas = ", ".join(f"{d} {v:+.2f}" for d, v in r["per_dataset"].items())
        lines.append(f"  ΔH per dataset: {deltas or 'none (no dataset has runs of both)'}")
        if r["p"] is None:
            lines.append(f"  no test: {len(r['datasets'])} dataset(s) paired, a test needs two")
        lines.append(f"  missing from {r['method']}: {', '.join(r['missing_from_method']) or 'none'}")
        lines.append(f"  missing from {r['baseline']}: {', '.join(r['missing_from_baseline']) or 'none'}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output_root", type=Path, help="the OUTPUT root the scripts wrote to")
    parser.add_argument("--out", type=Path, default=None, help="where tables go (default OUTPUT_ROOT/tables)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a run is missing or unfinished")
    parser.add_argument(
        "--compare",
        nargs=2,
        action="append",
        metavar=("BASELINE", "METHOD"),
        help="test METHOD against BASELINE over datasets (repeatable; Holm over the pairs); prints, writes no table",
    )
    parser.add_argument("--shots", type=int, default=None, help="with --compare: the shot count to pair")
    args = parser.parse_args(argv)
    root = args.output_root
    if args.shots is not None and not args.compare:
        print("--shots: only with --compare (the tables cover every shot count)", file=sys.stderr)
        return 2
    if not root.is_dir():
        print(f"output root not found: {root}", file=sys.stderr)
        return 2
    notes: list[str] = []
    logs: dict[tuple[RunKey, int], Path] = {}
    results, problems = collect(root, notes, logs)
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
    if args.compare:
        checks: list[str] = []
        try:
            rows = compare(results, [tuple(p) for p in args.compare], logs, args.shots, checks)
        except CompareRefused as err:
            print(err, file=sys.stderr)
            return 2
        for note in checks:
            print(f"note: {note}", file=sys.stderr)
        print(compare_markdown(rows), end="")
        return 1 if (args.strict and problems) else 0
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
