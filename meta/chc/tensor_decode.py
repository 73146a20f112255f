"""Batched JPEG decoding with torchvision on the CHC's device, resized there (``CHC.IMAGES.DECODER torchvision``).

The reference is :func:`meta.chc.imaging.decode_batch` (Pillow, ``CHC.IMAGES.DECODER pil``, the default).  This path
moves the decode and the resize of the common case onto the device that encodes the images: on CUDA,
``torchvision.io.decode_jpeg`` takes a list of JPEGs and decodes them in one nvJPEG batch; on a CPU it is libjpeg-turbo
(the same pixels as Pillow's decoder here), which lets CI test the plumbing.

Per image: no bytes is :data:`~meta.chc.imaging.NO_BYTES`; the header's declared size is checked against the caps and
its EXIF orientation read; an 8-bit JPEG in YCbCr or greyscale joins the batch (at most :data:`DECODE_BATCH_PIXELS`
declared pixels), anything else, a failing batch's images and an image torchvision refuses are decoded by the
reference, so an image is counted unreadable, and why, exactly as there.  The decoded tensor is turned upright, its
shorter side resized to ``size`` (antialiased bicubic, the size computed as :func:`~meta.chc.imaging.to_clip_uint8`
does), centre-cropped and rounded to uint8.

Pixels differ from the reference's by about one level (the resampling kernel; on CUDA also nvJPEG's IDCT); image
features agree to cosine >= 0.999 (``tests/test_chc_tensor_decode.py``; the CUDA numbers in the ``gpu`` test).
"""

from __future__ import annotations

import io
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from meta.chc.imaging import MAX_ASPECT, MAX_PIXELS, NO_BYTES, _decode_one, size_problem
from meta.data.image_decode import exif_orientation

# Declared pixels decoded at once (2^26 = 67 M: ~200 MB of RGB uint8, ~800 MB as float for the resize; ~350 photos of
# CC3M's typical 500x375, enough for nvJPEG's batching)
DECODE_BATCH_PIXELS = 2**26
BATCH_MODES = ("RGB", "L")  # Pillow's modes of 8-bit YCbCr and greyscale JPEGs: decoded by torchvision as by Pillow

# EXIF orientation -> the tensor operation on [3, H, W] equal to Pillow's transpose of meta.data.image_decode.UPRIGHT
_ORIENT = {
    2: lambda x: x.flip(-1),  # FLIP_LEFT_RIGHT
    3: lambda x: x.flip(-2, -1),  # ROTATE_180
    4: lambda x: x.flip(-2),  # FLIP_TOP_BOTTOM
    5: lambda x: x.transpose(-2, -1),  # TRANSPOSE
    6: lambda x: torch.rot90(x, -1, (-2, -1)),  # ROTATE_270
    7: lambda x: x.transpose(-2, -1).flip(-2, -1),  # TRANSVERSE
    8: lambda x: torch.rot90(x, 1, (-2, -1)),  # ROTATE_90
}


def orient(x: torch.Tensor, orientation: int) -> torch.Tensor:
    """``x`` (``[..., H, W]``) turned as EXIF ``orientation`` says; ``x`` itself for 1 or an unknown value."""
    op = _ORIENT.get(orientation)
    return x if op is None else op(x)


