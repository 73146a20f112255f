"""Small CHC inputs for tests: tar shards of image-caption pairs, damage to them, odd image bytes."""

from __future__ import annotations

import io
import struct
import tarfile
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
from PIL import Image

from gram_tools.synthetic import add_member  # noqa: F401 - the tests' tar-member writer
from meta.chc.hierarchy import Hierarchy


def png_bytes(color=(200, 30, 30), size=(20, 12)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def dds_bytes(pixel_format_flags: int = 6144) -> bytes:
    """150 bytes of a DDS header that makes Pillow raise ``NotImplementedError`` (unknown pixel format)."""
    head = bytearray(128)
    head[0:4] = b"DDS "
    struct.pack_into("<7I", head, 4, 124, 0x1007, 4, 4, 0, 0, 0)  # size, flags, height, width, ...
    struct.pack_into("<2I", head, 76, 32, pixel_format_flags)  # DDS_PIXELFORMAT size, flags
    return bytes(head) + bytes(22)


def write_shard(
    path,
    captions: Sequence[str],
    images: Optional[Sequence[bytes]] = None,
    ext: str = "png",
    caption_bytes: Optional[dict] = None,
) -> Path:
    """``<i:04d>.<ext>`` + ``<i:04d>.txt`` per caption (image first); ``caption_bytes`` {i: raw bytes} overrides."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for i, cap in enumerate(captions):
            img = images[i] if images is not None else png_bytes((10 * (i % 25), 100, 50))
            add_member(tar, f"{i:04d}.{ext}", img)
            add_member(tar, f"{i:04d}.txt", (caption_bytes or {}).get(i, cap.encode()))
    return path


def member_offsets(path) -> list:
    """``(name, header offset, data offset, size)`` of every member, in order."""
    with tarfile.open(path) as tar:
        return [(m.name, m.offset, m.offset_data, m.size) for m in tar.getmembers()]


def truncate_at(src, dst, offset: int) -> Path:
    """Copy of ``src`` cut to its first ``offset`` bytes."""
    Path(dst).write_bytes(Path(src).read_bytes()[:offset])
    return Path(dst)


def overwrite_at(src, dst, offset: int, data: bytes) -> Path:
    """Copy of ``src`` with ``data`` written over the bytes at ``offset``."""
    raw = bytearray(Path(src).read_bytes())
    raw[offset : offset + len(data)] = data
    Path(dst).write_bytes(bytes(raw))
    return Path(dst)


def toy_hierarchy(n_topics=8, layouts=((12, 7, 4), (12, 7), (6,)), excluded=10, seed=0):
    """Topic t has domains of sizes layouts[t % 3], plus excluded (-1) items."""
    rng = np.random.default_rng(seed)
    topic, domain = [], []
    for t in range(n_topics):
        for u, size in enumerate(layouts[t % len(layouts)]):
            topic += [t] * size
            domain += [u] * size
    topic += [-1] * excluded
    domain += [-1] * excluded
    order = rng.permutation(len(topic))
    topic, domain = np.array(topic)[order], np.array(domain)[order]
    feats = rng.normal(size=(len(topic), 8)).astype(np.float32)
    return Hierarchy(
        topic_names=[f"class{t}" for t in range(n_topics)],
        item_topic=topic,
        item_domain=domain,
        image_features=feats,
        meta={},
        image_loader=lambda idx: np.zeros((len(idx), 4, 4, 3), np.uint8),
    )
