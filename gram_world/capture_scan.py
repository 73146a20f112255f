"""Which capture conditions give a downstream dataset room for *both* kinds of prompt?

For every condition in :data:`gram_world.render.CAPTURES` and the base classes of every base-to-new
dataset plan of the world settings, freshly rendered images (``SPLIT_SIZES`` per class, drawn in the
dataset's styles from their own random streams, never written to the world) are put under the
condition and scored with a pretrained world CLIP:

* ``zeroshot``: the hand-made prompt :data:`gram_world.probe.TEMPLATE` on the test images;
* ``probe``: a linear probe on all train images (C picked on val), the ceiling of the features;
* ``coop``: CoOp's 4 context vectors fitted with Adam on all train images (:func:`~gram_world.probe.coop_fit`);
* ``vpt``: 4 shallow visual tokens fitted the same way (:func:`~gram_world.probe.vpt_fit`).

A condition suits a "specialised" downstream dataset when both fits end well above zero-shot: a
text prompt and a visual prompt can then each gain on base, as CoOp and VPT do on EuroSAT or DTD.
All accuracies are top-1 percent on the test images (40 per class).
Run with ``python -m gram_world captures --weights FILE [--captures c1 c2 ...] [--out FILE]``.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import open_clip
import torch

from meta.model.backbone import load_clip

from .build import make_labelled
from .clip_io import WORLD_MODEL, class_text_features, image_features
from .probe import TEMPLATE, coop_fit, linear_probe, vpt_fit
from .render import CAPTURES
from .settings import WorldSettings

SPLIT_SIZES = (("train", 32), ("val", 8), ("test", 40))  # images per base class
SCAN_STREAM = 900  # random-stream ids 900 + 10 * plan index + split index (never used by the world)
COLUMNS = ("zeroshot", "probe", "coop", "vpt")


def render_base_classes(
    settings: WorldSettings, split_sizes=SPLIT_SIZES
) -> dict[str, tuple[list[str], dict[str, tuple[np.ndarray, np.ndarray]]]]:
    """``{plan name: (base class names, {split: (uint8 images [N, S, S, 3], labels [N])})}`` for every
    base-to-new plan, rendered without any capture condition (CoOp's base half: the first half of
    the sorted class names)."""
    out = {}
    for index, plan in enumerate(settings.plans):
        if "base2new" not in plan.roles:
            continue
        classes = sorted(plan.classnames)
        base = classes[: (len(classes) + 1) // 2]
        splits = {}
        for split_index, (split, per_class) in enumerate(split_sizes):
            stream = SCAN_STREAM + 10 * index + split_index
            images = [
                make_labelled(settings, stream, label * per_class + k, name, plan.styles)[0]
                for label, name in enumerate(base)
                for k in range(per_class)
            ]
            splits[split] = (np.stack(images), np.repeat(np.arange(len(base)), per_class))
        out[plan.name] = (base, splits)
    return out


def scan_condition(
    clip, dims, tokenizer, rendered: dict, condition: str, vpt_lr: float = 0.01, vpt_epochs: int = 30
) -> dict:
    """``{plan name: {column: accuracy %}, ..., "average": {...}}`` for one capture ``condition``."""
    apply = CAPTURES[condition]
    rows = {}
    for name, (classes, splits) in rendered.items():
        images = {s: (torch.from_numpy(np.stack([apply(img) for img in x])), y) for s, (x, y) in splits.items()}
        feats = {s: (image_features(clip, x).numpy(), y) for s, (x, y) in images.items()}
        text = class_text_features(clip, tokenizer, classes, TEMPLATE).numpy()
        test_x, test_y = feats["test"]
        coop = coop_fit(clip, dims, classes, feats["train"], feats["test"])
        vpt = vpt_fit(clip, dims, classes, images["train"], images["test"], lr=vpt_lr, epochs=vpt_epochs)
        rows[name] = {
            "zeroshot": 100.0 * float(((test_x @ text.T).argmax(1) == test_y).mean()),
            "probe": linear_probe(feats["train"], feats["val"], feats["test"])["accuracy"],
            "coop": coop["accuracy"],
            "coop_train": coop["train_accuracy"],
            "vpt": vpt["accuracy"],
            "vpt_train": vpt["train_accuracy"],
        }
    keys = next(iter(rows.values())).keys()
    rows["average"] = {k: float(np.mean([r[k] for r in rows.values()])) for k in keys}
    return rows


def scan_captures(
    weights: Optional[Path],
    conditions: Sequence[str] = (),
    settings: Optional[WorldSettings] = None,
    model_name: str = WORLD_MODEL,
    log: Callable[[str], None] = print,
) -> dict:
    """:func:`scan_condition` for every condition (default: all of :data:`CAPTURES`).

    ``weights=None`` scans a randomly initialised CLIP (tests).  Returns ``{condition: rows}``.
    """
    conditions = list(conditions) or list(CAPTURES)
    unknown = [c for c in conditions if c not in CAPTURES]
    if unknown:
        raise ValueError(f"--captures: unknown conditions {unknown}; known: {', '.join(CAPTURES)}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        clip, dims = load_clip(model_name, pretrained=str(weights) if weights is not None else None)
    clip.eval()
    for p in clip.parameters():
        p.requires_grad_(False)
    tokenizer = open_clip.get_tokenizer(model_name)
    rendered = render_base_classes(settings or WorldSettings())
    out = {}
    for condition in conditions:
        t = time.time()
        out[condition] = scan_condition(clip, dims, tokenizer, rendered, condition)
        avg = out[condition]["average"]
        log(f"{condition:13s} " + "  ".join(f"{c} {avg[c]:5.1f}" for c in COLUMNS) + f"  ({time.time() - t:.0f} s)")
    return out


def scan_table(result: dict) -> str:
    """Markdown table: average over the datasets per condition, and each fit's gain over zero-shot."""
    lines = [
        "| capture | zero-shot | probe, all train | CoOp fit | VPT fit | CoOp - zero-shot | VPT - zero-shot |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for condition, rows in result.items():
        a = rows["average"]
        lines.append(
            f"| {condition} | {a['zeroshot']:.1f} | {a['probe']:.1f} | {a['coop']:.1f} | {a['vpt']:.1f} | "
            f"{a['coop'] - a['zeroshot']:+.1f} | {a['vpt'] - a['zeroshot']:+.1f} |"
        )
    return "\n".join(lines)
