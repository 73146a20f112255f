"""``python -m gram_world.confirm``: the confirmatory study of ``docs/study/plan.md`` and a check anyone can run on
fresh worlds.

The plan (committed before the study's first cell) fixes what this module runs:

* **The primary family** (:func:`family`): the nine pairs of :data:`gram_world.power.PRIMARY_PAIRS` (GRAM vs its
  baseline, θ* only vs the baseline, GRAM vs θ* only, for CoOp, VPT and UNIGRAM) and, per learner, the variant the
  base-to-new sweep chose on val splits (``docs/study/selection_b2n.json``, its written rule
  ``docs/study/selection_b2n_rule.md``) against θ* only (left out when the choice is θ* only itself) and against its
  fixed-λ consistency row at the λ that sweep chose.
* **The worlds** (:data:`CONFIRM_WORLDS`): seeds drawn at random from [1000, 1 000 000), one of them with another
  held-out style; no sweep read any of them.  A world's name says what it is (:func:`world_fields`).
* **The test**: a one-sample t-test over world means of each pair's paired H difference, Holm over the family
  (:func:`gram_world.study.summarise`); the two-level bootstrap interval is shown beside it.

Commands:

* ``run``: the family's rows on the test splits of every world x meta seed, world by world; ``confirm.json`` /
  ``.md`` rewritten after every world, so a stopped study leaves the summary of what finished (every stage of a
  world is the demo's, cached on disk: a rerun redoes only what is missing).  Kept worlds computed at another
  numerics fingerprint are refused unless ``--mix-fingerprints``.
* ``check --fresh K``: draws K new world seeds, runs the family there and prints, claim by claim, whether the claims
  of a results file (default ``docs/study/confirm.json``, the confirmatory study README states) hold there: the
  sign of the fresh worlds' mean difference against the claimed direction.
* ``plan``: the family, the worlds and the power of the planned design (:mod:`gram_world.power`), as ``plan.md``
  quotes them.
* ``readme``: README's answer block (:func:`readme_block`) from a results file, printed, or written between its
  markers with ``--write README.md``; ``tests/test_confirm.py`` holds README to the committed results file.

A row that reads a meta-training with META overrides (class-shift tasks, the gate form) runs in that sweep unit's
own cell folder (:class:`gram_world.study_b2n.Unit`) and is named ``<unit>:<row key>`` in the tables.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from meta.infra.cli_errors import run_cli
from meta.infra.fileio import write_json_atomic, write_text_atomic

from . import power, study, study_b2n
from .demo.pool import log
from .demo.settings import DemoSettings, consistency_key, method_row
from .items import STYLES
from .settings import WorldSettings

PLAN = "docs/study/plan.md"
SELECTION = "docs/study/selection_b2n.json"  # the val sweep's committed file: its choice and λ join the family
CLAIMS = "docs/study/confirm.json"  # the confirmatory study's results: the claims ``check`` tests on fresh worlds
REPO = Path(__file__).resolve().parents[1]  # where the committed study files above lie


def committed_file(path: str) -> Path:
    """``path`` as given when it exists (or is absolute), else the committed file of that name in the repository, so
    the defaults above work from any folder; the given path when neither exists (the caller names it)."""
    given = Path(path)
    if given.is_file() or given.is_absolute():
        return given
    in_repo = REPO / given
    return in_repo if in_repo.is_file() else given


def _missing(flag: str, path: str, advice: str) -> ValueError:
    """The one-line error of a results file that is neither where ``path`` says nor in the repository."""
    where = f"{path}" if Path(path).is_absolute() else f"{path} (looked in {Path.cwd()} and in {REPO})"
    return ValueError(f"{flag}: {where} does not exist; {advice}")


def print_plan(pilot_file: str, plan_text) -> int:
    """A study's ``plan`` command: print ``plan_text(pilot)`` from the committed pilot results file; 0."""
    path = committed_file(pilot_file)
    if not path.is_file():
        raise _missing("pilot", pilot_file, "it is the confirmatory study's committed results file")
    print(plan_text(json.loads(path.read_text())), end="")
    return 0


CONFIRM_FILE = "confirm.json"
FRESH_FILE = "fresh.json"

