"""The CHC result the meta-trainer consumes: topics -> domains -> items.

See the contract in :mod:`meta.chc`.  Files in a CHC output directory:

  hierarchy.json                    topic names, meta, counts
  item_topic.npy / item_domain.npy  int64 [N]
  item_status.npy                   int8  [N] (see ``STATUS``)
  image_features/image_features.npy float32 [N, D] (L2-normalised; zeros where unreadable)
  image_features/images_u8.npy      uint8 [N, H, W, 3] (optional cache)
  index/                            where each pair's image bytes live + captions
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from meta.chc.imaging import decode_batch
from meta.chc.outputs import OutputError, load_image_features, load_index, load_npy_output, read_json_output
from meta.data.input_limits import image_caps

# item_status codes
STATUS = {
    0: "clustered",
    1: "unreadable image",
    2: "filtered (image-text cosine)",
    3: "topic noise",
    4: "topic too small (excluded)",
}
CLUSTERED, UNREADABLE, FILTERED, NOISE, SMALL_TOPIC = 0, 1, 2, 3, 4


class PairIndexImages:
    """``images(indices)`` decoded lazily from the pair index (tar byte ranges or files), under the image caps
    the clustering ran with (:func:`meta.data.input_limits.image_caps`), so an image it encoded is decoded again."""

    def __init__(self, index, image_size: int, caps: Optional[dict] = None):
        self.index = index
        self.image_size = int(image_size)
        self.caps = image_caps({}) if caps is None else dict(caps)

    def __call__(self, indices: Sequence[int]) -> np.ndarray:
        caps = self.caps
        blobs = self.index.read_image_bytes(indices, max_bytes=caps["max_bytes"])
        pixels, _ = decode_batch(blobs, self.image_size, max_pixels=caps["max_pixels"], max_aspect=caps["max_aspect"])
        return pixels


@dataclass
class Hierarchy:
    """Topics (classes) -> visual domains -> items (image-text pairs); fields and shapes: the contract in
    :mod:`meta.chc` (``image_loader`` is its ``images``; ``captions`` [N] is None for image-folder hierarchies)."""

    topic_names: list
    item_topic: np.ndarray
    item_domain: np.ndarray
    image_features: np.ndarray
    meta: dict
    image_loader: Callable[[Sequence[int]], np.ndarray]
    captions: Optional[list] = None
    _members: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self.item_topic = np.asarray(self.item_topic, dtype=np.int64)
        self.item_domain = np.asarray(self.item_domain, dtype=np.int64)
        n = len(self.item_topic)
        if len(self.item_domain) != n or len(self.image_features) != n:
            raise ValueError(
                f"Hierarchy: item_topic [{n}], item_domain [{len(self.item_domain)}] and "
                f"image_features [{len(self.image_features)}] must have the same length"
            )
        if len(set(self.topic_names)) != len(self.topic_names):
            raise ValueError("Hierarchy: topic_names must be unique (merge clusters that share a word)")
        if n and self.item_topic.max(initial=-1) >= len(self.topic_names):
            raise ValueError("Hierarchy: item_topic refers to a topic id beyond topic_names")

    @property
    def num_topics(self) -> int:
        return len(self.topic_names)

    def images(self, indices: Sequence[int]) -> np.ndarray:
        """uint8 ``[n, H, W, 3]`` images of ``indices`` at the CLIP input size."""
        return self.image_loader(np.asarray(indices, dtype=np.int64))

    def _index_members(self) -> None:
        order = np.lexsort((np.arange(len(self.item_topic)), self.item_domain, self.item_topic))
        order = order[self.item_topic[order] >= 0]
        topics, domains = self.item_topic[order], self.item_domain[order]
        for t in range(self.num_topics):
            sel = order[topics == t]
            doms = domains[topics == t]
            self._members[t] = {int(u): sel[doms == u] for u in np.unique(doms)}

    def domain_members(self, topic: int) -> dict:
        """``{domain id: int64 item indices}`` of ``topic`` (sorted, cached)."""
        if not self._members:
            self._index_members()
        return self._members.get(int(topic), {})

    def topic_members(self, topic: int) -> np.ndarray:
        parts = list(self.domain_members(topic).values())
        return np.sort(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)

    def topic_sizes(self) -> np.ndarray:
        return np.bincount(self.item_topic[self.item_topic >= 0], minlength=self.num_topics)


def load_hierarchy(out_dir) -> Hierarchy:
    """Open a finished ``python -m meta cluster`` output directory (arrays memory-mapped).

    A file that is garbled, cut or of the wrong shape raises :class:`meta.chc.outputs.OutputError`
    (a ``ValueError``) naming it and what it should hold.
    """
    out = Path(out_dir)
    head_path = out / "hierarchy.json"
    if not head_path.is_file():
        raise FileNotFoundError(f"{head_path}: not found; run `python -m meta cluster` to completion first")
    expected = "a JSON object with 'topic_names' (a list of text) and 'meta' (an object with 'image_size')"
    head = read_json_output(head_path, expected)
    names = head.get("topic_names") if isinstance(head, dict) else None
    meta = head.get("meta") if isinstance(head, dict) else None
    if not (
        isinstance(names, list)
        and all(isinstance(t, str) for t in names)
        and isinstance(meta, dict)
        and isinstance(meta.get("image_size"), int)
    ):
        raise OutputError(
            f"{head_path}: does not hold {expected}; rerun `python -m meta cluster` with the same "
            f"config to write it again"
        )
    item_topic = load_npy_output(out / "item_topic.npy", "int64 [N] topic id per pair", "domains", np.int64, 1)
    n = len(item_topic)
    item_domain = load_npy_output(out / "item_domain.npy", f"int64 [{n}] domain id per pair", "domains", np.int64, 1, n)
    feats = load_image_features(out, n)
    cache = out / "image_features" / "images_u8.npy"
    index = load_index(out / "index")
    if len(index) != n:
        raise OutputError(
            f"{out / 'index'}: holds {len(index)} pairs, item_topic.npy {n}; expected the same "
            f"number (a partly copied CHC.OUTPUT_DIR?)"
        )
    if cache.is_file():
        size = int(meta["image_size"])
        pixels = load_npy_output(
            cache, f"uint8 [{n}, {size}, {size}, 3] decoded images", "image_features", np.uint8, 4, n, mmap=True
        )
        loader = lambda idx: np.asarray(pixels[np.asarray(idx, dtype=np.int64)])  # noqa: E731
    else:
        settings = meta.get("settings")
        chc = settings.get("CHC") if isinstance(settings, dict) else None
        try:
            caps = image_caps(chc.get("INPUT") if isinstance(chc, dict) else {})
        except (TypeError, ValueError, OverflowError):
            raise OutputError(
                f"{head_path}: meta.settings.CHC.INPUT holds image caps that are not numbers; rerun "
                f"`python -m meta cluster` with the same config to write it again"
            ) from None
        loader = PairIndexImages(index, meta["image_size"], caps)
    return Hierarchy(list(names), item_topic, item_domain, feats, meta, loader, captions=index.captions)
