"""CLIP image features of every pair, sharded across processes, cached and resumable.

The dominant cost at scale (meta/chc/README.md: ViT-B/32 ~11 images per CPU-second), so rank ``r`` of ``W`` encodes
its :func:`meta.chc.sources.rank_items` into its own files and :func:`merge_ranks` assembles them.

Per-rank files in ``<stage_dir>``:
  ``feats.rank{r}.npy``   float32 ``[n_r, D + 1]`` - L2-normalised features, last column 1 = image decoded
  ``images.rank{r}.npy``  uint8 ``[n_r, H, W, 3]`` - optional decoded-image cache
  ``unreadable.rank{r}.json`` unreadable images per chunk, by reason (exception type)
Merged files: ``image_features.npy`` float32 ``[N, D]`` (zeros for unreadable images),
``image_ok.npy`` bool ``[N]``, ``images_u8.npy`` uint8 ``[N, H, W, 3]`` (optional),
``unreadable.json`` ``{reason: count}``.

An image that fails to read or decode is unreadable (counted by reason), never a stop; except when more than
``max_unreadable_fraction`` of a rank's first chunk is: then the inputs point at the wrong place, and the run stops with
one line naming the path tried and the key that sets it.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from meta.chc.errors import InputError
from meta.chc.imaging import decode_batch, encode_images
from meta.chc.sources import KIND_TAR, PairIndex, rank_items
from meta.chc.stages import ChunkedArray, create_memmap, open_memmap_rw, save_npy_atomic, write_json_atomic
from meta.chc.tensor_decode import decode_batch_tensor
from meta.data.input_limits import MAX_IMAGE_ASPECT, MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS
from meta.model import precision

MERGE_BLOCK = 65536  # rows copied at a time when merging rank files


def rank_paths(stage_dir: Path, rank: int) -> tuple[Path, Path]:
    stage_dir = Path(stage_dir)
    return stage_dir / f"feats.rank{rank}.npy", stage_dir / f"images.rank{rank}.npy"


def reasons_path(stage_dir: Path, rank: int) -> Path:
    return Path(stage_dir) / f"unreadable.rank{rank}.json"


def _load_reasons(path: Path, fp: str) -> dict:
    """``{chunk start: {reason: count}}`` saved by a run with fingerprint ``fp`` (empty otherwise)."""
    try:
        saved = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return saved.get("chunks", {}) if saved.get("fingerprint") == fp else {}


def first_chunk_error(index: PairIndex, items: np.ndarray, reasons: list, image_root: Optional[str]) -> str:
    """One line naming the path tried and the key that sets it, for a first chunk that is mostly unreadable."""
    bad = [k for k, why in enumerate(reasons) if why]
    summary = ", ".join(f"{why} {n}" for why, n in Counter(r for r in reasons if r).most_common())
    first = int(items[bad[0]])
    src = int(index.item_source[first])
    head = f"{len(bad)} of {len(reasons)} images of the first chunk are unreadable ({summary}); tried "
    tail = "; fix the path, or set CHC.INPUT.MAX_UNREADABLE_FRACTION 1.0 to go on"
    if index.source_kind[src] == KIND_TAR:
        return f"CHC.INPUT.SHARDS: {head}{index.image_location(first)}{tail}"
    root = repr(image_root) if image_root else f"'' = the manifest's folder {os.path.dirname(index.sources[src])}"
    return f"CHC.INPUT.IMAGE_ROOT: {head}{index.image_location(first)} (CHC.INPUT.IMAGE_ROOT {root}){tail}"


def encode_rank(
    index: PairIndex,
    clip,
    rank: int,
    world_size: int,
    stage_dir: Path,
    fp: str,
    image_size: int,
    mean,
    std,
    batch_size: int = 64,
    chunk_size: int = 2048,
    cache_images: bool = False,
    device="cpu",
    show_progress: bool = True,
    decode_workers: int = 0,
    autocast: str = "none",
    max_unreadable_fraction: float = 1.0,
    image_root: Optional[str] = None,
    max_bytes: int = MAX_IMAGE_BYTES,
    max_pixels: int = MAX_IMAGE_PIXELS,
    max_aspect: float = MAX_IMAGE_ASPECT,
    decoder: str = "pil",
    read_threads: int = 1,
) -> dict:
    """Encode this rank's items, resuming from the last finished chunk; the next chunk is read and decoded in a
    background thread meanwhile (``chunk_size`` x ``image_size``² x 3 bytes ahead).  The keywords are the
    ``CHC.IMAGES`` / ``CHC.INPUT`` settings of the same names (``autocast`` resolved; ``image_root`` named in the
    :class:`~meta.chc.errors.InputError` of ``max_unreadable_fraction``).

    Returns ``{"items": n_r, "unreadable": count, "unreadable_by_reason": {reason: count}}`` for the rank.
    """
    items = rank_items(index, rank, world_size)
    dim = int(clip.visual.output_dim)
    feats_path, images_path = rank_paths(stage_dir, rank)
    store = ChunkedArray(feats_path, len(items), (dim + 1,), np.float32, fp)
    pixel_cache: Optional[np.memmap] = None
    if cache_images:
        shape = (len(items), image_size, image_size, 3)
        fresh = store.rows_done() == 0 or not images_path.is_file()
        if not fresh:
            pixel_cache = open_memmap_rw(images_path)
            fresh = pixel_cache.shape != shape
        if fresh:
            Path(stage_dir).mkdir(parents=True, exist_ok=True)
            pixel_cache = create_memmap(images_path, np.uint8, shape)
    rpath = reasons_path(stage_dir, rank)
    chunk_reasons = _load_reasons(rpath, fp) if store.rows_done() else {}

    def prepare(start: int, end: int) -> tuple:
        """Read and decode the chunk ``[start, end)``: ``(pixels, ok, reasons)``."""
        read_why: list = []
        blobs = index.read_image_bytes(items[start:end], read_why, max_bytes, read_threads)
        decode_why: list = []
        if decoder == "torchvision":
            pixels, ok = decode_batch_tensor(
                blobs, image_size, device, decode_workers, decode_why, max_pixels, max_aspect
            )
        else:
            pixels, ok = decode_batch(blobs, image_size, decode_workers, decode_why, max_pixels, max_aspect)
        return pixels, ok, [r or d for r, d in zip(read_why, decode_why)]

    # the next chunk is read and decoded in a background thread while this one is encoded (file reads, Pillow's
    # decoding and torch's kernels release the GIL; torchvision's device decode queues on the same stream as the
    # encoder, so its pixels are ready before the encoder reads them): decoding stays off the encoder's path
    ahead_pool = ThreadPoolExecutor(max_workers=1)
    ahead: dict = {}

    def compute(start: int, end: int) -> np.ndarray:
        pending = ahead.pop((start, end), None)
        pixels, ok, reasons = pending.result() if pending else prepare(start, end)
        if start == 0 and end > start and (~ok).sum() > max_unreadable_fraction * (end - start):
            raise InputError(first_chunk_error(index, items[start:end], reasons, image_root))
        if end < len(items):
            nxt = (end, min(end + chunk_size, len(items)))
            ahead[nxt] = ahead_pool.submit(prepare, *nxt)
        chunk_reasons[str(start)] = dict(Counter(r for r in reasons if r))
        Path(stage_dir).mkdir(parents=True, exist_ok=True)
        write_json_atomic(rpath, {"fingerprint": fp, "chunks": chunk_reasons})  # before the rows: resume-safe
        rows = np.zeros((end - start, dim + 1), dtype=np.float32)
        if ok.any():
            picked = pixels[torch.from_numpy(ok).to(pixels.device)] if torch.is_tensor(pixels) else pixels[ok]
            with precision.autocast(autocast, device):
                rows[ok, :dim] = encode_images(clip, picked, mean, std, batch_size=batch_size, device=device)
        rows[:, dim] = ok
        if pixel_cache is not None:
            pixel_cache[start:end] = pixels.cpu().numpy() if torch.is_tensor(pixels) else pixels
            pixel_cache.flush()
        return rows

    try:
        done = store.fill(
            compute, chunk_size, desc=f"image features (rank {rank}/{world_size})", disable_progress=not show_progress
        )
    finally:
        ahead_pool.shutdown(cancel_futures=True)
    return {
        "items": int(len(items)),
        "unreadable": int((done[:, dim] < 0.5).sum()),
        "unreadable_by_reason": rank_reasons(stage_dir, rank, fp),
    }


def rank_reasons(stage_dir: Path, rank: int, fp: str) -> dict:
    """``{reason: count}`` of unreadable images over the rank's chunks."""
    total: Counter = Counter()
    for per_chunk in _load_reasons(reasons_path(stage_dir, rank), fp).values():
        total.update(per_chunk)
    return dict(total.most_common())


