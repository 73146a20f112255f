"""A :class:`Hierarchy` from a labelled ``root/<class>/<image>`` folder (paper Table 4 row 4).

Supervised meta-learning replaces CHC's topics with the folder classes; visual domains
are still found by k-means on the frozen CLIP's image features inside each class.
Unreadable images (any failure to read or decode one file, or over the caps) are skipped and counted, and symbolic
links are never followed, so every image has exactly one label: the counts and messages are in docs/input_rules.md
("symbolic links in an image folder", "0-byte and unreadable images").
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from pathlib import Path

import numpy as np
from tqdm import tqdm

from meta.chc.domains import split_domains
from meta.chc.errors import InputError
from meta.chc.hierarchy import Hierarchy
from meta.chc.imaging import clip_norm_stats, decode_batch, encode_images
from meta.chc.settings import INT_RANGES, REAL_RANGES, check_int, check_real
from meta.chc.sources import EMPTY_FILE, FileTooLargeError, read_regular_file, too_large_reason
from meta.data.input_limits import MAX_IMAGE_ASPECT, MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS
from meta.infra.hashing import file_sha256

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp"}
INSIDE, OUTSIDE = "symlinks_skipped_inside_root", "symlinks_skipped_outside_root"

log = logging.getLogger(__name__)


def _link_kind(link: Path, root_real: Path) -> str:
    """:data:`INSIDE` when symbolic link ``link`` resolves inside ``root_real`` (the resolved data root), else
    :data:`OUTSIDE` (a dangling link counts by where it points)."""
    target = Path(os.path.realpath(link))
    return INSIDE if target == root_real or root_real in target.parents else OUTSIDE


def _class_folders(root: Path, root_real: Path, skipped: Counter) -> list:
    """Sorted names of the real (not symbolic-link) sub-folders of ``root``; links to folders counted in ``skipped``."""
    names = []
    for entry in root.iterdir():
        if entry.is_symlink():
            if entry.is_dir():  # a link to a file at the top is no class, as a file there is none
                skipped[_link_kind(entry, root_real)] += 1
        elif entry.is_dir():
            names.append(entry.name)
    return sorted(names)


def _images_under(folder: Path, root_real: Path, skipped: Counter) -> list:
    """Sorted image files under ``folder`` (any depth), symbolic links neither followed nor listed.

    A link to a folder, or to a file with an image suffix, is counted in ``skipped`` by :func:`_link_kind`.
    """
    found = []
    for dirpath, dirnames, filenames in os.walk(folder):  # followlinks=False: a linked folder is not entered
        for name in dirnames:
            if os.path.islink(os.path.join(dirpath, name)):
                skipped[_link_kind(Path(dirpath, name), root_real)] += 1
        for name in filenames:
            path = Path(dirpath, name)
            if path.suffix.lower() not in IMAGE_SUFFIXES:
                continue
            if path.is_symlink():
                skipped[_link_kind(path, root_real)] += 1
            elif path.is_file():
                found.append(path)
    return sorted(found)


def list_images(root: Path) -> tuple[list, list, list, Counter]:
    """``(classes, paths, labels, skipped)`` of a ``root/<class>/<image>`` folder, one label per image.

    ``classes``: sorted class folder names; ``paths`` (str, sorted within each class) and ``labels``
    (class index) of the image files; ``skipped``: symbolic links left out, by :func:`_link_kind`.
    """
    root_real = Path(os.path.realpath(root))
    skipped: Counter = Counter()
    classes = _class_folders(root, root_real, skipped)
    paths, labels = [], []
    for c, name in enumerate(classes):
        for f in _images_under(root / name, root_real, skipped):
            paths.append(str(f)), labels.append(c)
    if skipped:
        log.warning(
            "TASKS.IMAGE_FOLDER: skipped %d symbolic link(s) under %s (%d resolving inside it, %d outside; "
            "links are not followed, so every image has one label)",
            sum(skipped.values()),
            root,
            skipped[INSIDE],
            skipped[OUTSIDE],
        )
    return classes, paths, labels, skipped


def _read_blobs(paths: list, indices, max_bytes: int = MAX_IMAGE_BYTES) -> tuple[list, list]:
    """``(bytes or None, reason)`` lists for ``paths[i]``, ``i`` in ``indices``; reason ``""`` when read.

    A file over ``max_bytes`` bytes is not read (its size checked with ``stat`` first); a 0-byte file is
    :data:`meta.chc.sources.EMPTY_FILE`."""
    blobs, why = [], []
    for i in indices:
        try:
            data = read_regular_file(paths[int(i)], max_bytes)
            blobs.append(data or None), why.append("" if data else EMPTY_FILE)
        except FileTooLargeError:
            blobs.append(None), why.append(too_large_reason(max_bytes))
        except OSError as err:
            blobs.append(None), why.append(type(err).__name__)
    return blobs, why


def _check_readable(root: Path, classes: list, paths: list, labels: np.ndarray, ok: np.ndarray, reasons: list) -> str:
    """``"<path> (<reason>)"`` of the first unreadable image (``""`` when all were read), after one warning with the
    count; a class without a readable image is an :class:`InputError` naming its folder."""
    bad = np.flatnonzero(~ok)
    if not len(bad):
        return ""
    for c, name in enumerate(classes):
        members = np.flatnonzero(labels == c)
        if len(members) and not ok[members].any():
            why = ", ".join(f"{r} {n}" for r, n in Counter(reasons[i] for i in members).most_common())
            raise InputError(
                f"TASKS.IMAGE_FOLDER: class {name!r}: none of its {len(members)} images can be read ({why}), e.g. "
                f"{paths[members[0]]}; repair or remove the folder {root / name}"
            )
    example = f"{paths[bad[0]]} ({reasons[bad[0]]})"
    why = ", ".join(f"{r} {n}" for r, n in Counter(reasons[i] for i in bad).most_common())
    log.warning(
        "TASKS.IMAGE_FOLDER: %d of %d images unreadable (%s), left out; e.g. %s", len(bad), len(paths), why, example
    )
    return example


class _FileImages:
    def __init__(self, paths: list, image_size: int, caps: dict):
        self.paths, self.image_size, self.caps = paths, image_size, caps

    def __call__(self, indices) -> np.ndarray:
        caps = self.caps
        blobs = _read_blobs(self.paths, indices, caps["max_bytes"])[0]
        return decode_batch(blobs, self.image_size, max_pixels=caps["max_pixels"], max_aspect=caps["max_aspect"])[0]


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
    max_bytes: int = MAX_IMAGE_BYTES,
    max_pixels: int = MAX_IMAGE_PIXELS,
    max_aspect: float = MAX_IMAGE_ASPECT,
) -> Hierarchy:
    """Classes = sub-folder names (sorted); features and domains as in CHC.  The sizes and caps come from the
    ``CHC.DOMAINS`` / ``CHC.IMAGES`` / ``CHC.INPUT`` keys; a value they do not accept is a
    :class:`meta.infra.cli_errors.UserError` naming the key, before any image is read.
    """
    for key, value in (
        ("DOMAINS.NUM", num_domains),
        ("DOMAINS.MIN_PER_DOMAIN", min_per_domain),
        ("IMAGES.BATCH_SIZE", batch_size),
        ("INPUT.MAX_IMAGE_BYTES", max_bytes),
        ("INPUT.MAX_IMAGE_PIXELS", max_pixels),
    ):
        check_int(f"CHC.{key}", value, *INT_RANGES[key])
    check_real("CHC.INPUT.MAX_IMAGE_ASPECT", max_aspect, *REAL_RANGES["INPUT.MAX_IMAGE_ASPECT"])
    caps = {"max_bytes": max_bytes, "max_pixels": max_pixels, "max_aspect": max_aspect}
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"TASKS.IMAGE_FOLDER: not a directory: {root}")
    classes, paths, labels, skipped_links = list_images(root)
    if not paths:
        raise FileNotFoundError(
            f"TASKS.IMAGE_FOLDER: no images under {root}/<class>/ (expected {sorted(IMAGE_SUFFIXES)})"
        )
    image_size = int(
        clip.visual.image_size[0] if isinstance(clip.visual.image_size, (tuple, list)) else clip.visual.image_size
    )
    mean, std = clip_norm_stats(clip)
    loader = _FileImages(paths, image_size, caps)
    feats = np.zeros((len(paths), int(clip.visual.output_dim)), dtype=np.float32)
    ok = np.zeros(len(paths), dtype=bool)
    step = max(1, batch_size) * 8
    reasons: list = []
    for start in tqdm(range(0, len(paths), step), desc="image-folder features", disable=not show_progress):
        idx = np.arange(start, min(start + step, len(paths)))
        blobs, read_why = _read_blobs(paths, idx, max_bytes)
        decode_why: list = []
        pixels, good = decode_batch(blobs, image_size, reasons=decode_why, max_pixels=max_pixels, max_aspect=max_aspect)
        reasons.extend(r or d for r, d in zip(read_why, decode_why))
        if good.any():
            feats[idx[good]] = encode_images(clip, pixels[good], mean, std, batch_size, device)
        ok[idx] = good
    labels = np.asarray(labels, dtype=np.int64)
    example = _check_readable(root, classes, paths, labels, ok, reasons)
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
            INSIDE: skipped_links[INSIDE],
            OUTSIDE: skipped_links[OUTSIDE],
        },
        "domains_per_class": per_class,
        "unreadable_by_reason": dict(Counter(r for r in reasons if r).most_common()),
        "unreadable_example": example,  # "<path> (<reason>)" of the first unreadable image, "" when none
    }
    return Hierarchy(names, item_topic, item_domain, feats, meta, loader, captions=None)