# The confirmatory worlds, drawn once before the plan was committed (draw_worlds): 20 seeds without replacement from
# [1000, 1 000 000) by numpy.random.default_rng(20261128), the last world holding out a style drawn by the same
# generator from the four that are not the default sketch.
CONFIRM_WORLD_SEED = 20261128
CONFIRM_WORLD_COUNT = 20
CONFIRM_META_SEEDS = (0,)
DEFAULT_HOLDOUT = WorldSettings.__dataclass_fields__["holdout_style"].default  # "sketch"
STYLES_DRAWN = tuple(s for s in STYLES if s != DEFAULT_HOLDOUT)  # "another held-out style"
SEED_RANGE = (1000, 1_000_000)
_WORLD_NAME = re.compile(r"^(\d+)(?:-([a-z]+))?$")


def draw_worlds(count: int, draw_seed: int, exclude: Sequence[str] = (), held_out_style: bool = True) -> tuple:
    """``count`` world names of seeds drawn without replacement from :data:`SEED_RANGE` by
    ``numpy.random.default_rng(draw_seed)`` (none of ``exclude``'s seeds); with ``held_out_style`` the last one
    holds out a style drawn from :data:`STYLES_DRAWN` (``"<seed>-<style>"``)."""
    if count < 1:
        raise ValueError(f"--fresh: expected an integer >= 1 worlds, got {count}")
    rng = np.random.default_rng(draw_seed)
    taken = {world_fields(w)["world_seed"] for w in exclude if _WORLD_NAME.match(w)}
    pool = np.setdiff1d(np.arange(*SEED_RANGE), np.fromiter(taken, dtype=np.int64, count=len(taken)))
    seeds = [int(s) for s in rng.choice(pool, count, replace=False)]
    names = [str(s) for s in seeds]
    if held_out_style:
        names[-1] = f"{seeds[-1]}-{STYLES_DRAWN[int(rng.integers(len(STYLES_DRAWN)))]}"
    return tuple(names)


# draw_worlds(CONFIRM_WORLD_COUNT, CONFIRM_WORLD_SEED), written out (a test redraws it)
CONFIRM_WORLDS = (
    "617310", "670804", "710404", "859752", "416368", "676332", "507043", "28372", "422835", "643808",
    "929380", "931446", "907418", "291728", "368647", "613751", "972787", "956034", "355285", "728982-noisy",
)  # fmt: skip


def world_fields(name: str) -> dict:
    """The :class:`DemoSettings` fields of a world name: ``"<seed>"`` is the default world of that seed,
    ``"<seed>-<style>"`` holds out ``style`` instead of the default sketch.  Any other name is a one-line error."""
    match = _WORLD_NAME.match(name)
    if not match or (match.group(2) and match.group(2) not in STYLES_DRAWN):
        raise ValueError(
            f"--worlds: {name!r} is not a world name: expected <seed> or <seed>-<held-out style> "
            f"(held-out styles other than the default {DEFAULT_HOLDOUT}: {', '.join(STYLES_DRAWN)})"
        )
    seed, style = int(match.group(1)), match.group(2)
    return {"world_seed": seed, "world": (("holdout_style", style),) if style else ()}


# ------------------------------------------------------------------------------ the family
@dataclass(frozen=True)
class Row:
    """A row of the study: a demo row ``key`` evaluated in the plain cell (``unit`` "") or in the cell of the
    base-to-new sweep unit ``unit`` (its META overrides)."""

    key: str
    unit: str = ""

    @property
    def name(self) -> str:
        return f"{self.unit}:{self.key}" if self.unit else self.key


def row_of(name: str) -> Row:
    """:class:`Row` of a table name (``key`` or ``<unit>:<key>``)."""
    unit, _, key = name.rpartition(":")
    return Row(key, unit)


def row_label(name: str) -> str:
    """A row's words: the demo row's label (as it reads alone), and for a unit row what its meta-training differs
    in: the tasks, and the regulator form meta-trained beside θ* (a θ*-only row fine-tunes without it)."""
    row = row_of(name)
    label = method_row(row.key).standalone_label
    if not row.unit:
        return label
    task = "class-shift tasks" if row.unit.startswith("class_shift") else "paper's tasks"
    form = "gate R_φ" if "_gate_" in row.unit else "γ/β R_φ"
    return f"{label}, {task} (meta-trained with {form})"


def check_selection(selection: dict, path: str, allow_partial: bool = False) -> None:
    """Refuse (one line naming ``path``) a sweep file that is partial or off the rule's settings: its choice is then
    the reference by construction and its λ may be missing, not the plan's."""
    if "chosen" not in selection or "fixed" not in selection:
        raise ValueError(
            f"{path}: not a selection_b2n.json (no 'chosen' / 'fixed'); run python -m gram_world.study_b2n"
        )
    if not allow_partial and (selection.get("partial") or selection.get("off_rule")):
        why = "partial" if selection.get("partial") else "off the rule's settings"
        raise ValueError(f"{path}: the sweep is {why}; the plan's family needs the finished rule sweep")