def merge_ranks(
    index: PairIndex,
    world_size: int,
    stage_dir: Path,
    cache_images: bool,
    remove_rank_files: bool = False,
    fp: Optional[str] = None,
) -> dict:
    """Assemble the per-rank files into ``image_features.npy``, ``image_ok.npy`` (+ ``images_u8.npy``).

    ``fp`` (the ranks' chunk fingerprint) selects the per-rank reason files merged into
    ``unreadable.json``; without it the unreadable images are counted under one reason.
    """
    stage_dir = Path(stage_dir)
    n = len(index)
    feats = ok = pixels = None
    for rank in range(world_size):
        items = rank_items(index, rank, world_size)
        feats_path, images_path = rank_paths(stage_dir, rank)
        part = np.load(feats_path, mmap_mode="r")
        if part.shape[0] != len(items):
            raise RuntimeError(f"{feats_path}: {part.shape[0]} rows, rank {rank} owns {len(items)} items")
        if feats is None:
            dim = part.shape[1] - 1
            feats = create_memmap(stage_dir / "image_features.tmp.npy", np.float32, (n, dim))
            ok = np.zeros(n, dtype=bool)
        img_part = np.load(images_path, mmap_mode="r") if cache_images else None
        if img_part is not None and pixels is None:
            pixels = create_memmap(stage_dir / "images_u8.tmp.npy", np.uint8, (n, *img_part.shape[1:]))
        for start in range(0, len(items), MERGE_BLOCK):  # bounded memory at any N
            block = slice(start, start + MERGE_BLOCK)
            rows = np.asarray(part[block])
            feats[items[block]] = rows[:, :dim]
            ok[items[block]] = rows[:, dim] > 0.5
            if img_part is not None:
                pixels[items[block]] = img_part[block]
    feats.flush()
    del feats
    os.replace(stage_dir / "image_features.tmp.npy", stage_dir / "image_features.npy")
    save_npy_atomic(stage_dir / "image_ok.npy", ok)
    if pixels is not None:
        pixels.flush()
        del pixels
        os.replace(stage_dir / "images_u8.tmp.npy", stage_dir / "images_u8.npy")
    by_reason: Counter = Counter()
    for rank in range(world_size):
        by_reason.update(rank_reasons(stage_dir, rank, fp) if fp is not None else {})
    missing = int((~ok).sum()) - sum(by_reason.values())
    if missing > 0:  # rank files from before reasons were recorded
        by_reason["unreadable (reason not recorded)"] += missing
    write_json_atomic(stage_dir / "unreadable.json", dict(by_reason.most_common()))
    if remove_rank_files:
        remove_rank_files_of(stage_dir, world_size)
    return {"pairs": n, "unreadable_images": int((~ok).sum())}


def remove_rank_files_of(stage_dir: Path, world_size: int) -> None:
    """Delete the per-rank arrays once the merged files are marked done."""
    for rank in range(world_size):
        for p in rank_paths(stage_dir, rank):
            for q in (p, p.with_name(p.name + ".progress.json")):
                q.unlink(missing_ok=True)
        reasons_path(stage_dir, rank).unlink(missing_ok=True)
