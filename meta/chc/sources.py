"""Readers for image-text pairs: webdataset ``.tar`` shards and CSV/TSV/JSONL manifests.

Reading builds a :class:`PairIndex`: one row per pair that has an image member and a
non-empty caption, holding where the image bytes live (shard + byte offset + size,
or a file path) and the caption.  Images are *not* decoded here; the image-feature
stage decodes them and counts the unreadable ones.  Pairs without a caption or
without an image are skipped and counted in :attr:`PairIndex.counts`.

Shard layout (webdataset convention): members ``<key>.<ext>`` where ``key`` is the
member path up to the first dot of its file name; images are ``jpg|jpeg|png|webp``,
captions ``txt``, optional metadata ``json`` (kept verbatim, never used for clustering).
"""
from __future__ import annotations

import csv
import glob
import json
import os
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
KIND_TAR, KIND_FILE = 0, 1


@dataclass
class PairIndex:
    """Where each of the N pairs lives.

    Attributes:
        sources: [S] shard paths (tar) or manifest paths, as strings.
        source_kind: [S] int8, 0 = tar shard, 1 = manifest (image files on disk).
        item_source: [N] int32 index into ``sources``.
        item_offset: [N] int64 byte offset of the image data inside its tar (-1 for files).
        item_size: [N] int64 image byte count inside its tar (-1 for files).
        item_key: [N] pair keys (tar member stem, or manifest row number as text).
        item_path: [N] image file paths for manifest pairs ("" for tar pairs).
        captions: [N] stripped caption strings.
        meta_json: [N] raw ``<key>.json`` text ("" if absent).
        counts: pairs seen / skipped, by reason.
    """

    sources: list
    source_kind: np.ndarray
    item_source: np.ndarray
    item_offset: np.ndarray
    item_size: np.ndarray
    item_key: list
    item_path: list
    captions: list
    meta_json: list
    counts: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.captions)

    # ---------------------------------------------------------------- persistence
    def save(self, directory: Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / "items.jsonl.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            for key, path, cap, mj in zip(self.item_key, self.item_path, self.captions, self.meta_json):
                fh.write(json.dumps([key, path, cap, mj], ensure_ascii=False) + "\n")
        os.replace(tmp, directory / "items.jsonl")
        tmp = directory / "items.tmp.npz"
        np.savez(tmp, source_kind=self.source_kind, item_source=self.item_source,
                 item_offset=self.item_offset, item_size=self.item_size)
        os.replace(tmp, directory / "items.npz")
        tmp = directory / "sources.json.tmp"
        tmp.write_text(json.dumps({"sources": self.sources, "counts": self.counts}, indent=1))
        os.replace(tmp, directory / "sources.json")

    @classmethod
    def load(cls, directory: Path) -> "PairIndex":
        directory = Path(directory)
        head = json.loads((directory / "sources.json").read_text())
        arrays = np.load(directory / "items.npz")
        keys, paths, caps, metas = [], [], [], []
        with open(directory / "items.jsonl", encoding="utf-8") as fh:
            for line in fh:
                k, p, c, m = json.loads(line)
                keys.append(k), paths.append(p), caps.append(c), metas.append(m)
        return cls(sources=head["sources"], source_kind=arrays["source_kind"], item_source=arrays["item_source"],
                   item_offset=arrays["item_offset"], item_size=arrays["item_size"], item_key=keys,
                   item_path=paths, captions=caps, meta_json=metas, counts=head["counts"])

    # ---------------------------------------------------------------- reading bytes
    def read_image_bytes(self, indices: Iterable[int]) -> list:
        """Raw image bytes of ``indices`` in order; ``None`` where the file cannot be read."""
        out = []
        handles: dict = {}
        try:
            for i in indices:
                i = int(i)
                src = int(self.item_source[i])
                try:
                    if self.source_kind[src] == KIND_TAR:
                        fh = handles.get(src)
                        if fh is None:
                            fh = handles[src] = open(self.sources[src], "rb")
                        fh.seek(int(self.item_offset[i]))
                        data = fh.read(int(self.item_size[i]))
                        out.append(data if len(data) == int(self.item_size[i]) else None)
                    else:
                        with open(self.item_path[i], "rb") as fh:
                            out.append(fh.read())
                except OSError:
                    out.append(None)
        finally:
            for fh in handles.values():
                fh.close()
        return out


# ------------------------------------------------------------------------ tar shards
def expand_shards(patterns: Sequence[str]) -> list:
    """Expand glob patterns / brace-free paths into a sorted, de-duplicated list of tar files."""
    found = []
    for pat in patterns:
        matches = sorted(glob.glob(os.path.expanduser(pat)))
        if not matches:
            raise FileNotFoundError(f"CHC.INPUT.SHARDS: no file matches {pat!r}")
        found.extend(m for m in matches if m not in found)
    return found


def _split_member(name: str):
    """``'dir/000123.jpg'`` -> ``('dir/000123', 'jpg')`` (webdataset: stem up to the first dot)."""
    head, base = os.path.split(name)
    if "." not in base:
        return None, None
    stem, ext = base.split(".", 1)
    return (os.path.join(head, stem) if head else stem), ext.lower()


def scan_tar(path: str, counts: dict) -> list:
    """Records ``(key, offset, size, caption, meta_json)`` of one shard, in member order.

    A truncated or corrupt shard keeps the pairs read before the damage and counts
    ``corrupt_shards``; a pair missing its image or caption is counted and dropped.
    """
    groups: dict = {}
    order: list = []
    try:
        with tarfile.open(path, mode="r:") as tar:
            while True:
                try:
                    member = tar.next()
                except (tarfile.TarError, OSError, EOFError):
                    counts["corrupt_shards"] = counts.get("corrupt_shards", 0) + 1
                    break
                if member is None:
                    break
                if not member.isfile():
                    continue
                key, ext = _split_member(member.name)
                if key is None:
                    continue
                if key not in groups:
                    groups[key] = {}
                    order.append(key)
                g = groups[key]
                if ext in IMAGE_EXTS and "image" not in g:
                    g["image"] = (member.offset_data, member.size)
                elif ext in ("txt", "json"):
                    fh = tar.extractfile(member)
                    g[ext] = fh.read().decode("utf-8", errors="replace") if fh is not None else ""
    except (tarfile.TarError, OSError) as err:
        raise OSError(f"CHC.INPUT.SHARDS: cannot open {path} as a tar file ({err})") from None
    records = []
    for key in order:
        g = groups[key]
        counts["pairs_seen"] = counts.get("pairs_seen", 0) + 1
        caption = " ".join(g.get("txt", "").split())
        if "image" not in g:
            counts["skipped_no_image"] = counts.get("skipped_no_image", 0) + 1
            continue
        if not caption:
            counts["skipped_empty_caption"] = counts.get("skipped_empty_caption", 0) + 1
            continue
        records.append((key, g["image"][0], g["image"][1], caption, g.get("json", "")))
    return records


# ------------------------------------------------------------------------ manifests
def _manifest_rows(path: str):
    ext = Path(path).suffix.lower()
    if ext in (".jsonl", ".json", ".ndjson"):
        with open(path, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if line.strip():
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError as err:
                        raise ValueError(f"{path}:{lineno}: not a JSON object per line ({err.msg})") from None
        return
    if ext not in (".csv", ".tsv", ".txt"):
        raise ValueError(f"CHC.INPUT.MANIFEST: {path}: expected a .csv, .tsv or .jsonl file")
    delimiter = "\t" if ext in (".tsv", ".txt") else ","
    with open(path, encoding="utf-8", newline="") as fh:
        yield from csv.DictReader(fh, delimiter=delimiter)


def scan_manifest(path: str, image_column: str, caption_column: str, image_root: str, counts: dict) -> list:
    """Records ``(key, path, caption)`` of a manifest; a missing column is a one-line error."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"CHC.INPUT.MANIFEST: no such file: {path}")
    root = image_root or os.path.dirname(os.path.abspath(path))
    records = []
    for row_no, row in enumerate(_manifest_rows(path)):
        if row_no == 0:
            for col, key in ((image_column, "IMAGE_COLUMN"), (caption_column, "CAPTION_COLUMN")):
                if col not in row:
                    raise KeyError(f"CHC.INPUT.{key}: column {col!r} not in {path} "
                                   f"(columns: {', '.join(map(str, row.keys()))})")
        counts["pairs_seen"] = counts.get("pairs_seen", 0) + 1
        caption = " ".join(str(row.get(caption_column) or "").split())
        image = str(row.get(image_column) or "").strip()
        if not image:
            counts["skipped_no_image"] = counts.get("skipped_no_image", 0) + 1
            continue
        if not caption:
            counts["skipped_empty_caption"] = counts.get("skipped_empty_caption", 0) + 1
            continue
        records.append((str(row_no), image if os.path.isabs(image) else os.path.join(root, image), caption))
    return records


# ------------------------------------------------------------------------ build
def build_index(shards: Sequence[str] = (), manifest: str = "", image_column: str = "image",
                caption_column: str = "caption", image_root: str = "", max_pairs: int = 0,
                show_progress: bool = True) -> PairIndex:
    """Scan the inputs into a :class:`PairIndex` (no image decoding)."""
    from tqdm import tqdm

    if not shards and not manifest:
        raise ValueError("CHC.INPUT: set SHARDS (webdataset .tar files) or MANIFEST (csv/tsv/jsonl)")
    counts: dict = {"pairs_seen": 0, "skipped_no_image": 0, "skipped_empty_caption": 0, "corrupt_shards": 0}
    sources, kinds = [], []
    src_ids, offsets, sizes, keys, paths, caps, metas = [], [], [], [], [], [], []
    for path in tqdm(expand_shards(shards) if shards else [], desc="index shards", unit="shard",
                     disable=not show_progress, dynamic_ncols=True):
        sid = len(sources)
        sources.append(os.path.abspath(path)), kinds.append(KIND_TAR)
        for key, off, size, cap, mj in scan_tar(path, counts):
            src_ids.append(sid), offsets.append(off), sizes.append(size)
            keys.append(key), paths.append(""), caps.append(cap), metas.append(mj)
    if manifest:
        sid = len(sources)
        sources.append(os.path.abspath(manifest)), kinds.append(KIND_FILE)
        for key, path, cap in scan_manifest(manifest, image_column, caption_column, image_root, counts):
            src_ids.append(sid), offsets.append(-1), sizes.append(-1)
            keys.append(key), paths.append(path), caps.append(cap), metas.append("")
    if max_pairs and len(caps) > max_pairs:
        counts["dropped_by_max_pairs"] = len(caps) - max_pairs
        del src_ids[max_pairs:], offsets[max_pairs:], sizes[max_pairs:]
        del keys[max_pairs:], paths[max_pairs:], caps[max_pairs:], metas[max_pairs:]
    counts["pairs_indexed"] = len(caps)
    return PairIndex(sources=sources, source_kind=np.asarray(kinds, dtype=np.int8),
                     item_source=np.asarray(src_ids, dtype=np.int32), item_offset=np.asarray(offsets, dtype=np.int64),
                     item_size=np.asarray(sizes, dtype=np.int64), item_key=keys, item_path=paths,
                     captions=caps, meta_json=metas, counts=counts)


def rank_items(index: PairIndex, rank: int, world_size: int) -> np.ndarray:
    """Item indices that process ``rank`` of ``world_size`` encodes (disjoint, covering).

    With at least as many sources as processes each rank takes whole sources
    (shard ``s`` goes to rank ``s % world_size``), so a rank reads only its own tar
    files; otherwise the items are cut into ``world_size`` contiguous blocks.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside [0, {world_size})")
    n = len(index)
    if world_size == 1:
        return np.arange(n, dtype=np.int64)
    if len(index.sources) >= world_size:
        return np.flatnonzero(index.item_source % world_size == rank).astype(np.int64)
    bounds = np.linspace(0, n, world_size + 1).round().astype(np.int64)
    return np.arange(bounds[rank], bounds[rank + 1], dtype=np.int64)