def variant_row(selection: dict, learner: str) -> Row:
    """The row of the sweep's chosen variant for ``learner`` (a key of :data:`study_b2n.LEARNERS`)."""
    form, task = selection["chosen"].split("/")
    unit = "" if task == "paper" else f"{task}_gb"
    if form == "init_only":
        return Row(study_b2n.INIT_ONLY_OF[learner], unit)
    if form == "gb":
        return Row(learner, unit)
    point = selection["gate_lambda"][task][learner]["lambda"]
    if point is None:
        raise ValueError(f"selection: no gate λ for {learner} on {task} tasks")
    return Row(consistency_key(learner, *point), study_b2n.gate_unit_name(task, learner, tuple(point)))


def fixed_row(selection: dict, learner: str) -> Row:
    """The fixed-λ consistency row of ``learner`` at the sweep's chosen λ (plain cell: no meta-training)."""
    point = selection["fixed"][learner]["lambda"]
    if point is None:
        raise ValueError(f"selection: no fixed λ for {learner}")
    return Row(consistency_key(study_b2n.FIXED_OF[learner], *point))


def family_by_learner(selection: dict) -> dict[str, tuple[tuple[str, str], ...]]:
    """The primary family per learner (keys of :data:`study_b2n.LEARNERS`) as (method row, baseline row) table names:
    its three pairs of :data:`power.PRIMARY_BY_LEARNER`, then the chosen variant against θ* only (unless it is θ*
    only) and against its fixed-λ row."""
    out = {}
    for learner in study_b2n.LEARNERS:
        pairs = list(power.PRIMARY_BY_LEARNER[learner])
        chosen, init_only = variant_row(selection, learner), Row(study_b2n.INIT_ONLY_OF[learner])
        if chosen != init_only:
            pairs.append((chosen.name, init_only.name))
        pairs.append((chosen.name, fixed_row(selection, learner).name))
        out[learner] = tuple(pairs)
    return out


def family(selection: dict) -> tuple[tuple[str, str], ...]:
    """The primary family in the plan's order: the nine pairs of :data:`power.PRIMARY_PAIRS`, then per learner the
    pairs of the chosen variant (:func:`family_by_learner`)."""
    by_learner = family_by_learner(selection)
    extra = [p for pairs in by_learner.values() for p in pairs if p not in power.PRIMARY_PAIRS]
    return tuple(power.PRIMARY_PAIRS) + tuple(extra)


def rows_by_unit(
    pairs: Sequence[tuple[str, str]], regime: Sequence[str] = study.REGIME_KEYS
) -> dict[str, tuple[str, ...]]:
    """``{unit: row keys}`` a world runs for ``pairs`` ("" = the plain cell, which also runs the rows ``regime``:
    zero-shot CLIP and the baselines of the regime table)."""
    out: dict = {"": list(regime)}
    for name in dict.fromkeys(n for pair in pairs for n in pair):
        row = row_of(name)
        keys = out.setdefault(row.unit, [])
        if row.key not in keys:
            keys.append(row.key)
    return {unit: tuple(keys) for unit, keys in out.items()}


def unit_cell(unit: str, world: str, settings: DemoSettings) -> study.Cell:
    """The cell of ``unit`` on ``world``: the plain cell, or the sweep unit's (its META overrides and folder)."""
    if not unit:
        return study.Cell(world, settings)
    units = {u.name: u for u in study_b2n.b2n_units()}
    if unit not in units:
        raise ValueError(f"unknown base-to-new sweep unit {unit!r}")
    return units[unit].cell(world, settings)


# ------------------------------------------------------------------------------ running
def run_world(
    world: str, settings: DemoSettings, root: Path, units: dict, world_root: Optional[Path] = None
) -> tuple[dict, dict]:
    """Every unit's rows on ``world`` (cached stages); returns the merged ``{(row name, fine-tuning seed): (base,
    new, H)}`` table and the start digests (:func:`study.cell_inputs`) under row names."""
    table, inputs = {}, {"hierarchy": [], "start_sha256": {}}
    for unit, keys in units.items():
        records = study.run_cell(unit_cell(unit, world, settings), root, keys, world_root)
        for (key, seed), value in study.cell_h(records).items():
            table[(Row(key, unit).name, seed)] = value
        got = study.cell_inputs(records)
        inputs["hierarchy"] = sorted(set(inputs["hierarchy"]) | set(got["hierarchy"]))
        inputs["start_sha256"].update({Row(k, unit).name: v for k, v in got["start_sha256"].items()})
    return table, inputs


