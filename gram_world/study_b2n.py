"""``python -m gram_world.study_b2n``: the base-to-new regulator sweep, the written rule of
``docs/study/selection_b2n_rule.md`` (committed before any of its cells ran) applied to val-split cells.

What runs on each world (meta-training seed ``settings.meta_seed``, val splits, the demo's settings otherwise),
as *units*, the sweep's resumable cells:

* ``baselines``: CoOp, VPT, joint tuning and zero-shot CLIP.
* ``fixed_coop``, ``fixed_vpt``, ``fixed_joint``: the fixed-λ comparators, each baseline fine-tuned with the
  zero-shot consistency terms (:mod:`meta.method.consistency`) at every point of its learner's grid (:data:`GRIDS`), no
  meta-training; rows ``coop@ct4``, ``vpt@ci2.5``, ``joint@ct1_ci1.25``, ... (:func:`consistency_key`).
* ``paper_gb``, ``class_shift_gb``: today's γ/β R_φ, meta-trained once per learner on the paper's tasks and on
  class-shift tasks (:data:`TASKS`); rows: the three GRAM rows and the θ*-only rows of the same runs.
* ``<tasks>_gate_<learner>_<λ>`` (e.g. ``paper_gate_gram_coop_ct4``): the gate form of R_φ
  (``META.REGULATOR.FORM gate``) meta-trained at one grid point of one learner, its GRAM row fine-tuned with the
  consistency weights it was meta-trained with (row ``gram_coop@ct4``).

Units without META overrides (the baselines, the fixed-λ rows and ``paper_gb``) share the world's plain cell
folder; every other unit has its own cell and meta-training folder (``Cell.variant`` ``b2n_<unit>``).

``selection_b2n.json`` / ``.md`` are rewritten after every unit; a rerun (or ``--resume-from`` an earlier
``selection_b2n.json`` of the same seeds and settings) keeps the finished units, and the demo's cached stages make a
stopped unit resume where it stopped.  Each unit records what computed it (``computed_by``); kept units of another
numerics fingerprint are refused unless ``--mix-fingerprints`` (then both files name them), as ``study run`` does.
A sweep that lacks a unit of the rule's worlds (0 and 1) is partial, and one run off the rule's settings (other
fine-tuning seeds than 1-3, ``--quick``) is not the rule's: both report what the rule would pick and choose the
reference, θ* only of the paper's tasks.

Cost per world: 34 meta-training runs (3 learners × 2 task kinds γ/β, and 14 grid points × 2 task kinds gate) and
58 rows, each evaluated on every base-to-new dataset for every fine-tuning seed (5 datasets × 3 seeds: 870
evaluation runs, the 15 zero-shot ones without training).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from meta.infra.cli_errors import run_cli
from meta.infra.fileio import write_json_atomic, write_text_atomic

from . import study
from .demo.pool import log
from .demo.settings import DemoSettings, consistency_key

RULE = "docs/study/selection_b2n_rule.md"
B2N_FILE = "selection_b2n.json"
B2N_WORLDS = ("0", "1")  # the rule's worlds (the worlds earlier sweeps read)
B2N_SEEDS = (1, 2, 3)  # the rule's fine-tuning seeds (its meta-training seed: 0, the demo's)

# The learners (their GRAM rows), their fixed-λ comparators and θ*-only rows.  UNIGRAM's θ*-only row reads the
# regulated run's file (meta/method/methods.yaml unigram_init_only), as CoOp's and VPT's do.
LEARNERS = study.SWEEP_GRAM_KEYS
FIXED_OF = study.BASELINE_OF
INIT_ONLY_OF = {"gram_coop": "gram_coop_init_only", "gram_vpt": "gram_vpt_init_only", "unigram": "unigram_init_only"}
LEARNER_LABEL = {"gram_coop": "CoOp", "gram_vpt": "VPT", "unigram": "UNIGRAM"}

# λ grids (the rule): text λ for learners with text prompts (KgCoOp's published 8 in the middle), image λ for learners
# with visual prompts (PromptSRC's published 10); UNIGRAM, which has both, takes the pairs (λ, 1.25 λ): KgCoOp's 8
# and PromptSRC's 10 scaled together by 1/8 ... 2 (the rule's clarification of 2026-11-28).  (text λ, image λ).
TEXT_GRID = (1.0, 2.0, 4.0, 8.0, 16.0)
IMAGE_GRID = (2.5, 5.0, 10.0, 20.0)
GRIDS = {
    "gram_coop": tuple((t, 0.0) for t in TEXT_GRID),
    "gram_vpt": tuple((0.0, i) for i in IMAGE_GRID),
    "unigram": tuple((t, 1.25 * t) for t in TEXT_GRID),
}

# The meta-tasks: the paper's (the query shares the support's classes; the domain shifts) and class shift (the
# query's topics are not the support's).
TASKS = {"paper": (), "class_shift": ("TASKS.QUERY_NEW_SHARE", 1.0)}
TASK_LABEL = {"paper": "paper's tasks", "class_shift": "class-shift tasks"}
# Test-time regulator of a variant, in the rule's order of simplicity.
FORMS = ("init_only", "gb", "gate")
FORM_LABEL = {"init_only": "θ* only", "gb": "γ/β R_φ", "gate": "gate R_φ"}
# The variants, as the rule lists them, and in its tie order (simpler first: the form, then the paper's tasks
# before class shift).
VARIANTS = tuple(f"{form}/{task}" for task in TASKS for form in FORMS)
SIMPLER_FIRST = tuple(f"{form}/{task}" for form in FORMS for task in TASKS)
REFERENCE = "init_only/paper"
MARGIN_H = study.SELECT_MARGIN_H  # the chosen variant beats the reference by more than this (H points)
TIE_H = 0.1  # mean ΔH within this of the best (inclusive) is a tie, won by the simpler variant
MIN_ABOVE_FIXED = 2  # ... and its mean val H is above its learner's fixed-λ row for at least this many learners
_EPS = 1e-9  # float noise: "higher" (λ choice) and "within TIE_H" are decided beyond it


def variant_label(variant: str) -> str:
    form, task = variant.split("/")
    return f"{FORM_LABEL[form]}, {TASK_LABEL[task]}"


def gate_overrides(task: str, point: tuple) -> tuple:
    """META overrides of a gate meta-training: the tasks' override, the gate, and the support loss's consistency
    weights (``point`` = (λ text, λ image))."""
    text, image = point
    return TASKS[task] + (
        "META.REGULATOR.FORM",
        "gate",
        "META.CONSISTENCY.TEXT_WEIGHT",
        float(text),
        "META.CONSISTENCY.IMAGE_WEIGHT",
        float(image),
    )


def gate_unit_name(task: str, learner: str, point: tuple) -> str:
    """``<tasks>_gate_<learner>_<λ tags>``, e.g. ``paper_gate_gram_coop_ct4``."""
    return f"{task}_gate_" + consistency_key(learner, *point).replace("@", "_")


@dataclass(frozen=True)
class Unit:
    """One resumable cell of the sweep on a world: the rows ``keys`` and the META overrides of their
    meta-training (() = none: the world's plain cell)."""

    name: str
    keys: tuple
    meta_overrides: tuple = ()

    @property
    def folder(self) -> str:
        """Its :class:`gram_world.study.Cell` variant: "" (the plain cell) without META overrides, else b2n_<name>."""
        return f"b2n_{self.name}" if self.meta_overrides else ""

    def cell(self, world: str, settings: DemoSettings) -> study.Cell:
        return study.Cell(world, replace(settings, meta_overrides=self.meta_overrides), variant=self.folder)


def b2n_units() -> tuple[Unit, ...]:
    """Every unit a world runs, in the order it runs them (baselines and fixed-λ rows first: no meta-training)."""
    units = [Unit("baselines", tuple(FIXED_OF.values()) + ("zsclip",))]
    for learner, baseline in FIXED_OF.items():
        units.append(Unit(f"fixed_{baseline}", tuple(consistency_key(baseline, *p) for p in GRIDS[learner])))
    for task, overrides in TASKS.items():
        units.append(Unit(f"{task}_gb", LEARNERS + tuple(INIT_ONLY_OF[k] for k in LEARNERS), overrides))
    for task in TASKS:
        for learner in LEARNERS:
            for point in GRIDS[learner]:
                key = consistency_key(learner, *point)
                units.append(Unit(gate_unit_name(task, learner, point), (key,), gate_overrides(task, point)))
    return tuple(units)


# ------------------------------------------------------------------------------ the rule
def _by_world(cells: dict, unit: str, key: str) -> dict:
    """``{world: {fine-tuning seed: H}}`` of row ``key`` in unit ``unit``'s cells."""
    out: dict = {}
    for (world, _), table in cells.get(unit, {}).items():
        for (k, seed), value in table.items():
            if k == key:
                out.setdefault(world, {})[int(seed)] = float(value[2])
    return out


def _mean_h(by_world: dict) -> Optional[float]:
    """Mean over worlds of each world's mean over fine-tuning seeds; None without any."""
    means = [float(np.mean(list(s.values()))) for s in by_world.values() if s]
    return float(np.mean(means)) if means else None


def _r(x: Optional[float]) -> Optional[float]:
    return None if x is None else round(float(x), 3)


def choose_lambda(cells: dict, learner: str, where) -> dict:
    """The rule's λ of ``learner``: the grid point with the highest mean val H over worlds and seeds, ties (within
    float noise) to the smaller λ.  ``where(point) -> (unit, key)`` locates a grid point's row.  Returns ``lambda``
    (``[text, image]``, None when no point has cells), its ``unit`` / ``key`` / ``mean_H`` and every point's
    ``grid`` entry."""
    grid, best = [], None
    for point in GRIDS[learner]:
        unit, key = where(point)
        h = _mean_h(_by_world(cells, unit, key))
        grid.append({"lambda": list(point), "key": key, "mean_H": _r(h)})
        if h is not None and (best is None or h > best[0] + _EPS):
            best = (h, point, unit, key)
    if best is None:
        return {"lambda": None, "unit": None, "key": None, "mean_H": None, "grid": grid, "_h": None}
    h, point, unit, key = best
    return {"lambda": list(point), "unit": unit, "key": key, "mean_H": _r(h), "grid": grid, "_h": h}


def missing_units(cells: dict, worlds: Sequence[str], seeds: Sequence[int] = ()) -> list[str]:
    """``unit/world`` of every unit of :func:`b2n_units` that a world of ``worlds`` lacks, or that lacks one of its
    rows (for one of ``seeds``, when given)."""
    missing = []
    for world in worlds:
        for unit in b2n_units():
            table = next((t for (w, _), t in cells.get(unit.name, {}).items() if w == world), {})
            rows = {k for k, _ in table}
            if any(k not in rows or any((k, s) not in table for s in seeds) for k in unit.keys):
                missing.append(f"{unit.name}/{world}")
    return missing


def rank_b2n_variants(cells: dict, worlds: Sequence[str] = (), seeds: Sequence[int] = ()) -> dict:
    """The written rule of ``docs/study/selection_b2n_rule.md`` applied to finished units.

    ``cells``: ``{unit name: {(world, meta seed): cell_h table}}`` (:func:`b2n_units`).  Steps:

    1. λ of each learner's fixed-λ row, and of its gate per task kind: :func:`choose_lambda`.
    2. Per variant (:data:`VARIANTS`) and learner: ΔH = H(variant) − H(θ* only, paper's tasks), paired by fine-tuning
       seed, averaged over the seeds of each world, then over the worlds; the variant's mean ΔH is the mean over the
       three learners.  Its mean val H per learner (over worlds of seed means) against the fixed-λ row's.
    3. The best variant: the highest mean ΔH, where every variant within :data:`TIE_H` of it (inclusive) ties and the
       simplest of the tied wins (:data:`SIMPLER_FIRST`).  It is chosen only if its mean ΔH > :data:`MARGIN_H` and its
       mean val H is above the fixed-λ row for at least :data:`MIN_ABOVE_FIXED` learners; otherwise the reference.

    With ``worlds`` (the worlds the sweep was asked for) a sweep that lacks any unit, row or (with ``seeds``) seed is
    partial: ``chosen`` is the reference and ``best_if_complete`` what the rule picks on the finished units."""
    fixed = {
        learner: {
            "row": FIXED_OF[learner],
            **choose_lambda(
                cells,
                learner,
                lambda p, b=FIXED_OF[learner]: (f"fixed_{b}", consistency_key(b, *p)),
            ),
        }
        for learner in LEARNERS
    }
    gate = {
        task: {
            learner: choose_lambda(
                cells, learner, lambda p, t=task, n=learner: (gate_unit_name(t, n, p), consistency_key(n, *p))
            )
            for learner in LEARNERS
        }
        for task in TASKS
    }

    def where(variant: str, learner: str) -> Optional[tuple]:
        form, task = variant.split("/")
        if form == "init_only":
            return f"{task}_gb", INIT_ONLY_OF[learner]
        if form == "gb":
            return f"{task}_gb", learner
        chosen = gate[task][learner]
        return (chosen["unit"], chosen["key"]) if chosen["unit"] else None

    rows = []
    for variant in VARIANTS:
        per_world: dict = {}
        mean_h: dict = {}
        for learner in LEARNERS:
            at = where(variant, learner)
            mine = _by_world(cells, *at) if at else {}
            ref = _by_world(cells, *where(REFERENCE, learner))
            for w in sorted(set(mine) & set(ref)):
                seeds_both = sorted(set(mine[w]) & set(ref[w]))
                if seeds_both:
                    diff = float(np.mean([mine[w][s] - ref[w][s] for s in seeds_both]))
                    per_world.setdefault(w, {})[learner] = diff
            h = _mean_h(mine)
            if h is not None:
                mean_h[learner] = h
        per_learner = {
            learner: float(np.mean([d[learner] for d in per_world.values() if learner in d]))
            for learner in LEARNERS
            if any(learner in d for d in per_world.values())
        }
        mean = float(np.mean(list(per_learner.values()))) if per_learner else None
        above = {
            learner: mean_h[learner] > fixed[learner]["_h"]
            for learner in LEARNERS
            if learner in mean_h and fixed[learner]["_h"] is not None
        }
        rows.append(
            {
                "variant": variant,
                "label": variant_label(variant),
                "delta_H_per_world": {w: {k: _r(v) for k, v in d.items()} for w, d in sorted(per_world.items())},
                "delta_H": {k: _r(v) for k, v in per_learner.items()},
                "mean_delta_H": _r(mean),
                "mean_H": {k: _r(v) for k, v in mean_h.items()},
                "above_fixed": above,
                "learners_above_fixed": sum(above.values()),
                "_mean": mean,
            }
        )
    scored = [r for r in rows if r["_mean"] is not None]
    best, reason = None, "no_cells"
    if scored:
        top = max(r["_mean"] for r in scored)
        tied = [r for r in scored if r["_mean"] >= top - TIE_H - _EPS]
        best = min(tied, key=lambda r: SIMPLER_FIRST.index(r["variant"]))
        if best["variant"] == REFERENCE:
            reason = "reference_best"
        elif not best["_mean"] > MARGIN_H:
            reason = "margin"
        elif best["learners_above_fixed"] < MIN_ABOVE_FIXED:
            reason = "fixed"
        else:
            reason = "chosen"
    would = best["variant"] if reason == "chosen" else REFERENCE
    missing = missing_units(cells, worlds, seeds)
    for r in rows:
        del r["_mean"]
    for choice in [*fixed.values(), *(c for by in gate.values() for c in by.values())]:
        del choice["_h"]
    return {
        "rule": RULE,
        "variants": rows,
        "fixed": fixed,
        "gate_lambda": gate,
        "best": best["variant"] if best else None,
        "reason": reason,
        "chosen": REFERENCE if missing else would,
        "best_if_complete": would,
        "partial": bool(missing),
        "missing": missing,
        "reference": REFERENCE,
        "margin_H": MARGIN_H,
        "tie_H": TIE_H,
        "min_learners_above_fixed": MIN_ABOVE_FIXED,
    }


# ------------------------------------------------------------------------------ the report
def _lam(point: Optional[list]) -> str:
    """``text 4`` / ``image 10`` / ``text 1, image 1.25``; ``-`` for none."""
    if point is None:
        return "-"
    return ", ".join(f"{what} {v:g}" for what, v in zip(("text", "image"), point) if v)


def _num(x: Optional[float], signed: bool = False) -> str:
    return "-" if x is None else f"{x:+.2f}" if signed else f"{x:.2f}"


def b2n_markdown(result: dict) -> str:
    """``selection_b2n.md``: the variants' ΔH and val H against the fixed-λ rows, each learner's chosen λ and the
    rule's choice in one sentence."""
    worlds = sorted({w for r in result["variants"] for w in r["delta_H_per_world"]})
    learners = " / ".join(LEARNER_LABEL[k] for k in LEARNERS)
    lines = [
        f"Val splits, fine-tuning seeds {', '.join(map(str, result.get('seeds', [])))}, meta-training seed "
        f"{result.get('meta_seed', '-')}; the rule: `{RULE}`.  ΔH: H of the variant minus H of θ* only on the paper's "
        "tasks, paired by fine-tuning seed and averaged over them, per learner; the mean is over the worlds and the "
        "three learners.  A gate variant is shown at each learner's chosen λ (second table).",
        "",
        "| variant | "
        + " | ".join(f"world {w}: ΔH {learners} (mean)" for w in worlds)
        + f" | mean ΔH | val H {learners} | above the fixed-λ row |",
        "| --- | " + " | ".join("---" for _ in worlds) + " | --- | --- | --- |",
    ]
    for r in result["variants"]:
        cells = []
        for w in worlds:
            d = r["delta_H_per_world"].get(w)
            cells.append(
                "-"
                if not d
                else " / ".join(_num(d.get(k), True) for k in LEARNERS)
                + f" ({_num(float(np.mean(list(d.values()))), True)})"
            )
        h = " / ".join(_num(r["mean_H"].get(k)) for k in LEARNERS)
        above = f"{r['learners_above_fixed']} of {len(LEARNERS)}" if r["above_fixed"] else "-"
        lines.append(f"| {r['label']} | " + " | ".join(cells) + f" | {_num(r['mean_delta_H'], True)} | {h} | {above} |")
    ref = next(r for r in result["variants"] if r["variant"] == REFERENCE)
    lines += [
        "",
        "Chosen λ per learner (the grid point with the highest mean val H, ties to the smaller λ):",
        "",
        "| learner | fixed-λ row: λ | its val H | gate, paper's tasks: λ | its val H | gate, class-shift tasks: λ | "
        "its val H | θ* only, paper's tasks: val H |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for k in LEARNERS:
        f, gp, gc = result["fixed"][k], result["gate_lambda"]["paper"][k], result["gate_lambda"]["class_shift"][k]
        lines.append(
            f"| {LEARNER_LABEL[k]} | {f['row']} {_lam(f['lambda'])} | {_num(f['mean_H'])} | {_lam(gp['lambda'])} | "
            f"{_num(gp['mean_H'])} | {_lam(gc['lambda'])} | {_num(gc['mean_H'])} | {_num(ref['mean_H'].get(k))} |"
        )
    lines += [
        "",
        "Val H at every grid point (chosen λ in bold):",
        "",
        "| learner | row | val H per λ |",
        "| --- | --- | --- |",
    ]
    for k in LEARNERS:
        for name, choice in (
            (f"fixed-λ {result['fixed'][k]['row']}", result["fixed"][k]),
            ("gate, paper's tasks", result["gate_lambda"]["paper"][k]),
            ("gate, class-shift tasks", result["gate_lambda"]["class_shift"][k]),
        ):
            points = []
            for g in choice["grid"]:
                text = f"{_lam(g['lambda'])}: {_num(g['mean_H'])}"
                points.append(f"**{text}**" if g["lambda"] == choice["lambda"] else text)
            lines.append(f"| {LEARNER_LABEL[k]} | {name} | {'; '.join(points)} |")
    lines += ["", choice_sentence(result)]
    if result.get("mixed_fingerprints"):
        lines += [
            "",
            "**Mixed numerics fingerprints** (kept with --mix-fingerprints): units "
            f"{', '.join(result['mixed_fingerprints'])} were computed, in whole or in part, at another fingerprint "
            "than the others.",
        ]
    return "\n".join(lines) + "\n"


def missing_text(missing: Sequence[str]) -> str:
    """``missing_units``'s list in words: a world that lacks every unit as ``world 1``, then at most six units."""
    names = [u.name for u in b2n_units()]
    by_world: dict = {}
    for item in missing:
        unit, world = item.rsplit("/", 1)
        by_world.setdefault(world, []).append(unit)
    whole = [w for w, units in by_world.items() if len(units) == len(names)]
    rest = [m for m in missing if m.rsplit("/", 1)[1] not in whole]
    parts = [f"world {w}" for w in whole] + rest[:6]
    return ", ".join(parts) + (f" and {len(rest) - 6} more units" if len(rest) > 6 else "")


def choice_sentence(result: dict) -> str:
    """The rule's choice in one sentence, with the reason when it is the reference."""
    rows = {r["variant"]: r for r in result["variants"]}
    ref = variant_label(result["reference"])
    best = rows.get(result["best"]) if result["best"] else None
    n = len(LEARNERS)
    if result["reason"] == "no_cells":
        why = f"**{ref}**: no finished cells of it yet"
    elif result["reason"] == "reference_best":
        why = f"**{ref}**: no variant's mean ΔH is more than {result['tie_H']:g} H above it"
    elif result["reason"] == "margin":
        why = (
            f"**{ref}**: the best variant, {best['label']} (mean ΔH {_num(best['mean_delta_H'], True)}), is not more "
            f"than {result['margin_H']:g} H above it"
        )
    elif result["reason"] == "fixed":
        why = (
            f"**{ref}**: the best variant, {best['label']} (mean ΔH {_num(best['mean_delta_H'], True)}), is above "
            f"its learner's fixed-λ row for {best['learners_above_fixed']} of {n} learners, fewer than "
            f"{result['min_learners_above_fixed']}"
        )
    else:
        why = (
            f"**{best['label']}**: mean ΔH {_num(best['mean_delta_H'], True)} over {ref} (more than "
            f"{result['margin_H']:g} H), above its learner's fixed-λ row for {best['learners_above_fixed']} of {n} "
            "learners"
        )
    if result.get("off_rule"):
        return (
            f"Not the rule's sweep ({'; '.join(result['off_rule'])}): the choice stays **{ref}**; on these cells the "
            f"rule would pick {why}"
            + (
                f"; the sweep is also partial (missing {missing_text(result['missing'])})."
                if result["partial"]
                else "."
            )
        )
    if result["partial"]:
        return (
            f"Partial sweep (missing {missing_text(result['missing'])}): the choice stays **{ref}**; on the finished "
            f"units the rule would pick {why}."
        )
    return f"Chosen by the rule: {why}."


# ------------------------------------------------------------------------------ files and the sweep
def off_rule(base: DemoSettings) -> list[str]:
    """How ``base`` differs from the rule's cells (fine-tuning seeds 1-3, meta-training seed 0, the demo's full
    settings); a sweep run otherwise reports what the rule would pick but chooses the reference (a smoke test
    with ``--quick``, or fewer seeds)."""
    out = []
    if tuple(base.seeds) != B2N_SEEDS:
        out.append(f"fine-tuning seeds {' '.join(map(str, base.seeds))}, the rule's are 1 2 3")
    if base.meta_seed != 0:
        out.append(f"meta-training seed {base.meta_seed}, the rule's is 0")
    if base.quick:
        out.append("the demo's --quick settings")
    return out


def b2n_record(base: DemoSettings) -> dict:
    """What a ``selection_b2n.json`` was run with; a file of other values is not this sweep's."""
    return {
        "split": "val",
        "seeds": list(base.seeds),
        "meta_seed": base.meta_seed,
        "settings": {
            "quick": base.quick,
            "reg_window": base.reg_window,
            "launch": base.launch,
            "query_before_weight": base.query_before_weight,
        },
    }


def load_b2n_cells(path: Path, base: DemoSettings) -> tuple[dict, dict]:
    """Finished units of an earlier ``selection_b2n.json`` run with ``base``'s seeds and settings:
    ``({unit: {(world, meta seed): cell_h table}}, the file's content)``.  A file written with other settings is an
    error naming the differing keys."""
    data = study.read_sweep_file(path, B2N_FILE, b2n_record(base))
    cells: dict = {}
    for name, table in data["cells"].items():
        unit, world, seed = name.rsplit("/", 2)
        cells.setdefault(unit, {})[(world, int(seed))] = study.table_from_json(table)
    return cells, data


def merge_sweep_files(paths: Sequence[Path], base: DemoSettings) -> tuple[dict, dict]:
    """:func:`load_b2n_cells` of every file in ``paths``, merged: ``({unit: {(world, meta seed): table}}, the files'
    "computed_by", "mixed_fingerprints", "inputs" and "seconds_per_cell")``.  A unit cell found in two files must
    hold the same table (else a one-line error naming both)."""
    cells: dict = {}
    merged: dict = {"computed_by": {}, "mixed_fingerprints": [], "inputs": {}, "seconds_per_cell": {}}
    origin: dict = {}
    for path in paths:
        theirs, data = load_b2n_cells(path, base)
        for unit, by in theirs.items():
            for key, table in by.items():
                name = f"{unit}/{key[0]}/{key[1]}"
                study.merge_cell(
                    cells.setdefault(unit, {}), origin.setdefault(unit, {}), key, table, path, f"unit {name}"
                )
        for field in ("computed_by", "inputs", "seconds_per_cell"):
            merged[field].update(data.get(field, {}))
        merged["mixed_fingerprints"] = sorted(
            set(merged["mixed_fingerprints"]) | set(data.get("mixed_fingerprints", []))
        )
    return cells, merged


def select_b2n(
    root: Path,
    worlds: Sequence[str],
    base: DemoSettings,
    world_root: Optional[Path] = None,
    previous: Optional[Path | Sequence[Path]] = None,
    mix_fingerprints: bool = False,
    units: Optional[Sequence[str]] = None,
) -> dict:
    """The base-to-new regulator sweep (module docstring) on ``worlds``, val splits, meta seed ``base.meta_seed``,
    fine-tuning seeds ``base.seeds``; world by world, unit by unit (:func:`b2n_units`), rewriting
    ``selection_b2n.json`` / ``.md`` after every unit.  Units in ``previous`` (default ``root/selection_b2n.json``;
    several files, e.g. of worlds swept in parallel into different folders, are merged: :func:`merge_sweep_files`)
    are kept and not run again; kept units of another numerics fingerprint are refused unless
    ``mix_fingerprints``.  ``units`` (names of :func:`b2n_units`; default all) runs only those, so one world's units
    can be split over processes writing to different folders.  The rule's choice needs the rule's worlds
    (:data:`B2N_WORLDS`, whatever ``worlds`` asks) and its settings (:func:`off_rule`); without them the files say
    what it would pick and choose the reference."""
    chosen_units = pick_units(units)
    files = [Path(p) for p in ([previous] if isinstance(previous, (str, Path)) else previous or [root / B2N_FILE])]
    previous = files[0] if len(files) == 1 else Path(" + ".join(map(str, files)))  # named in messages
    kept, earlier = merge_sweep_files([f for f in files if f.is_file()], base)
    cells = {u: {c: t for c, t in by.items() if c[0] in worlds} for u, by in kept.items()}
    cells = {u: by for u, by in cells.items() if by}
    names = sorted(f"{u}/{w}/{s}" for u, by in cells.items() for w, s in by)
    now = study.current_provenance()
    computed = {n: v for n, v in earlier.get("computed_by", {}).items() if n in names}
    mixed = set(study.check_fingerprints(previous, computed, names, now["fingerprint"], mix_fingerprints))
    mixed |= {n for n in earlier.get("mixed_fingerprints", []) if n in names}
    book = study._Book(computed, mixed)
    inputs = {n: v for n, v in earlier.get("inputs", {}).items() if n in names}
    seconds = {n: v for n, v in earlier.get("seconds_per_cell", {}).items() if n in names}
    result = _write_b2n_result(root, cells, worlds, base, book, inputs, seconds)
    for world in worlds:
        ws = replace(study.world_settings(world, base), eval_split="val")
        todo = [u for u in chosen_units if (world, ws.meta_seed) not in cells.get(u.name, {})]
        if not todo:
            log(f"select b2n: world {world}: every unit taken from {previous}")
            continue
        for unit in todo:
            cell = unit.cell(world, ws)
            name = f"{unit.name}/{world}/{ws.meta_seed}"
            log(f"select b2n: world {world} unit {unit.name} ({cell.name})")
            t = time.time()
            records = study.run_cell(cell, root, unit.keys, world_root)
            cells.setdefault(unit.name, {})[(world, ws.meta_seed)] = study.cell_h(records)
            study._merge_inputs(inputs, name, study.cell_inputs(records))
            seconds[name] = round(time.time() - t, 1)
            book.computed[name] = now
            result = _write_b2n_result(root, cells, worlds, base, book, inputs, seconds)
    return result


def pick_units(names: Optional[Sequence[str]]) -> tuple[Unit, ...]:
    """The units of :func:`b2n_units` named in ``names`` (all when None), in the order they run; an unknown name is a
    one-line error listing the known ones."""
    every = b2n_units()
    if names is None:
        return every
    known = {u.name for u in every}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"--units: unknown {', '.join(unknown)}; expected some of {', '.join(u.name for u in every)}")
    return tuple(u for u in every if u.name in set(names))


def _write_b2n_result(
    root: Path,
    cells: dict,
    worlds: Sequence[str],
    base: DemoSettings,
    book: study._Book,
    inputs: dict,
    seconds: dict,
) -> dict:
    """``selection_b2n.json`` / ``.md``: the rule applied to ``cells``, every unit, and what computed each."""
    ranked = rank_b2n_variants(cells, worlds=sorted(set(worlds) | set(B2N_WORLDS)), seeds=base.seeds)
    off = off_rule(base)
    if off:
        ranked["chosen"] = REFERENCE
    result = {
        **ranked,
        "off_rule": off,
        **b2n_record(base),
        "worlds": list(worlds),
        **study.cells_record(cells, book),
        "inputs": {k: v for k, v in sorted(inputs.items()) if v.get("hierarchy") or v.get("start_sha256")},
        "seconds_per_cell": dict(sorted(seconds.items())),
    }
    write_json_atomic(root / B2N_FILE, result)
    write_text_atomic(root / B2N_FILE.replace(".json", ".md"), b2n_markdown(result))
    return result


def _parser():
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m gram_world.study_b2n",
        description=f"The base-to-new regulator sweep on val splits, by the written rule of {RULE}.",
    )
    parser.add_argument("--worlds", nargs="+", default=list(B2N_WORLDS), help="study worlds (default 0 1, the rule's)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="fine-tuning seeds (default 1 2 3)")
    parser.add_argument("--out", default="output/select_b2n", help="sweep folder (default output/select_b2n)")
    parser.add_argument("--jobs", type=int, help="worker processes")
    parser.add_argument(
        "--resume-from",
        nargs="+",
        default=[],
        help=f"earlier {B2N_FILE} files (same seeds and settings) whose units are kept; several are merged (worlds "
        "swept in parallel into different --out folders)",
    )
    parser.add_argument(
        "--units",
        nargs="+",
        help="run only these units (default all; names: --list-units), e.g. to split a world over two --out folders",
    )
    parser.add_argument("--list-units", action="store_true", help="print the units in the order they run and stop")
    parser.add_argument(
        "--mix-fingerprints",
        action="store_true",
        help="keep units of --resume-from computed at another numerics fingerprint (the summary names them)",
    )
    study.add_settings_flags(parser)
    return parser


def main(argv: Optional[list] = None) -> int:
    return run_cli(_main, argv)


def _main(argv: list) -> int:
    args = _parser().parse_args(argv)
    if args.list_units:
        print("\n".join(f"{u.name}: {', '.join(u.keys)}" for u in b2n_units()))
        return 0
    base = study.base_settings(args.quick, args.jobs, args.worlds)
    t = time.time()
    base = replace(base, seeds=tuple(args.seeds))
    root = Path(args.out)
    result = select_b2n(
        root,
        args.worlds,
        base,
        previous=[Path(p) for p in args.resume_from] or None,
        mix_fingerprints=args.mix_fingerprints,
        units=args.units,
    )
    print(b2n_markdown(result), end="")
    print(f"study_b2n: chosen {result['chosen']} ({root / B2N_FILE}); this call took {time.time() - t:.0f} s")
    return 0


if __name__ == "__main__":
    from meta.infra.numerics import pin_process

    pin_process()  # numpy started with this module: this starts the command again, pinned (meta.infra.numerics)
    raise SystemExit(main())
