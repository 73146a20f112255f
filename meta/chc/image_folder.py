"""A :class:`Hierarchy` from a labelled ``root/<class>/<image>`` folder (paper Table 4 row 4).

Supervised meta-learning replaces CHC's topics with the folder classes; visual domains
are still found by k-means on the frozen CLIP's image features inside each class.
Unreadable images (any failure to read or decode one file) are skipped and counted in
``meta['counts']``, by reason (exception type) in ``meta['unreadable_by_reason']``.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
from tqdm import tqdm

from meta.chc.domains import split_domains
from meta.chc.hierarchy import Hierarchy
from meta.chc.imaging import clip_norm_stats, decode_batch, encode_images
from meta.chc.settings import INT_RANGES, check_int
from meta.chc.sources import read_regular_file
from meta.hashing import file_sha256

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp"}


class _FileImages:
    def __init__(self, paths: list, image_size: int):
        self.paths, self.image_size = paths, image_size

    def __call__(self, indices) -> np.ndarray:
        blobs = []
        for i in indices:
            try:
                blobs.append(read_regular_file(self.paths[int(i)]))
            except OSError:
                blobs.append(None)
        return decode_batch(blobs, self.image_size)[0]


def build_image_folder_hierarchy(
    root,
    clip,
    num_domains: int = 3,
    min_per_domain: int = 8,
    batch_size: int = 64,
    seed: int = 0,
    device="cpu",
    model_name: str = "",
    pretrained: str = "",
    show_progress: bool = True,
) -> Hierarchy:
    """Classes = sub-folder names (sorted); features and domains as in CHC.

    ``num_domains``, ``min_per_domain`` and ``batch_size`` come from ``CHC.DOMAINS.NUM``,
    ``CHC.DOMAINS.MIN_PER_DOMAIN`` and ``CHC.IMAGES.BATCH_SIZE``; a value those keys do not accept
    is a :class:`meta.cli_errors.UserError` naming the key, before any image is read.
    """
    for key, value in (
        ("DOMAINS.NUM", num_domains),
        ("DOMAINS.MIN_PER_DOMAIN", min_per_domain),
        ("IMAGES.BATCH_SIZE", batch_size),
    ):
        check_int(f"CHC.{key}", value, *INT_RANGES[key])
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"TASKS.IMAGE_FOLDER: not a directory: {root}")
    classes = sorted(d.name for d in root.iterdir() if d.is_dir())
    paths, labels = [], []
    for c, name in enumerate(classes):
        for f in sorted((root / name).rglob("*")):
            if f.suffix.lower() in IMAGE_SUFFIXES and f.is_file():
                paths.append(str(f)), labels.append(c)
    if not paths:
        raise FileNotFoundError(
            f"TASKS.IMAGE_FOLDER: no images under {root}/<class>/ (expected {sorted(IMAGE_SUFFIXES)})"
        )
    image_size = int(
        clip.visual.image_size[0] if isinstance(clip.visual.image_size, (tuple, list)) else clip.visual.image_size
    )
    mean, std = clip_norm_stats(clip)
    loader = _FileImages(paths, image_size)
    feats = np.zeros((len(paths), int(clip.visual.output_dim)), dtype=np.float32)
    ok = np.zeros(len(paths), dtype=bool)
    step = max(1, batch_size) * 8
    reasons: list = []
    for start in tqdm(range(0, len(paths), step), desc="image-folder features", disable=not show_progress):
        idx = np.arange(start, min(start + step, len(paths)))
        blobs = []
        for i in idx:
            try:
                blobs.append(read_regular_file(paths[i]))
            except OSError:
                blobs.append(None)
        pixels, good = decode_batch(blobs, image_size, reasons=reasons)
        if good.any():
            feats[idx[good]] = encode_images(clip, pixels[good], mean, std, batch_size, device)
        ok[idx] = good
    labels = np.asarray(labels, dtype=np.int64)
    item_topic = np.full(len(paths), -1, dtype=np.int64)
    item_domain = np.full(len(paths), -1, dtype=np.int64)
    names, per_class = [], {}
    for c, name in enumerate(classes):
        members = np.flatnonzero((labels == c) & ok)
        split = split_domains(feats[members], num_domains, min_per_domain, seed=seed)
        per_class[name] = split.num_domains
        if split.excluded:
            continue
        item_topic[members] = len(names)
        item_domain[members] = split.labels
        names.append(name)
    weights = pretrained if pretrained and Path(pretrained).is_file() else None
    meta = {
        "source": "image_folder",
        "root": str(root),
        "backbone": model_name,
        "pretrained": pretrained or None,
        "weights_sha256": file_sha256(weights) if weights else None,  # as CHC records it (meta.chc.pipeline)
        "image_size": image_size,
        "mean": list(mean),
        "std": list(std),
        "counts": {
            "images": len(paths),
            "unreadable_images": int((~ok).sum()),
            "classes": len(classes),
            "classes_excluded_small": len(classes) - len(names),
        },
        "domains_per_class": per_class,
        "unreadable_by_reason": dict(Counter(r for r in reasons if r).most_common()),
    }
    return Hierarchy(
        topic_names=names,
        item_topic=item_topic,
        item_domain=item_domain,
        image_features=feats,
        meta=meta,
        image_loader=loader,
        captions=None,
    )
