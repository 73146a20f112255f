"""A tiny generated image-text corpus with known topics and image styles.

Used by the tests and for smoke runs of ``python -m meta cluster`` without real data.
Captions mix a topic word with topic-specific attributes and scenes, generic words
shared by all topics, caption boiler-plate ("stock image of ...") and, with
probability ``mention_rate``, a second topic's word - the cross-topic leakage that
makes the paper's literal ``L_w`` definition pick poor topic words.  Each image is
drawn in one of a few styles (line sketch on white, bright blob at night, noisy
texture), the ground truth for visual domain clustering.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
from PIL import Image, ImageDraw

TOPICS = {
    "dog": (
        ["playful", "sleepy", "fluffy", "puppy"],
        [
            "running on the beach",
            "playing fetch in the park",
            "sleeping on the sofa",
            "chasing a ball",
            "wagging its tail",
        ],
    ),
    "car": (
        ["vintage", "sports", "electric", "parked"],
        [
            "driving on the highway",
            "parked on the street",
            "racing around the track",
            "in a garage",
            "with shiny wheels",
        ],
    ),
    "pizza": (
        ["pepperoni", "cheesy", "homemade", "sliced"],
        ["fresh from the oven", "served on a wooden board", "with melted mozzarella", "topped with basil", "in a box"],
    ),
    "guitar": (
        ["acoustic", "electric", "wooden", "bass"],
        ["played on stage", "leaning against an amplifier", "with steel strings", "at a concert", "being tuned"],
    ),
    "castle": (
        ["medieval", "ancient", "ruined", "royal"],
        ["on a hill", "with stone towers", "surrounded by a moat", "in the mountains", "with a drawbridge"],
    ),
    "bicycle": (
        ["mountain", "folding", "racing", "rusty"],
        ["locked to a rack", "on a dirt trail", "with a basket", "leaning on a fence", "with flat tyres"],
    ),
    "flower": (
        ["blooming", "purple", "wild", "fragrant"],
        ["in the garden", "with dew drops on its petals", "in a glass vase", "in a spring meadow", "attracting bees"],
    ),
    "airplane": (
        ["jet", "passenger", "cargo", "propeller"],
        [
            "taking off from the runway",
            "flying above the clouds",
            "landing at the airport",
            "at the gate",
            "with its wings",
        ],
    ),
    "cake": (
        ["chocolate", "birthday", "wedding", "layered"],
        ["with candles", "decorated with frosting", "on a plate", "with strawberries", "being cut"],
    ),
    "horse": (
        ["brown", "wild", "racing", "pony"],
        ["galloping across the field", "grazing in the pasture", "jumping a fence", "in the stable", "with a saddle"],
    ),
    "boat": (
        ["sailing", "fishing", "wooden", "motor"],
        ["on the lake", "docked at the harbour", "sailing at sea", "with white sails", "near the pier"],
    ),
    "laptop": (
        ["open", "new", "gaming", "thin"],
        ["on a desk", "with a glowing keyboard", "next to a coffee cup", "showing a spreadsheet", "in an office"],
    ),
}
PREFIXES = ["", "a photo of a ", "stock image of a ", "close up of a ", "the ", "an image of a ", "illustration of a "]
GENERIC = ["beautiful", "old", "small", "big", "white", "red", "lovely", "nice"]
CONTEXTS = ["", " at sunset", " in winter", " during the day", " in the city", " on a sunny day", " at night"]
STYLES = ("sketch", "night", "texture")


def make_caption(topic: str, rng: np.random.Generator, topics: Sequence[str], mention_rate: float) -> str:
    adjectives, scenes = TOPICS[topic]
    words = [
        rng.choice(PREFIXES) + str(rng.choice(GENERIC)) + " " + str(rng.choice(adjectives)) + " " + topic,
        str(rng.choice(scenes)) + str(rng.choice(CONTEXTS)),
    ]
    if rng.random() < mention_rate:
        other = str(rng.choice([t for t in topics if t != topic]))
        words.append(f"next to a {other}")
    return " ".join(w.strip() for w in words if w.strip())


def make_image(topic_id: int, style: int, rng: np.random.Generator, size=(48, 40)) -> Image.Image:
    """A small RGB picture whose *style* (not the topic) dominates its pixel statistics."""
    w, h = size
    if style == 0:  # sketch: dark strokes on white
        img = Image.new("RGB", size, (245, 245, 240))
        draw = ImageDraw.Draw(img)
        for _ in range(4):
            pts = [tuple(int(v) for v in rng.integers(0, [w, h])) for _ in range(2)]
            draw.line(pts, fill=(20, 20, 20), width=2)
    elif style == 1:  # night: deep blue, one bright blob
        img = Image.new("RGB", size, (10, 12, 50))
        draw = ImageDraw.Draw(img)
        cx, cy, r = int(rng.integers(12, w - 12)), int(rng.integers(12, h - 12)), int(rng.integers(5, 10))
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=(255, 220, 60))
    else:  # texture: saturated colour noise
        arr = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
        arr[..., 1] //= 3
        img = Image.fromarray(arr, "RGB")
    # a faint topic mark so topics are not pixel-identical across styles
    ImageDraw.Draw(img).rectangle([0, 0, 3 + topic_id % 6, 2], fill=(128, 64 + 10 * (topic_id % 12), 128))
    return img


def _encode(img: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


def add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    """Append a regular-file member ``name`` holding ``data`` to ``tar``."""
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_synthetic_shards(
    out_dir,
    n_pairs: int = 1200,
    topics: Optional[Sequence[str]] = None,
    n_styles: int = 3,
    n_shards: int = 4,
    corrupt_fraction: float = 0.02,
    empty_caption_fraction: float = 0.02,
    missing_image_fraction: float = 0.0,
    mention_rate: float = 0.1,
    seed: int = 0,
    size: tuple[int, int] = (48, 40),
    first_shard: int = 0,
    first_key: int = 0,
) -> dict:
    """Write ``shard-{i:05d}.tar`` files; returns the ground truth.

    ``size``: (width, height) of the images in pixels.  ``first_shard`` / ``first_key``: number of the first
    shard file and of the first key written, so several processes can each write a slice of one corpus
    into the same folder (with different seeds).

    Returns:
        dict with ``shards`` (paths), and per written pair (in shard order) ``key``,
        ``topic`` (name), ``style`` (int), ``corrupt`` (bool), ``empty_caption`` (bool),
        ``missing_image`` (bool), ``caption``.
    """
    rng = np.random.default_rng(seed)
    topics = list(topics or TOPICS)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    truth = {k: [] for k in ("key", "topic", "style", "corrupt", "empty_caption", "missing_image", "caption")}
    per_shard = int(np.ceil(n_pairs / n_shards))
    shards = []
    for j in range(n_shards):
        path = out_dir / f"shard-{first_shard + j:05d}.tar"
        shards.append(str(path))
        with tarfile.open(path, "w") as tar:
            for i in range(first_key + j * per_shard, first_key + min(n_pairs, (j + 1) * per_shard)):
                key = f"{i:08d}"
                t = int(rng.integers(len(topics)))
                style = int(rng.integers(n_styles))
                caption = make_caption(topics[t], rng, topics, mention_rate)
                corrupt = bool(rng.random() < corrupt_fraction)
                empty = bool(rng.random() < empty_caption_fraction)
                missing = bool(rng.random() < missing_image_fraction)
                if not missing:
                    fmt = "JPEG" if i % 2 else "PNG"
                    data = _encode(make_image(t, style, rng, size), fmt)
                    if corrupt:  # truncated file with garbage: PIL cannot decode it
                        data = data[: len(data) // 3] + bytes(rng.integers(0, 256, 64, dtype=np.uint8))
                    add_member(tar, f"{key}.{'jpg' if fmt == 'JPEG' else 'png'}", data)
                add_member(tar, f"{key}.txt", (" " if empty else caption).encode())
                add_member(tar, f"{key}.json", json.dumps({"category": topics[t], "style": STYLES[style % 3]}).encode())
                for name, val in (
                    ("key", key),
                    ("topic", topics[t]),
                    ("style", style),
                    ("corrupt", corrupt),
                    ("empty_caption", empty),
                    ("missing_image", missing),
                    ("caption", caption),
                ):
                    truth[name].append(val)
    truth["shards"] = shards
    return truth


def write_synthetic_image_folder(
    root, classes: Sequence[str], per_class: int = 24, n_styles: int = 3, seed: int = 0
) -> dict:
    """``root/<class>/<i>.png`` images; returns ``{path: style}`` ground truth."""
    rng = np.random.default_rng(seed)
    root = Path(root)
    styles = {}
    for c, name in enumerate(classes):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            style = int(rng.integers(n_styles))
            path = root / name / f"{i:04d}.png"
            make_image(c, style, rng).save(path)
            styles[str(path)] = style
    return styles


def write_synthetic_dtd(
    root, n_classes: int, counts: dict[str, int], size: tuple[int, int] = (224, 224), n_styles: int = 3, seed: int = 0
) -> dict:
    """A few-shot dataset in CoOp's DTD layout: ``root/dtd/images/<class>/*.jpg`` and
    ``root/dtd/split_zhou_DescribableTextures.json`` (``{"train"|"val"|"test": [[rel path, label, class]]}``).

    The classes are the first ``n_classes`` generated topics (at most 12), ``counts[split]`` JPEG images of
    ``size`` pixels per class and split, each in a random style.  Returns the split dict as written.
    """
    names = list(TOPICS)[:n_classes]
    if len(names) < n_classes:
        raise ValueError(f"at most {len(TOPICS)} classes, got {n_classes}")
    rng = np.random.default_rng(seed)
    image_dir = Path(root) / "dtd" / "images"
    split: dict[str, list] = {}
    for part, count in counts.items():
        rows = []
        for label, name in enumerate(names):
            (image_dir / name).mkdir(parents=True, exist_ok=True)
            for i in range(count):
                rel = f"{name}/{part}_{i:04d}.jpg"
                make_image(label, int(rng.integers(n_styles)), rng, size).save(image_dir / rel, quality=90)
                rows.append([rel, label, name])
        split[part] = rows
    with open(Path(root) / "dtd" / "split_zhou_DescribableTextures.json", "w") as f:
        json.dump(split, f)
    return split