def regime_tail(cells: dict) -> str:
    """The results markdown's last part: each world's regime (:func:`study.regime_markdown`)."""
    return "\nRegime (base / new accuracy, %):\n\n" + study.regime_markdown(cells)


@dataclass(frozen=True)
class Measure:
    """What a family's cells hold and how its files read: ``run_world`` (as :func:`run_world`: a world's table
    ``{(row name, fine-tuning seed): (.., .., value)}``, the pairs compared on the value), ``label`` (a row name's
    words), ``unit`` (the value's name in the tables and sentences) and ``tail`` (markdown after the summary)."""

    run_world: Callable = run_world
    label: Callable[[str], str] = row_label
    unit: str = "H"
    tail: Callable[[dict], str] = regime_tail


H_MEASURE = Measure()


def study_record(base: DemoSettings, pairs: Sequence[tuple[str, str]], selection: dict) -> dict:
    """What a results file was run with; kept worlds of a file with other values are not this study's."""
    return {
        **study.settings_record(base),
        "quick": base.quick,
        "family": [list(p) for p in pairs],
        "chosen": selection["chosen"],
    }


def load_kept(path: Path, record: dict) -> tuple[dict, dict]:
    """Finished worlds of an earlier results file of the same settings and family: ``(cells, file content)``; a file
    of other settings is an error naming the differing keys."""
    data = json.loads(path.read_text())
    theirs = data.get("settings", {})
    differ = sorted(k for k in set(record) | set(theirs) if theirs.get(k) != record.get(k))
    if differ:
        raise ValueError(f"{path}: written with other settings or family ({', '.join(differ)}); use another --out")
    cells = {}
    for name, table in data.get("cells", {}).items():
        world, seed = name.rsplit("/", 1)
        cells[(world, int(seed))] = study.table_from_json(table)
    return cells, data


def merge_kept(paths: Sequence[Path], record: dict) -> tuple[dict, dict]:
    """:func:`load_kept` of every file in ``paths`` (e.g. halves of the worlds run in parallel into other folders),
    merged: ``(cells, {"computed_by", "inputs", "seconds_per_cell"} of all files)``.  A world found in two files must
    hold the same table (else a one-line error naming both)."""
    cells: dict = {}
    merged: dict = {"computed_by": {}, "inputs": {}, "seconds_per_cell": {}}
    origin: dict = {}
    for path in paths:
        if not path.is_file():
            raise ValueError(f"--resume-from: {path} does not exist; expected a confirm.json of the same study")
        theirs, data = load_kept(path, record)
        for key, table in theirs.items():
            study.merge_cell(cells, origin, key, table, path, f"world {key[0]}/{key[1]}")
        for field in merged:
            merged[field].update(data.get(field, {}))
    return cells, merged


def run(
    root: Path,
    worlds: Sequence[str],
    meta_seeds: Sequence[int],
    base: DemoSettings,
    selection: dict,
    file: str = CONFIRM_FILE,
    world_root: Optional[Path] = None,
    mix_fingerprints: bool = False,
    previous: Sequence[Path] = (),
) -> dict:
    """The primary family's rows (:func:`family` of the sweep's ``selection``) on the test splits of ``worlds`` x
    ``meta_seeds``: :func:`run_family`."""
    pairs = family(selection)
    record = study_record(base, pairs, selection)
    kept = dict(world_root=world_root, mix_fingerprints=mix_fingerprints, previous=previous)
    return run_family(root, worlds, meta_seeds, base, pairs, family_by_learner(selection), record, file, **kept)


