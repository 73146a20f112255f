"""Zero-shot accuracy of a (pretrained) world CLIP on the downstream test splits.

One hand-written prompt per class, CoOp's ``"a photo of a {}."`` (the
template CoOp and the GRAM paper use for zero-shot CLIP), cosine similarity,
arg-max.  Test images are read from the CoOp-layout files the datasets code
reads, not from any cache.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Optional

import numpy as np
import open_clip
import torch

from meta.method.prompts import DEFAULT_TEMPLATE
from meta.model.backbone import load_clip

from .build import DatasetPaths, WorldPaths, read_chc_shards
from .clip_io import WORLD_MODEL, class_text_features, image_features, load_images

TEMPLATE = DEFAULT_TEMPLATE


def read_split(ds: DatasetPaths, split: str = "test") -> tuple[list[Path], torch.Tensor]:
    """Image paths and labels ``[N]`` of one split of a CoOp ``split_zhou_*.json``."""
    data = json.loads(ds.split_file.read_text())
    if split not in data:
        raise KeyError(f"{ds.split_file}: no {split!r} split; has {sorted(data)}")
    rows = data[split]
    return [ds.image_dir / r[0] for r in rows], torch.tensor([int(r[1]) for r in rows])


@torch.no_grad()
def dataset_accuracy(clip, tokenizer, ds: DatasetPaths, split: str = "test", template: str = TEMPLATE) -> dict:
    """Top-1 accuracy (%) of zero-shot ``clip`` on one dataset split, with chance level (%)."""
    paths, labels = read_split(ds, split)
    text = class_text_features(clip, tokenizer, ds.classnames, template)  # [C, D]
    pred = (image_features(clip, load_images(paths)) @ text.T).argmax(dim=-1)  # [N]
    return {
        "accuracy": round(100.0 * float((pred == labels).float().mean()), 2),
        "chance": round(100.0 / len(ds.classnames), 2),
        "n": len(labels),
        "classes": len(ds.classnames),
    }


def zeroshot_accuracy(
    world: WorldPaths, weights: Optional[Path], model_name: str = WORLD_MODEL, split: str = "test", save: bool = True
) -> dict:
    """``{dataset name: {"accuracy", "chance", "n", "classes"}}`` for every downstream dataset.

    ``weights=None`` evaluates random weights (the chance baseline).  With
    ``save`` the result is also written next to the weights as ``<stem>.zeroshot.json``.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        clip, _ = load_clip(model_name, pretrained=str(weights) if weights is not None else None)
    tokenizer = open_clip.get_tokenizer(model_name)
    result = {name: dataset_accuracy(clip, tokenizer, ds, split) for name, ds in world.datasets.items()}
    if save and weights is not None:
        Path(weights).with_suffix(".zeroshot.json").write_text(json.dumps(result, indent=1))
    return result


@torch.no_grad()
def style_clustering(
    world: WorldPaths, weights: Optional[Path], model_name: str = WORLD_MODEL, max_items: int = 2000, seed: int = 0
) -> dict:
    """How well k-means (k = number of styles) on CLIP image features of the CHC corpus recovers styles.

    This is the signal CHC's visual-domain clustering relies on.  Returns the
    adjusted Rand index and normalised mutual information (scikit-learn)
    between clusters and the ground-truth style of up to ``max_items`` pairs.
    """
    from sklearn.cluster import KMeans
    from sklearn.metrics import adjusted_rand_score, normalized_mutual_info_score

    pairs = read_chc_shards(world)[:max_items]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        clip, _ = load_clip(model_name, pretrained=str(weights) if weights is not None else None)
    feats = image_features(clip, torch.from_numpy(np.stack([p["image"] for p in pairs]))).numpy()
    styles = [p["truth"]["style"] for p in pairs]
    k = len(set(styles))
    clusters = KMeans(n_clusters=k, n_init=10, random_state=seed).fit_predict(feats)
    return {
        "ari": round(float(adjusted_rand_score(styles, clusters)), 3),
        "nmi": round(float(normalized_mutual_info_score(styles, clusters)), 3),
        "k": k,
        "n": len(pairs),
    }
