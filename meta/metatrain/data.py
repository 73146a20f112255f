"""From a hierarchy (CHC output or a labelled image folder) to tensors for the meta-learner.

* :func:`load_task_hierarchy` opens the configured source and names the config key in errors.
* :func:`check_cached_features` refuses cached image features that do not come from the CLIP
  being trained with (metadata check, then re-encoding a few images).
* :class:`TaskBatcher` turns a :class:`meta.metatrain.tasks.Task` (item indices) into a
  :class:`meta.method.gram.TaskBatch` of ``{"classnames", "label", "features" | "images"}`` dicts.

Which items a task or a batch holds (index level, numpy only) is :mod:`meta.metatrain.tasks`'s job.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from meta.chc import load_hierarchy
from meta.chc.image_folder import build_image_folder_hierarchy
from meta.chc.imaging import clip_norm_stats, normalize_uint8
from meta.infra.hashing import file_sha256
from meta.method.gram import TaskBatch


class FeatureMismatchError(ValueError):
    """Cached image features were computed with a different CLIP than the one configured."""


# ----------------------------------------------------------------------------- sources
@dataclass(frozen=True)
class HierarchySource:
    """Where meta-training's tasks come from (``TASKS.SOURCE``), typed: a CHC output folder, or a labelled image
    folder clustered into visual domains here (``TASKS.IMAGE_FOLDER`` with the ``CHC.DOMAINS`` / ``CHC.IMAGES`` /
    ``CHC.INPUT`` keys it uses).  :func:`meta.metatrain.settings.hierarchy_source` reads it from a config."""

    source: str  # chc | image_folder
    chc_dir: str  # META.HIERARCHY, or CHC.OUTPUT_DIR when that is empty
    chc_dir_key: str  # the key chc_dir came from (for errors)
    image_folder: str  # TASKS.IMAGE_FOLDER
    num_domains: int
    min_per_domain: int
    batch_size: int  # images per encoding batch
    seed: int
    backbone: str
    pretrained: str
    show_progress: bool
    caps: dict  # meta.data.input_limits.image_caps


def load_task_hierarchy(src: HierarchySource, clip, dims, device: str = "cpu"):
    """The hierarchy ``src`` names: a CHC output dir or a labelled image folder (encoded by ``clip``)."""
    if src.source == "image_folder":
        root = src.image_folder
        if not root or not os.path.isdir(root):
            raise FileNotFoundError(f"TASKS.IMAGE_FOLDER: not a directory: {root!r} (expected root/<class>/<images>)")
        same = ("num_domains", "min_per_domain", "batch_size", "seed", "pretrained", "show_progress")
        same_named = {name: getattr(src, name) for name in same}
        return build_image_folder_hierarchy(
            root, clip, device=device, model_name=src.backbone, **same_named, **src.caps
        )
    out_dir, key = src.chc_dir, src.chc_dir_key
    if not (Path(out_dir) / "hierarchy.json").is_file():
        raise FileNotFoundError(
            f"{key}: no finished CHC output at {out_dir!r} (hierarchy.json missing); "
            f"run `python -m meta cluster` first or point {key} at its output dir"
        )
    return load_hierarchy(out_dir)


def hierarchy_fingerprint(h) -> str:
    """sha256 (16 hex) over topic names, item topics/domains and the backbone metadata."""
    digest = hashlib.sha256()
    digest.update(json.dumps(list(h.topic_names)).encode())
    digest.update(np.ascontiguousarray(h.item_topic, dtype=np.int64).tobytes())
    digest.update(np.ascontiguousarray(h.item_domain, dtype=np.int64).tobytes())
    meta = {k: h.meta.get(k) for k in ("backbone", "pretrained", "weights_sha256", "image_size")}
    digest.update(json.dumps(meta, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:16]


def hierarchy_summary(h) -> dict:
    """Provenance of the task source: sizes and the CLIP its features came from; for an image-folder source
    (``TASKS.IMAGE_FOLDER``) also its counts and unreadable images by reason (:mod:`meta.chc.image_folder`)."""
    sizes = h.topic_sizes()
    folder = {}
    if h.meta.get("source") == "image_folder":
        folder = {key: h.meta[key] for key in ("counts", "unreadable_by_reason", "unreadable_example") if key in h.meta}
    return {
        "fingerprint": hierarchy_fingerprint(h),
        "num_topics": int(h.num_topics),
        "num_items": int(len(h.item_topic)),
        "items_in_topics": int(sizes.sum()),
        **{key: h.meta.get(key) for key in ("backbone", "pretrained", "weights_sha256")},
        "source": h.meta.get("source", "chc"),
        **folder,
    }


def norm_stats(h, clip) -> tuple[tuple, tuple]:
    """CLIP pixel mean/std: the hierarchy's record, else the model's own."""
    if h.meta.get("mean") and h.meta.get("std"):
        return tuple(h.meta["mean"]), tuple(h.meta["std"])
    return clip_norm_stats(clip)


def check_cached_features(
    h, clip, dims, model_name: str, pretrained: str, n_check: int = 8, min_cosine: float = 0.99, device: str = "cpu"
) -> dict:
    """Refuse ``h.image_features`` unless they come from this CLIP (backbone, weights sha256 and width, then a cosine
    >= ``min_cosine`` of ``n_check`` re-encoded images: seeds, QuickGELU, precision or preprocessing); returns what
    was checked."""
    meta = h.meta
    if meta.get("source") == "image_folder":  # built from TASKS.IMAGE_FOLDER by a run, not by `meta cluster`
        hint = (
            f"rebuild the image-folder hierarchy of {meta.get('root')} with this MODEL "
            "(a `meta train` with TASKS.SOURCE image_folder does so itself)"
        )
    else:
        hint = "re-run `python -m meta cluster` with this MODEL, or set MODEL.* to the clustering CLIP"
    if meta.get("backbone") and meta["backbone"] != model_name:
        raise FeatureMismatchError(
            f"MODEL.BACKBONE: cached image features come from {meta['backbone']!r}, not {model_name!r}; {hint}"
        )
    feats = h.image_features
    if feats.shape[1] != dims.embed_dim:
        raise FeatureMismatchError(
            f"MODEL.BACKBONE: cached image features are {feats.shape[1]}-d, "
            f"this CLIP embeds in {dims.embed_dim}-d; {hint}"
        )
    theirs = meta.get("weights_sha256")
    mine = file_sha256(pretrained) if pretrained and os.path.isfile(pretrained) else None
    if (theirs or mine) and theirs != mine:
        raise FeatureMismatchError(
            f"MODEL.PRETRAINED: cached image features come from weights {meta.get('pretrained') or 'random'} "
            f"(sha256 {str(theirs)[:12]}), this run uses {pretrained or 'random'} (sha256 {str(mine)[:12]}); {hint}"
        )
    result = {"metadata": True, "images_checked": 0, "min_cosine": None}
    if n_check <= 0:
        return result
    members = np.flatnonzero(np.asarray(h.item_topic) >= 0)
    if len(members) == 0:
        return result
    pick = np.unique(members[np.linspace(0, len(members) - 1, num=min(n_check, len(members))).round().astype(np.int64)])
    mean, std = norm_stats(h, clip)
    dtype = next(clip.parameters()).dtype
    with torch.no_grad():
        x = normalize_uint8(h.images(pick), mean, std, dtype=dtype, device=device)
        fresh = F.normalize(clip.encode_image(x).float(), dim=-1).cpu()
    cached = torch.from_numpy(np.asarray(h.image_features[pick], dtype=np.float32))
    cos = (fresh * F.normalize(cached, dim=-1)).sum(-1)
    worst = float(cos.min())
    if worst < min_cosine:
        raise FeatureMismatchError(
            f"MODEL: cached image features do not match this CLIP (cosine {worst:.3f} < {min_cosine} on {len(pick)} "
            f"re-encoded images; different weights, seed, QuickGELU or preprocessing); {hint}"
        )
    result.update(images_checked=int(len(pick)), min_cosine=worst)
    return result


# ----------------------------------------------------------------------------- batches
class TaskBatcher:
    """Item indices of ``hierarchy`` -> loss-function batches: images (normalised by ``mean``, ``std``, in the CLIP's
    ``dtype``) when ``use_images`` (θ has visual prompts), else its cached L2-normalised ``image_features``."""

    def __init__(
        self,
        hierarchy,
        use_images: bool,
        mean: Sequence[float],
        std: Sequence[float],
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        views: Optional[Callable[[torch.Tensor, np.ndarray], dict]] = None,
    ):
        self.h = hierarchy
        self.use_images = use_images
        self.mean, self.std = tuple(mean), tuple(std)
        self.device = device
        self.dtype = dtype
        self.views = views  # META.MODE testtime: (query images, their indices) -> the query's view entry

    def part(self, classnames: Sequence[str], index: np.ndarray, label: np.ndarray) -> dict:
        """``{"classnames": [K], "label": [n] int64, "features": [n, E] | "images": [n, 3, H, W]}``."""
        index = np.asarray(index, dtype=np.int64)
        batch: dict[str, Any] = {
            "classnames": list(classnames),
            "label": torch.as_tensor(np.asarray(label), dtype=torch.long, device=self.device),
        }
        if self.use_images:
            batch["images"] = self.images(index)
        else:
            feats = np.asarray(self.h.image_features[index], dtype=np.float32)
            batch["features"] = torch.from_numpy(feats).to(device=self.device, dtype=self.dtype)
        return batch

    def images(self, index: np.ndarray) -> torch.Tensor:
        """``[n, 3, H, W]`` normalised images of items ``index``."""
        return normalize_uint8(self.h.images(index), self.mean, self.std, dtype=self.dtype, device=self.device)

    def __call__(self, task) -> TaskBatch:
        if self.views is not None:  # META.MODE testtime: labels and each query image's views (view 0: the image)
            index = np.asarray(task.query_index, dtype=np.int64)  # alone; the support is not read (support=None)
            label = torch.as_tensor(np.asarray(task.query_label), dtype=torch.long, device=self.device)
            query = {"classnames": list(task.query_names), "label": label, **self.views(self.images(index), index)}
            return TaskBatch(support=None, query=query)
        query = self.part(task.query_names, task.query_index, task.query_label)
        return TaskBatch(support=self.part(task.classnames, task.support_index, task.support_label), query=query)