def run_family(
    root: Path,
    worlds: Sequence[str],
    meta_seeds: Sequence[int],
    base: DemoSettings,
    pairs: Sequence[tuple[str, str]],
    by_learner: dict,
    record: dict,
    file: str,
    plan: str = PLAN,
    regime: Sequence[str] = study.REGIME_KEYS,
    world_root: Optional[Path] = None,
    mix_fingerprints: bool = False,
    previous: Sequence[Path] = (),
    measure: Measure = H_MEASURE,
) -> dict:
    """The rows of ``pairs`` (and ``regime``'s) on the test splits of ``worlds`` x ``meta_seeds`` (every world's
    first seed first), the results file ``root/file`` (and its ``.md``, pointing at ``plan``) rewritten after every
    world; kept worlds of the same ``record`` (in ``root/file`` and the files ``previous``, :func:`merge_kept`) are
    not run again.  ``measure``: what a world's table holds (default: H of base-to-new, :class:`Measure`)."""
    for w in worlds:
        world_fields(w)
    units = rows_by_unit(pairs, regime)
    path = root / file
    cells, earlier = merge_kept(([path] if path.is_file() else []) + [Path(p) for p in previous], record)
    names = sorted(f"{w}/{s}" for w, s in cells)
    now = study.current_provenance()
    computed = {n: v for n, v in earlier.get("computed_by", {}).items() if n in names}
    mixed = set(study.check_fingerprints(path, computed, names, now["fingerprint"], mix_fingerprints))
    book = study._Book(computed, mixed)
    inputs = dict(earlier.get("inputs", {}))
    seconds = dict(earlier.get("seconds_per_cell", {}))
    result = write_results(root, file, cells, pairs, record, book, inputs, seconds, by_learner, plan, measure)
    for seed in meta_seeds:
        for world in worlds:
            if (world, seed) in cells:
                log(f"confirm: world {world}, meta seed {seed}: taken from {path}")
                continue
            log(f"confirm: world {world}, meta seed {seed}")
            t = time.time()
            settings = replace(base, **world_fields(world), meta_seed=seed, eval_split="test")
            cells[(world, seed)], inputs[f"{world}/{seed}"] = measure.run_world(
                world, settings, root, units, world_root
            )
            seconds[f"{world}/{seed}"] = round(time.time() - t, 1)
            book.computed[f"{world}/{seed}"] = now
            result = write_results(root, file, cells, pairs, record, book, inputs, seconds, by_learner, plan, measure)
    return result


def components(cells: dict, pairs: Sequence[tuple[str, str]]) -> dict:
    """Each pair's variance components (:func:`power.variance_components`; a balanced design only) as
    ``{"method vs baseline": {...}}``."""
    as_json = study.cells_to_json(cells)
    out = {}
    for method, base in pairs:
        d = power.differences(as_json, method, base)
        if d is not None and d.shape[0] >= 2 and d.shape[2] >= 2:
            comps = power.variance_components(d)
            out[f"{method} vs {base}"] = {k: None if v is None else round(v, 4) for k, v in comps.items()}
    return out


def write_results(
    root: Path,
    file: str,
    cells: dict,
    pairs: Sequence[tuple[str, str]],
    record: dict,
    book: study._Book,
    inputs: dict,
    seconds: dict,
    by_learner: Optional[dict] = None,
    plan: str = PLAN,
    measure: Measure = H_MEASURE,
) -> dict:
    """The results file and its ``.md``: the answer (:func:`answer`, one sentence per learner of ``by_learner``),
    the family's summary (Holm over it), the cells, variance components and what computed each world (``plan``:
    the committed plan it follows)."""
    rows = study.summarise(cells, pairs, label=measure.label) if cells else []
    sentences = answer(rows, by_learner or {}, measure.unit)
    names = {f"{w}/{s}" for w, s in cells}
    result = {
        "plan": plan,
        "answer": sentences,
        "pairs": rows,
        "variance_components": components(cells, pairs),
        "cells": study.cells_to_json(cells),
        "settings": record,
        "computed_by": dict(sorted(book.computed.items())),
        "mixed_fingerprints": sorted(book.mixed),
        "inputs": {k: v for k, v in sorted(inputs.items()) if k in names},
        "seconds_per_cell": {k: v for k, v in sorted(seconds.items()) if k in names},
    }
    root.mkdir(parents=True, exist_ok=True)
    write_json_atomic(root / file, result)
    mixed = (
        f"\n**Mixed numerics fingerprints**: worlds {', '.join(result['mixed_fingerprints'])} were computed at "
        "another fingerprint than the others.\n"
        if result["mixed_fingerprints"]
        else ""
    )
    body = "".join(f"- {line}\n" for line in sentences) + ("\n" if sentences else "")
    summary = study.markdown(rows, result["variance_components"], measure.unit) if rows else "No finished world yet.\n"
    body += summary + mixed + (measure.tail(cells) if cells else "")
    write_text_atomic(root / file.replace(".json", ".md"), body)
    return result


