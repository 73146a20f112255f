"""Web-like captions for world images: varied wording, optional attributes, distractor words.

A caption names the category of the spec it describes (singular or plural),
usually some attributes (count, size, colour, position), sometimes the style
("a pencil sketch of ..."), and is often wrapped in alt-text noise
("stock image", "#art", "free download").  For a mismatched pair the caller
passes the spec of a *different* random item.
"""

from __future__ import annotations

import numpy as np

from .items import ItemSpec
from .shapes import CATEGORIES

NUMBER_WORDS = {1: "a", 2: "two", 3: "three"}
# How often an object phrase names the size / colour.  Kept low so that, as in
# web alt-text, the object itself is what most captions agree on; colour words
# in most captions let a from-scratch CLIP reduce its loss without learning shapes.
SIZE_MENTION = 0.35
COLOUR_MENTION = 0.35

STYLE_PHRASES: dict[str, tuple[str, ...]] = {
    "shaded": ("a 3d render of", "a glossy rendering of", "a shaded drawing of", "a soft 3d image of"),
    "sketch": ("a pencil sketch of", "a line drawing of", "a doodle of", "an outline sketch of"),
    "noisy": ("a grainy photo of", "a blurry picture of", "a low quality photo of", "a noisy scan of"),
    "cartoon": ("a cartoon of", "clip art of", "a flat cartoon drawing of", "a sticker of"),
    "textured": ("a patterned picture of", "a pattern with", "a fabric print of", "a decorative print of"),
}

POSITION_PHRASES = {
    "center": ("in the middle", "in the center", "centered"),
    "top left": ("in the top left corner", "at the upper left"),
    "top right": ("in the top right corner", "at the upper right"),
    "bottom left": ("in the bottom left corner", "at the lower left"),
    "bottom right": ("in the bottom right corner", "at the lower right"),
    "scattered": ("side by side", "next to each other", "scattered around"),
}

PLAIN_TEMPLATES = (
    "a photo of {obj}.",
    "{obj}.",
    "{obj} {pos}.",
    "here is {obj}",
    "look at {obj} i found",
    "i drew {obj} today",
    "an image of {obj}",
    "a picture showing {obj} {pos}",
    "there is {obj} {pos}",
    "{obj} on a background",
    "close-up of {obj}",
)
STYLE_TEMPLATES = (
    "{style} {obj}.",
    "{style} {obj} {pos}.",
    "{obj}, {style_word}",
)
# How often a caption names the style.  Web alt-text often says "sketch of",
# "cartoon", "illustration"; without such words a CLIP's image embedding becomes
# style-invariant and CHC's visual-domain k-means has nothing to find.
STYLE_MENTION = 0.4
STYLE_WORDS = {
    "shaded": "3d render",
    "sketch": "pencil sketch",
    "noisy": "grainy photo",
    "cartoon": "cartoon",
    "textured": "patterned print",
}

PREFIXES = ("", "", "", "stock image:", "new!", "vintage", "free download -", "lol", "wow,", "throwback:")
SUFFIXES = (
    "",
    "",
    "",
    "#art",
    "#design",
    "stock photo",
    "hd wallpaper",
    "via instagram",
    "made with love",
    "illustration",
    "free vector",
    "on sale now",
    "from my collection",
    "for kids",
)


def object_phrase(spec: ItemSpec, rng: np.random.Generator) -> str:
    """``"two small red hearts"``-style noun phrase; size and colour are each dropped at random."""
    cat = CATEGORIES[spec.category]
    words = [NUMBER_WORDS[spec.count]]
    if spec.count == 1 and rng.random() < SIZE_MENTION:
        words.append(spec.size)
    if rng.random() < COLOUR_MENTION:
        words.append(spec.colour)
    words.append(cat.name if spec.count == 1 else cat.plural)
    if words[0] == "a" and words[1][0] in "aeiou":
        words[0] = "an"
    return " ".join(words)


def write_caption(spec: ItemSpec, rng: np.random.Generator) -> str:
    """A caption describing ``spec`` (lower case, one line)."""
    pool = STYLE_TEMPLATES if rng.random() < STYLE_MENTION else PLAIN_TEMPLATES
    template = pool[int(rng.integers(len(pool)))]
    style = STYLE_PHRASES[spec.style]
    pos = POSITION_PHRASES[spec.position]
    text = template.format(
        obj=object_phrase(spec, rng),
        pos=pos[int(rng.integers(len(pos)))],
        style=style[int(rng.integers(len(style)))],
        style_word=STYLE_WORDS[spec.style],
    )
    prefix = PREFIXES[int(rng.integers(len(PREFIXES)))]
    suffix = SUFFIXES[int(rng.integers(len(SUFFIXES)))]
    return " ".join(p for p in (prefix, text, suffix) if p)


def named_category(caption: str) -> list[str]:
    """Every category whose singular or plural form is a word of ``caption`` (for checks)."""
    words = set(caption.replace(".", " ").replace(",", " ").replace(":", " ").split())
    return sorted(n for n, c in CATEGORIES.items() if n in words or c.plural in words)
