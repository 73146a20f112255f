"""``python -m gram_world.demo``: the command line, and :func:`run` (every stage, then the report)."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Optional

from meta.infra.cli_errors import UserError, run_cli

from ..items import STYLES
from ..shapes import CATEGORIES
from .background import BackgroundRuns
from .pool import log
from .profile import StageProfile
from .report import last_screen, stage_report
from .settings import DEFAULT_TABLES, OPT_IN_TABLES, TABLE_GROUPS, DemoSettings, demo_world_settings
from .stages import check_settings, check_world, stage_chc, stage_eval, stage_meta, stage_world


def run(settings: DemoSettings, out: Path, world_root: Optional[Path] = None) -> Path:
    """All stages into ``out``; worlds (and their CLIP weights) are cached under ``world_root``
    (default :func:`gram_world.build.default_world_parent`).  Returns the path of ``results.md``."""
    unknown = sorted(set(settings.tables) - set(TABLE_GROUPS))
    if unknown or not settings.tables:
        raise ValueError(f"DemoSettings.tables: unknown table groups {unknown}; known: {', '.join(TABLE_GROUPS)}")
    out.mkdir(parents=True, exist_ok=True)
    check_settings(settings, out)
    profile = StageProfile()
    world, weights, model, zeroshot = stage_world(settings, out, world_root, profile)
    check_world(out, world, weights)
    background = BackgroundRuns.start(world, weights, model, out, settings)  # baseline runs on the idle core
    finished = False
    try:
        with profile.stage("CHC"):
            stage_chc(world, weights, model, out, settings)
        with profile.stage("meta-training", processes=settings.jobs):
            inits = stage_meta(world, weights, model, out, settings)
        finished = True
    finally:
        if background is not None:
            background.finish(wait=finished)
    with profile.stage("evaluation", processes=settings.jobs):
        records = stage_eval(world, weights, model, inits, out, settings)
    timings = profile.seconds()
    log(f"stage profile: {profile.write(out)}")
    md = stage_report(records, zeroshot, settings, out, world, weights, timings)
    print(md.read_text(), flush=True)
    print(last_screen(md, settings), flush=True)  # the table and the file's path, last
    return md


def default_out(settings: DemoSettings) -> Path:
    """``output/demo`` (``demo_quick``) under the current working directory, with ``_world<seed>`` for
    another world seed, or ``_world-<settings hash>`` when world settings are overridden."""
    name = "demo_quick" if settings.quick else "demo"
    if settings.world:
        name += f"_world-{demo_world_settings(settings).checksum()}"
    elif settings.world_seed:
        name += f"_world{settings.world_seed}"
    return Path.cwd() / "output" / name


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gram_world.demo", description="GRAM end to end in the CPU-sized world: the paper's tables"
    )
    parser.add_argument("--quick", action="store_true", help="tiny everything (<= 5 minutes)")
    parser.add_argument(
        "--out",
        default="",
        help="output folder (default output/demo or output/demo_quick, "
        "with _world<N> or _world-<hash> for another world)",
    )
    parser.add_argument("--seeds", type=int, nargs="+", help="override the seeds")
    parser.add_argument("--jobs", type=int, help="worker processes for meta-training and evaluation (>= 1)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks (also GRAM_DEBUG=1)")
    parser.add_argument(
        "--tables",
        nargs="+",
        choices=tuple(TABLE_GROUPS) + ("all",),
        help="table groups to compute (default: "
        + " ".join(DEFAULT_TABLES)
        + "): "
        + "; ".join(f"{k} = {v}" for k, v in TABLE_GROUPS.items())
        + "; all = every group but "
        + ", ".join(OPT_IN_TABLES),
    )
    parser.add_argument("--world-seed", type=int, default=0, help="seed of the world and of its tiny CLIP")
    parser.add_argument(
        "--holdout-style",
        choices=sorted(STYLES),
        help="style kept out of everything but the pretraining corpus and the cross-domain target (default sketch)",
    )
    parser.add_argument(
        "--mixed-classes",
        nargs="+",
        choices=sorted(CATEGORIES),
        metavar="CLASS",
        help="classes of the mixed source dataset and its held-out-style twin "
        "(default: five from each of three families)",
    )
    return parser


def settings_from_args(args: argparse.Namespace) -> DemoSettings:
    """The command line's :class:`DemoSettings` (quick or default preset plus the flags given)."""
    settings = DemoSettings.preset(args.quick)
    if args.seeds:
        settings = replace(settings, seeds=tuple(args.seeds))
    if args.jobs is not None:
        if args.jobs < 1:
            raise UserError("--jobs", f"expected an integer >= 1 worker processes, got {args.jobs}")
        settings = replace(settings, jobs=args.jobs)
    if args.tables:
        everything = tuple(g for g in TABLE_GROUPS if g not in OPT_IN_TABLES)
        tables = tuple(dict.fromkeys(a for t in args.tables for a in (everything if t == "all" else (t,))))
        settings = replace(settings, tables=tables)
    world = []
    if args.holdout_style:
        world.append(("holdout_style", args.holdout_style))
    if args.mixed_classes:
        world.append(("mixed_classes", tuple(args.mixed_classes)))
    return replace(settings, world_seed=args.world_seed, world=tuple(world))


def main(argv: Optional[list] = None) -> int:
    """Entry point; bad input: one ``error: <file, folder or setting>: ...`` line and exit 2 (``--debug``:
    traceback)."""
    return run_cli(_main, argv)


def _main(argv: list) -> int:
    args = _parser().parse_args(argv)
    settings = settings_from_args(args)
    demo_world_settings(settings)  # bad world settings fail here, before any work
    run(settings, Path(args.out) if args.out else default_out(settings))
    return 0
