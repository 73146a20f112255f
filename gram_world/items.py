"""What one world image shows: category, style and attributes, sampled from a seed.

An :class:`ItemSpec` is the full ground truth of an image-caption pair; the
renderer draws it and the caption writer describes it (or, for a mismatched
pair, describes another spec).  Every item has its own numpy generator seeded
by ``(world seed, corpus id, item index)``, so an item does not depend on how
many items precede it and corpora drawn from different ids never share a stream.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np

from .shapes import CATEGORIES

# Named colours (RGB, 0-255) used for objects and in captions.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (215, 40, 40),
    "green": (40, 165, 60),
    "blue": (45, 85, 220),
    "yellow": (235, 205, 35),
    "orange": (240, 135, 30),
    "purple": (135, 55, 185),
    "pink": (240, 120, 185),
    "cyan": (40, 190, 200),
}

# Visual styles = domains.  Descriptions are documentation only.
STYLES: dict[str, str] = {
    "shaded": "smooth-shaded 3-D look on a soft gradient background, with a drop shadow",
    "sketch": "thin dark outline only, on off-white paper with stray pencil strokes",
    "noisy": "low-contrast object on grey, blurred, strong per-pixel noise",
    "cartoon": "flat saturated fill with a thick black outline on a flat pastel background",
    "textured": "flat fill with a thin outline on a striped / checked / dotted background",
}

# Object radius in pixels of a 32-px image, per size word (scaled for other sides).
SIZE_RADIUS = {"small": 7.0, "medium": 10.0, "large": 13.5}
POSITIONS = ("center", "top left", "top right", "bottom left", "bottom right")
_POSITION_OFFSET = {
    "center": (0, 0),
    "top left": (-1, -1),
    "top right": (1, -1),
    "bottom left": (-1, 1),
    "bottom right": (1, 1),
}
COUNT_PROBS = (0.85, 0.1, 0.05)  # one, two, three objects
SIZE_PROBS = (0.15, 0.35, 0.5)  # small, medium, large (single objects)


@dataclass(frozen=True)
class ItemSpec:
    """Ground truth of one image: what is drawn and how."""

    category: str
    family: str
    style: str
    colour: str
    size: str  # small | medium | large (always "small" when count > 1)
    count: int  # 1..3 copies of the object
    position: str  # one of POSITIONS, or "scattered" when count > 1

    def as_dict(self) -> dict:
        return asdict(self)


def item_rng(seed: int, corpus_id: int, index: int) -> np.random.Generator:
    """The generator that owns every random choice of one item."""
    return np.random.default_rng(np.random.SeedSequence([int(seed), int(corpus_id), int(index)]))


def sample_spec(
    rng: np.random.Generator, categories: Sequence[str], styles: Sequence[str], category: str | None = None
) -> ItemSpec:
    """Draw category (unless given), style and attributes uniformly / by the fixed priors above."""
    if category is None:
        category = categories[int(rng.integers(len(categories)))]
    style = styles[int(rng.integers(len(styles)))]
    colour = list(COLOURS)[int(rng.integers(len(COLOURS)))]
    count = int(rng.choice(3, p=COUNT_PROBS)) + 1
    if count == 1:
        size = ("small", "medium", "large")[int(rng.choice(3, p=SIZE_PROBS))]
        position = "center" if size == "large" else POSITIONS[int(rng.integers(len(POSITIONS)))]
    else:
        size, position = "small", "scattered"
    return ItemSpec(category, CATEGORIES[category].family, style, colour, size, count, position)


def object_layout(spec: ItemSpec, rng: np.random.Generator, side: int) -> list[tuple[float, float, float]]:
    """Centres and radii ``(cx, cy, r)`` in pixels of a ``side``-px image, one per object copy."""
    k = side / 32.0
    if spec.count == 1:
        r = SIZE_RADIUS[spec.size]
        off = 7.5 if spec.size == "small" else 5.0
        dx, dy = _POSITION_OFFSET[spec.position]
        cx, cy = 16.0 + dx * off, 16.0 + dy * off
        cx, cy = cx + rng.uniform(-1.5, 1.5), cy + rng.uniform(-1.5, 1.5)
        return [(cx * k, cy * k, r * k)]
    if spec.count == 2:
        r = 6.5
        layout = int(rng.integers(3))
        pts = {0: [(9, 16), (23, 16)], 1: [(16, 9), (16, 23)], 2: [(10, 10), (22, 22)]}[layout]
    else:
        r = 5.8
        pts = [(9.5, 10), (22.5, 10), (16, 22.5)]
        if rng.random() < 0.5:
            pts = [(x, 32 - y) for x, y in pts]
    return [((x + rng.uniform(-1.0, 1.0)) * k, (y + rng.uniform(-1.0, 1.0)) * k, r * k) for x, y in pts]