def _pair_words(row: dict, unit: str = "H") -> str:
    diff, (lo, hi) = row["mean_diff_H"], row["ci95"]
    numbers = f"{diff:+.2f} {unit}, 95 % interval [{lo:+.2f}, {hi:+.2f}]"
    if row["p_holm"] is None:
        return f"{row['label']} vs {row['baseline_label']}: no test yet ({numbers}, one world)"
    numbers += f", Holm-adjusted p {row['p_holm']:.3g}"
    if row["holds"] == "better":
        return f"{row['label']} beats {row['baseline_label']} ({numbers})"
    if row["holds"] == "worse":
        return f"{row['label']} is below {row['baseline_label']} ({numbers})"
    return f"{row['label']} is not shown to differ from {row['baseline_label']} ({numbers})"


def answer(rows: Sequence[dict], by_learner: dict, unit: str = "H") -> list[str]:
    """One plain sentence per learner of the family from the summary ``rows`` (:func:`study.summarise`, Holm over
    the family): each of its pairs as "beats" / "is below" (holds after correction) or "is not shown to differ
    from", with the mean ΔH, interval and adjusted p.  A learner none of whose pairs has a row is left out."""
    found = {(r["method"], r["baseline"]): r for r in rows}
    sentences = []
    for learner, pairs in by_learner.items():
        parts = [_pair_words(found[p], unit) for p in pairs if p in found]
        if not parts:
            continue
        worlds = max(len(found[p]["worlds"]) for p in pairs if p in found)
        family_size = max(found[p]["family"] for p in pairs if p in found)
        name = study_b2n.LEARNER_LABEL.get(learner, learner)
        head = f"{name} ({worlds} world{'s' if worlds != 1 else ''}, Holm over {family_size}"
        sentences.append(f"{head} pairs): " + "; ".join(parts) + ".")
    return sentences


README_BEGIN = "<!-- confirm:begin (python -m gram_world.confirm readme --write README.md) -->"
README_END = "<!-- confirm:end -->"


def readme_block(result: dict, path: str = CLAIMS) -> str:
    """README's answer, restated from the confirmatory results ``result`` (a ``confirm.json`` at ``path``) alone:
    its sentences (:func:`answer`) between :data:`README_BEGIN` and :data:`README_END`, and where the table is."""
    if not result.get("answer"):
        raise ValueError(f"{path}: no answer yet (no finished world); run python -m gram_world.confirm run first")
    worlds = len({name.rsplit("/", 1)[0] for name in result.get("cells", {})})  # cells are "world/meta seed"
    table = path.replace(".json", ".md")
    lines = [
        README_BEGIN,
        f"**The confirmatory study** ({worlds} worlds, test splits, plan [{PLAN}]({PLAN}); table [{table}]({table})):",
        "",
        *(f"- {line}" for line in result["answer"]),
        README_END,
    ]
    return "\n".join(lines) + "\n"


def replace_readme_block(text: str, block: str, path: str = "README.md") -> str:
    """``text`` with the part from :data:`README_BEGIN` to :data:`README_END` (both lines included) replaced by
    ``block``; a text without both markers, once each and in order, is a one-line error naming ``path``."""
    begin, end = text.find(README_BEGIN), text.find(README_END)
    if text.count(README_BEGIN) != 1 or text.count(README_END) != 1 or end < begin:
        raise ValueError(f"{path}: expected the lines {README_BEGIN!r} and {README_END!r} once each, in that order")
    tail = text.index("\n", end) + 1 if "\n" in text[end:] else len(text)
    return text[:begin] + block + text[tail:]


# ------------------------------------------------------------------------------ claims on fresh worlds
def claim_check(claims: Sequence[dict], fresh: dict) -> list[dict]:
    """Claim by claim (a results file's ``pairs``), whether fresh worlds agree: ``fresh`` is ``{(world, meta seed):
    table}``.  A claim "better" / "worse" agrees when the fresh worlds' mean difference has its sign; a pair without
    a claim ("not shown") is reported with the fresh mean only."""
    diffs = study.paired_differences(fresh, [(c["method"], c["baseline"]) for c in claims])
    out = []
    for c in claims:
        groups = diffs.get((c["method"], c["baseline"]), {})
        world_means = {w: round(float(np.mean(v)), 3) for w, v in sorted(groups.items())}
        mean = float(np.mean(list(world_means.values()))) if world_means else None
        if mean is None:
            verdict = "no fresh cells"
        elif c["holds"] == "not shown":
            verdict = "no claim"
        else:
            verdict = "agrees" if (mean > 0) == (c["holds"] == "better") and mean != 0 else "disagrees"
        out.append(
            {
                "method": c["method"],
                "baseline": c["baseline"],
                "label": c["label"],
                "baseline_label": c["baseline_label"],
                "claim": c["holds"],
                "claimed_diff_H": c["mean_diff_H"],
                "fresh_diff_H": None if mean is None else round(mean, 3),
                "fresh_per_world": world_means,
                "verdict": verdict,
            }
        )
    return out


