"""Markdown tables of the measured costs: ``python -m gram_tools.cost_tables``.

Reads the files :mod:`gram_tools.realsize` and :mod:`gram_tools.chc_growth` write and prints the tables
``docs/cost.md`` and ``docs/realsize.md`` show, so no number is copied by hand.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

from gram_tools.chc_growth import DEFAULT_OUT as CHC_FIGURES
from gram_tools.plan import REPO_ROOT, card_label, default_path, line_value
from gram_tools.realsize import DEFAULT_OUT as FIGURES


def _fmt(v: float, digits: int = 0) -> str:
    if abs(v) < 0.5 * 10**-digits:
        v = 0.0  # no "-0"
    return f"{v:,.{digits}f}"


def realsize_table(figures: dict, way: int, n_support: int, n_query: int) -> str:
    """Per learner and mode: intercept and MiB / GFLOP per support and query image, and one task's total."""
    rows = [
        "| learner | step | MiB fixed | MiB per support image | MiB per query image | GFLOP per support / query image "
        f"| one task ({way * n_support} + {way * n_query} images) | CPU s per task (s/GFLOP x GFLOP; load) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for learner, modes in figures["fits"].items():
        for mode in ("second", "first"):
            f = modes.get(mode)
            if f is None:
                continue
            m, g = f["peak_mib"], f["gflops"]
            xs = [way * n_support, way * n_query]
            mib, gflop = line_value(m, xs), line_value(g, xs)
            sec = gflop * f["seconds_per_gflop"]
            lo, hi = f["load_avg_1min_range"]
            if len(m["slopes"]) == 1:  # first order: per image of the larger pass
                per_s, per_q = f"{_fmt(m['slopes'][0])} x max(s, q)", "(same)"
            else:
                per_s, per_q = _fmt(m["slopes"][0]), _fmt(m["slopes"][1])
            rows.append(
                f"| {learner} | {mode} order | {_fmt(m['intercept'])} | {per_s} | "
                f"{per_q} | {_fmt(g['slopes'][0], 1)} / {_fmt(g['slopes'][1], 1)} | "
                f"{_fmt(mib / 1024, 2)} GiB, {_fmt(gflop / 1000, 2)} TFLOP | {_fmt(sec)} ({lo:.1f}-{hi:.1f}) |"
            )
    return "\n".join(rows)


def plain_table(figures: dict) -> str:
    """Fine-tuning step and image encoding: MiB and GFLOP per image."""
    rows = [
        "| learner | step | MiB fixed | MiB per image | GFLOP fixed | GFLOP per image | CPU s per image (load) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for learner, modes in figures["fits"].items():
        for mode in ("finetune", "encode"):
            f = modes.get(mode)
            if f is None:
                continue
            lo, hi = f["load_avg_1min_range"]
            rows.append(
                f"| {learner if mode == 'finetune' else 'image tower (CHC)'} | {mode} | "
                f"{_fmt(f['peak_mib']['intercept'])} | {_fmt(f['peak_mib']['slopes'][0], 1)} | "
                f"{_fmt(f['gflops']['intercept'], 1)} | {_fmt(f['gflops']['slopes'][0], 1)} | "
                f"{_fmt(f['seconds_per_gflop'] * f['gflops']['slopes'][0], 2)} ({lo:.1f}-{hi:.1f}) |"
            )
    return "\n".join(rows)


def backbone_table(way: int, n_support: int, n_query: int) -> str:
    """Per backbone of :data:`gram_tools.backbone_table.BACKBONES`, from its own figures file
    (:func:`gram_tools.realsize.figures_path`): weights, the image tower per image, and the text-prompt learners'
    steps (CoOp's meta-task on cached features, CoCoOp's per-image text passes, a fine-tuning image of each)."""
    from gram_tools.backbone_table import BACKBONES
    from gram_tools.realsize import figures_path

    rows = [
        "| backbone | weights MiB | image tower per image: GFLOP, CPU s (load) | CoOp meta-task, 2nd order "
        f"({way * n_support} + {way * n_query} images) | CoCoOp meta-task, 2nd order: MiB per support / query image; "
        "one task | fine-tuning image, CoOp / CoCoOp: MiB, GFLOP |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    xs = [way * n_support, way * n_query]
    for backbone in BACKBONES:
        figures = json.loads((REPO_ROOT / figures_path(backbone)).read_text())
        fits = figures["fits"]
        enc, coop, cocoop = fits["coop"]["encode"], fits["coop"]["second"], fits["cocoop"]["second"]
        lo, hi = enc["load_avg_1min_range"]
        gflop = enc["gflops"]["slopes"][0]
        ft = [fits[k]["finetune"] for k in ("coop", "cocoop")]
        rows.append(
            f"| {backbone} | {_fmt(figures['settings']['model_mib'])} | {_fmt(gflop, 1)}, "
            f"{_fmt(enc['seconds_per_gflop'] * gflop, 2)} ({lo:.1f}-{hi:.1f}) | "
            f"{_fmt(line_value(coop['peak_mib'], xs))} MiB, {_fmt(line_value(coop['gflops'], xs), 1)} GFLOP | "
            f"{_fmt(cocoop['peak_mib']['slopes'][0])} / {_fmt(cocoop['peak_mib']['slopes'][1])}; "
            f"{line_value(cocoop['peak_mib'], xs) / 1024:.2f} GiB, "
            f"{line_value(cocoop['gflops'], xs) / 1000:.2f} TFLOP | "
            + " / ".join(f"{_fmt(f['peak_mib']['slopes'][0], 1)}, {_fmt(f['gflops']['slopes'][0], 1)}" for f in ft)
            + " |"
        )
    return "\n".join(rows)


def saved_table(figures: dict, n_support: int = 3, n_query: int = 1) -> str:
    """What autograd saved at one measured point, by tensor kind, against the measured resident peak."""
    rows = [
        "| learner | step | point | " + "saved MiB by kind | " + "saved total | resident peak |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for p in figures["points"]:
        if p["mode"] in ("second", "first") and p["support"] == n_support and p["query"] == n_query:
            kinds = ", ".join(f"{k} {_fmt(v)}" for k, v in sorted(p["saved_mib"].items(), key=lambda kv: -kv[1]))
            rows.append(
                f"| {p['learner']} | {p['mode']} | s={n_support}, q={n_query} | {kinds} | "
                f"{_fmt(sum(p['saved_mib'].values()))} | {_fmt(p['peak_mib'])} |"
            )
    return "\n".join(rows)


# The planner table of docs/realsize.md: (config, KEY VALUE overrides) as a user would plan them.
PLANNER_ROWS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("configs/meta/train_coop.yaml", ()),
    ("configs/meta/train_vpt.yaml", ()),
    ("configs/meta/train_unigram.yaml", ()),
    ("configs/meta/train_unigram.yaml", ("META.FIRST_ORDER", "True")),
    ("configs/meta/train_ivlp.yaml", ()),
    ("configs/meta/train_maple.yaml", ()),
    ("configs/meta/train_vpt.yaml", ("META.AUTOCAST", "bf16")),
    ("configs/meta/train_unigram.yaml", ("META.AUTOCAST", "bf16")),
    ("configs/meta/train_cocoop.yaml", ()),
    *(
        (f"configs/meta/train_{learner}.yaml", ("MODEL.BACKBONE", backbone))
        for backbone in ("RN50", "RN101", "ViT-B-32", "ViT-L-14")  # text-prompt learners on CoOp's other backbones
        for learner in ("coop", "cocoop")
    ),
)


def planner_table(gpu_memory_gib: float = 80.0, margin: float = 0.1) -> str:
    """``python -m gram_tools.plan`` on :data:`PLANNER_ROWS` (one GPU, the checkout's figures of each row's backbone
    and autocast, :func:`gram_tools.plan.figures_for`), beside the peak those GPU figures measured for the step."""
    from gram_tools.plan import figures_for, meta_plan
    from meta.config import load_meta_cfg

    rows = [
        f"| config | learner, step | one task + weights | tasks per pass: peak + weights | fits {gpu_memory_gib:g} GiB "
        f"({margin:.0%} kept free) | largest N_SUPPORT / N_QUERY (one task per pass) | measured peak of the step "
        "(GPU figures) | GPU hours, 1 GPU |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for config, opts in PLANNER_ROWS:
        cfg = load_meta_cfg(str(REPO_ROOT / config), list(opts))
        figures_path, figures, _, gpu = figures_for(cfg)
        m = meta_plan(cfg, figures, figures_path, gpu, gpu_memory_gib, 1, 30.0, margin)
        mode = {"second": "2nd order", "first": "1st order"}.get(m["mode"], m["mode"])
        name = Path(config).stem + "".join(f", {k} {v}" for k, v in zip(opts[::2], opts[1::2]))
        one = m["task_peak_gib"]["value"] + m["weights_gib"]["value"]
        measured = "-"
        if gpu is not None and m["hours"]["how"].startswith("measured"):
            peak = gpu["variants"].get(m["learner"], {}).get(f"{m['mode']}_order_peak_mb")
            if peak is not None:
                measured = f"{peak / 1024:.2f} GiB ({card_label(gpu['settings'])})"
        hours = (
            f"{m['hours']['value']:.2f} ({'measured' if m['hours']['how'].startswith('measured') else 'FLOP estimate'})"
        )
        rows.append(
            f"| {name} | {m['learner']}, {mode} | {one:.2f} GiB | {m['task_batching']['chunk']}: "
            f"{m['peak_gib']['value']:.2f} GiB | {'yes' if m['fits'] else 'NO'} | "
            f"{_largest(m['largest_n_support'])} / {_largest(m['largest_n_query'])} | {measured} | {hours} |"
        )
    return "\n".join(rows)


def testtime_points_table(figures: dict) -> str:
    """The measured test-time points (one TPT image, :mod:`gram_tools.realsize` ``--modes testtime``)."""
    rows = [
        "| learner | views V | classes C | peak MiB (no-grad encoding of the views alone) | GFLOP | CPU s (load) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    points = [p for p in figures.get("points", []) if p["mode"] == "testtime"]
    for p in sorted(points, key=lambda p: (p["learner"], p["views"], p["classes"])):
        encode = "" if p.get("views_peak_mib") is None else f" ({_fmt(p['views_peak_mib'], 1)})"
        load = "-".join(f"{x:.1f}" for x in (min(p["load_avg_1min"]), max(p["load_avg_1min"])))
        rows.append(
            f"| {p['learner']} | {p['views']} | {p['classes']} | {_fmt(p['peak_mib'], 1)}{encode} | "
            f"{_fmt(p['flops'] / 1e9, 1)} | {p['seconds']:.1f} ({load}) |"
        )
    return "\n".join(rows)


def _terms(line: dict, names: list[str], digits: int) -> str:
    """``a + b1 n1 + ...``; a coefficient below the digits shown in two significant figures (``3.1e-06``)."""

    def num(b: float) -> str:
        return f"{b:.2g}" if 0 < b < 0.5 * 10**-digits else _fmt(b, digits)

    return f"{_fmt(line['intercept'], digits)}" + "".join(
        f" {'-' if b < 0 else '+'} {num(abs(b))} {n}" for b, n in zip(line["slopes"], names)
    )


def testtime_fit_table(figures: dict) -> str:
    """Per learner: the fitted test-time planes (:func:`gram_tools.realsize.fit_testtime`)."""
    rows = [
        "| learner | peak MiB (max residual) | GFLOP (max residual) | CPU s per GFLOP (load) |",
        "| --- | --- | --- | --- |",
    ]
    for learner, modes in figures["fits"].items():
        f = modes.get("testtime")
        if f is None:
            continue
        peak = f"{_terms(f['peak_mib'], ['V', 'C'], 2)} ({_fmt(f['peak_mib']['max_abs_residual'], 1)})"
        if "views_peak_mib" in f:
            e = f["views_peak_mib"]
            peak = (
                f"max(encoding {_terms(e, ['V'], 2)} ({_fmt(e['max_abs_residual'], 1)}), step {peak}, fitted to "
                f"the {f['peak_mib']['points']} points the step dominates)"
            )
        g = f["gflops"]
        load = "-".join(f"{x:.1f}" for x in f["load_avg_1min_range"])
        rows.append(
            f"| {learner} | {peak} | {_terms(g, ['V', 'C', 'V C'], 3)} ({_fmt(g['max_abs_residual'], 3)}) | "
            f"{f['seconds_per_gflop']:.4f} ({load}) |"
        )
    return "\n".join(rows)


TESTTIME_CONFIGS = ("configs/meta/train_coop.yaml", "configs/meta/train_unigram.yaml")


def testtime_plan_table(views: int = 64, classes: int = 1000) -> str:
    """``python -m gram_tools.plan --config-file <config> --test-time views classes`` on :data:`TESTTIME_CONFIGS`
    (the checkout's figures), one row per config."""
    from gram_tools.plan import figures_for, test_time_plan
    from meta.config import load_meta_cfg

    rows = [
        f"| config | learner | peak GiB, weights included ({views} views x {classes} classes) | GFLOP | CPU s (one "
        "core) | GPU s | GPU s from |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for config in TESTTIME_CONFIGS:
        cfg = load_meta_cfg(str(REPO_ROOT / config), [])
        figures_path, figures, _, gpu = figures_for(cfg)
        t = test_time_plan(cfg, figures, figures_path, gpu, views, classes, 30.0)
        how = t["gpu_seconds"]["how"].removeprefix("estimated: ").split(";")[0]
        rows.append(
            f"| {Path(config).stem} | {t['learner']} | {t['peak_gib']['value']:.2f} | {_fmt(t['gflop']['value'])} | "
            f"{_fmt(t['cpu_seconds']['value'])} | {t['gpu_seconds']['value']:.2f} | {how} |"
        )
    return "\n".join(rows)


def _largest(n) -> str:
    return "unbounded" if isinstance(n, str) else str(n)


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h" if seconds >= 600 else f"{seconds:.0f} s"


def chc_table(chc: dict) -> str:
    """Per CHC stage: measured time and resident peak at each size, the fitted laws, the extrapolation.

    Time is the process's CPU seconds inside the stage (``time`` = ``cpu_seconds``) when every run has them,
    else wall seconds; the law ``c * items^p`` is fitted in log-log space, the resident peak as ``a + b * items``.
    """
    sizes = [r["pairs"] for r in chc["runs"]]
    target = next(iter(chc["growth"].values()))["target_pairs"] if chc["growth"] else 3.1e6
    head = " | ".join(f"{n:,} pairs: s (peak RSS MiB)" for n in sizes)
    at = f"{target / 1e6:g} M pairs"
    rows = [
        f"| stage | {head} | time law (s; items) | peak RSS law (MiB; items) | items at {at} "
        f"| time at {at} | peak RSS at {at} |",
        "| --- | " + "--- | " * len(sizes) + "--- | --- | --- | --- | --- |",
    ]
    for name, g in chc["growth"].items():
        law, mem = g["seconds_law"], g["rss_law"]
        cells = []
        for r in chc["runs"]:
            st = r["stages"].get(name)
            cells.append("-" if st is None else f"{st[g.get('time', 'seconds')]:.2f} ({st['peak_rss_mib']:,.0f})")
        kind = "CPU s" if g.get("time") == "cpu_seconds" else "wall s"
        t_law = "-" if law is None else f"{kind} = {law['c']:.3g} x items^{law['p']:.2f}"
        m_law = "-" if mem is None else f"{mem['intercept']:,.0f} + {mem['slope']:.4f} x items"
        ext = "-" if g["target_seconds"] is None else _duration(g["target_seconds"])
        rss = "-" if g["target_peak_rss_mib"] is None else f"{g['target_peak_rss_mib'] / 1024:.1f} GiB"
        rows.append(
            f"| {name} | " + " | ".join(cells) + f" | {t_law} | {m_law} | {g['target_items']:,} | {ext} | {rss} |"
        )
    return "\n".join(rows)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gram_tools.cost_tables", description=__doc__.splitlines()[0])
    ap.add_argument("--figures", default=default_path(FIGURES), help=f"default: <checkout>/{FIGURES}")
    ap.add_argument("--chc-figures", default=default_path(CHC_FIGURES), help=f"default: <checkout>/{CHC_FIGURES}")
    ap.add_argument(
        "--only",
        choices=("realsize", "planner", "chc", "testtime"),
        help="print only the real-size, planner, CHC or test-time tables",
    )
    args = ap.parse_args(argv)
    from meta.config import get_meta_cfg_default

    t = get_meta_cfg_default().TASKS
    paths = {"realsize": args.figures, "planner": args.figures, "chc": args.chc_figures, "testtime": args.figures}
    wanted = [args.only] if args.only else ["realsize", "planner", "chc", "testtime"]
    for path in (paths[k] for k in wanted):
        if not Path(path).is_file():
            print(f"error: {path}: no such file", file=sys.stderr)
            return 2
    if "realsize" in wanted:
        figures = json.loads(Path(args.figures).read_text())
        print(realsize_table(figures, int(t.K_WAY), int(t.N_SUPPORT), int(t.N_QUERY)) + "\n")
        print(plain_table(figures) + "\n")
        print(saved_table(figures) + "\n")
        print(backbone_table(int(t.K_WAY), int(t.N_SUPPORT), int(t.N_QUERY)) + "\n")
    if "planner" in wanted:
        print(planner_table() + "\n")
    if "chc" in wanted:
        print(chc_table(json.loads(Path(args.chc_figures).read_text())) + "\n")
    if "testtime" in wanted:
        figures = json.loads(Path(args.figures).read_text())
        print(testtime_points_table(figures) + "\n")
        print(testtime_fit_table(figures) + "\n")
        print(testtime_plan_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
