"""``python -m gram_world.study_testtime``: the test-time study of ``docs/study/testtime_plan.md`` and its val sweep,
the written rule of ``docs/study/testtime_selection_rule.md``.

The measure is the accuracy on the cross-domain target (the held-out style) after test-time tuning (TPT, Shu et al.,
NeurIPS 2022) of each :data:`gram_world.demo.settings.TESTTIME_ROWS` row, the transfer runs of the demo's test-time
group only (``DemoSettings.testtime_protocols``).

* ``select``: the val sweep (:data:`CHOICES`: test-time steps of the test-time GRAM rows x the views their θ*, R_φ
  are meta-trained with) on the **val** splits of worlds 0 and 1, meta-training seed 0, fine-tuning seeds 1-3; each
  choice is a resumable unit per world, ``testtime_selection.json`` / ``.md`` rewritten after every unit
  (:func:`rank_choices`: highest mean val accuracy, ties within :data:`TIE_POINTS` to fewer steps, then fewer views).
* ``select-cache``: the cache row's views per test image (:data:`CACHE_CHOICES`, TDA's 1 or 64) on the same val
  splits by the rule of ``docs/study/testtime_cache_rule.md`` (:func:`rank_cache_views`), ``testtime_cache_selection``
  ``.json`` / ``.md``; the choice is ``DemoSettings.cache_views``.
* ``plan``: the family, the pilot, the cost, the size and the draw.
* ``run``: the family (:data:`PAIRS`, Holm over all four) on the **test** splits of :data:`WORLDS` with the choice of
  the committed ``docs/study/testtime_selection.json`` (``--selection``), world by world, resumable
  (:func:`gram_world.confirm.run_family`; ``--resume-from`` keeps the worlds of a committed partial results file).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from meta.infra.cli_errors import run_cli
from meta.infra.fileio import write_json_atomic, write_text_atomic

from . import confirm, power, study, study_cocoop
from .demo.pool import log
from .demo.settings import TESTTIME_BY_KEY, VARIANT_BY_NAME, DemoSettings
from .demo.stages import stage_eval
from .demo.testtime_report import _values

RULE = "docs/study/testtime_selection_rule.md"
PLAN = "docs/study/testtime_plan.md"
SELECTION = "docs/study/testtime_selection.json"  # the committed sweep file ``run`` reads
SELECTION_FILE = "testtime_selection.json"
RESULTS_FILE = "testtime.json"
UNIT = "acc"  # the tables' name of the measure: accuracy on the cross-domain target, percentage points

# ------------------------------------------------------------------------------ the val sweep
TT_GRAM_ROWS = ("tt_gram", "tt_gram_proto")  # the test-time GRAM rows, without and with CHC prototypes
SELECT_WORLDS = ("0", "1")  # the worlds earlier sweeps read
SELECT_SEEDS = (1, 2, 3)
STEPS = (1, 2)  # test-time steps of the test-time GRAM rows (their meta-trained step, DemoSettings.testtime_steps)
VIEWS = (8, 16)  # META.TEST_TIME.VIEWS of their meta-training
_TT = VARIANT_BY_NAME["gram_coop_testtime"].overrides
DEFAULT_VIEWS = dict(zip(_TT[::2], _TT[1::2]))["META.TEST_TIME.VIEWS"]  # the demo's: 8, the sweep's choice
TIE_POINTS = 0.1
_EPS = 1e-9


@dataclass(frozen=True)
class Choice:
    steps: int
    views: int

    @property
    def name(self) -> str:
        return f"steps{self.steps}_views{self.views}"

    def settings(self, base: DemoSettings) -> DemoSettings:
        """``base`` with this choice: its test-time steps, its views as a META override (none at the default)."""
        views = () if self.views == DEFAULT_VIEWS else ("META.TEST_TIME.VIEWS", self.views)
        return replace(base, testtime_steps=self.steps, meta_overrides=views, testtime_protocols=("transfer",))

    def cell(self, world: str, base: DemoSettings) -> study.Cell:
        """Its cell on ``world``: the steps name the cell folder, views other than the default their own meta folder."""
        variant = "" if self.views == DEFAULT_VIEWS else f"tt_views{self.views}"
        return study.Cell(world, self.settings(base), variant=variant)


CHOICES = tuple(Choice(s, v) for s in STEPS for v in VIEWS)
BY_NAME = {c.name: c for c in CHOICES}


def testtime_records(cell: study.Cell, root: Path, keys: Sequence[str], world_root: Optional[Path] = None) -> list:
    """Every cached stage of ``cell`` for the test-time rows ``keys``, then their transfer runs; the records."""
    rows = tuple(TESTTIME_BY_KEY[k].row for k in keys)
    world, weights, model, inits, out = study.prepare_cell(cell, root, rows, world_root)
    return stage_eval(world, weights, model, inits, out, cell.settings, testtime=tuple(keys))


def testtime_table(records: Sequence[dict]) -> dict:
    """``{(test-time row, fine-tuning seed): (accuracy before tuning, ECE or None, accuracy)}`` on the cross-domain
    target(s) (their mean) of the transfer records."""
    out = {}
    for r in records:
        if r.get("test_time_row") and r["protocol"] == "transfer":
            v = _values(r, "targets")
            out[(r["test_time_row"], int(r["seed"]))] = (v["accuracy_before"], v.get("ece"), v["accuracy"])
    return out


def _by_world(by: dict, row: str, field: int = 2) -> dict:
    """``{world: mean over fine-tuning seeds of row's accuracy}`` of one choice's cells ``by`` (``field`` 0: its
    accuracy before tuning, of :func:`testtime_table`'s triples)."""
    out = {}
    for (world, _), table in by.items():
        values = [v[field] for (k, _), v in table.items() if k == row]
        if values:
            out[world] = float(np.mean(values))
    return out


def missing_cells(
    cells: dict, seeds: Sequence[int] = SELECT_SEEDS, units: Sequence = CHOICES, rows: Sequence[str] = TT_GRAM_ROWS
) -> list[str]:
    """``unit/world`` of every unit (default :data:`CHOICES`) and rule world that lacks one of ``rows`` at one of
    ``seeds``."""
    out = []
    for unit in units:
        for world in SELECT_WORLDS:
            table = next((t for (w, _), t in cells.get(unit.name, {}).items() if w == world), {})
            if any((row, s) not in table for row in rows for s in seeds):
                out.append(f"{unit.name}/{world}")
    return out


def rank_choices(cells: dict, off_rule: Sequence[str] = (), seeds: Sequence[int] = SELECT_SEEDS) -> dict:
    """The rule of ``docs/study/testtime_selection_rule.md`` on ``cells`` (``{choice name: {(world, meta seed):
    testtime_table}}``): per choice, each test-time GRAM row's val accuracy averaged over the fine-tuning seeds of a
    world, then over the worlds, then over the two rows; the highest wins, every choice within :data:`TIE_POINTS` of
    it (inclusive) ties and the fewest steps, then the fewest views, of the tied wins.  A partial sweep (a cell without
    one of ``seeds``) or one off the rule's settings (``off_rule``) chooses nothing (``chosen`` None) and says what the
    rule would pick."""
    rows = []
    for choice in CHOICES:
        per_row = {row: _by_world(cells.get(choice.name, {}), row) for row in TT_GRAM_ROWS}
        means = {row: float(np.mean(list(w.values()))) for row, w in per_row.items() if w}
        mean = float(np.mean(list(means.values()))) if means else None
        rows.append(
            {
                "choice": choice.name,
                "steps": choice.steps,
                "views": choice.views,
                "per_world": {row: {w: round(v, 3) for w, v in sorted(d.items())} for row, d in per_row.items()},
                "per_row": {row: round(v, 3) for row, v in means.items()},
                "mean_accuracy": None if mean is None else round(mean, 3),
                "_mean": mean,
            }
        )
    return _verdict(rows, lambda r: (r["steps"], r["views"]), missing_cells(cells, seeds), RULE, off_rule)


def _verdict(rows: list, cheaper: Callable, missing: list, rule: str, off_rule: Sequence[str]) -> dict:
    """A sweep file's verdict on its ``rows`` (each with ``choice`` and ``_mean``, dropped here): the highest mean
    wins, every row within :data:`TIE_POINTS` of it (inclusive) ties and the tied row first by ``cheaper`` wins;
    nothing is chosen when cells are ``missing`` or the sweep ran ``off_rule``."""
    scored = [r for r in rows if r["_mean"] is not None]
    best = None
    if scored:
        top = max(r["_mean"] for r in scored)
        best = min((r for r in scored if r["_mean"] >= top - TIE_POINTS - _EPS), key=cheaper)
    for r in rows:
        del r["_mean"]
    would = best["choice"] if best else None
    return {
        "rule": rule,
        "choices": rows,
        "best_if_complete": would,
        "chosen": None if missing or off_rule else would,
        "partial": bool(missing),
        "missing": missing,
        "off_rule": list(off_rule),
        "tie_points": TIE_POINTS,
    }


def selection_record(base: DemoSettings) -> dict:
    """What a sweep file was run with; a file of other values is not this sweep's."""
    return {"split": "val", "seeds": list(base.seeds), "meta_seed": base.meta_seed, "quick": base.quick}


def selection_markdown(result: dict) -> str:
    head = " | ".join(f"{row} world {w}" for row in TT_GRAM_ROWS for w in SELECT_WORLDS)
    lines = [
        f"Val splits (cross-domain target), fine-tuning seeds {', '.join(map(str, result['seeds']))}, meta-training "
        f"seed {result['meta_seed']}; the rule: `{RULE}`.  Accuracy (%) after test-time tuning, mean over seeds.",
        "",
        f"| choice | {head} | {' | '.join(TT_GRAM_ROWS)} | mean |",
        "| --- " * (2 + len(TT_GRAM_ROWS) * (len(SELECT_WORLDS) + 1)) + "|",
    ]

    def num(x: Optional[float]) -> str:
        return "-" if x is None else f"{x:.2f}"

    for r in result["choices"]:
        cells = [num(r["per_world"][row].get(w)) for row in TT_GRAM_ROWS for w in SELECT_WORLDS]
        cells += [num(r["per_row"].get(row)) for row in TT_GRAM_ROWS] + [num(r["mean_accuracy"])]
        lines.append(f"| {r['steps']} step(s), {r['views']} views | " + " | ".join(cells) + " |")
    return "\n".join(lines + _verdict_lines(result)) + "\n"


def _verdict_lines(result: dict) -> list[str]:
    """The closing lines of a sweep's table: its choice, or why none and what the rule would pick; mixed
    fingerprints."""
    if result["chosen"]:
        lines = ["", f"Chosen by the rule: **{result['chosen']}**."]
    else:
        why = [f"missing {', '.join(result['missing'])}"] if result["partial"] else []
        would = result["best_if_complete"] or "nothing yet"
        lines = ["", f"No choice ({'; '.join(why + result['off_rule'])}); the rule would pick {would}."]
    if result.get("mixed_fingerprints"):
        lines += ["", f"**Mixed numerics fingerprints**: {', '.join(result['mixed_fingerprints'])}."]
    return lines


def off_rule(base: DemoSettings) -> list[str]:
    seeds = " ".join(map(str, base.seeds))
    out = [] if tuple(base.seeds) == SELECT_SEEDS else [f"fine-tuning seeds {seeds}, the rule's are 1 2 3"]
    out += [] if base.meta_seed == 0 else [f"meta-training seed {base.meta_seed}, the rule's is 0"]
    return out + (["the demo's --quick settings"] if base.quick else [])


@dataclass(frozen=True)
class Sweep:
    """One val sweep: its units (``name``, ``cell(world, settings)``), the test-time rows each unit runs, the file it
    writes, its written rule (``rank(cells, off_rule, seeds)``) and its table (``markdown(result)``)."""

    file: str
    units: tuple
    rows: tuple
    rank: Callable[[dict, Sequence[str], Sequence[int]], dict]
    markdown: Callable[[dict], str]


def select(
    root: Path,
    worlds: Sequence[str],
    base: DemoSettings,
    previous: Sequence[Path] = (),
    mix: bool = False,
    sweep: Optional[Sweep] = None,
) -> dict:
    """The val sweep ``sweep`` (default :data:`STEPS_VIEWS`) on ``worlds``, unit by unit, ``root/<its file>`` (JSON and
    ``.md``) rewritten after every unit; units of ``root``'s file and of ``previous`` files (same settings) are kept,
    those of another numerics fingerprint refused unless ``mix``."""
    sweep = sweep or STEPS_VIEWS
    path, record = root / sweep.file, selection_record(base)
    cells: dict = {}
    earlier: dict = {"computed_by": {}, "seconds_per_cell": {}}
    for p in ([path] if path.is_file() else []) + list(previous):
        data = study.read_sweep_file(p, sweep.file, record)
        for name, table in data["cells"].items():
            unit, world, seed = name.rsplit("/", 2)
            if world in worlds:
                cells.setdefault(unit, {})[(world, int(seed))] = study.table_from_json(table)
        for field in earlier:
            earlier[field].update(data.get(field, {}))
    names = sorted(f"{u}/{w}/{s}" for u, by in cells.items() for w, s in by)
    now = study.current_provenance()
    computed = {n: v for n, v in earlier["computed_by"].items() if n in names}
    book = study._Book(computed, set(study.check_fingerprints(path, computed, names, now["fingerprint"], mix)))
    seconds = {n: v for n, v in earlier["seconds_per_cell"].items() if n in names}

    def write() -> dict:
        result = {
            **sweep.rank(cells, off_rule(base), base.seeds),
            **record,
            "worlds": list(worlds),
            **study.cells_record(cells, book),
            "seconds_per_cell": dict(sorted(seconds.items())),
        }
        write_json_atomic(path, result)
        write_text_atomic(path.with_suffix(".md"), sweep.markdown(result))
        return result

    result = write()
    for world in worlds:
        ws = replace(study.world_settings(world, base), eval_split="val")
        for unit in sweep.units:
            if (world, ws.meta_seed) in cells.get(unit.name, {}):
                continue
            name, t = f"{unit.name}/{world}/{ws.meta_seed}", time.time()
            log(f"select testtime: world {world} {unit.name}")
            records = testtime_records(unit.cell(world, ws), root, sweep.rows)
            cells.setdefault(unit.name, {})[(world, ws.meta_seed)] = testtime_table(records)
            seconds[name], book.computed[name] = round(time.time() - t, 1), now
            result = write()
    return result


STEPS_VIEWS = Sweep(SELECTION_FILE, CHOICES, TT_GRAM_ROWS, rank_choices, selection_markdown)


# ------------------------------------------------------------------------------ the cache row's views, on val
@dataclass(frozen=True)
class CacheChoice:
    """Views per test image of the cache row (``DemoSettings.cache_views``)."""

    views: int

    @property
    def name(self) -> str:
        return f"cache_views{self.views}"

    def cell(self, world: str, base: DemoSettings) -> study.Cell:
        """Its cell on ``world``, transfer runs only (the choices share the cell folder: the cache row's records at
        other views than TPT's 64 have their own files, ``stages.EvalJob.path``)."""
        return study.Cell(world, replace(base, cache_views=self.views, testtime_protocols=("transfer",)))


CACHE_ROW = "tda_cache"
CACHE_VIEWS = (1, 64)  # TDA's two settings: its cross-domain datasets and ImageNet's variants (kdiAAA/TDA utils.py)
CACHE_CHOICES = tuple(CacheChoice(v) for v in CACHE_VIEWS)
CACHE_RULE = "docs/study/testtime_cache_rule.md"
CACHE_FILE = "testtime_cache_selection.json"
CACHE_SELECTION = "docs/study/testtime_cache_selection.json"  # committed; DemoSettings.cache_views is its choice


def rank_cache_views(cells: dict, off_rule: Sequence[str] = (), seeds: Sequence[int] = SELECT_SEEDS) -> dict:
    """The rule of ``docs/study/testtime_cache_rule.md`` on ``cells`` (``{choice name: {(world, meta seed):
    testtime_table}}``): per choice, the cache row's val accuracy averaged over the fine-tuning seeds of a world, then
    over the worlds; the highest wins, every choice within :data:`TIE_POINTS` of it (inclusive) ties and the fewest
    views of the tied wins.  A partial or off-rule sweep chooses nothing and says what the rule would pick."""
    rows = []
    for choice in CACHE_CHOICES:
        per_world = _by_world(cells.get(choice.name, {}), CACHE_ROW)
        before = _by_world(cells.get(choice.name, {}), CACHE_ROW, field=0)  # zero-shot CLIP's, the same images
        mean = float(np.mean(list(per_world.values()))) if per_world else None
        rows.append(
            {
                "choice": choice.name,
                "views": choice.views,
                "per_world": {w: round(v, 3) for w, v in sorted(per_world.items())},
                "zero_shot_per_world": {w: round(v, 3) for w, v in sorted(before.items())},
                "mean_accuracy": None if mean is None else round(mean, 3),
                "_mean": mean,
            }
        )
    missing = missing_cells(cells, seeds, CACHE_CHOICES, (CACHE_ROW,))
    return _verdict(rows, lambda r: r["views"], missing, CACHE_RULE, off_rule)


def cache_markdown(result: dict) -> str:
    def num(x: Optional[float]) -> str:
        return "-" if x is None else f"{x:.2f}"

    head = " | ".join(f"world {w}" for w in SELECT_WORLDS)
    lines = [
        f"Val splits (cross-domain target), fine-tuning seeds {', '.join(map(str, result['seeds']))}; the rule: "
        f"`{CACHE_RULE}`.  Accuracy (%) of the cache row (TDA's caches on zero-shot CLIP), mean over seeds; in "
        "brackets zero-shot CLIP's on the same images.",
        "",
        f"| views per image | {head} | mean |",
        "| --- " * (2 + len(SELECT_WORLDS)) + "|",
    ]
    for r in result["choices"]:
        cells = [f"{num(r['per_world'].get(w))} ({num(r['zero_shot_per_world'].get(w))})" for w in SELECT_WORLDS]
        lines.append(f"| {r['views']} | " + " | ".join(cells) + f" | {num(r['mean_accuracy'])} |")
    return "\n".join(lines + _verdict_lines(result)) + "\n"


CACHE_VIEWS_SWEEP = Sweep(CACHE_FILE, CACHE_CHOICES, (CACHE_ROW,), rank_cache_views, cache_markdown)
SWEEPS = {"select": STEPS_VIEWS, "select-cache": CACHE_VIEWS_SWEEP}  # command -> its sweep


# ------------------------------------------------------------------------------ the planned family
PAIRS: tuple[tuple[str, str], ...] = (
    ("tt_gram_proto", "tt_gram"),  # what CHC prototypes add
    ("tt_gram", "tpt_init"),  # meta-training for the test-time step vs TPT from the ordinary θ*
    ("tt_gram", "zsclip"),
    ("tpt_hand", "zsclip"),  # TPT's gain, replicated
)
DESCRIPTIVE = ("tda_cache",)  # rows run beside the family and shown in its descriptive tail, never tested
BY_LEARNER = {"Test-time tuning": PAIRS}
DELTA, ALPHA, TARGET_POWER = 1.0, 0.05, 0.8
META_SEEDS = (0,)
FINETUNE_SEEDS = 3
# The stand-in pilot (no test-time cell exists beyond world 0's one world): the confirmatory study's CoOp pairs on
# new-class accuracy (prompts scored on classes they never trained on, as the target's held-out style is unseen).
PILOT_FILE = "docs/study/confirm.json"
PILOT_PAIRS = (("gram_coop", "coop"), ("gram_coop_init_only", "coop"), ("gram_coop", "gram_coop_init_only"))
PILOT_INDEX = 1  # (base, new, H): new-class accuracy
# Core-seconds per world at the dearest choice (16 views, 2 steps), from world 0's runs (docs/demo.md): the default
# demo's world, tiny CLIP and CHC stages; CoOp's θ* (tpt_init's start) and the two test-time variants at 16 views
# (955 s, the prototype one taken as equal); 3 seeds x the source's and the target's 600 test images each (every test
# set is tuned) x seconds per image of TPT from the hand prompt, from θ*, and each test-time GRAM row at 2 x 0.025.
COST_S = {
    "world, tiny CLIP, CHC": 89 + 274 + 83,
    "meta-training": 25 + 2 * 955,
    "test-time runs": 3 * 1200 * (0.078 + 0.030 + 2 * 2 * 0.025),
}
BUDGET_CORE_H = 8.0
WORLD_CAP = math.floor(BUDGET_CORE_H * 3600 / sum(COST_S.values()))
USED_WORLDS = study_cocoop.USED_WORLDS + study_cocoop.WORLDS
DRAW_SEED = 20261203
WORLD_COUNT = 9  # min(planned_worlds(pilot), WORLD_CAP) on the committed pilot file (a test recomputes it)
# confirm.draw_worlds(WORLD_COUNT, DRAW_SEED, exclude=USED_WORLDS, held_out_style=False), written out (a test redraws)
WORLDS = ("237604", "600737", "779045", "362455", "454425", "837952", "972344", "187143", "635468")


def pilot_variance(pilot: dict) -> tuple[str, float]:
    """Of :data:`PILOT_PAIRS`, the pair whose world mean (1 meta seed, 3 fine-tuning seeds) of the new-class
    accuracy difference has the largest variance in the pilot's cells; ``(pair, variance in points²)``."""
    cells = {n: {k: [0.0, 0.0, v[PILOT_INDEX]] for k, v in t.items()} for n, t in pilot["cells"].items()}
    ranked = {}
    for method, base in PILOT_PAIRS:
        d = power.differences(cells, method, base)
        if d is None:
            raise ValueError(f"{PILOT_FILE}: no balanced cells of {method} vs {base}")
        ranked[f"{method} vs {base}"] = power.world_mean_variance(power.variance_components(d), 1, FINETUNE_SEEDS)
    pair = max(ranked, key=ranked.get)
    return pair, ranked[pair]


def planned_worlds(pilot: dict) -> int:
    """Worlds for :data:`TARGET_POWER` at |Δ| = :data:`DELTA` and level ``ALPHA / len(PAIRS)`` (200 if more)."""
    return power.worlds_needed(pilot_variance(pilot)[1], DELTA, ALPHA / len(PAIRS), TARGET_POWER) or 200


def detectable(worlds: int, variance: float) -> float:
    """The smallest |Δ| (points, to 0.01) the test over ``worlds`` worlds detects with :data:`TARGET_POWER`."""
    lo, hi = 0.0, 50.0
    while hi - lo > 0.005:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if power.power(worlds, variance, mid, ALPHA / len(PAIRS)) >= TARGET_POWER else (mid, hi)
    return round(hi, 2)


def row_label(key: str) -> str:
    return TESTTIME_BY_KEY[key].label if key in TESTTIME_BY_KEY else key


def plan_text(pilot: dict) -> str:
    pair, variance = pilot_variance(pilot)
    cost = sum(COST_S.values())
    lines = [f"Family ({len(PAIRS)} pairs, cross-domain target test accuracy, Holm over all of them):", ""]
    lines += [f"{i + 1}. {row_label(m)} vs {row_label(b)} (`{m}` vs `{b}`)" for i, (m, b) in enumerate(PAIRS)]
    lines += [
        "",
        f"Pilot (a stand-in): {PILOT_FILE}, new-class accuracy of {pair}, world-mean variance {variance:.3f} points² "
        f"at {len(META_SEEDS)} meta seed x {FINETUNE_SEEDS} fine-tuning seeds.",
        f"Worlds for {TARGET_POWER:.0%} power at |Δ| = {DELTA:g}, α = {ALPHA:g}/{len(PAIRS)}: {planned_worlds(pilot)}.",
        "Cost per world (core-seconds, 16 views, 2 steps): "
        + ", ".join(f"{k} {v:.0f}" for k, v in COST_S.items())
        + f"; {cost:.0f} s = {cost / 3600:.2f} core-hours, so {WORLD_CAP} worlds fit {BUDGET_CORE_H:g} core-hours.",
        f"Worlds run: {WORLD_COUNT} (about {WORLD_COUNT * cost / 3600:.1f} core-hours); power there at |Δ| = "
        f"{DELTA:g}: {power.power(WORLD_COUNT, variance, DELTA, ALPHA / len(PAIRS)):.2f}; |Δ| detected with "
        f"{TARGET_POWER:.0%} power: {detectable(WORLD_COUNT, variance):.2f} points.",
        f"Worlds ({WORLD_COUNT}, draw seed {DRAW_SEED}, none of the {len(USED_WORLDS)} used before): "
        + ", ".join(WORLDS),
    ]
    return "\n".join(lines) + "\n"


def run_world(world: str, settings: DemoSettings, root: Path, units: dict, world_root: Optional[Path] = None):
    """The family's test-time rows and the :data:`DESCRIPTIVE` ones on ``world`` (its plain cell, test splits):
    ``(table, start digests)``."""
    keys = tuple(dict.fromkeys((*units[""], *DESCRIPTIVE)))
    records = testtime_records(study.Cell(world, settings), root, keys, world_root)
    return testtime_table(records), study.cell_inputs(records)


def ece_tail(cells: dict) -> str:
    """Descriptive, no claim: each row's accuracy before / after tuning and ECE, means over worlds of seed means."""
    lines = ["", "Descriptive (no claim): mean over worlds of seed means.", ""]
    lines += ["| row | accuracy | accuracy before | ECE |", "| --- | --- | --- | --- |"]
    for key in dict.fromkeys([*(k for pair in PAIRS for k in pair), *DESCRIPTIVE]):
        cols = []
        for i in (2, 0, 1):
            worlds = [[v[i] for (k, _), v in t.items() if k == key and v[i] is not None] for t in cells.values()]
            means = [np.mean(w) for w in worlds if w]
            cols.append(f"{np.mean(means):.2f}" if means else "—")
        lines.append(f"| {row_label(key)} | " + " | ".join(cols) + " |")
    return "\n".join(lines) + "\n"


MEASURE = confirm.Measure(lambda *a: run_world(*a), row_label, UNIT, ece_tail)


def read_selection(path: str, allow_partial: bool = False) -> Choice:
    """The choice of a committed sweep file; a missing, partial or off-rule file is a one-line error naming it."""
    found = confirm.committed_file(path)
    if not found.is_file():
        raise confirm._missing("--selection", path, "run python -m gram_world.study_testtime select first")
    data = json.loads(found.read_text())
    name = data.get("chosen") or (data.get("best_if_complete") if allow_partial else None)
    if name not in BY_NAME:
        raise ValueError(f"{path}: no choice (partial or off the rule's settings); the plan needs the finished sweep")
    return BY_NAME[name]


def study_record(base: DemoSettings, choice: Choice) -> dict:
    return {
        **study.settings_record(base),
        "quick": base.quick,
        "family": [list(p) for p in PAIRS],
        "choice": choice.name,
    }


# ------------------------------------------------------------------------------ command line
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gram_world.study_testtime", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=(*SWEEPS, "plan", "run"))
    parser.add_argument("--worlds", nargs="+", help="world names (default: select 0 1; run the plan's WORLDS)")
    parser.add_argument(
        "--out",
        default="",
        help="folder (default output/select_testtime, output/select_cache_testtime, output/study_testtime)",
    )
    parser.add_argument("--jobs", type=int, help="worker processes")
    parser.add_argument("--selection", default=SELECTION, help=f"run: the sweep's file (default {SELECTION})")
    parser.add_argument("--allow-partial-selection", action="store_true", help="run: a smoke test's partial sweep")
    study.add_resume_flags(parser, f"{SELECTION_FILE} (select) or {RESULTS_FILE} (run)")
    study.add_settings_flags(parser)
    return parser


def main(argv: Optional[list] = None) -> int:
    """The command line (module docstring); errors end in one line (:func:`meta.infra.cli_errors.run_cli`)."""
    return run_cli(lambda given: _command(_parser().parse_args(given)), argv)


def _command(args: argparse.Namespace) -> int:
    if args.command == "plan":
        return confirm.print_plan(PILOT_FILE, plan_text)
    t, previous = time.time(), [Path(p) for p in args.resume_from]
    if args.command in SWEEPS:
        sweep = SWEEPS[args.command]
        base = study.base_settings(args.quick, args.jobs, args.worlds or SELECT_WORLDS)
        root = Path(args.out or f"output/{args.command.replace('-', '_')}_testtime")
        result = select(root, tuple(args.worlds or SELECT_WORLDS), base, previous, args.mix_fingerprints, sweep)
        print(sweep.markdown(result), end="")
        print(
            f"study_testtime {args.command}: chosen {result['chosen']} ({root / sweep.file}); {time.time() - t:.0f} s"
        )
        return 0
    choice = read_selection(args.selection, args.allow_partial_selection)
    base = study.base_settings(args.quick, args.jobs, ())
    base = choice.settings(replace(base, seeds=base.seeds[:FINETUNE_SEEDS]))
    root = Path(args.out or "output/study_testtime")
    result = confirm.run_family(
        root,
        tuple(args.worlds or WORLDS),
        META_SEEDS,
        base,
        PAIRS,
        BY_LEARNER,
        study_record(base, choice),
        RESULTS_FILE,
        plan=PLAN,
        regime=(),
        mix_fingerprints=args.mix_fingerprints,
        previous=previous,
        measure=MEASURE,
    )
    print((root / RESULTS_FILE.replace(".json", ".md")).read_text(), end="")
    print(f"study_testtime: {len(result['cells'])} worlds in {root}; this call took {time.time() - t:.0f} s")
    return 0


if __name__ == "__main__":
    from meta.infra.numerics import pin_process

    pin_process()  # numpy started with this module: this starts the command again, pinned (meta.infra.numerics)
    raise SystemExit(main())
