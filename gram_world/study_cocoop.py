"""``python -m gram_world.study_cocoop``: the planned CoCoOp study of ``docs/study/cocoop_plan.md``.

The plan, committed before the study's first cell, fixes what this module runs:

* **The family** (:data:`PAIRS`, four pairs, Holm over all four): CoCoOp + GRAM (θ* and R_φ) vs CoCoOp, CoCoOp from
  θ* alone vs CoCoOp, CoCoOp + GRAM vs θ* alone, and CoCoOp vs CoOp (Zhou et al., CVPR 2022, report CoCoOp's
  base-to-new H above CoOp's: 75.83 against 71.66 over 11 datasets, their Table 1).
* **The worlds** (:data:`WORLDS`): :data:`WORLD_COUNT` seeds drawn without replacement from [1000, 1 000 000) by
  ``numpy.random.default_rng(DRAW_SEED)``, none of them a world any earlier study, sweep or check read
  (:data:`USED_WORLDS`); the default held-out style; one meta-training seed; the demo's three fine-tuning seeds.
* **The size** (:func:`planned_worlds`): 80 % power for |ΔH| = 1 at α = 0.05 / 4 (Holm's first step) from the
  variance components of a stand-in pilot, since no CoCoOp cell existed: the confirmatory study's CoOp pair with the
  largest world-mean variance (:data:`PILOT_FILE`, its ``variance_components``).
* **The test**: the confirmatory study's (:func:`gram_world.study.summarise`): one-sample t-test over the world means
  of each pair's paired H difference, Holm over the family, the two-level bootstrap interval beside it.

Commands: ``plan`` prints the plan's numbers (the family, the draw, the power); ``run`` runs the rows world by world
into ``--out`` (default ``output/study_cocoop``), ``cocoop.json`` / ``.md`` rewritten after every world, every stage
cached on disk, so a stopped study resumes where it stopped (:func:`gram_world.confirm.run_family`); on a new
machine ``--resume-from docs/study/cocoop.json`` keeps the worlds of the committed results file.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

from meta.infra.cli_errors import run_cli

from . import confirm, power, study

PLAN = "docs/study/cocoop_plan.md"
RESULTS_FILE = "cocoop.json"
PAIRS: tuple[tuple[str, str], ...] = (
    ("gram_cocoop", "cocoop"),
    ("gram_cocoop_init_only", "cocoop"),
    ("gram_cocoop", "gram_cocoop_init_only"),
    ("cocoop", "coop"),
)
BY_LEARNER = {"CoCoOp": PAIRS}  # the answer's one sentence
REGIME = ("zsclip", "coop")  # the plain cell's rows besides the family's: zero-shot and CoOp for the regime table
DELTA_H, ALPHA, TARGET_POWER = 1.0, 0.05, 0.8
META_SEEDS = (0,)
FINETUNE_SEEDS = 3  # the demo's seeds 1, 2, 3
PILOT_FILE = "docs/study/confirm.json"
PILOT_PAIRS = ("gram_coop vs coop", "gram_coop_init_only vs coop", "gram_coop vs gram_coop_init_only")

# Every world an earlier study, sweep or fresh check read (the history study's and the base-to-new sweep's
# worlds 0-13 lie below the draw's range; tests/test_study_cocoop.py checks this list against docs/study/*.json).
USED_WORLDS = tuple(study.WORLDS) + confirm.CONFIRM_WORLDS + ("221555", "963059", "185780", "654316")
DRAW_SEED = 20261202
WORLD_COUNT = 18  # planned_worlds() on the committed pilot file (a test recomputes it)
# confirm.draw_worlds(WORLD_COUNT, DRAW_SEED, exclude=USED_WORLDS, held_out_style=False), written out (a test redraws)
WORLDS = (
    "282166", "378549", "913060", "77361", "714584", "815736", "853585", "458066", "535133",
    "4247", "684715", "127738", "897017", "730474", "510228", "369238", "163286", "160483",
)  # fmt: skip


def pilot_variance(pilot: dict) -> tuple[str, float]:
    """The stand-in pilot: of :data:`PILOT_PAIRS`, the pair whose world mean (1 meta seed, 3 fine-tuning seeds) has
    the largest variance in ``pilot``'s ``variance_components``; ``(pair, variance in H²)``."""
    comps = pilot["variance_components"]
    missing = [p for p in PILOT_PAIRS if p not in comps]
    if missing:
        raise ValueError(f"{PILOT_FILE}: no variance components for {', '.join(missing)}")
    ranked = {p: power.world_mean_variance(comps[p], len(META_SEEDS), FINETUNE_SEEDS) for p in PILOT_PAIRS}
    pair = max(ranked, key=ranked.get)
    return pair, ranked[pair]


