"""The test-time table (``--tables testtime``): each :data:`.settings.TESTTIME_ROWS` row on the cross-domain target
and on base-to-new's base and new classes, with accuracy and ECE after TPT beside the same start's plain
prediction, and seconds per test image.

A record of a test-time run (``test_time_row`` set, :func:`.stages.run_eval_job`) holds ``test_time.sets``:
``{test set: {accuracy, ece, accuracy_before, ece_before, seconds_per_image, peak_mib_per_image, ...}}`` (percent,
percent, seconds, MiB: the resident peak of one image's tuning on the CPU, null elsewhere, "—" in the table);
zero-shot CLIP's record has plain accuracies only.  Every cell is the mean ± population std over seeds of the
per-seed value, a per-seed value over several datasets or targets being their mean first, as in the other tables.
"""

from __future__ import annotations

import json
import statistics

from meta.finetune.testtime import TestTimeSpec

from .settings import TESTTIME_ROWS, DemoSettings

# (group id, heading, protocol, test sets of a record: "targets" = every cross-domain target)
GROUPS = (
    ("cross_domain", "cross-domain target (held-out style)", "transfer", "targets"),
    ("base", "base-to-new: base classes", "base2new", "base"),
    ("new", "base-to-new: new classes", "base2new", "new"),
)
FIELDS = ("accuracy", "accuracy_before", "ece", "ece_before", "seconds_per_image", "peak_mib_per_image")


def _sets(record: dict, which: str) -> list:
    return list(record.get("targets", {})) if which == "targets" else [which]


def _values(record: dict, which: str) -> dict:
    """``{field: value}`` of one record averaged over its test sets ``which``; a plain record has accuracy only."""
    names = _sets(record, which)
    tuned = (record.get("test_time") or {}).get("sets")
    if tuned is None:  # zero-shot CLIP: its plain accuracy is both "before" and "after"
        acc = statistics.fmean(record["targets"][n] if which == "targets" else record[n] for n in names)
        return {"accuracy": acc, "accuracy_before": acc}
    return {
        f: statistics.fmean(tuned[n][f] for n in names) for f in FIELDS if None not in (tuned[n].get(f) for n in names)
    }


def _mean_std(values: list) -> tuple:
    return (statistics.fmean(values), statistics.pstdev(values)) if values else (None, None)


ROW_OWN = ("optimizer", "prototypes", "adapt", "steps")  # spec fields a row sets for itself (settings.TestTimeRow)


def _spec(records: list) -> TestTimeSpec:
    """The one TPT spec the records were tuned with, their rows' own fields aside (:data:`ROW_OWN`, and the cache
    row's views, ``DemoSettings.cache_views``); runs under different specs are never pooled."""

    def shared(spec: dict, own: tuple) -> str:
        return json.dumps({k: v for k, v in spec.items() if k not in own}, sort_keys=True)

    specs = [r["test_time"]["spec"] for r in records if r.get("test_time")]
    tuned = {shared(spec, ROW_OWN) for spec in specs if spec.get("adapt") != "cache"}
    every = {shared(spec, (*ROW_OWN, "views")) for spec in specs}
    if len(tuned) > 1 or len(every) != 1:
        found = max(len(tuned), len(every))
        raise ValueError(f"test-time table: expected the runs of one TPT spec, found {found}: {sorted(tuned | every)}")
    spec = json.loads((tuned or every).pop())
    return TestTimeSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in spec.items()})


def build_testtime_table(records: list, settings: DemoSettings) -> dict:
    """``{"title", "kind": "testtime", "spec", "groups": {group id: {"heading", "rows": [...]}}}``; a row holds the
    row's key and label, ``seeds`` and ``<field>`` = ``(mean, std)`` over seeds (None where not measured).  The spec
    is the records' own (:func:`_spec`)."""
    spec = _spec(records)
    cache_views = sorted({r["test_time"]["spec"]["views"] for r in records if _adapt(r) == "cache"})
    groups = {}
    for gid, heading, protocol, which in GROUPS:
        rows = []
        for tt in TESTTIME_ROWS:
            mine = [r for r in records if r.get("test_time_row") == tt.key and r["protocol"] == protocol]
            per_seed: dict = {}
            for r in mine:  # a seed's value over several datasets: their mean first
                per_seed.setdefault(r["seed"], []).append(_values(r, which))
            if not per_seed:
                continue
            row = {"key": tt.key, "label": tt.label, "seeds": sorted(per_seed)}
            for f in FIELDS:
                seed_values = [
                    statistics.fmean(v[f] for v in vs) for vs in per_seed.values() if all(f in v for v in vs)
                ]
                row[f] = _mean_std(seed_values)
            rows.append(row)
        groups[gid] = {"heading": heading, "rows": rows}
    return {
        "title": f"Test-time prompt tuning (TPT, {spec.views} views, {spec.kept} kept, {spec.steps} step(s); AdamW at "
        f"{spec.lr:g} unless a row says its own step)",
        "kind": "testtime",
        "spec": {"views": spec.views, "kept": spec.kept, "steps": spec.steps, "lr": spec.lr},
        "cache_views": cache_views,
        "fine_tuning": f"{settings.shots} shots, {settings.epochs} epochs for the row fine-tuned first",
        "groups": groups,
    }


def _adapt(record: dict) -> str:
    return (record.get("test_time") or {}).get("spec", {}).get("adapt", "")


def _cache_views(views: list) -> str:
    """How the cache row's feature of an image is made, from its records' view counts."""
    if not views:
        return ""
    if views == [1]:
        return " (each image's own feature, no augmented views)"
    return f" (each image's feature the mean of its most confident of {' / '.join(map(str, views))} views)"


def _cell(pair: tuple, digits: int = 2) -> str:
    mean, std = pair
    return "—" if mean is None else f"{mean:.{digits}f} ± {std:.{digits}f}"


def markdown_of_testtime(table: dict) -> list[str]:
    """The markdown lines of :func:`build_testtime_table`: its title, what it measures, one table per group."""
    parts = [
        f"## {table['title']}",
        "",
        "Each test image is scored after TPT from the row's start, θ reset per image (Shu et al., NeurIPS 2022): "
        "accuracy (%) and expected calibration error (ECE, %, 15 bins) after tuning, beside the same start's plain "
        f"prediction (before). Only the row fine-tuned first sees labels ({table['fine_tuning']}); seconds and "
        "peak MiB (resident high-water mark of one image's tuning, the largest over a set's images; CPU runs only) "
        "are per test image on this machine. Test-time GRAM's θ* and R_φ are meta-trained for this use "
        "(`META.MODE testtime`: an entropy step on each query image, then its cross-entropy) and each of its "
        "steps is the meta-trained one, θ − α R_φ(∇H), not AdamW's. The cache row tunes nothing: TDA's positive "
        "and negative feature caches (Karmanov et al., CVPR 2024) fill over the shuffled test stream"
        f"{_cache_views(table.get('cache_views', []))}, so unlike the episodic rows an image's prediction depends on "
        "the images before it.",
        "",
    ]
    for group in table["groups"].values():
        parts += [
            f"### {group['heading']}",
            "",
            "| method | accuracy | accuracy before | ECE | ECE before | s / image | peak MiB / image |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in group["rows"]:
            cells = [r["label"]] + [_cell(r[f]) for f in FIELDS[:4]] + [_cell(r["seconds_per_image"], 3)]
            cells.append(_cell(r["peak_mib_per_image"], 1))
            parts.append("| " + " | ".join(cells) + " |")
        parts.append("")
    return parts
