"""``python -m gram_world.study``: how sure each GRAM claim is, over worlds × meta-training seeds ×
fine-tuning seeds, and the validation sweep that chose the test-time defaults.

Three commands, each resumable cell by cell (a cell is one world, one meta-training seed and one setting
of the switches; every stage of a cell is the demo's, cached on disk, so a killed run redoes only what
is missing):

* ``select``: on the **val** splits of the world's base-to-new datasets, the GRAM rows for every
  combination of the switches in :data:`SWEEP` (regulation window, launch step, before-adaptation query
  weight) and their baselines.  The default is the combination with the best mean paired H difference
  (GRAM row − its baseline) over the three prompt types; test splits are never read.  ``--sweep regulator``
  sweeps how R_φ is meta-trained instead (:data:`REGULATOR_SWEEP`, at the default switches), ranked by
  :func:`rank_regulator_variants` (a variant replaces ``k1`` only by more than :data:`SELECT_MARGIN_H`).
  The base-to-new regulator sweep of ``docs/study/selection_b2n_rule.md`` is its own command,
  ``python -m gram_world.study_b2n`` (:mod:`gram_world.study_b2n`, built on this module's cells).
* ``run``: the default pipeline (the demo's settings) on the **test** splits of every world in
  :data:`WORLDS` for each meta-training seed; then every pair of :data:`gram_world.demo.settings.PAIRS`
  as a paired mean difference of H with a 95 % bootstrap interval, and each world's regime (zero-shot, CoOp,
  VPT) beside the paper's.
* ``travel``: β's share of θ's travel over the fine-tuning schedule of a cell's regulated rows
  (:class:`meta.method.travel.TravelSplit`).

Unit of a difference: one (world, meta seed, fine-tuning seed): H of the method's base and new accuracy,
each averaged over the five base-to-new datasets, minus the same for its baseline.  Interval: a
two-level percentile bootstrap (resample worlds, then the cells within each drawn world; 10,000 draws,
fixed RNG seed), so that cells of one world, which share its CLIP and CHC, are not counted as
independent.  A claim "holds" when the interval excludes zero.

Cells share what does not depend on their settings: the world cache, the world's CHC folder, the
meta-training runs of one (meta seed, query weight), and the feature cache (symlinks inside each
cell folder).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from gram_tools.paired_stats import (  # the statistics the user's --compare shares
    BOOTSTRAP_DRAWS,
    bootstrap_interval,  # noqa: F401  (study.bootstrap_interval, as before)
    bootstrap_means,
    bootstrap_p,
    holm,
    world_t_p,
)
from meta.infra.cli_errors import run_cli
from meta.infra.fileio import parse_json, write_json_atomic, write_text_atomic

from .demo.pool import log
from .demo.settings import METHOD_BY_KEY, PAIRS, REG_ADDS_PAIRS, DemoSettings, method_row
from .demo.stages import check_settings, check_world, stage_chc, stage_eval, stage_meta, stage_world

# The study's worlds: world seeds 0, 1, 2, 7 and world 13 with the noisy held-out style and the other
# fifteen mixed classes (the five worlds of README's earlier tables), and world seed 3, the next unused seed,
# added as a world that no sweep ever read (the sweeps chose on worlds 0 and 1, val splits).
MIXED_13 = (
    "pentagon",
    "octagon",
    "trapezoid",
    "parallelogram",
    "kite",
    "ellipse",
    "teardrop",
    "semicircle",
    "spiral",
    "flower",
    "bowtie",
    "chevron",
    "asterisk",
    "checkmark",
    "zigzag",
)
WORLDS: dict[str, dict] = {
    "0": {"world_seed": 0},
    "1": {"world_seed": 1},
    "2": {"world_seed": 2},
    "7": {"world_seed": 7},
    "13v": {"world_seed": 13, "world": (("holdout_style", "noisy"), ("mixed_classes", MIXED_13))},
    "3": {"world_seed": 3},
}
META_SEEDS = (0, 1)

# Rows of the study (PAIRS' GRAM rows and baselines) and of the sweep.
STUDY_KEYS = tuple(dict.fromkeys(k for pair in PAIRS for k in pair)) + ("zsclip",)
# The rows of the "what R_φ adds to θ*" pairs alone (``study run --rows reg-adds``: a regulator variant's study
# needs no baseline, one-step or R_φ-only row to answer whether the variant's R_φ helps; 6 of the 16 rows, ~40 %
# of a cell's evaluation by the evaluator's cost weights, EvalJob.cost).
REG_ADDS_KEYS = tuple(k for pair in REG_ADDS_PAIRS for k in pair)
ROWS = {"all": STUDY_KEYS, "reg-adds": REG_ADDS_KEYS}
# The deep learners' pairs (``study run --deep``, on the worlds asked for): each GRAM row and its components
# against the learner without GRAM, and what R_φ adds to θ* (GRAM against its θ*-only row).
DEEP_PAIRS = tuple(
    pair
    for learner in ("ivlp", "maple")
    for pair in (
        (f"gram_{learner}", learner),
        (f"gram_{learner}_init_only", learner),
        (f"gram_{learner}_reg_only", learner),
        (f"gram_{learner}", f"gram_{learner}_init_only"),
    )
)
DEEP_STUDY_KEYS = tuple(dict.fromkeys(k for pair in DEEP_PAIRS for k in pair))
STUDY_PAIRS = PAIRS + DEEP_PAIRS  # a pair is summarised over the cells that hold both of its rows
# The regime of a world: base and new accuracy of zero-shot CLIP, CoOp and VPT, beside the paper's (GRAM, Table 1a:
# average over 11 datasets under CoCoOp's base-to-new protocol, 16 shots).
REGIME_KEYS = ("zsclip", "coop", "vpt")
PAPER_REGIME = {"zsclip": (69.34, 74.22), "coop": (77.58, 73.11), "vpt": (72.53, 72.34)}
SWEEP_GRAM_KEYS = ("gram_coop", "gram_vpt", "unigram")
BASELINE_OF = {"gram_coop": "coop", "gram_vpt": "vpt", "unigram": "joint"}
# The switches tried on validation: regulation window (1 = per image; 20 = the meta-training support
# size, 5 ways x 4 shots), launch step, weight of the before-adaptation query loss.
SWEEP = {"reg_window": (1, 20), "launch": (False, True), "query_before_weight": (0.0, 1.0)}
# How R_φ is meta-trained (the second sweep, ``select --sweep regulator``), each a named set of META overrides
# at the test-time defaults: K = 1 is today's one regulated step on the whole support; K = 4 unrolls the
# downstream optimiser (4 class-balanced windows of the support, heavy-ball 0.9, weight decay 5e-4 as CoCoOp's
# SGD, and α = 0.04 per window = CoCoOp's lr 0.002 × the regulation window of 20 images, the step the schedule
# takes per window in units of the window's mean gradient).
UNROLL_4 = (
    "META.INNER_STEPS",
    4,
    "META.INNER_SUPPORT",
    "split",
    "META.INNER_MOMENTUM",
    0.9,
    "META.INNER_WEIGHT_DECAY",
    5e-4,
    "META.INNER_LR",
    0.04,
)
REGULATOR_SWEEP: dict[str, tuple] = {"k1": (), "k4": UNROLL_4}
# Variants the sweep also ran (docs/study/selection_regulator.*; the β-only test study docs/study/results_beta_only.*)
# whose options were measured and dropped since (meta.config.REMOVED_KEYS; numbers: docs/evidence.md, "Options
# removed"): their overrides, so the committed files still read and re-rank as written; they cannot run again.
REMOVED_VARIANTS: dict[str, tuple] = {
    "gamma_only": ("META.REGULATOR.HALVES", "gamma"),
    "beta_only": ("META.REGULATOR.HALVES", "beta"),
    "meta_sgd": ("META.REGULATOR.LEARN_LR", True),
    "trajectory": ("META.TRAJECTORY_STATES", 4, "META.TRAJECTORY_WINDOWS", 20),
}


@dataclass(frozen=True)
class Cell:
    """One world, one meta-training seed and one setting of the switches."""

    world: str
    settings: DemoSettings
    variant: str = ""  # name of the settings' meta_overrides (REGULATOR_SWEEP, or a b2n sweep unit's); "" = none

    @property
    def name(self) -> str:
        s = self.settings
        return (
            f"{s.eval_split}_seed{s.meta_seed}_w{s.reg_window}_launch{int(s.launch)}"
            f"_qbw{s.query_before_weight:g}"
            + (f"_tts{s.testtime_steps}" if s.testtime_steps != 1 else "")
            + (f"_{self.variant}" if self.variant else "")
        )

    @property
    def meta_folder(self) -> str:
        """The world's folder of this cell's meta-training runs (shared by cells that train the same)."""
        s = self.settings
        return f"meta_seed{s.meta_seed}_qbw{s.query_before_weight:g}" + (f"_{self.variant}" if self.variant else "")


def world_settings(world: str, base: DemoSettings) -> DemoSettings:
    """``base`` on the study world ``world`` (a key of :data:`WORLDS`)."""
    if world not in WORLDS:
        raise ValueError(f"--worlds: unknown world {world!r}; known: {', '.join(WORLDS)}")
    return replace(base, **WORLDS[world])


def _link(link: Path, target: Path) -> None:
    """``link`` -> ``target`` (relative symlink), created once; a real folder in its place is an error."""
    target.mkdir(parents=True, exist_ok=True)
    if link.is_symlink():
        return
    if link.exists():
        raise ValueError(f"{link}: expected a link to {target}, found a folder; delete it")
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(target, link.parent))


def prepare_cell(cell: Cell, root: Path, keys: Sequence[str], world_root: Optional[Path] = None) -> tuple:
    """The cached stages before evaluation (world, CLIP, CHC, meta-training of the rows ``keys``'s variants);
    returns ``(world, weights, model, inits, cell folder)``."""
    s = cell.settings
    world_dir = root / f"world{cell.world}"
    out = world_dir / cell.name
    out.mkdir(parents=True, exist_ok=True)
    check_settings(s, out)
    world, weights, model, _ = stage_world(s, out, world_root)
    check_world(out, world, weights)
    _link(out / "chc", world_dir / "chc")
    _link(out / "feature_cache", world_dir / "feature_cache")
    _link(out / "meta", world_dir / cell.meta_folder)
    stage_chc(world, weights, model, out, s)
    variants = tuple(v for v in dict.fromkeys(method_row(k).variant for k in keys) if v)
    inits = stage_meta(world, weights, model, out, s, names=variants)
    return world, weights, model, inits, out


def run_cell(cell: Cell, root: Path, keys: Sequence[str], world_root: Optional[Path] = None) -> list[dict]:
    """Every stage of ``cell`` for the rows ``keys`` (cached); returns their base-to-new records."""
    world, weights, model, inits, out = prepare_cell(cell, root, keys, world_root)
    return stage_eval(world, weights, model, inits, out, cell.settings, keys=tuple(keys))


# ------------------------------------------------------------------------------ statistics
def cell_h(records: Sequence[dict]) -> dict:
    """``{(key, fine-tuning seed): (base, new, H)}``: base / new averaged over the datasets, then H."""
    groups: dict = {}
    for r in records:
        groups.setdefault((r["key"], int(r["seed"])), []).append((float(r["base"]), float(r["new"])))
    out = {}
    for key, values in groups.items():
        base = float(np.mean([b for b, _ in values]))
        new = float(np.mean([n for _, n in values]))
        out[key] = (base, new, 2 * base * new / (base + new) if base + new > 0 else 0.0)
    return out


def cell_inputs(records: Sequence[dict]) -> dict:
    """What a cell's meta-learned rows started from, so that a rerun can tell a changed θ* from a changed
    fine-tuning: ``{"hierarchy": [CHC fingerprints], "start_sha256": {key: digest of the start θ}}``, the
    start taken from the first record of each key that loads an init file (every seed starts there)."""
    hierarchy, starts = set(), {}
    for r in records:
        init = r.get("init") or {}
        fingerprint = ((init.get("provenance") or {}).get("hierarchy") or {}).get("fingerprint")
        if fingerprint:
            hierarchy.add(fingerprint)
        if init.get("prompt_sha256") and r.get("key"):
            starts.setdefault(r["key"], init["prompt_sha256"])
    return {"hierarchy": sorted(hierarchy), "start_sha256": dict(sorted(starts.items()))}


def paired_differences(cells: dict, pairs: Sequence[tuple] = PAIRS) -> dict:
    """``{(method, baseline): {world: [H(method) − H(baseline) per (meta seed, fine-tuning seed)]}}``.

    ``cells``: ``{(world, meta seed): cell_h(...)}``; a pair is left out of a cell that lacks either row.
    """
    out: dict = {}
    for (world, _), table in sorted(cells.items()):
        seeds = sorted({seed for _, seed in table})
        for method, base in pairs:
            for seed in seeds:
                if (method, seed) in table and (base, seed) in table:
                    diff = table[(method, seed)][2] - table[(base, seed)][2]
                    out.setdefault((method, base), {}).setdefault(world, []).append(diff)
    return out


def mean_h(cells: dict, key: str, beside: str = "") -> Optional[float]:
    """H of ``key`` averaged over every (world, meta seed, fine-tuning seed) that has it (and, with ``beside``,
    that row too: the units a pair's difference is taken over); None if none does."""
    values = [
        h
        for table in cells.values()
        for (k, fs), (_, _, h) in table.items()
        if k == key and (not beside or (beside, fs) in table)
    ]
    return round(float(np.mean(values)), 3) if values else None


def summarise(
    cells: dict, pairs: Sequence[tuple] = PAIRS, alpha: float = 0.05, label: Optional[Callable[[str], str]] = None
) -> list[dict]:
    """One row per pair: mean H of both rows, mean difference, 95 % bootstrap interval, n (paired runs: world x
    meta seed x fine-tuning seed), worlds, p-values and whether the claim holds.  ``label(row key)``: a row's words
    (default: the demo row's label as it reads alone, :attr:`MethodRow.standalone_label`).

    The test is the paired t-test over world means (``p_world_t``; the bootstrap p is shown beside it, but it is
    more lenient); ``p_holm`` adjusts it by Holm over every row of this summary (the family; rows with one world
    have no test and are not in it).  ``holds`` is ``better`` / ``worse`` when ``p_holm`` < ``alpha``,
    else ``not shown``; ``holds_uncorrected`` is the per-row verdict of the 95 % interval alone."""
    label = label or (lambda key: method_row(key).standalone_label)
    rows = []
    for (method, base), groups in paired_differences(cells, pairs).items():
        mean, stats = bootstrap_means(groups)
        lo, hi = (float(q) for q in np.quantile(stats, [0.025, 0.975]))
        rows.append(
            {
                "method": method,
                "baseline": base,
                "label": label(method),
                "baseline_label": label(base),
                "mean_H": mean_h(cells, method, beside=base),
                "baseline_mean_H": mean_h(cells, base, beside=method),
                "mean_diff_H": round(mean, 3),
                "ci95": [round(lo, 3), round(hi, 3)],
                "n": sum(len(v) for v in groups.values()),
                "worlds": sorted(groups),
                "p_world_t": world_t_p(groups),
                "p_bootstrap": round(bootstrap_p(stats), 5),
                "holds_uncorrected": ("better" if lo > 0 else "worse" if hi < 0 else "not shown"),
            }
        )
    adjusted = holm([r["p_world_t"] for r in rows])
    for row, p in zip(rows, adjusted):
        row["p_world_t"] = None if row["p_world_t"] is None else round(row["p_world_t"], 5)
        row["p_holm"] = None if p is None else round(p, 5)
        row["family"] = sum(q is not None for q in adjusted)
        shown = p is not None and p < alpha
        row["holds"] = ("better" if row["mean_diff_H"] > 0 else "worse") if shown else "not shown"
    return rows


def regime(cells: dict) -> dict:
    """``{world: {key: (base, new)}}`` for :data:`REGIME_KEYS`, each averaged over the world's cells and seeds."""
    out: dict = {}
    for (world, _), table in cells.items():
        for (key, _), (base, new, _) in table.items():
            if key in REGIME_KEYS:
                out.setdefault(world, {}).setdefault(key, []).append((base, new))
    return {
        w: {k: (float(np.mean([b for b, _ in v])), float(np.mean([n for _, n in v]))) for k, v in d.items()}
        for w, d in sorted(out.items())
    }


def regime_markdown(cells: dict) -> str:
    """Each world's regime (base / new of zero-shot, CoOp, VPT and the gains over zero-shot) beside the paper's."""

    def row(name: str, d: dict) -> str:
        parts = []
        for k in REGIME_KEYS:
            parts.append(f"{d[k][0]:.2f} / {d[k][1]:.2f}" if k in d else "-")
        gains = []
        for k in ("coop", "vpt"):
            ok = k in d and "zsclip" in d
            gains.append(f"{d[k][0] - d['zsclip'][0]:+.2f} / {d[k][1] - d['zsclip'][1]:+.2f}" if ok else "-")
        return f"| {name} | " + " | ".join(parts + gains) + " |"

    lines = [
        "| world | zero-shot base / new | CoOp base / new | VPT base / new | CoOp − zero-shot | VPT − zero-shot |",
        "| --- | --- | --- | --- | --- | --- |",
        row("paper, Table 1a (11 datasets)", PAPER_REGIME),
    ]
    lines += [row(f"world {w}", d) for w, d in regime(cells).items()]
    return "\n".join(lines) + "\n"


def markdown(rows: Sequence[dict], components: Optional[dict] = None, measure: str = "H") -> str:
    """The summary table; "claim" is after Holm over the table's rows (world t-test), the family size in the header.

    ``components`` (``{"method vs baseline": {"world": σ², "finetune": σ², ...}}``, a results file's
    ``variance_components``) adds a column σ²_world / σ²_finetune (H²) per pair ("-" where a pair has none).
    ``measure`` names what the rows' numbers are (the ``*_H`` fields of a study of another measure)."""
    family = max((r.get("family", 0) for r in rows), default=0)
    extra = f" σ²_world / σ²_finetune ({measure}²) |" if components is not None else ""
    lines = [
        f"| method | baseline | {measure} method / baseline | mean Δ{measure} | 95 % interval | p (world t) | p Holm "
        f"({family} rows) | n runs (worlds) |{extra} claim (Holm, 5 %) |",
        "| --- " * (10 if components is not None else 9) + "|",
    ]

    def p(x: Optional[float]) -> str:
        return "-" if x is None else f"{x:.3f}" if x >= 0.001 else "<0.001"

    def sigma(x: Optional[float]) -> str:
        return "-" if x is None else f"{x:.2f}"

    for r in rows:
        comp = ""
        if components is not None:
            c = components.get(f"{r['method']} vs {r['baseline']}", {})
            comp = f" {sigma(c.get('world'))} / {sigma(c.get('finetune'))} |"
        lines.append(
            f"| {r['label']} | {r['baseline_label']} | {r['mean_H']:.2f} / {r['baseline_mean_H']:.2f} | "
            f"{r['mean_diff_H']:+.2f} | "
            f"[{r['ci95'][0]:+.2f}, {r['ci95'][1]:+.2f}] | {p(r.get('p_world_t'))} | {p(r.get('p_holm'))} | "
            f"{r['n']} ({', '.join(r['worlds'])}) |{comp} "
            f"{ {'better': 'holds: better', 'worse': 'holds: worse', 'not shown': 'not shown'}[r['holds']] } |"
        )
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ commands
def table_from_json(table: dict) -> dict:
    """A cell's table as a results file stores it (``{"key/seed": [base, new, H]}``) back to
    ``{(key, seed): (base, new, H)}``, the form :func:`cell_h` returns."""
    return {(key, int(fs)): tuple(v) for key, fs, v in ((*k.rsplit("/", 1), v) for k, v in table.items())}


def table_to_json(table: dict) -> dict:
    """A cell's ``{(key, seed): (base, new, H)}`` table as a results file stores it (``{"key/seed": [base, new, H]}``);
    :func:`table_from_json` reads it back."""
    return {f"{k}/{fs}": list(v) for (k, fs), v in table.items()}


def cells_to_json(cells: dict) -> dict:
    """``{(world, meta seed): table}`` as a results file's ``cells``: ``{"world/seed": table_to_json(table)}``."""
    return {f"{w}/{s}": table_to_json(t) for (w, s), t in sorted(cells.items())}


def settings_record(base: DemoSettings, variant: str = "") -> dict:
    """The switches and fine-tuning seeds a study's cells were run with (``results.json`` ``settings``), and the
    regulator variant (:data:`REGULATOR_SWEEP`) its meta-training used, when not today's ``k1``."""
    record = {
        "reg_window": base.reg_window,
        "launch": base.launch,
        "query_before_weight": base.query_before_weight,
        "fine_tuning_seeds": list(base.seeds),
    }
    if variant and variant != "k1":
        record["regulator_variant"] = variant
    return record


def current_provenance() -> dict:
    """:func:`meta.fingerprint.record.computed_by` of this process (computed once: the golden run takes ~15 s)."""
    if "record" not in _PROVENANCE:
        from meta.fingerprint.record import computed_by

        _PROVENANCE["record"] = computed_by()
    return _PROVENANCE["record"]


_PROVENANCE: dict = {}


def check_fingerprints(path: Path, computed: dict, kept: Sequence[str], fingerprint: str, mix: bool) -> list[str]:
    """The kept cells of ``path`` computed at another numerics fingerprint than ``fingerprint`` (or unrecorded).

    Without ``mix`` any such cell is an error (one line naming the cells): cells of different code or kernels are
    not pooled.  With ``mix`` they are returned, and the summary names them."""
    other = sorted(name for name in kept if computed.get(name, {}).get("fingerprint") != fingerprint)
    if other and not mix:
        seen = sorted({str(computed.get(n, {}).get("fingerprint", "none"))[:12] for n in other})
        raise ValueError(
            f"{path}: cells {', '.join(other)} were computed at numerics fingerprint {', '.join(seen)}, this "
            f"machine and code give {fingerprint[:12]}; rerun them (another --out) or pass --mix-fingerprints"
        )
    return other


def load_cells(path: Path, base: DemoSettings, variant: str = "") -> tuple[dict, dict]:
    """Finished cells and their seconds from an earlier ``results.json`` run with ``base``'s settings.

    Returns ``({(world, meta seed): cell_h table}, {"world/seed": seconds})``; a file written with other
    settings is an error naming the differing keys (its cells are not this study's).  What computed each cell
    is in the file's ``computed_by`` (:func:`check_fingerprints`)."""
    data = json.loads(path.read_text())
    theirs = data.get("settings", {})
    ours = settings_record(base, variant)
    differ = sorted(k for k in set(ours) | set(theirs) if theirs.get(k) != ours.get(k))
    if differ:
        raise ValueError(
            f"{path}: written with other settings "
            f"({', '.join(f'{k} {theirs.get(k)!r} != {ours.get(k)!r}' for k in differ)}); "
            "use another --out or --resume-from"
        )
    cells = {}
    for name, table in data.get("cells", {}).items():
        world, seed = name.rsplit("/", 1)
        cells[(world, int(seed))] = table_from_json(table)
    seconds = data.get("seconds_per_cell", data.get("seconds_per_cell_this_call", {}))
    kept = {f"{w}/{s}" for w, s in cells}
    return cells, {k: v for k, v in seconds.items() if k in kept}


def study(
    root: Path,
    worlds: Sequence[str],
    meta_seeds: Sequence[int],
    base: DemoSettings,
    world_root: Optional[Path] = None,
    previous: Optional[Path] = None,
    add_missing_rows: bool = False,
    deep: bool = False,
    variant: str = "",
    rows: str = "all",
    mix_fingerprints: bool = False,
) -> dict:
    """The default pipeline on test splits for every (world, meta seed), meta seed by meta seed (every
    world's first seed before any second one); ``results.json`` / ``.md`` are rewritten after every cell,
    so a stopped study leaves the summary of the cells it finished.

    Cells already in ``previous`` (an earlier ``results.json`` with the same settings, default
    ``root/results.json``) are taken from it and not run again; the summary covers them and this call's.
    With ``add_missing_rows``, such a cell that lacks rows of :data:`STUDY_KEYS` added since (zero-shot, ...)
    runs those rows only.  With ``deep``, every cell of ``worlds`` × ``meta_seeds`` also holds the deep learners'
    rows (:data:`DEEP_STUDY_KEYS`): a kept cell without them runs them only.

    ``variant``: a :data:`REGULATOR_SWEEP` name whose META overrides every meta-training run of the cells uses
    (its own cell and meta-training folders, as the sweep's, and ``results_<variant>.json``); "" or ``k1`` =
    today's defaults, ``results.json``.

    ``rows``: a name of :data:`ROWS`, the rows a new cell runs (``reg-adds``: only the "GRAM vs θ* only" pairs'
    rows); a kept cell that holds them all is kept as it is.

    Every cell records what computed it (``computed_by``: commit, numerics fingerprint, CPU, pins, builds;
    :func:`current_provenance`).  Kept cells of another fingerprint are refused unless ``mix_fingerprints``;
    then the results name them (``mixed_fingerprints``), and so they do a kept cell of another fingerprint
    that gains rows here."""
    if rows not in ROWS:
        raise ValueError(f"--rows: unknown {rows!r}; known: {', '.join(ROWS)}")
    variant = study_variant(variant)
    if variant:
        base = replace(base, meta_overrides=REGULATOR_SWEEP[variant])
    previous = previous or root / results_name(variant)
    cells, seconds = load_cells(previous, base, variant) if previous.is_file() else ({}, {})
    kept = {f"{w}/{s}" for w, s in cells}
    earlier = json.loads(previous.read_text()) if cells else {}
    inputs = {name: v for name, v in earlier.get("inputs", {}).items() if name in kept}
    now = current_provenance()
    computed = {name: v for name, v in earlier.get("computed_by", {}).items() if name in kept}
    mixed = set(check_fingerprints(previous, computed, sorted(kept), now["fingerprint"], mix_fingerprints))
    book = _Book(computed, mixed)
    result: dict = _write_results(root, cells, seconds, base, inputs, variant, book) if cells else {}
    for seed in meta_seeds:
        for world in worlds:
            cell = Cell(world, replace(world_settings(world, base), meta_seed=seed, eval_split="test"), variant)
            if (world, seed) in cells:
                have = {k for k, _ in cells[(world, seed)]}
                wanted = (ROWS[rows] if add_missing_rows else ()) + (DEEP_STUDY_KEYS if deep else ())
                missing = tuple(k for k in wanted if k not in have)
                if not missing:
                    log(f"study cell world {world}, meta seed {seed}: taken from {previous}")
                    continue
                # a cell from an earlier study that lacks rows added since (e.g. zero-shot): only those run
                log(f"study cell world {world}, meta seed {seed}: adding rows {', '.join(missing)}")
                t = time.time()
                records = run_cell(cell, root, missing, world_root)
                cells[(world, seed)].update(cell_h(records))
                _merge_inputs(inputs, f"{world}/{seed}", cell_inputs(records))
                seconds[f"{world}/{seed}"] = round(seconds.get(f"{world}/{seed}", 0.0) + time.time() - t, 1)
                book.add_rows(f"{world}/{seed}", now)
                result = _write_results(root, cells, seconds, base, inputs, variant, book)
                continue
            t = time.time()
            log(f"study cell world {world}, meta seed {seed}: {cell.name}")
            keys = ROWS[rows] + (DEEP_STUDY_KEYS if deep else ())
            records = run_cell(cell, root, keys, world_root)
            cells[(world, seed)] = cell_h(records)
            _merge_inputs(inputs, f"{world}/{seed}", cell_inputs(records))
            seconds[f"{world}/{seed}"] = round(time.time() - t, 1)
            book.computed[f"{world}/{seed}"] = now
            result = _write_results(root, cells, seconds, base, inputs, variant, book)
    return result


def cells_record(cells: dict, book: "_Book") -> dict:
    """The per-cell part of a sweep file: ``cells`` (``{unit: {(world, seed): table}}``) as JSON under
    ``"unit/world/seed"``, what computed each and the cells that mix fingerprints."""
    return {
        "cells": {
            f"{u}/{w}/{s}": table_to_json(t) for u, by in sorted(cells.items()) for (w, s), t in sorted(by.items())
        },
        "computed_by": dict(sorted(book.computed.items())),
        "mixed_fingerprints": sorted(book.mixed),
    }


@dataclass
class _Book:
    """What computed each cell (``"world/seed"`` -> :func:`meta.fingerprint.record.computed_by`) and the cells that mix
    fingerprints (kept from another fingerprint with ``--mix-fingerprints``, or such a cell that gained rows)."""

    computed: dict
    mixed: set

    def add_rows(self, name: str, now: dict) -> None:
        """Rows computed by ``now`` joined the kept cell ``name``."""
        old = self.computed.get(name)
        if old is None or old.get("fingerprint") != now["fingerprint"]:
            self.mixed.add(name)
            self.computed[name] = {**now, "earlier": old}


def merge_cell(cells: dict, origin: dict, key, table: dict, path: Path, name: str) -> None:
    """Put ``table`` (a cell of the results file ``path``) at ``cells[key]``; a key already there from another file
    must hold the same table (else a one-line error naming both files and the cell ``name``).  ``origin``: key ->
    the file it came from first."""
    if key in cells and cells[key] != table:
        raise ValueError(f"{origin[key]} and {path}: {name} holds different numbers; keep one file")
    origin.setdefault(key, path)
    cells[key] = table


def _merge_inputs(inputs: dict, name: str, new: dict) -> None:
    old = inputs.get(name, {"hierarchy": [], "start_sha256": {}})
    inputs[name] = {
        "hierarchy": sorted(set(old["hierarchy"]) | set(new["hierarchy"])),
        "start_sha256": dict(sorted({**old["start_sha256"], **new["start_sha256"]}.items())),
    }


def check_variants(names: Sequence[str]) -> None:
    """Refuse, in one line naming ``--variants``, any name that is not a :data:`REGULATOR_SWEEP` variant (a
    :data:`REMOVED_VARIANTS` one with the option it needed)."""
    for name in names:
        if name in REMOVED_VARIANTS:
            raise ValueError(
                f"--variants: {name} needs {REMOVED_VARIANTS[name][0]}, which was removed (measured and dropped: "
                f"docs/evidence.md, Options removed); known: {', '.join(REGULATOR_SWEEP)}"
            )
    unknown = [v for v in names if v not in REGULATOR_SWEEP]
    if unknown:
        raise ValueError(f"--variants: unknown {', '.join(unknown)}; known: {', '.join(REGULATOR_SWEEP)}")


def study_variant(name: str) -> str:
    """The variant a test-split study (``study run --variants``) runs: ``""`` for today's defaults (``""`` or
    ``k1``), else the :data:`REGULATOR_SWEEP` name itself (checked by :func:`check_variants`)."""
    if name:
        check_variants([name])
    return "" if name == "k1" else name


def results_name(variant: str = "") -> str:
    """The study's results file: ``results.json`` at today's defaults, ``results_<variant>.json`` for a
    :data:`REGULATOR_SWEEP` variant (its ``.md`` beside it)."""
    return f"results_{variant}.json" if variant and variant != "k1" else "results.json"


def travel_name(variant: str = "") -> str:
    """``study travel``'s file: ``travel.json`` for today's meta-training, ``travel_<variant>.json`` for a
    :data:`REGULATOR_SWEEP` variant's cells (so that measuring one does not overwrite the other)."""
    return f"travel_{variant}.json" if variant and variant != "k1" else "travel.json"


def _earlier_travel(path: Path, seed: int, split: str) -> list[dict]:
    """The records of an earlier ``study travel`` file measured with the same fine-tuning seed and split (none
    when the file is absent); a file of another seed or split is an error naming it."""
    if not path.is_file():
        return []
    data = json.loads(path.read_text())
    theirs = (data.get("fine_tuning_seed"), data.get("split"))  # files written before the split was kept: None
    if theirs != (seed, split):
        raise ValueError(
            f"{path}: measured with fine-tuning seed {theirs[0]}, split {theirs[1]}; this call asks for seed {seed}, "
            f"split {split}: use another --out or delete the file"
        )
    return list(data.get("records", []))


def _write_results(
    root: Path,
    cells: dict,
    seconds: dict,
    base: DemoSettings,
    inputs: Optional[dict] = None,
    variant: str = "",
    book: Optional[_Book] = None,
) -> dict:
    """``results.json`` and ``results.md`` for the finished ``cells`` (``inputs``: :func:`cell_inputs` per
    cell, where known; cells of studies run before it was recorded have none; ``book``: what computed each
    cell, and the cells of mixed fingerprints, named in both files)."""
    rows = summarise(cells, STUDY_PAIRS)
    result = {
        "pairs": rows,
        "cells": cells_to_json(cells),
        "seconds_per_cell": seconds,
        # cells run before inputs were recorded, or that gained only rows without an init file (zero-shot), have none
        "inputs": {k: v for k, v in sorted((inputs or {}).items()) if v.get("hierarchy") or v.get("start_sha256")},
        "settings": settings_record(base, variant),
        "bootstrap": {"draws": BOOTSTRAP_DRAWS, "levels": ["world", "meta seed x fine-tuning seed"]},
        "computed_by": dict(sorted(book.computed.items())) if book else {},
        "mixed_fingerprints": sorted(book.mixed) if book else [],
    }
    name = results_name(variant)
    write_json_atomic(root / name, result)
    mixed_note = (
        "\n**Mixed numerics fingerprints** (kept with --mix-fingerprints): cells "
        f"{', '.join(result['mixed_fingerprints'])} were computed, in whole or in part, at another fingerprint "
        "than the others.\n"
        if result["mixed_fingerprints"]
        else ""
    )
    write_text_atomic(
        root / name.replace(".json", ".md"),
        markdown(rows) + mixed_note + "\nRegime (base / new accuracy, %; a world's numbers are "
        "means over its cells and fine-tuning seeds):\n\n" + regime_markdown(cells),
    )
    return result


def select(root: Path, worlds: Sequence[str], base: DemoSettings, world_root: Optional[Path] = None) -> dict:
    """The validation sweep over :data:`SWEEP` (meta seed ``base.meta_seed``, val splits); writes
    ``selection.json`` / ``selection.md`` and returns the chosen switches."""
    combos = [dict(zip(SWEEP, values)) for values in itertools.product(*SWEEP.values())]
    per_combo: dict = {}
    for world in worlds:
        ws = replace(world_settings(world, base), eval_split="val")
        baseline = cell_h(run_cell(Cell(world, ws), root, tuple(BASELINE_OF.values()), world_root))
        for combo in combos:
            cell = Cell(world, replace(ws, **combo))
            log(f"select: world {world} {cell.name}")
            table = {**baseline, **cell_h(run_cell(cell, root, SWEEP_GRAM_KEYS, world_root))}
            per_combo.setdefault(cell.name.split("_", 2)[2], {})[(world, ws.meta_seed)] = (combo, table)
    rows = []
    for name, by_world in per_combo.items():
        combo = next(iter(by_world.values()))[0]
        cells = {w: t for w, (_, t) in by_world.items()}
        diffs = paired_differences(cells, tuple(BASELINE_OF.items()))
        means = {m: float(np.mean([d for v in g.values() for d in v])) for (m, _), g in diffs.items()}
        per_world = {
            w: {m: round(float(np.mean(g[w])), 3) for (m, _), g in diffs.items() if w in g}
            for w in sorted({w for g in diffs.values() for w in g})
        }
        rows.append(
            {
                **combo,
                "name": name,
                "val_diff_H": {k: round(v, 3) for k, v in means.items()},
                "val_diff_H_per_world": per_world,
                "mean_val_diff_H": round(float(np.mean(list(means.values()))), 3),
            }
        )
    rows.sort(key=lambda r: -r["mean_val_diff_H"])
    chosen = {k: rows[0][k] for k in SWEEP}
    (root / "selection.json").write_text(
        json.dumps(
            {"rows": rows, "chosen": chosen, "worlds": list(worlds), "split": "val", "seeds": list(base.seeds)},
            indent=1,
        )
    )
    lines = [
        "| window | launch | query weight | CoOp + GRAM − CoOp | VPT + GRAM − VPT | UNIGRAM − joint | mean |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        d = r["val_diff_H"]
        lines.append(
            f"| {r['reg_window']} | {'on' if r['launch'] else 'off'} | {r['query_before_weight']:g} | "
            f"{d.get('gram_coop', float('nan')):+.2f} | {d.get('gram_vpt', float('nan')):+.2f} | "
            f"{d.get('unigram', float('nan')):+.2f} | {r['mean_val_diff_H']:+.2f} |"
        )
    worlds_seen = sorted({w for r in rows for w in r["val_diff_H_per_world"]})
    lines += [
        "",
        "Per world (mean of the three paired differences):",
        "",
        "| window | launch | query weight | " + " | ".join(f"world {w}" for w in worlds_seen) + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in worlds_seen) + " |",
    ]
    for r in rows:
        per = r["val_diff_H_per_world"]
        cells = [f"{np.mean(list(per[w].values())):+.2f}" if w in per else "-" for w in worlds_seen]
        lines.append(
            f"| {r['reg_window']} | {'on' if r['launch'] else 'off'} | {r['query_before_weight']:g} | "
            + " | ".join(cells)
            + " |"
        )
    (root / "selection.md").write_text("\n".join(lines) + "\n")
    return chosen


# ------------------------------------------------------------------------------ β's share of the travel
TRAVEL_KEYS = ("gram_coop", "gram_vpt", "unigram", "gram_coop_reg_only", "gram_vpt_reg_only", "unigram_reg_only")


def travel_cell(
    cell: Cell,
    root: Path,
    keys: Sequence[str] = TRAVEL_KEYS,
    seed: int = 1,
    datasets: Optional[Sequence[str]] = None,
    world_root: Optional[Path] = None,
) -> list[dict]:
    """β's share of θ's travel (:class:`meta.method.travel.TravelSplit`) over the fine-tuning schedule of the regulated
    rows ``keys`` of ``cell`` (its cached world, CHC and meta-training; fine-tuning seed ``seed``), one record per
    (dataset, row) with the row's base / new / H of that run.  In-process, one run at a time."""
    import warnings

    from meta.evaluation import DatasetRef, EvaluationSession, TrainSpec, evaluate_base_to_new
    from meta.method.travel import TravelSplit
    from meta.model.backbone import load_clip

    from .demo.stages import method_spec

    s = cell.settings
    world, weights, model, inits, out = prepare_cell(cell, root, keys, world_root)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        clip, dims = load_clip(model, pretrained=str(weights))
    session = EvaluationSession(clip, dims, cache_dir=str(out / "feature_cache"), log=lambda m: None)
    train = TrainSpec(epochs=s.epochs, batch_size=s.batch_size, rrcrop_scale=s.rrcrop_scale, eval_every_epoch=False)
    names = datasets or s.datasets or tuple(d.name for d in world.with_role("base2new"))
    records = []
    for name in names:
        ref = DatasetRef.from_dir(str(world.dataset(name).dataset_dir), name=name)
        for key in keys:
            row = METHOD_BY_KEY[key]
            with TravelSplit() as split:
                rec = evaluate_base_to_new(
                    ref,
                    clip,
                    dims,
                    method_spec(row, inits.get(row.variant, ""), s),
                    seed=seed,
                    shots=s.shots,
                    train=train,
                    session=session,
                    log=lambda m: None,
                    eval_split=s.eval_split,
                )
            records.append(
                {
                    "dataset": name,
                    "key": key,
                    "seed": seed,
                    "base": rec["base"],
                    "new": rec["new"],
                    "H": rec["H"],
                    **{k: round(v, 6) for k, v in split.summary().items()},
                }
            )
            log(f"travel {cell.world} {name} {key}: beta share {records[-1].get('beta_share', float('nan')):.3f}")
    return records


# A variant replaces today's (k1) only when its mean paired difference beats k1's by more than this (H points):
# the earlier sweep's top three were within 0.15 H, two seeds of val splits (docs/notes/gram_training_match.md).
SELECT_MARGIN_H = 0.5


def rank_regulator_variants(
    per_variant: dict, reference: str = "k1", margin: float = SELECT_MARGIN_H, worlds: Sequence[str] = ()
) -> dict:
    """The written-down rule of ``select --sweep regulator`` applied to finished cells.

    ``per_variant``: ``{variant: {(world, meta seed): cell_h table holding the GRAM rows and their baselines}}``.
    Score of a variant: the mean over its worlds of the three paired H differences (GRAM row − its baseline,
    :data:`BASELINE_OF`), each averaged over the world's fine-tuning seeds.  Returns ``{"rows": [...] best
    first, "chosen": name}``: the best variant when it beats ``reference`` by more than ``margin`` on the worlds
    both have, else ``reference``.  With ``worlds`` (the worlds the sweep was asked for), a sweep in which any
    variant lacks one of them is partial (``"partial": True``) and keeps ``reference``, as the written rule says."""
    rows = []
    for name, cells in per_variant.items():
        diffs = paired_differences(cells, tuple(BASELINE_OF.items()))
        per_world = {
            w: {m: round(float(np.mean(g[w])), 3) for (m, _), g in diffs.items() if w in g}
            for w in sorted({w for g in diffs.values() for w in g})
        }
        complete = {w: d for w, d in per_world.items() if len(d) == len(BASELINE_OF)}
        if not complete:
            continue
        world_means = {w: float(np.mean(list(d.values()))) for w, d in complete.items()}
        rows.append(
            {
                "variant": name,
                "overrides": list(REGULATOR_SWEEP.get(name, REMOVED_VARIANTS.get(name, ()))),
                "val_diff_H_per_world": complete,
                "mean_per_world": {w: round(v, 3) for w, v in world_means.items()},
                "mean_val_diff_H": round(float(np.mean(list(world_means.values()))), 3),
            }
        )
    rows.sort(key=lambda r: -r["mean_val_diff_H"])
    chosen = reference
    ref = next((r for r in rows if r["variant"] == reference), None)
    if rows and ref is not None and rows[0]["variant"] != reference:
        shared = sorted(set(rows[0]["mean_per_world"]) & set(ref["mean_per_world"]))
        if shared:
            gain = np.mean([rows[0]["mean_per_world"][w] for w in shared]) - np.mean(
                [ref["mean_per_world"][w] for w in shared]
            )
            if gain > margin:
                chosen = rows[0]["variant"]
    partial = (
        bool(worlds)
        and any(set(worlds) - set(r["mean_per_world"]) for r in rows)
        or (bool(worlds) and len(rows) < len(per_variant))
    )
    best = chosen
    if partial:
        chosen = reference
    return {
        "rows": rows,
        "chosen": chosen,
        "best_if_complete": best,
        "partial": partial,
        "margin_H": margin,
        "reference": reference,
    }


def regulator_markdown(result: dict) -> str:
    worlds = sorted({w for r in result["rows"] for w in r["val_diff_H_per_world"]})
    lines = [
        "| variant | "
        + " | ".join(f"world {w}: CoOp / VPT / UNIGRAM (mean)" for w in worlds)
        + " | mean over worlds |",
        "| --- | " + " | ".join("---" for _ in worlds) + " | --- |",
    ]
    for r in result["rows"]:
        cells = []
        for w in worlds:
            d = r["val_diff_H_per_world"].get(w)
            cells.append(
                "-"
                if d is None
                else " / ".join(f"{d.get(k, float('nan')):+.2f}" for k in SWEEP_GRAM_KEYS)
                + f" ({r['mean_per_world'][w]:+.2f})"
            )
        lines.append(f"| {r['variant']} | " + " | ".join(cells) + f" | {r['mean_val_diff_H']:+.2f} |")
    lines += [
        "",
        f"Chosen by the rule (beat `{result['reference']}` by more than {result['margin_H']:g} H): "
        f"`{result['chosen']}`"
        + (
            f" (partial sweep: no default changes; on the finished worlds the rule "
            f"would pick `{result['best_if_complete']}`)"
            if result.get("partial")
            else ""
        ),
    ]
    return "\n".join(lines) + "\n"


def read_sweep_file(path: Path, kind: str, ours: dict) -> dict:
    """The content of an earlier sweep file ``path`` (``kind``: its file name, for messages) after checking that it
    holds ``cells`` and was written with the settings ``ours`` (``{key: value}``); an error naming the differing keys
    otherwise (its cells are not this sweep's)."""
    try:
        data = parse_json(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: not a {kind} ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("cells"), dict):
        raise ValueError(f"{path}: expected a {kind} (an object with 'cells')")
    differ = sorted(k for k in ours if data.get(k) != ours[k])
    if differ:
        raise ValueError(
            f"{path}: written with other settings "
            f"({', '.join(f'{k} {data.get(k)!r} != {ours[k]!r}' for k in differ)}); "
            "use another --out or --resume-from"
        )
    return data


def load_regulator_cells(path: Path, base: DemoSettings) -> dict:
    """Finished cells of an earlier ``selection_regulator.json`` run with ``base``'s fine-tuning seeds and
    meta-training seed on val splits: ``{variant: {(world, meta seed): cell_h table}}``."""
    ours = {"split": "val", "seeds": list(base.seeds), "meta_seed": base.meta_seed}
    data = read_sweep_file(path, "selection_regulator.json", ours)
    per_variant: dict = {}
    for name, table in data["cells"].items():
        variant, world, seed = name.split("/")
        per_variant.setdefault(variant, {})[(world, int(seed))] = table_from_json(table)
    return per_variant


def select_regulator(
    root: Path,
    worlds: Sequence[str],
    base: DemoSettings,
    variants: Sequence[str] = tuple(REGULATOR_SWEEP),
    world_root: Optional[Path] = None,
    previous: Optional[Path] = None,
) -> dict:
    """The validation sweep over how R_φ is meta-trained (:data:`REGULATOR_SWEEP`) at the default test-time
    switches, meta seed ``base.meta_seed``, val splits; world by world, variant by variant, rewriting
    ``selection_regulator.json`` / ``.md`` after every cell (a stopped sweep leaves what finished, and a
    rerun takes every cached stage).

    Cells in ``previous`` (an earlier ``selection_regulator.json`` with the same seeds, default
    ``root/selection_regulator.json``) are taken from it and not run again; a world whose asked-for variants
    are all there runs nothing, not even its baselines."""
    check_variants(variants)
    previous = previous or root / "selection_regulator.json"
    kept = load_regulator_cells(previous, base) if previous.is_file() else {}
    per_variant: dict = {}
    for v in variants:
        cells = {c: t for c, t in kept.get(v, {}).items() if c[0] in worlds}
        if cells:
            per_variant[v] = cells
    for world in worlds:
        ws = replace(world_settings(world, base), eval_split="val")
        todo = [v for v in variants if (world, ws.meta_seed) not in per_variant.get(v, {})]
        if not todo:
            log(f"select regulator: world {world}: every variant taken from {previous}")
            continue
        baseline = cell_h(run_cell(Cell(world, ws), root, tuple(BASELINE_OF.values()) + ("zsclip",), world_root))
        for name in todo:
            cell = Cell(world, replace(ws, meta_overrides=REGULATOR_SWEEP[name]), variant=name)
            log(f"select regulator: world {world} {cell.name}")
            table = {**baseline, **cell_h(run_cell(cell, root, SWEEP_GRAM_KEYS, world_root))}
            per_variant.setdefault(name, {})[(world, ws.meta_seed)] = table
            _write_regulator_result(root, per_variant, worlds, base)
    return _write_regulator_result(root, per_variant, worlds, base)


def _write_regulator_result(root: Path, per_variant: dict, worlds: Sequence[str], base: DemoSettings) -> dict:
    """``selection_regulator.json`` / ``.md``: the written rule applied to ``per_variant``, and every cell."""
    result = {
        **rank_regulator_variants(per_variant, worlds=worlds),
        "worlds_done": sorted({w for c in per_variant.values() for w, _ in c}),
        "split": "val",
        "seeds": list(base.seeds),
        "meta_seed": base.meta_seed,
        "cells": {f"{v}/{w}/{s}": table_to_json(t) for v, c in per_variant.items() for (w, s), t in c.items()},
    }
    write_json_atomic(root / "selection_regulator.json", result)
    write_text_atomic(root / "selection_regulator.md", regulator_markdown(result))
    return result


def resummarise(path: Path) -> dict:
    """Recompute a committed results file's summary (``pairs``, ``results*.md``) from its cells, nothing rerun:
    for files written before the summary gained p-values and Holm's correction.  Other keys are kept."""
    data = parse_json(path.read_text())
    cells = {
        (name.rsplit("/", 1)[0], int(name.rsplit("/", 1)[1])): table_from_json(t) for name, t in data["cells"].items()
    }
    data["pairs"] = summarise(cells, STUDY_PAIRS)
    write_json_atomic(path, data)
    write_text_atomic(
        path.with_suffix(".md"),
        markdown(data["pairs"]) + "\nRegime (base / new accuracy, %; a world's numbers are "
        "means over its cells and fine-tuning seeds):\n\n" + regime_markdown(cells),
    )
    return data


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gram_world.study", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("run", "select", "travel", "summary"))
    parser.add_argument(
        "--worlds",
        nargs="+",
        help=f"study worlds ({', '.join(WORLDS)}; default all)",
    )
    parser.add_argument(
        "--meta-seeds", type=int, nargs="+", help=f"meta-training seeds (default {' '.join(map(str, META_SEEDS))})"
    )
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        help="fine-tuning seeds (default: the demo's 1 2 3; select: 1 2)",
    )
    parser.add_argument(
        "--out", default="", help="study folder (default output/study, output/select, output/select_<sweep>)"
    )
    parser.add_argument("--jobs", type=int, help="worker processes")
    parser.add_argument(
        "--resume-from",
        default="",
        help="run: an earlier results.json (same settings) whose "
        "cells are kept, not rerun (default: <out>/results.json when it exists); e.g. "
        "docs/study/results.json, the committed study; select --sweep regulator: an earlier "
        "selection_regulator.json (same seeds), e.g. docs/study/selection_regulator.json",
    )
    parser.add_argument(
        "--sweep",
        choices=("switches", "regulator"),
        default="switches",
        help="select: the test-time switches (window, launch, query weight) or how R_φ is "
        "meta-trained (REGULATOR_SWEEP, at the default switches); the base-to-new sweep is "
        "python -m gram_world.study_b2n",
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        help=f"select --sweep regulator: the variants "
        f"(default all: {', '.join(REGULATOR_SWEEP)}); travel: the sweep variant whose cell is "
        "measured; run: the variant every meta-training run of the study uses (results_<variant>.json)",
    )
    parser.add_argument("--datasets", nargs="+", help="travel: base-to-new datasets (default: all of the world's)")
    parser.add_argument(
        "--add-missing-rows",
        action="store_true",
        help="run: cells kept from --resume-from that lack rows added since (zero-shot) run those rows",
    )
    parser.add_argument(
        "--deep",
        action="store_true",
        help="run: the deep learners' rows (IVLP, MaPLe: with GRAM, θ* only, R_φ only) in every cell of "
        "--worlds x --meta-seeds; kept cells without them run them only",
    )
    parser.add_argument(
        "--split",
        choices=("test", "val"),
        help="travel: the split of the cells whose schedules are measured (default test: run's cells)",
    )
    parser.add_argument(
        "--rows",
        choices=tuple(ROWS),
        help="run: the rows a new cell runs: all (default), or reg-adds (only each GRAM row and its θ*-only row: "
        "what R_φ adds, e.g. for a --variants study)",
    )
    parser.add_argument(
        "--mix-fingerprints",
        action="store_true",
        help="run: keep cells of --resume-from computed at another numerics fingerprint (other "
        "code or kernels); the summary names them. Without it such cells are refused",
    )
    add_settings_flags(parser)
    return parser


def add_resume_flags(parser: argparse.ArgumentParser, results: str) -> None:
    """``--mix-fingerprints`` and ``--resume-from FILE...`` (earlier ``results`` files whose worlds are kept), the
    flags of the commands that run a family world by world (:func:`gram_world.confirm.run_family`)."""
    parser.add_argument("--mix-fingerprints", action="store_true", help="run: keep worlds of another fingerprint")
    parser.add_argument(
        "--resume-from",
        nargs="+",
        default=[],
        metavar="FILE",
        help=f"run: also keep the worlds of these {results} files (a committed partial file, halves run elsewhere)",
    )


def add_settings_flags(parser: argparse.ArgumentParser) -> None:
    """``--quick`` and ``--debug``, the flags every study command shares (with ``--jobs``: :func:`base_settings`)."""
    parser.add_argument("--quick", action="store_true", help="the demo's --quick settings (a smoke test)")
    parser.add_argument("--debug", action="store_true")


def base_settings(quick: bool, jobs: Optional[int], worlds: Sequence[str]) -> DemoSettings:
    """The demo's settings (``--quick``'s preset or the default) with ``--jobs`` worker processes, after checking
    ``jobs`` (>= 1) and that every name in ``worlds`` is a study world (one-line ``ValueError`` otherwise)."""
    base = DemoSettings.preset(quick)
    if jobs is not None:
        if jobs < 1:
            raise ValueError(f"--jobs: expected an integer >= 1 worker processes, got {jobs}")
        base = replace(base, jobs=jobs)
    for w in worlds:
        world_settings(w, base)
    return base


def main(argv: Optional[list] = None) -> int:
    return run_cli(_main, argv)


def _main(argv: list) -> int:
    args = _parser().parse_args(argv)
    args.worlds = args.worlds or list(WORLDS)
    args.meta_seeds = args.meta_seeds or list(META_SEEDS)
    args.split = args.split or "test"
    args.rows = args.rows or "all"
    base = base_settings(args.quick, args.jobs, args.worlds)
    t = time.time()
    if args.command in ("run", "travel") and args.variants and len(args.variants) > 1:
        raise ValueError(f"--variants: {args.command} takes one variant, got {' '.join(args.variants)}")
    if args.command == "run":
        base = replace(base, seeds=tuple(args.seeds or base.seeds))
        root = Path(args.out or "output/study")
        result = study(
            root,
            args.worlds,
            args.meta_seeds,
            base,
            previous=Path(args.resume_from) if args.resume_from else None,
            add_missing_rows=args.add_missing_rows,
            deep=args.deep,
            variant=(args.variants or [""])[0],
            rows=args.rows,
            mix_fingerprints=args.mix_fingerprints,
        )
        print((root / results_name((args.variants or [""])[0]).replace(".json", ".md")).read_text(), end="")
        print(f"study: {len(result['cells'])} cells in {root}; this call took {time.time() - t:.0f} s")
    elif args.command == "summary":  # re-summarise --resume-from's cells (p-values, Holm), nothing rerun
        if not args.resume_from:
            raise ValueError("summary: --resume-from names the results file to re-summarise")
        resummarise(Path(args.resume_from))
        print(Path(args.resume_from).with_suffix(".md").read_text(), end="")
    elif args.command == "travel":
        seed = (args.seeds or [1])[0]
        root = Path(args.out or "output/study")
        variant = args.variants[0] if args.variants else ""  # k1 = the sweep's own k1 cells and folders
        check_variants(args.variants or [])
        asked = {(w, m) for w in args.worlds for m in args.meta_seeds}
        # cells measured by earlier calls (same fine-tuning seed and split) stay in the file
        records = [
            r
            for r in _earlier_travel(root / travel_name(variant), seed, args.split)
            if (r["world"], r["meta_seed"]) not in asked
        ]
        for world in args.worlds:
            for meta_seed in args.meta_seeds:
                settings = replace(world_settings(world, base), meta_seed=meta_seed, eval_split=args.split)
                if variant:  # a cell of the regulator sweep (its folder and meta-training runs)
                    settings = replace(settings, meta_overrides=REGULATOR_SWEEP[variant])
                cell = Cell(world, settings, variant=variant)
                for rec in travel_cell(cell, root, seed=seed, datasets=args.datasets):
                    records.append({"world": world, "meta_seed": meta_seed, "variant": variant, **rec})
                write_json_atomic(
                    root / travel_name(variant), {"records": records, "fine_tuning_seed": seed, "split": args.split}
                )
        for key in TRAVEL_KEYS:
            shares = [r["beta_share"] for r in records if r["key"] == key and "beta_share" in r]
            proj = [r["beta_projection"] for r in records if r["key"] == key and "beta_projection" in r]
            if shares:
                print(
                    f"{key:<22} beta share of the travel {np.mean(shares):.3f} (projection {np.mean(proj):+.3f}), "
                    f"{len(shares)} runs"
                )
    elif args.sweep == "regulator":
        base = replace(base, seeds=tuple(args.seeds or base.seeds[:2]))
        root = Path(args.out or "output/select_regulator")
        result = select_regulator(
            root,
            args.worlds,
            base,
            tuple(args.variants or REGULATOR_SWEEP),
            previous=Path(args.resume_from) if args.resume_from else None,
        )
        print(regulator_markdown(result), end="")
        print(f"select --sweep regulator: chosen {result['chosen']}; this call took {time.time() - t:.0f} s")
    else:
        base = replace(base, seeds=tuple(args.seeds or base.seeds[:2]))
        root = Path(args.out or "output/select")
        chosen = select(root, args.worlds, base)
        print((root / "selection.md").read_text(), end="")
        print(f"select: chosen {chosen}; this call took {time.time() - t:.0f} s")
    return 0


if __name__ == "__main__":
    from meta.infra.numerics import pin_process

    pin_process()  # numpy started with this module: this starts the command again, pinned (meta.infra.numerics)
    raise SystemExit(main())
