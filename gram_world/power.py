"""How many worlds a confirmatory study needs: variance components of the committed cells and a power calculation.

``python -m gram_world.power --results docs/study/results.json [--delta 1.0] [--family 11] [--at W M] [--out F.md]``

For each pair of a study (method row vs baseline row), the paired differences ``d[w, m, f]`` of H over worlds w,
meta-training seeds m and fine-tuning seeds f are split into three variance components by the balanced nested
ANOVA (method of moments; Searle, Casella & McCulloch, *Variance Components*, 1992, ch. 3)::

    MS_f = Σ (d_wmf − d̄_wm)² / (W M (F − 1))          σ²_f = MS_f                    (fine-tuning seed)
    MS_m = F Σ (d̄_wm − d̄_w)² / (W (M − 1))            σ²_m = (MS_m − MS_f) / F        (meta seed in a world)
    MS_w = M F Σ (d̄_w − d̄)² / (W − 1)                 σ²_w = (MS_w − MS_m) / (M F)    (world)

(negative estimates set to 0).  A study with W worlds x M meta seeds x F fine-tuning seeds tests each pair with a
one-sample t-test over the W world means, each of variance ``v = σ²_w + σ²_m / M + σ²_f / (M F)``; its two-sided
power at level α for a true difference δ is ``P(|T| > t_{1-α/2, W-1})`` with T noncentral t, W − 1 degrees of
freedom and noncentrality ``δ √W / √v``.  Holm over a family of m pairs tests the smallest p at α/m, so a claim
has at least the power computed at α/m (the level used here: conservative for all but the first claim).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

import numpy as np


def differences(cells: dict, method: str, base: str) -> Optional[np.ndarray]:
    """``d[w, m, f]`` = H(method) − H(base) as a ``[W, M, F]`` array from a results file's ``cells``
    (``{"world/meta seed": {"key/fine-tuning seed": [base, new, H]}}``); None unless the design is balanced
    (every world the same meta seeds, every cell the same fine-tuning seeds, both rows everywhere)."""
    grid: dict = {}
    for name, table in cells.items():
        world, meta = name.rsplit("/", 1)
        seeds = sorted({int(k.rsplit("/", 1)[1]) for k in table})
        diffs = {}
        for f in seeds:
            a, b = table.get(f"{method}/{f}"), table.get(f"{base}/{f}")
            if a is None or b is None:
                return None
            diffs[f] = a[2] - b[2]
        grid.setdefault(world, {})[int(meta)] = diffs
    metas = {tuple(sorted(m)) for m in grid.values()}
    seeds = {tuple(sorted(d)) for m in grid.values() for d in m.values()}
    if not grid or len(metas) != 1 or len(seeds) != 1:
        return None
    (meta_list,), (seed_list,) = metas, seeds
    return np.array([[[grid[w][m][f] for f in seed_list] for m in meta_list] for w in sorted(grid)], dtype=float)


def variance_components(d: np.ndarray) -> dict:
    """``{"world", "meta", "finetune"}`` variances (H²) of a balanced ``[W, M, F]`` array (module docstring),
    and the mean difference.  Needs W >= 2 and F >= 2; with M = 1 ``meta`` is None and ``world`` holds the world's
    and the meta seed's components together."""
    w, m, f = d.shape
    if min(w, f) < 2:
        raise ValueError(f"variance_components: need at least 2 worlds and fine-tuning seeds, got {d.shape}")
    cell = d.mean(axis=2)  # [W, M]
    world = cell.mean(axis=1)  # [W]
    ms_f = float(((d - cell[:, :, None]) ** 2).sum() / (w * m * (f - 1)))
    ms_w = float(m * f * ((world - world.mean()) ** 2).sum() / (w - 1))
    if m == 1:  # one meta seed per world: its component cannot be told from the world's; "world" holds both
        return {"world": max(0.0, (ms_w - ms_f) / f), "meta": None, "finetune": ms_f, "mean": float(d.mean())}
    ms_m = float(f * ((cell - world[:, None]) ** 2).sum() / (w * (m - 1)))
    return {
        "world": max(0.0, (ms_w - ms_m) / (m * f)),
        "meta": max(0.0, (ms_m - ms_f) / f),
        "finetune": ms_f,
        "mean": float(d.mean()),
    }


