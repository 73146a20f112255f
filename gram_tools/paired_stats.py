"""The statistics of a paired comparison over independent units, written once for two users.

``gram_world.study`` judges a claim over worlds (each world holds several (meta seed, fine-tuning seed) cells);
``scripts/parse_results.py --compare`` judges a user's runs over datasets (each dataset holds its seed-averaged
ΔH).  Both hand over ``groups``: ``{unit: [paired differences]}`` (H points), and both read the same numbers:

* :func:`world_t_p`: the test, a two-sided one-sample t-test of the per-unit mean differences against 0 (the
  paired t-test over units: the values inside one unit share its CLIP, CHC or dataset, so they are not counted
  as independent);
* :func:`holm`: Holm's step-down adjustment over the family of pairs asked;
* :func:`bootstrap_interval`: the 95 % interval, a two-level percentile bootstrap (units, then the values inside
  each drawn unit; :data:`BOOTSTRAP_DRAWS` draws, fixed RNG seed), and :func:`bootstrap_p` beside it.

numpy only at import; scipy is imported by :func:`world_t_p` when it runs.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

BOOTSTRAP_DRAWS = 10_000


def bootstrap_means(groups: dict, draws: int = BOOTSTRAP_DRAWS, seed: int = 0) -> tuple[float, np.ndarray]:
    """The mean of the differences in ``groups`` ({group: [values]}) and ``draws`` two-level bootstrap means.

    Each draw resamples the groups (worlds) with replacement, then the values within each drawn group,
    and takes the mean of all drawn values.  With one group only the second level remains.
    Returns ``(mean, stats)``, ``stats`` of shape ``[draws]``, in the unit of the values.
    """
    values = [np.asarray(v, dtype=float) for v in groups.values() if len(v)]
    if not values:
        raise ValueError("bootstrap_interval: no values")
    mean = float(np.mean(np.concatenate(values)))
    rng = np.random.default_rng(seed)
    stats = np.empty(draws)
    n_groups = len(values)
    for i in range(draws):
        picked = rng.integers(n_groups, size=n_groups)
        drawn = [values[g][rng.integers(len(values[g]), size=len(values[g]))] for g in picked]
        stats[i] = np.mean(np.concatenate(drawn))
    return mean, stats


def bootstrap_interval(
    groups: dict, draws: int = BOOTSTRAP_DRAWS, seed: int = 0, level: float = 0.95
) -> tuple[float, float, float]:
    """Mean and two-level percentile bootstrap interval of the differences in ``groups`` (:func:`bootstrap_means`)."""
    mean, stats = bootstrap_means(groups, draws, seed)
    lo, hi = np.quantile(stats, [(1 - level) / 2, 1 - (1 - level) / 2])
    return mean, float(lo), float(hi)


def bootstrap_p(stats: np.ndarray) -> float:
    """Two-sided bootstrap p-value of "mean difference = 0" from the bootstrap means: twice the smaller tail
    share at 0, with the +1 correction of a Monte-Carlo p-value ((count + 1) / (draws + 1)), at most 1."""
    tail = min(int(np.sum(stats <= 0)), int(np.sum(stats >= 0)))
    return min(1.0, 2.0 * (tail + 1) / (len(stats) + 1))


def world_t_p(groups: dict) -> Optional[float]:
    """Two-sided p of a one-sample t-test on the per-group mean differences (the groups, worlds or datasets, are
    the units); None with fewer than two groups; 0 or 1 when every group mean is the same (no spread)."""
    from scipy.stats import ttest_1samp

    means = [float(np.mean(v)) for v in groups.values() if len(v)]
    if len(means) < 2:
        return None
    if float(np.std(means)) == 0.0:
        return 0.0 if means[0] != 0 else 1.0
    return float(ttest_1samp(means, 0.0).pvalue)


def holm(pvalues: Sequence[Optional[float]]) -> list[Optional[float]]:
    """Holm's step-down adjustment over the non-None p-values (the family); None stays None.

    Sorted ascending p_(1) <= ... <= p_(m): adjusted p_(i) = max over j <= i of min(1, (m − j + 1) p_(j))."""
    present = sorted((p, i) for i, p in enumerate(pvalues) if p is not None)
    m = len(present)
    out: list[Optional[float]] = [None] * len(pvalues)
    running = 0.0
    for rank, (p, i) in enumerate(present):
        running = max(running, min(1.0, (m - rank) * p))
        out[i] = running
    return out