def planned_worlds(pilot: dict) -> int:
    """Worlds for :data:`TARGET_POWER` at |ΔH| = :data:`DELTA_H`, level ``ALPHA / len(PAIRS)``, on the pilot's
    variance (:func:`pilot_variance`)."""
    _, variance = pilot_variance(pilot)
    needed = power.worlds_needed(variance, DELTA_H, ALPHA / len(PAIRS), TARGET_POWER)
    if needed is None:
        raise ValueError(f"{PILOT_FILE}: the pilot's variance {variance:.3f} H² needs more than 200 worlds")
    return needed


def plan_text(pilot: dict) -> str:
    """The plan's numbers: the family, the pilot, the power at :data:`WORLD_COUNT` worlds and the draw."""
    pair, variance = pilot_variance(pilot)
    alpha = ALPHA / len(PAIRS)
    lines = [f"Family ({len(PAIRS)} pairs, Holm over all of them):", ""]
    lines += [
        f"{i + 1}. {confirm.row_label(m)} vs {confirm.row_label(b)} (`{m}` vs `{b}`)" for i, (m, b) in enumerate(PAIRS)
    ]
    lines += [
        "",
        f"Pilot (a stand-in: no CoCoOp cell existed): {PILOT_FILE}, pair {pair}, world-mean variance {variance:.3f} H²"
        f" at {len(META_SEEDS)} meta seed x {FINETUNE_SEEDS} fine-tuning seeds.",
        f"Worlds for {TARGET_POWER:.0%} power at |ΔH| = {DELTA_H:g}, α = {ALPHA:g}/{len(PAIRS)}: "
        f"{planned_worlds(pilot)}; power at {WORLD_COUNT} worlds: "
        f"{power.power(WORLD_COUNT, variance, DELTA_H, alpha):.2f}.",
        f"Worlds ({WORLD_COUNT}, draw seed {DRAW_SEED}, none of the {len(USED_WORLDS)} used before): "
        + ", ".join(WORLDS),
    ]
    return "\n".join(lines) + "\n"


def study_record(base) -> dict:
    """What a results file was run with; kept worlds of a file with other values are not this study's."""
    return {**study.settings_record(base), "quick": base.quick, "family": [list(p) for p in PAIRS]}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gram_world.study_cocoop", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("plan", "run"))
    parser.add_argument("--worlds", nargs="+", help="run: world names (default: the plan's WORLDS)")
    parser.add_argument("--out", default="output/study_cocoop", help="study folder (default output/study_cocoop)")
    parser.add_argument("--jobs", type=int, help="worker processes")
    study.add_resume_flags(parser, RESULTS_FILE)
    study.add_settings_flags(parser)
    return parser


def main(argv: Optional[list] = None) -> int:
    """The command line (module docstring); errors end in one line (:func:`meta.infra.cli_errors.run_cli`)."""
    return run_cli(lambda given: _command(_parser().parse_args(given)), argv)


def _command(args: argparse.Namespace) -> int:
    if args.command == "plan":
        return confirm.print_plan(PILOT_FILE, plan_text)
    base = study.base_settings(args.quick, args.jobs, ())
    base = replace(base, seeds=base.seeds[:FINETUNE_SEEDS])
    root, t = Path(args.out), time.time()
    result = confirm.run_family(
        root,
        tuple(args.worlds or WORLDS),
        META_SEEDS,
        base,
        PAIRS,
        BY_LEARNER,
        study_record(base),
        RESULTS_FILE,
        plan=PLAN,
        regime=REGIME,
        mix_fingerprints=args.mix_fingerprints,
        previous=[Path(p) for p in args.resume_from],
    )
    print((root / RESULTS_FILE.replace(".json", ".md")).read_text(), end="")
    print(f"study_cocoop: {len(result['cells'])} worlds in {root}; this call took {time.time() - t:.0f} s")
    return 0


if __name__ == "__main__":
    from meta.infra.numerics import pin_process

    pin_process()  # numpy started with this module: this starts the command again, pinned (meta.infra.numerics)
    raise SystemExit(main())