def world_mean_variance(comps: dict, meta_seeds: int, finetune_seeds: int) -> float:
    """Variance (H²) of one world's mean difference with ``meta_seeds`` x ``finetune_seeds`` units."""
    meta = comps["meta"] or 0.0  # None: folded into "world" (one meta seed per world measured)
    return comps["world"] + meta / meta_seeds + comps["finetune"] / (meta_seeds * finetune_seeds)


def power(worlds: int, variance: float, delta: float, alpha: float) -> float:
    """Two-sided power of the one-sample t-test over ``worlds`` world means of variance ``variance`` for a true
    difference ``delta`` (H) at level ``alpha``."""
    from scipy.stats import nct, t

    if worlds < 2:
        return 0.0
    df = worlds - 1
    crit = t.ppf(1 - alpha / 2, df)
    ncp = delta * np.sqrt(worlds) / np.sqrt(max(variance, 1e-12))
    value = float(nct.sf(crit, df, ncp) + nct.cdf(-crit, df, ncp))
    if not np.isfinite(value):  # scipy's noncentral t gives nan far in its tail (large ncp): power is ~1 there
        from scipy.stats import norm

        value = float(norm.sf(crit - abs(ncp)) + norm.cdf(-crit - abs(ncp)))
    return min(1.0, max(0.0, value))


def worlds_needed(variance: float, delta: float, alpha: float, target: float = 0.8, most: int = 200) -> Optional[int]:
    """The fewest worlds (2..``most``) whose test reaches ``target`` power; None if none does."""
    for w in range(2, most + 1):
        if power(w, variance, delta, alpha) >= target:
            return w
    return None


def plan_table(
    cells: dict,
    pairs: Sequence[tuple[str, str]],
    delta: float = 1.0,
    family: int = 11,
    alpha: float = 0.05,
    meta_options: Sequence[int] = (1, 2, 3),
    finetune_seeds: int = 3,
    at: Optional[tuple[int, int]] = None,
) -> list[dict]:
    """Per pair: the components, and per meta-seed count the worlds needed for 80 % power at ``alpha / family``;
    with ``at = (worlds, meta seeds)``, also ``power_at``: the power of that design (what a study that cannot
    afford the worlds needed has)."""
    rows = []
    for method, base in pairs:
        d = differences(cells, method, base)
        if d is None or d.shape[0] < 2 or d.shape[2] < 2:  # unbalanced, or one world or fine-tuning seed: no estimate
            continue
        comps = variance_components(d)
        need = {
            str(m): worlds_needed(world_mean_variance(comps, m, finetune_seeds), delta, alpha / family)
            for m in meta_options
        }
        row = {"method": method, "baseline": base, "shape": list(d.shape), **comps, "worlds_needed": need}
        if at is not None:
            worlds, metas = at
            row["power_at"] = power(worlds, world_mean_variance(comps, metas, finetune_seeds), delta, alpha / family)
        rows.append(row)
    return rows


