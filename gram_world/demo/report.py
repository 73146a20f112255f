"""Stage 6 of the demo: every table of the paper (``results.md`` / ``results.json``) and the plots.

Tables are built from the run records of :mod:`.stages` with ``meta.evaluation.summarise``: mean ±
population std over seeds; for "Average" each seed's accuracies are averaged over the datasets first,
H is the harmonic mean of the mean base and new accuracies.  Rows carry the stable method key
(:data:`.settings.METHODS`) and the paper's row name.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import fields
from pathlib import Path

import torch

from meta.evaluation.spec import TrainSpec
from meta.evaluation.summary import epoch_curves, summarise
from meta.fingerprint.record import computed_by
from meta.infra.provenance import git_commit
from meta.metatrain.runlog import read_log

from .settings import (
    DEEP_KEYS,
    EPOCH_CURVE_KEYS,
    EPOCH_PLOT_KEYS,
    META_VARIANTS,
    METHOD_BY_KEY,
    TABLE1_ROWS,
    TABLE4_KEYS,
    TOKEN_KEYS,
    TRANSFER_KEYS,
    VARIANT_BY_NAME,
    DemoSettings,
    consistency_keys,
    consistency_lambdas,
    settings_hash,
    settings_record,
    variants_needed,
)
from .testtime_report import build_testtime_table, markdown_of_testtime

AVERAGE = "Average"
QUICK_NOTE = (
    "Quick demo: these numbers check the wiring of every stage (a CLIP near chance, few steps); they are not "
    "results and do not compare methods."
)
# colours of Fig. 3a's methods
COLOURS = {
    "zsclip": "0.4",
    "coop": "tab:blue",
    "gram_coop": "tab:cyan",
    "vpt": "tab:red",
    "gram_vpt": "tab:orange",
    "unigram": "tab:green",
    "unigram_no_shift": "tab:purple",
    "unigram_no_reg": "tab:brown",
    "unigram_pretrain": "tab:pink",
    "unigram_supervised": "tab:olive",
    "joint": "tab:gray",
    "cocoop": "midnightblue",
    "gram_cocoop": "darkturquoise",
    "gram_cocoop_init_only": "lightseagreen",
}


# Plot labels that read without the paper: Table 4 names its rows by the part of UNIGRAM removed ("- gradient
# regulating" under a "UNIGRAM" row); a plot names what the run is.  The tables keep the paper's row names.
PLOT_LABELS = {
    "unigram_no_shift": "UNIGRAM, meta-trained without domain shift",
    "unigram_no_reg": "UNIGRAM, no R_φ (θ* meta-trained and tuned without it)",
    "unigram_pretrain": "UNIGRAM, θ* from prompt pre-training (no meta-learning)",
    "unigram_supervised": "UNIGRAM, meta-trained on labelled images (no CHC)",
    "joint": "text + visual prompts tuned jointly (no GRAM)",
}
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
LINESTYLES = ("-", "--", "-.", ":")
FEW_POINTS = 5  # a series with fewer points is drawn with large markers and its count said


def plot_label(key: str, fallback: str = "") -> str:
    """The name of row ``key`` in a plot: :data:`PLOT_LABELS`, else the row's name where it stands alone
    (:attr:`.settings.MethodRow.standalone_label`), else ``fallback`` (a row the method table does not know)."""
    if key in PLOT_LABELS:
        return PLOT_LABELS[key]
    row = METHOD_BY_KEY.get(key)
    return row.standalone_label if row is not None else (fallback or key)


def _seed_count(rows: list) -> int:
    """The most seeds any of ``rows`` (``summarise`` rows) averages over."""
    return max((len(r.get("seeds", ())) for r in rows), default=0)


def _spread(n_seeds: int) -> str:
    """What the error bars of a plot over ``n_seeds`` seeds show (none for one seed: a std of one value is 0)."""
    return f"mean ± std over {n_seeds} seeds" if n_seeds > 1 else "1 seed, so no error bars"


def colour(key: str):
    """The plot colour of demo row (or meta variant) ``key``: its entry in :data:`COLOURS`, else one of the 40
    colours of matplotlib's ``tab20b`` + ``tab20c`` chosen by the row's place among the method table's rows without an
    entry, so a row added to the table is drawn, in a colour of its own, before anyone picks one for it."""
    if key in COLOURS:
        return COLOURS[key]
    import matplotlib

    order = [k for k in METHOD_BY_KEY if k not in COLOURS]
    place = (order.index(key) if key in order else len(order)) % 40
    return matplotlib.colormaps["tab20b" if place < 20 else "tab20c"](place % 20)


# ------------------------------------------------------------------ provenance
def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU core(s) ({cpu}), python "
        f"{platform.python_version()}, torch {torch.__version__}, 1 thread per worker, CPU only"
    )


def provenance(settings: DemoSettings, world, weights: Path) -> dict:
    """What the numbers depend on: world seed and hash, CLIP weights, demo settings hash, commit, machine, and
    what computed them (:func:`meta.fingerprint.record.computed_by`: numerics fingerprint, kernel pins, CPU, builds)."""
    source = world.with_role("cross_domain_source")
    return {
        "world_seed": settings.world_seed,
        "world_settings_hash": world.settings_hash,
        "world_root": str(world.root),
        "holdout_style": world.settings.get("holdout_style"),
        "mixed_classes": list(source[0].classnames) if source else [],
        "clip_weights": weights.name,
        "demo_settings_hash": settings_hash(settings),
        "commit": git_commit(Path(__file__).resolve().parent),
        "machine": _machine(),
        "computed_by": computed_by(),  # numerics fingerprint, CPU and its kernel flags, pins, builds
        "finished_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "tables": list(settings.tables),
    }


# ------------------------------------------------------------------ tables
def _ordered(rows: list, keys: tuple) -> list:
    """Rows whose key is in ``keys``, grouped by dataset (first-seen order) and in ``keys`` order."""
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    return [r for d in datasets for k in keys for r in rows if r["dataset"] == d and r["key"] == k]


def _subset(record: dict, targets: list) -> dict:
    """A transfer record restricted to some targets (one table's columns), its target mean recomputed."""
    kept = {n: record["targets"][n] for n in targets if n in record["targets"]}
    return {**record, "targets": kept, "target_mean": sum(kept.values()) / len(kept) if kept else None}


def build_tables(records: list, settings: DemoSettings, world) -> dict:
    """``{table id: {"title", "kind", "rows", ...}}`` for the requested table groups (paper ids:
    table1, table4, tableA3 base-to-new; table2, table3, tableA1, tableA2 transfer; testtime)."""
    testtime = [r for r in records if r.get("test_time_row")]  # the test-time group's runs: its table only
    records = [r for r in records if not r.get("test_time_row")]
    b2n = summarise([r for r in records if r["protocol"] == "base2new"], average=AVERAGE)
    n_data = len({r["dataset"] for r in b2n if r["dataset"] != AVERAGE})
    tables: dict = {}
    if "base2new" in settings.tables or "diagnostics" in settings.tables:  # diagnostics: Table 1's extra rows
        tables["table1"] = {
            "title": f"Table 1: base-to-new generalization ({settings.shots} shots)",
            "kind": "base2new",
            "rows": _ordered(b2n, TABLE1_ROWS),
        }
    if "ablations" in settings.tables:
        tables["table4"] = {
            "title": f"Table 4: ablations (base-to-new, {settings.shots} shots)",
            "kind": "base2new",
            "rows": _ordered(b2n, TABLE4_KEYS),
        }
    if "transfer" in settings.tables:
        domain = [d.name for d in world.with_role("cross_domain_target")]
        family = [d.name for d in world.with_role("cross_dataset_target")]
        ids = (("table2", "table3"), ("tableA1", "tableA2"))
        for shots, (dom_id, data_id) in zip(settings.transfer_shot_counts, ids):
            runs = [r for r in records if r["protocol"] == "transfer" and r["shots"] == shots]
            for tid, kind, targets in ((dom_id, "cross-domain", domain), (data_id, "cross-dataset", family)):
                rows = summarise([_subset(r, targets) | {"protocol": kind.replace("-", "_")} for r in runs])
                tables[tid] = {
                    "title": f"Table {tid[5:]}: {kind} generalization ({shots} shots)",
                    "kind": "transfer",
                    "shots": shots,
                    "source": runs[0]["dataset"] if runs else "",
                    "targets": targets,
                    "rows": _ordered(rows, TRANSFER_KEYS),
                }
    if "deep" in settings.tables:
        tables["deep"] = {
            "title": f"Deep prompts: IVLP and MaPLe with and without GRAM (base-to-new, {settings.shots} shots)",
            "kind": "base2new",
            "rows": _ordered(b2n, DEEP_KEYS),
        }
    if "consistency" in settings.tables:
        _, source = consistency_lambdas()
        tables["consistency"] = {
            "title": f"Zero-shot consistency baselines (base-to-new, {settings.shots} shots)",
            "kind": "base2new",
            "source": source,
            "rows": _ordered(b2n, consistency_keys()),
        }
    if "tokens" in settings.tables:
        rows = []
        for n, key in TOKEN_KEYS.items():
            variant = VARIANT_BY_NAME[METHOD_BY_KEY[key].variant]
            rows += [
                r | {"tokens": n, "text_tokens": variant.n_ctx_text, "visual_tokens": variant.n_ctx_vision}
                for r in b2n
                if r["key"] == key and r["dataset"] == AVERAGE
            ]
        tables["tableA3"] = {
            "title": f"Table A3: UNIGRAM with 2 / 4 / 6 / 8 prompt tokens (base-to-new, "
            f"average over {n_data} dataset(s))",
            "kind": "tokens",
            "rows": rows,
        }
    if "testtime" in settings.tables:
        tables["testtime"] = build_testtime_table(testtime, settings)
    return tables


def _pm(mean: float, std: float) -> str:
    return f"{mean:.2f} ± {std:.2f}"


def markdown_table(rows: list, dataset: str, numbered: bool = False) -> str:
    """One base-to-new table (rows of ``dataset``): method | base | new | H."""
    head = "| row | method | base | new | H |" if numbered else "| method | base | new | H |"
    lines = [head, "| --- " * (5 if numbered else 4) + "|"]
    for i, r in enumerate(r for r in rows if r["dataset"] == dataset):
        cells = (
            f"| {r['method']} | {_pm(r['base_mean'], r['base_std'])} | {_pm(r['new_mean'], r['new_std'])} | "
            f"{r['H']:.2f} |"
        )
        lines.append(f"| {i} " + cells if numbered else cells)
    return "\n".join(lines)


def _b2n_section(table: dict, datasets: list, note: str = "", numbered: bool = False) -> list[str]:
    """The markdown lines of a base-to-new table: its title, ``note``, the average over ``datasets``, then each one."""
    parts = [f"## {table['title']}", ""] + ([note, ""] if note else [])
    for heading, dataset in [(f"Average over {len(datasets)} dataset(s)", AVERAGE)] + [(d, d) for d in datasets]:
        parts += [f"### {heading}", "", markdown_table(table["rows"], dataset, numbered=numbered), ""]
    return parts


def transfer_markdown(table: dict) -> str:
    targets = table["targets"]
    average = len(targets) > 1
    head = f"| method | source: {table['source']} | " + " | ".join(f"target: {t}" for t in targets)
    head += " | target average |" if average else " |"
    lines = [head, "| --- " * (2 + len(targets) + average) + "|"]
    for r in table["rows"]:
        cells = [r["method"], _pm(r["source_mean"], r["source_std"])] + [_pm(*r["targets"][t]) for t in targets]
        if average:
            cells.append(_pm(r["target_mean"], r["target_std"]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tokens_markdown(table: dict) -> str:
    lines = ["| prompt tokens (text + visual) | base | new | H |", "| --- | --- | --- | --- |"]
    for r in table["rows"]:
        lines.append(
            f"| {r['tokens']} ({r['text_tokens']} + {r['visual_tokens']}) | "
            f"{_pm(r['base_mean'], r['base_std'])} | {_pm(r['new_mean'], r['new_std'])} | {r['H']:.2f} |"
        )
    return "\n".join(lines)


def zeroshot_markdown(zeroshot: dict, tables: dict) -> str:
    """The full-test-split zero-shot table next to the zero-shot rows of Tables 1-3."""
    b2n = {r["dataset"]: r for r in tables.get("table1", {}).get("rows", []) if r["key"] == "zsclip"}
    transfer = {}
    for tid in ("table2", "table3"):
        for r in tables.get(tid, {}).get("rows", []):
            if r["key"] == "zsclip":
                transfer[tables[tid]["source"]] = r["source_mean"]
                transfer.update({t: m for t, (m, _) in r["targets"].items()})
    lines = [
        "| dataset | zero-shot, full test split (all classes) | chance | Table 1 CLIP row: base / new "
        "(half the classes each) | Tables 2-3 CLIP row (full test split) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, r in zeroshot.items():
        b = f"{b2n[name]['base_mean']:.2f} / {b2n[name]['new_mean']:.2f}" if name in b2n else "-"
        t = f"{transfer[name]:.2f}" if name in transfer else "-"
        lines.append(f"| {name} | {r['accuracy']:.2f} | {r['chance']:.2f} | {b} | {t} |")
    return "\n".join(lines)


# ------------------------------------------------------------------ plots
def _subtitle(settings: DemoSettings, world, seeds: bool = True) -> str:
    text = f"world seed {settings.world_seed} ({world.settings_hash})"
    if seeds:
        text += f", fine-tuning seeds {', '.join(map(str, settings.seeds))}"
    return text + f", {'quick' if settings.quick else 'default'} demo"


def _bars(tables: dict, settings: DemoSettings, world, path: Path, plt) -> None:
    rows = [r for tid in ("table1", "table4") for r in tables.get(tid, {}).get("rows", []) if r["dataset"] == AVERAGE]
    rows = list({r["key"]: r for r in rows}.values())  # UNIGRAM is in both tables
    fig, ax = plt.subplots(figsize=(max(12, 0.75 * len(rows)), 5))
    width = 0.27
    lows = []
    bars = (
        ("base", "tab:blue", "base classes"),
        ("new", "tab:orange", "new classes"),
        ("H", "tab:green", "H (harmonic mean)"),
    )
    n_seeds = _seed_count(rows)
    for i, (stat, colour, label) in enumerate(bars):
        values = [r[f"{stat}_mean"] if stat != "H" else r["H"] for r in rows]
        errs = [r[f"{stat}_std"] for r in rows] if stat != "H" and n_seeds > 1 else None
        ax.bar(
            [j + (i - 1) * width for j in range(len(rows))],
            values,
            width=width,
            color=colour,
            label=label,
            yerr=errs,
            capsize=2,
        )
        lows += [v - (e or 0) for v, e in zip(values, errs or [0] * len(values))]
    zs = next((r for r in rows if r["key"] == "zsclip"), None)
    if zs is not None:
        ax.axhline(zs["H"], color="k", ls="--", lw=1, label=f"CLIP zero-shot H ({zs['H']:.1f})")
    top = max(r[k] for r in rows for k in ("base_mean", "new_mean", "H")) + max(r["base_std"] for r in rows)
    bottom = max(0.0, 5 * int((min(lows) - 5) // 5))
    ax.set_ylim(bottom, top + 0.12 * (top - bottom))
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([plot_label(r["key"], r["method"]) for r in rows], rotation=25, ha="right", fontsize=8)
    if "table4" in tables and "table1" in tables:
        n_table1 = sum(r["dataset"] == AVERAGE for r in tables.get("table1", {}).get("rows", []))
        split = n_table1 - 0.5  # Table 1 rows | the rest of Table 4
        ax.axvline(split, color="0.6", lw=0.8)
        ax.text(
            split - 0.1,
            0.98,
            "Table 1 with GRAM's components",
            transform=ax.get_xaxis_transform(),
            ha="right",
            va="top",
            fontsize=8,
        )
        ax.text(
            split + 0.1,
            0.98,
            "Table 4: UNIGRAM without one part",
            transform=ax.get_xaxis_transform(),
            ha="left",
            va="top",
            fontsize=8,
        )
    ax.set_ylabel(f"accuracy (%), axis starts at {bottom:.0f} %")
    n = len({r["dataset"] for r in tables.get("table1", tables.get("table4", {"rows": []}))["rows"]}) - 1
    if "table1" in tables and "table4" in tables:
        shown = "Tables 1 and 4"
    else:
        shown = "Table 1" if "table1" in tables else "Table 4"
    ax.set_title(
        f"{shown}: base-to-new accuracy, average over {n} dataset(s) ({_spread(n_seeds)})\n"
        + _subtitle(settings, world),
        fontsize=10,
    )
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _overlaps(curves: dict, keys: list, split: str) -> dict:
    """``{key: earlier key}`` for each curve of ``split`` equal at every epoch to one drawn before it (a line the
    other hides)."""
    same: dict = {}
    for i, key in enumerate(keys):
        c = curves[key]
        for earlier in keys[:i]:
            e = curves[earlier]
            if e["epochs"] == c["epochs"] and all(abs(a - b) < 1e-9 for a, b in zip(e[split], c[split])):
                same[key] = earlier
                break
    return same


def _epochs(records: list, settings: DemoSettings, world, path: Path, plt) -> None:
    b2n = [r for r in records if r["protocol"] == "base2new" and r["key"] in EPOCH_CURVE_KEYS]
    curves = {c["key"]: c for c in epoch_curves(b2n, average=AVERAGE) if c["dataset"] == AVERAGE}
    zs = summarise([r for r in b2n if r["key"] == "zsclip"], average=AVERAGE)
    zs = next((r for r in zs if r["dataset"] == AVERAGE), None)
    keys = [k for k in EPOCH_PLOT_KEYS if curves.get(k) and curves[k]["epochs"]]
    overlap = {split: _overlaps(curves, keys, split) for split in ("base", "new")}
    labels = {}
    for key in keys:  # a line drawn exactly over another says so, in the legend
        under = {split: plot_label(overlap[split][key]) for split in ("base", "new") if key in overlap[split]}
        if len(set(under.values())) == 1:
            (other,) = set(under.values())
            where = "" if len(under) == 2 else f" ({next(iter(under))} classes)"
            note = f"same values as {other}{where}"
        else:
            note = "same values as " + "; ".join(f"{name} ({split} classes)" for split, name in under.items())
        labels[key] = plot_label(key) + (f"\n(lines overlap: {note})" if under else "")
    warmup = f"{next(f.default for f in fields(TrainSpec) if f.name == 'warmup_lr'):g}".replace("e-0", "e-")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6), sharey=True)
    for split, ax in zip(("base", "new"), axes):
        ax.axvspan(0.0, 1.0, color="0.9", zorder=0)
        if zs is not None:
            ax.axhline(zs[f"{split}_mean"], color="k", ls="--", lw=1, label="CLIP (zero-shot)")
        for i, key in enumerate(keys):
            c = curves[key]
            mean, std = c[split], c[f"{split}_std"]
            ax.plot(
                c["epochs"],
                mean,
                marker=MARKERS[i % len(MARKERS)],
                markersize=7 if key in overlap[split] else 5,  # a hidden line's markers stick out
                markerfacecolor="none" if key in overlap[split] else colour(key),
                linestyle=LINESTYLES[i % len(LINESTYLES)],
                color=colour(key),
                label=labels[key],
            )
            if len(settings.seeds) > 1:
                ax.fill_between(
                    c["epochs"],
                    [m - s for m, s in zip(mean, std)],
                    [m + s for m, s in zip(mean, std)],
                    color=colour(key),
                    alpha=0.15,
                    lw=0,
                )
        ax.set_xlabel(f"fine-tuning epoch (0 = before training;\nshaded: epoch 1, the warm-up at lr {warmup})")
        ax.set_title(f"{split} classes")
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    axes[0].set_ylabel("test accuracy (%), average over datasets")
    axes[1].legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8)
    band = "band: ± std over seeds" if len(settings.seeds) > 1 else "1 seed, so no spread band"
    fig.suptitle(
        f"Fig. 3a: accuracy vs fine-tuning epoch (line: mean over seeds; {band})\n" + _subtitle(settings, world),
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _grad_cosine(out: Path, settings: DemoSettings, world, path: Path, plt) -> dict:
    # a meta-training run is labelled by its own row (the key equal to the variant's name), else by the first row
    # that starts from it; never by a component row such as "R_φ only", which shares the run
    labels: dict = {}
    for m in METHOD_BY_KEY.values():
        if m.variant and (m.variant not in labels or m.key == m.variant):
            labels[m.variant] = plot_label(m.key, m.label)
    fig, ax = plt.subplots(figsize=(10, 4.6))
    series, missing = {}, []
    trained = variants_needed(settings.tables)
    for variant in (v for v in META_VARIANTS if v in trained):
        log = [
            r
            for r in read_log(out / "meta" / variant.name / "log.jsonl")
            if r.get("kind") == "train" and "grad_cosine" in r
        ]
        if not log:
            missing.append(labels[variant.name])
            continue
        steps, values = [r["step"] for r in log], [r["grad_cosine"] for r in log]
        series[variant.name] = {"label": labels[variant.name], "step": steps, "grad_cosine": values}
        few = len(steps) < FEW_POINTS  # a line through 2 points says little: large markers, and the count said
        label = labels[variant.name] + (f" ({len(steps)} logged step{'s' * (len(steps) != 1)})" if few else "")
        ax.plot(
            steps,
            values,
            marker=MARKERS[len(series) % len(MARKERS)] if few else ".",
            markersize=8 if few else 6,
            linestyle=":" if few else "-",  # few points: the markers are the data, not the line between them
            color=colour(variant.name),
            label=label,
        )
    ax.axhline(0.0, color="0.5", lw=0.8)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("meta-training step (outer update)")
    ax.set_ylabel(
        "cosine(regulated support step, query gradient)\n(unitless, -1 to 1; mean over the meta-batch)", fontsize=8
    )
    ax.grid(alpha=0.3)
    note = ""
    if missing:
        note = (
            f"Not shown: {', '.join(repr(m) for m in missing)} (Table 4 row 3). Prompt pre-training has no "
            "inner support step,\nso there is no support / query gradient pair to compare."
        )
        ax.text(0.01, -0.3, note, transform=ax.transAxes, fontsize=8, va="top")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    n_steps = sorted({len(v["step"]) for v in series.values()})
    counted = {0: "", 1: f"; {n_steps[0]} logged step(s) per run"}.get(
        len(n_steps), f"; {n_steps[0]} to {n_steps[-1]} logged steps per run"
    )
    ax.set_title(
        "Fig. 3b: normalised inner product of support and query gradients during meta-training\n"
        + _subtitle(settings, world, seeds=False)
        + counted,
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return {"series": series, "not_shown": missing, "note": note.replace("\n", " ")}


def _transfer_bars(tables: dict, settings: DemoSettings, world, path: Path, plt) -> None:
    ids = [t for t in ("table2", "table3", "tableA1", "tableA2") if t in tables and tables[t]["rows"]]
    fig, axes = plt.subplots(1, len(ids), figsize=(3.4 * len(ids) + 2, 4.4), sharey=True, squeeze=False)
    lows, highs = [], []
    for ax, tid in zip(axes[0], ids):
        t = tables[tid]
        rows = t["rows"]
        multi = _seed_count(rows) > 1  # one seed: no error bar (its std is 0 by definition)
        for j, r in enumerate(rows):
            err = r["target_std"] if multi else None
            ax.bar(
                j,
                r["target_mean"],
                yerr=err,
                color=colour(r["key"]),
                capsize=2,
                label=plot_label(r["key"], r["method"]),
            )
            lows.append(r["target_mean"] - (err or 0.0))
            highs.append(r["target_mean"] + (err or 0.0))
        zs = next((r for r in rows if r["key"] == "zsclip"), None)
        if zs is not None:
            ax.axhline(zs["target_mean"], color="k", ls="--", lw=1)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels([plot_label(r["key"], r["method"]) for r in rows], rotation=40, ha="right", fontsize=7)
        ax.set_title(
            f"{t['title'].split(':')[0]}: {t['title'].split(': ')[1].split(' generalization')[0]}, {t['shots']} shots",
            fontsize=9,
        )
    n_seeds = _seed_count([r for tid in ids for r in tables[tid]["rows"]])
    bottom = max(0.0, 5 * int((min(lows) - 5) // 5))
    axes[0][0].set_ylim(bottom, max(highs) + 0.05 * (max(highs) - bottom))
    axes[0][0].set_ylabel(f"target accuracy (%), axis starts at {bottom:.0f} %")
    fig.suptitle(
        f"Tables 2, 3, A1, A2: prompts tuned on {tables[ids[0]]['source']}, accuracy on the targets "
        f"(average over targets; {_spread(n_seeds)}; dashed: CLIP zero-shot)\n" + _subtitle(settings, world),
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plots(tables: dict, records: list, settings: DemoSettings, world, out: Path) -> dict:
    """Write the PNGs of the requested tables; returns ``{name: path}`` (and Fig. 3b's data under "fig3b")."""
    import matplotlib  # lazy: plotting only here, and matplotlib is slow to import

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files: dict = {}
    if "table1" in tables or "table4" in tables:
        files["bars"] = out / "accuracy_bars.png"
        _bars(tables, settings, world, files["bars"], plt)
    if "table1" in tables:
        files["epochs"] = out / "accuracy_vs_epoch.png"
        _epochs(records, settings, world, files["epochs"], plt)
        files["grad_cosine"] = out / "grad_cosine.png"
        files["fig3b"] = _grad_cosine(out, settings, world, files["grad_cosine"], plt)
    if any(t in tables for t in ("table2", "table3")):
        files["transfer_bars"] = out / "transfer_bars.png"
        _transfer_bars(tables, settings, world, files["transfer_bars"], plt)
    return files


# ------------------------------------------------------------------ results.md / results.json
def stage_report(
    records: list, zeroshot: dict, settings: DemoSettings, out: Path, world, weights: Path, timings: dict
) -> Path:
    """Write ``results.md``, ``results.json`` and the plots into ``out``; returns the ``results.md`` path."""
    tables = build_tables(records, settings, world)
    testtime_seconds = sum(r["seconds"] for r in records if r.get("test_time_row"))
    records = [r for r in records if not r.get("test_time_row")]
    files = plots(tables, records, settings, world, out)
    fig3b = files.pop("fig3b", None)
    prov = provenance(settings, world, weights)
    b2n_rows = summarise([r for r in records if r["protocol"] == "base2new"], average=AVERAGE)
    datasets = [d for d in dict.fromkeys(r["dataset"] for r in b2n_rows) if d != AVERAGE]
    run_seconds = {p: sum(r["seconds"] for r in records if r["protocol"] == p) for p in ("base2new", "transfer")}
    if testtime_seconds:
        run_seconds["testtime"] = testtime_seconds
    parts = [
        "# GRAM in the CPU world: the paper's tables",
        "",
        f"- world seed **{prov['world_seed']}**, world settings hash `{prov['world_settings_hash']}` "
        f"(held-out style `{prov['holdout_style']}`, mixed classes {', '.join(prov['mixed_classes'])})",
        f"- tiny CLIP `{prov['clip_weights']}`; demo settings hash `{prov['demo_settings_hash']}` "
        f"({'quick' if settings.quick else 'default'} demo); tables computed: {', '.join(settings.tables)}",
        f"- commit `{prov['commit']}`; machine: {prov['machine']}; finished {prov['finished_utc']} UTC",
        f"- numerics: {prov['computed_by']['numerics']['mode']} (kernel pins "
        f"{'on' if prov['computed_by']['numerics']['pinned'] else 'off'}), fingerprint "
        f"`{prov['computed_by']['fingerprint'][:12]}` "
        f"({'the committed golden one' if prov['computed_by']['golden'] else 'NOT the committed golden one'})",
        "",
        f"Fine-tuning: {settings.epochs} epochs, batch {settings.batch_size}, seeds "
        f"{', '.join(map(str, settings.seeds))}. Every cell is mean ± population std over seeds; for "
        "averages each seed's accuracies are averaged over the datasets (or targets) first. H = harmonic "
        "mean of the mean base and mean new accuracies. Row names are the paper's; CoCoOp + GRAM with R_φ "
        "(beside CoCoOp's θ*-only row) comes with the diagnostics tables.",
        "",
    ]
    if settings.quick:
        parts += [f"**{QUICK_NOTE}**", ""]
    if "table1" in tables:
        parts += _b2n_section(tables["table1"], datasets)
    if "table4" in tables:
        note = (
            "Rows 1-4: UNIGRAM with one component removed; row 5: text and visual prompts tuned jointly without GRAM."
        )
        parts += _b2n_section(tables["table4"], datasets, note, numbered=True)
    for tid in ("table2", "table3", "tableA1", "tableA2"):
        if tid in tables:
            t = tables[tid]
            parts += [
                f"## {t['title']}",
                "",
                f"Prompts are tuned on all classes of {t['source']} ({t['shots']} shots per class) and "
                f"tested on the full test split of every target with the target's class names.",
                "",
                transfer_markdown(t),
                "",
            ]
    if "deep" in tables:
        note = (
            "IVLP: 2 text + 2 visual prompt tokens in every layer of both towers; "
            "MaPLe: 2 text tokens in every layer, the visual prompts their learned linear maps "
            "(docs/deep_prompts.md). Same fine-tuning protocol as Table 1."
        )
        parts += _b2n_section(tables["deep"], datasets, note)
    if "consistency" in tables:
        note = (
            "Each baseline beside itself fine-tuned with the zero-shot consistency terms (KgCoOp's text-feature "
            "distance, PromptSRC's image-feature distance to frozen CLIP; meta/method/consistency.py); "
            f"λ: {tables['consistency']['source']}."
        )
        parts += _b2n_section(tables["consistency"], datasets, note)
    if "tableA3" in tables:
        parts += [
            f"## {tables['tableA3']['title']}",
            "",
            "Total prompt tokens, split half text / half visual (the paper does not give the split); "
            "4 = UNIGRAM's own 2 + 2. Each count has its own meta-training run.",
            "",
            tokens_markdown(tables["tableA3"]),
            "",
        ]
    if "testtime" in tables:
        parts += markdown_of_testtime(tables["testtime"])
    parts += [
        '## Tiny CLIP zero-shot accuracy ("a photo of a {}.")',
        "",
        "The first column classifies each test image among *all* classes of its dataset. Table 1's "
        "CLIP row classifies base-class test images among the base classes only and new-class images "
        "among the new classes only: half as many candidates, hence higher numbers from the same "
        "weights and prompt. Tables 2-3's CLIP row uses the full test split and all classes, like the "
        "first column (the evaluator resizes and crops images as CoOp's test transform does, so small "
        "differences can remain).",
        "",
        zeroshot_markdown(zeroshot, tables),
        "",
    ]
    parts += ["## Plots", ""] + [f"- `{p.name}`" for p in files.values()]
    if fig3b and fig3b["note"]:
        parts += [f"- Fig. 3b note: {fig3b['note']}"]
    parts += ["", "## Stage times (s, wall clock of this invocation; cached stages take ~0)", ""]
    parts += [f"- {k}: {v:.0f}" for k, v in timings.items()]
    parts += [
        f"- summed run time of the {p} runs (worker seconds, all invocations): {v:.0f}"
        for p, v in run_seconds.items()
        if v
    ]
    parts += ["", "## Settings", "", "```json", json.dumps(settings_record(settings), indent=1), "```", ""]
    md = out / "results.md"
    md.write_text("\n".join(parts))
    payload = {
        "provenance": prov,
        "tables": tables,
        "rows": b2n_rows,
        "zeroshot": zeroshot,
        "fig3b": fig3b,
        "settings": settings_record(settings),
        "timings": timings,
        "run_seconds": run_seconds,
    }
    (out / "results.json").write_text(json.dumps(payload, indent=1))
    return md


def last_screen(md: Path, settings: DemoSettings) -> str:
    """The lines printed after ``results.md``: its first table (with the headings above it), where the file is,
    and for a quick run that its numbers are a wiring check, not a comparison of methods."""
    lines = md.read_text(encoding="utf-8").splitlines()
    first = next((i for i, ln in enumerate(lines) if ln.startswith("|")), len(lines))
    end = next((i for i in range(first, len(lines)) if not lines[i].startswith("|")), len(lines))
    title = next((i for i in range(first - 1, -1, -1) if lines[i].startswith("## ")), first)
    out = [ln for ln in lines[title:first] if ln.startswith("#")] + lines[first:end] + ["", f"results: {md.resolve()}"]
    if settings.quick:
        out.append(
            f"quick demo: a wiring check of every stage ({len(settings.seeds)} seed(s), {settings.meta_steps} "
            f"meta-steps, {settings.epochs} epochs); its numbers are not results and do not compare methods (bash "
            "scripts/demo.sh without --quick computes them)"
        )
    return "\n".join(out)