def header(data: bytes, max_pixels: int, max_aspect: float) -> tuple[str, int, str, int]:
    """``(route, orientation, reason, pixels)`` of an image from its header alone: route ``"batch"`` (a JPEG
    torchvision decodes as Pillow does; ``pixels``: width x height it declares), ``"reference"`` (anything else) or
    ``"refused"`` (``reason``: a cap of :func:`size_problem`)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            img = Image.open(io.BytesIO(data))
            problem = size_problem(img.size, max_pixels, max_aspect)
            if problem:
                return "refused", 1, problem, 0
            if img.format == "JPEG" and img.mode in BATCH_MODES:
                return "batch", exif_orientation(img), "", img.size[0] * img.size[1]
    except Exception:  # noqa: BLE001 - the reference decides what is wrong with it, and says why
        pass
    return "reference", 1, "", 0


def pixel_batches(indices: Sequence[int], pixels: Sequence[int], budget: int) -> list[list[int]]:
    """``indices`` in order, cut into runs whose declared pixels sum to at most ``budget`` (an image above it alone)."""
    runs: list[list[int]] = []
    total = budget + 1
    for i, p in zip(indices, pixels):
        if total + p > budget:
            runs.append([])
            total = 0
        runs[-1].append(i)
        total += p
    return runs


def clip_size(height: int, width: int, size: int) -> tuple[int, int]:
    """``(new height, new width)`` of the shorter side resized to ``size``, as :func:`to_clip_uint8` rounds it."""
    scale = size / min(width, height)
    return max(size, round(height * scale)), max(size, round(width * scale))


def resize_crop(x: torch.Tensor, size: int) -> torch.Tensor:
    """uint8 ``[n, 3, H, W]`` -> uint8 ``[n, size, size, 3]``: shorter side to ``size`` (antialiased bicubic), centre
    crop, rounded."""
    h, w = x.shape[-2:]
    nh, nw = clip_size(h, w, size)
    y = x.float()
    if (nh, nw) != (h, w):
        y = F.interpolate(y, size=(nh, nw), mode="bicubic", antialias=True, align_corners=False)
    top, left = (nh - size) // 2, (nw - size) // 2
    y = y[:, :, top : top + size, left : left + size]
    return y.round_().clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1)


def _decode_jpegs(blobs: Sequence[bytes], device) -> list[Optional[torch.Tensor]]:
    """torchvision's decode of ``blobs`` to RGB ``[3, H, W]`` uint8 on ``device``: one batch, or image by image when
    the batch fails (None for an image it refuses)."""
    from torchvision.io import ImageReadMode, decode_jpeg

    raw = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchvision 0.29 marks its image decoders deprecated (TorchCodec)
        try:
            return list(decode_jpeg(raw, mode=ImageReadMode.RGB, device=device))
        except Exception:  # noqa: BLE001 - one bad image fails the whole batch: find it
            out: list[Optional[torch.Tensor]] = []
            for r in raw:
                try:
                    out.append(decode_jpeg(r, mode=ImageReadMode.RGB, device=device))
                except Exception:  # noqa: BLE001 - the reference decodes it, or says why it cannot
                    out.append(None)
            return out


def decode_batch_tensor(
    blobs: Sequence[Optional[bytes]],
    size: int,
    device="cpu",
    workers: int = 0,
    reasons: Optional[list] = None,
    max_pixels: int = MAX_PIXELS,
    max_aspect: float = MAX_ASPECT,
) -> tuple[torch.Tensor, np.ndarray]:
    """:func:`meta.chc.imaging.decode_batch` with JPEGs decoded and resized by torchvision on ``device``.

    Args and ``reasons`` as :func:`~meta.chc.imaging.decode_batch` (``workers``: threads of the header pass and of the
    reference's images).

    Returns:
        ``(pixels, ok)``: uint8 ``[n, size, size, 3]`` on ``device`` (zeros where unreadable) and bool ``[n]``.
    """
    n = len(blobs)
    pixels = torch.zeros((n, size, size, 3), dtype=torch.uint8, device=device)
    ok = np.zeros(n, dtype=bool)
    why = [""] * n
    pool = ThreadPoolExecutor(max_workers=int(workers)) if workers and workers > 0 and n > 1 else None
    mapper = pool.map if pool else map
    try:
        heads = list(mapper(lambda b: header(b, max_pixels, max_aspect) if b else ("refused", 1, NO_BYTES, 0), blobs))
        batch = [i for i, head in enumerate(heads) if head[0] == "batch"]
        reference = [i for i, head in enumerate(heads) if head[0] == "reference"]
        for i, (route, _, reason, _) in enumerate(heads):
            if route == "refused":
                why[i] = reason
        # decoded full-size in runs of at most DECODE_BATCH_PIXELS declared pixels: a chunk of large photos (the caps
        # allow 50 MP each) never sits on the device at once
        for run in pixel_batches(batch, [heads[i][3] for i in batch], DECODE_BATCH_PIXELS):
            by_shape: dict = {}
            for i, img in zip(run, _decode_jpegs([blobs[i] for i in run], device)):
                if img is None:
                    reference.append(i)
                    continue
                img = orient(img, heads[i][1])
                by_shape.setdefault(tuple(img.shape), []).append((i, img))
            for group in by_shape.values():
                index = torch.tensor([i for i, _ in group], device=device)
                pixels[index] = resize_crop(torch.stack([img for _, img in group]), size)
                ok[[i for i, _ in group]] = True
        for i, (arr, reason) in zip(
            reference, mapper(lambda i: _decode_one(blobs[i], size, max_pixels, max_aspect), reference)
        ):
            why[i] = reason
            if arr is not None:
                pixels[i] = torch.tensor(arr, device=device)
                ok[i] = True
    finally:
        if pool:
            pool.shutdown()
    if reasons is not None:
        reasons.extend(why)
    return pixels, ok