def markdown(
    rows: Sequence[dict],
    delta: float,
    family: int,
    alpha: float,
    finetune_seeds: int,
    at: Optional[tuple[int, int]] = None,
    source: str = "the committed cells",
) -> str:
    """The table of :func:`plan_table` (with its ``power_at`` column when ``at`` is given); ``source``: where its
    components were read, in words."""
    metas = list(rows[0]["worlds_needed"]) if rows else []
    head = " | ".join(f"worlds, {m} meta seed{'s' if m != '1' else ''}" for m in metas)
    if at is not None:
        head += f" | power at {at[0]} worlds x {at[1]} meta seed{'s' if at[1] != 1 else ''}"
    lines = [
        f"Worlds for 80 % power, |ΔH| = {delta} at α = {alpha}/{family} (Holm's first step), {finetune_seeds} "
        f"fine-tuning seeds per cell; variance components in H² from {source}.",
        "",
        f"| method | baseline | mean ΔH | σ²_world | σ²_meta | σ²_finetune | {head} |",
        "| --- | --- | --- | --- | --- | --- | " + " | ".join("---" for _ in metas) + (" | ---" if at else "") + " |",
    ]
    for r in rows:
        need = " | ".join("> 200" if r["worlds_needed"][m] is None else str(r["worlds_needed"][m]) for m in metas)
        if at is not None:
            need += f" | {r['power_at']:.2f}"
        lines.append(
            f"| {r['method']} | {r['baseline']} | {r['mean']:+.2f} | {r['world']:.2f} | "
            f"{'-' if r['meta'] is None else format(r['meta'], '.2f')} | "
            f"{r['finetune']:.2f} | {need} |"
        )
    return "\n".join(lines) + "\n"


# The plan's primary pairs, per learner of the family (GRAM vs its baseline, θ* only vs the baseline, GRAM vs θ*
# only); keys of gram_world.study_b2n.LEARNERS.
PRIMARY_BY_LEARNER = {
    "gram_coop": (("gram_coop", "coop"), ("gram_coop_init_only", "coop"), ("gram_coop", "gram_coop_init_only")),
    "gram_vpt": (("gram_vpt", "vpt"), ("gram_vpt_init_only", "vpt"), ("gram_vpt", "gram_vpt_init_only")),
    "unigram": (("unigram", "joint"), ("unigram_no_reg", "joint"), ("unigram", "unigram_no_reg")),
}
PRIMARY_PAIRS = tuple(pair for pairs in PRIMARY_BY_LEARNER.values() for pair in pairs)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gram_world.power", description=__doc__.splitlines()[0])
    ap.add_argument("--results", default="docs/study/results.json", help="a study results.json (its cells)")
    ap.add_argument("--delta", type=float, default=1.0, help="the difference to detect (H points, > 0)")
    ap.add_argument("--family", type=int, default=11, help="claims in the Holm family (>= 1)")
    ap.add_argument("--alpha", type=float, default=0.05)
    ap.add_argument("--finetune-seeds", type=int, default=3)
    ap.add_argument("--out", default="", help="also write the table (markdown) here")
    ap.add_argument(
        "--at",
        type=int,
        nargs=2,
        metavar=("WORLDS", "META_SEEDS"),
        help="also the power of a study of WORLDS worlds x META_SEEDS meta seeds (the design a budget affords)",
    )
    args = ap.parse_args(argv)
    if not args.delta > 0 or args.family < 1 or not 0 < args.alpha < 1 or args.finetune_seeds < 1:
        print(
            "error: --delta > 0, --family >= 1, 0 < --alpha < 1 and --finetune-seeds >= 1 are needed", file=sys.stderr
        )
        return 2
    at = tuple(args.at) if args.at else None
    if at is not None and (at[0] < 2 or at[1] < 1):
        print(f"error: --at: expected WORLDS >= 2 and META_SEEDS >= 1, got {at[0]} {at[1]}", file=sys.stderr)
        return 2
    try:
        cells = json.loads(Path(args.results).read_text())["cells"]
    except (OSError, ValueError, KeyError) as err:
        print(f"error: {args.results}: not a study results file with cells ({err})", file=sys.stderr)
        return 2
    rows = plan_table(
        cells, PRIMARY_PAIRS, args.delta, args.family, args.alpha, finetune_seeds=args.finetune_seeds, at=at
    )
    text = markdown(rows, args.delta, args.family, args.alpha, args.finetune_seeds, at)
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