def claim_markdown(rows: Sequence[dict], claims_path: str) -> str:
    lines = [
        f"Claims of `{claims_path}` on fresh worlds (mean ΔH over the fresh worlds' means; a claim agrees when the "
        "sign matches; no test: a few worlds cannot confirm or refute a claim alone).",
        "",
        "| method | baseline | claim | claimed ΔH | fresh ΔH | per world | verdict |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        per = ", ".join(f"{w}: {v:+.2f}" for w, v in r["fresh_per_world"].items()) or "-"
        fresh = "-" if r["fresh_diff_H"] is None else f"{r['fresh_diff_H']:+.2f}"
        lines.append(
            f"| {r['label']} | {r['baseline_label']} | {r['claim']} | {r['claimed_diff_H']:+.2f} | {fresh} | {per} | "
            f"{r['verdict']} |"
        )
    return "\n".join(lines) + "\n"


def read_claims(path: Path) -> list[dict]:
    """The ``pairs`` of a results file (the claims); a missing or foreign file is a one-line error."""
    if not path.is_file():
        raise ValueError(f"--claims: {path} does not exist; run the confirmatory study first or name a results file")
    data = json.loads(path.read_text())
    if not data.get("pairs"):
        raise ValueError(f"--claims: {path} holds no summarised pairs")
    return list(data["pairs"])


# ------------------------------------------------------------------------------ the plan's numbers
def plan_text(
    selection: dict, history: dict, worlds: int, meta_seeds: int, delta: float = 1.0, history_name: str = "history"
) -> str:
    """The family, the worlds and the power of the design (``worlds`` x ``meta_seeds`` x 3 fine-tuning seeds), the
    components read from ``history`` (a study results file; pairs it lacks have no row)."""
    pairs = family(selection)
    rows = power.plan_table(history["cells"], pairs, delta, len(pairs), at=(worlds, meta_seeds))
    lines = [f"Primary family ({len(pairs)} pairs; chosen variant: {selection['chosen']}):", ""]
    lines += [f"{i + 1}. {row_label(m)} vs {row_label(b)} (`{m}` vs `{b}`)" for i, (m, b) in enumerate(pairs)]
    lines += ["", f"Worlds ({len(CONFIRM_WORLDS)}): {', '.join(CONFIRM_WORLDS)}", ""]
    source = f"the cells of {history_name}"
    lines.append(power.markdown(rows, delta, len(pairs), 0.05, 3, (worlds, meta_seeds), source=source))
    missing = [(m, b) for m, b in pairs if not any(r["method"] == m and r["baseline"] == b for r in rows)]
    if missing:
        val = power.plan_table(sweep_tables(selection), missing, delta, len(pairs), at=(worlds, meta_seeds))
        if val:
            source = "the sweep's val cells (its worlds, one meta seed: σ²_world holds the meta seed's component)"
            lines += ["Pairs the history cells lack:", ""]
            lines.append(power.markdown(val, delta, len(pairs), 0.05, 3, (worlds, meta_seeds), source=source))
        absent = [f"{m} vs {b}" for m, b in missing if not any(r["method"] == m and r["baseline"] == b for r in val)]
        if absent:
            lines.append(f"No components anywhere for: {', '.join(absent)}.")
    return "\n".join(lines) + "\n"


def sweep_tables(selection: dict) -> dict:
    """The sweep file's unit cells merged per (world, meta seed) under this module's row names (a unit with META
    overrides prefixes its rows, :class:`Row`), in a results file's form ``{"world/seed": {"row/fs": [b, n, H]}}``."""
    units = {u.name: u for u in study_b2n.b2n_units()}
    out: dict = {}
    for name, table in selection.get("cells", {}).items():
        unit, world, seed = name.rsplit("/", 2)
        prefix = unit if units.get(unit) and units[unit].meta_overrides else ""
        merged = out.setdefault(f"{world}/{seed}", {})
        for row_seed, value in table.items():
            key, fs = row_seed.rsplit("/", 1)
            merged[f"{Row(key, prefix).name}/{fs}"] = value
    return out


# ------------------------------------------------------------------------------ command line
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gram_world.confirm", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("run", "check", "plan", "readme"))
    parser.add_argument("--worlds", nargs="+", help="run: world names (default: the plan's CONFIRM_WORLDS)")
    parser.add_argument("--meta-seeds", type=int, nargs="+", help="run: meta-training seeds (default: the plan's 0)")
    parser.add_argument("--seeds", type=int, nargs="+", help="fine-tuning seeds (default: the demo's 1 2 3)")
    parser.add_argument("--out", default="", help="study folder (default output/confirm; check: output/fresh)")
    parser.add_argument("--jobs", type=int, help="worker processes")
    parser.add_argument("--selection", default=SELECTION, help=f"the b2n sweep's file (default {SELECTION})")
    parser.add_argument(
        "--allow-partial-selection",
        action="store_true",
        help="accept a partial or off-rule sweep file (a smoke test; not the plan's family)",
    )
    parser.add_argument("--fresh", type=int, default=2, help="check: how many fresh worlds to draw (default 2)")
    parser.add_argument("--draw-seed", type=int, help="check: the seed of the draw (default: from the clock, printed)")
    parser.add_argument("--claims", default=CLAIMS, help=f"check: the results file whose claims are tested ({CLAIMS})")
    parser.add_argument(
        "--history", default="docs/study/results.json", help="plan: the results file whose cells give the components"
    )
    parser.add_argument("--write", default="", help="readme: replace the answer block of this file (README.md)")
    study.add_resume_flags(parser, CONFIRM_FILE)
    study.add_settings_flags(parser)
    return parser


def main(argv: Optional[list] = None) -> int:
    return run_cli(_main, argv)


def _main(argv: list) -> int:
    args = _parser().parse_args(argv)
    if args.command == "readme":
        path = committed_file(args.claims)
        if not path.is_file():
            raise _missing("--claims", args.claims, "run the confirmatory study first or name a results file")
        block = readme_block(json.loads(path.read_text()), args.claims)
        if args.write:
            target = Path(args.write)
            write_text_atomic(target, replace_readme_block(target.read_text(encoding="utf-8"), block, args.write))
            print(f"confirm: wrote the answer of {path} into {target}")
        else:
            print(block, end="")
        return 0
    selection_path = committed_file(args.selection)
    if not selection_path.is_file():
        raise _missing("--selection", args.selection, "run python -m gram_world.study_b2n first, or name its file")
    selection = json.loads(selection_path.read_text())
    check_selection(selection, args.selection, args.allow_partial_selection)
    base = study.base_settings(args.quick, args.jobs, ())
    base = replace(base, seeds=tuple(args.seeds or base.seeds))
    meta_seeds = tuple(args.meta_seeds or CONFIRM_META_SEEDS)
    t = time.time()
    if args.command == "plan":
        history = json.loads(committed_file(args.history).read_text())
        print(plan_text(selection, history, len(CONFIRM_WORLDS), len(meta_seeds), history_name=args.history), end="")
        return 0
    if args.command == "run":
        root = Path(args.out or "output/confirm")
        result = run(
            root,
            tuple(args.worlds or CONFIRM_WORLDS),
            meta_seeds,
            base,
            selection,
            CONFIRM_FILE,
            mix_fingerprints=args.mix_fingerprints,
            previous=[Path(p) for p in args.resume_from],
        )
        print((root / CONFIRM_FILE.replace(".json", ".md")).read_text(), end="")
        print(f"confirm: {len(result['cells'])} worlds in {root}; this call took {time.time() - t:.0f} s")
        return 0
    claims = read_claims(committed_file(args.claims))
    draw_seed = args.draw_seed if args.draw_seed is not None else int(time.time())
    worlds = args.worlds or draw_worlds(args.fresh, draw_seed, exclude=CONFIRM_WORLDS, held_out_style=False)
    log(f"check: fresh worlds {', '.join(worlds)} (draw seed {draw_seed})")
    root = Path(args.out or "output/fresh")
    result = run(root, tuple(worlds), meta_seeds, base, selection, FRESH_FILE, mix_fingerprints=args.mix_fingerprints)
    fresh = {
        (w, int(s)): study.table_from_json(tb) for name, tb in result["cells"].items() for w, s in [name.rsplit("/", 1)]
    }
    checked = claim_check(claims, fresh)
    write_json_atomic(
        root / "claims_check.json",
        {"claims": args.claims, "worlds": list(worlds), "draw_seed": draw_seed, "rows": checked},
    )
    print(claim_markdown(checked, args.claims), end="")
    print(f"check: {len(fresh)} fresh worlds in {root}; this call took {time.time() - t:.0f} s")
    return 0


if __name__ == "__main__":
    from meta.infra.numerics import pin_process

    pin_process()  # numpy started with this module: this starts the command again, pinned (meta.infra.numerics)
    raise SystemExit(main())
