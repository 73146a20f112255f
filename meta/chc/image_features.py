"""CLIP image features of every pair, sharded across processes, cached and resumable.

This is the dominant cost at scale (issue #3: ViT-B/32 ran ~11 images per CPU-second,
~40 h for 3.1 M images on one CPU), so it runs per *rank*: rank ``r`` of ``W`` encodes
the items :func:`meta.chc.sources.rank_items` gives it (whole tar shards when there are
at least ``W`` shards) into its own files, and :func:`merge_ranks` assembles them.

Per-rank files in ``<stage_dir>``:
  ``feats.rank{r}.npy``   float32 ``[n_r, D + 1]`` - L2-normalised features, last column 1 = image decoded
  ``images.rank{r}.npy``  uint8 ``[n_r, H, W, 3]`` - optional decoded-image cache
Merged files: ``image_features.npy`` float32 ``[N, D]`` (zeros for unreadable images),
``image_ok.npy`` bool ``[N]``, ``images_u8.npy`` uint8 ``[N, H, W, 3]`` (optional).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import numpy as np

from meta import precision

from meta.chc.imaging import decode_batch, encode_images
from meta.chc.sources import PairIndex, rank_items
from meta.chc.stages import ChunkedArray, save_npy_atomic

MERGE_BLOCK = 65536  # rows copied at a time when merging rank files


def rank_paths(stage_dir: Path, rank: int) -> tuple[Path, Path]:
    stage_dir = Path(stage_dir)
    return stage_dir / f"feats.rank{rank}.npy", stage_dir / f"images.rank{rank}.npy"


def encode_rank(index: PairIndex, clip, rank: int, world_size: int, stage_dir: Path, fp: str,
                image_size: int, mean, std, batch_size: int = 64, chunk_size: int = 2048,
                cache_images: bool = False, device="cpu", show_progress: bool = True,
                decode_workers: int = 0, autocast: str = "none") -> dict:
    """Encode this rank's items; resumes from the last finished chunk.

    ``autocast``: a mode resolved by :func:`meta.precision.resolve_autocast` (``none`` = the CLIP's dtype).

    Returns ``{"items": n_r, "unreadable": count}`` for the rank.
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
            pixel_cache = np.load(images_path, mmap_mode="r+")
            fresh = pixel_cache.shape != shape
        if fresh:
            Path(stage_dir).mkdir(parents=True, exist_ok=True)
            pixel_cache = np.lib.format.open_memmap(images_path, mode="w+", dtype=np.uint8, shape=shape)

    def compute(start: int, end: int) -> np.ndarray:
        blobs = index.read_image_bytes(items[start:end])
        pixels, ok = decode_batch(blobs, image_size, decode_workers)
        rows = np.zeros((end - start, dim + 1), dtype=np.float32)
        if ok.any():
            with precision.autocast(autocast, device):
                rows[ok, :dim] = encode_images(clip, pixels[ok], mean, std, batch_size=batch_size, device=device)
        rows[:, dim] = ok
        if pixel_cache is not None:
            pixel_cache[start:end] = pixels
            pixel_cache.flush()
        return rows

    done = store.fill(compute, chunk_size, desc=f"image features (rank {rank}/{world_size})",
                      disable_progress=not show_progress)
    return {"items": int(len(items)), "unreadable": int((done[:, dim] == 0).sum())}


def merge_ranks(index: PairIndex, world_size: int, stage_dir: Path, cache_images: bool,
                remove_rank_files: bool = False) -> dict:
    """Assemble the per-rank files into ``image_features.npy``, ``image_ok.npy`` (+ ``images_u8.npy``)."""
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
            feats = np.lib.format.open_memmap(stage_dir / "image_features.tmp.npy", mode="w+",
                                              dtype=np.float32, shape=(n, dim))
            ok = np.zeros(n, dtype=bool)
        img_part = np.load(images_path, mmap_mode="r") if cache_images else None
        if img_part is not None and pixels is None:
            pixels = np.lib.format.open_memmap(stage_dir / "images_u8.tmp.npy", mode="w+", dtype=np.uint8,
                                               shape=(n, *img_part.shape[1:]))
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
    if remove_rank_files:
        remove_rank_files_of(stage_dir, world_size)
    return {"pairs": n, "unreadable_images": int((~ok).sum())}


def remove_rank_files_of(stage_dir: Path, world_size: int) -> None:
    """Delete the per-rank arrays once the merged files are marked done."""
    for rank in range(world_size):
        for p in rank_paths(stage_dir, rank):
            for q in (p, p.with_name(p.name + ".progress.json")):
                q.unlink(missing_ok=True)
