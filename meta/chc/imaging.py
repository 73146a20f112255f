"""Image decoding to CLIP's input geometry, as uint8, and CLIP normalisation.

Every image that reaches a CLIP tower in GRAM goes through :func:`to_clip_uint8` (shorter side to ``size``, bicubic,
centre crop: open_clip's ``resize_mode='shortest'``) and then :func:`normalize_uint8`, so the hierarchy hands out
``[n, H, W, 3]`` uint8.  :func:`decode_image_why` checks the declared size against the caps before decoding a pixel
(a 257-byte 60000x1 PNG never asks for a ~9 GB resize) and turns photos upright by their EXIF Orientation tag
(docs/input_rules.md).
"""

from __future__ import annotations

import io
import warnings
from typing import Optional, Sequence

import numpy as np
import torch
from PIL import Image

from meta.data.image_caps import EMPTY_IMAGE, size_problem
from meta.data.image_decode import exif_orientation, to_rgb8, upright
from meta.data.input_limits import MAX_IMAGE_ASPECT, MAX_IMAGE_PIXELS

# open_clip / OpenAI CLIP normalisation (open_clip.constants OPENAI_DATASET_MEAN/STD).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


# Reason recorded when an image has no bytes to decode (missing file, short read of a tar member).
NO_BYTES = "no image bytes"

# Caps on the size an image file declares: the defaults of CHC.INPUT.MAX_IMAGE_PIXELS / MAX_IMAGE_ASPECT.
MAX_PIXELS = MAX_IMAGE_PIXELS  # pixels (width * height); a 24 MP photo is 24,000,000
MAX_ASPECT = MAX_IMAGE_ASPECT  # longer side / shorter side (a panorama is ~4-8)

# What decoding does before the resize, in the cached stages' fingerprints (a new rule recomputes image features).
DECODE_RULE = f"rgb8,exif-upright,max_pixels={MAX_PIXELS},max_aspect={MAX_ASPECT:g}"


def decode_image_why(
    data: Optional[bytes], max_pixels: int = MAX_PIXELS, max_aspect: Optional[float] = None
) -> tuple[Optional[Image.Image], str]:
    """``(upright 8-bit RGB PIL image, "")``, or ``(None, reason)``: the exception's type name, :data:`NO_BYTES` or a
    :func:`size_problem` of the declared size, checked before any pixel is decoded.  Every ``Exception`` is that
    image's problem (a fuzz found Pillow raising NotImplementedError, RuntimeError, struct.error, IndexError, ...)."""
    if not data:
        return None, NO_BYTES
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # PIL DecompressionBombWarning, palette warnings
            img = Image.open(io.BytesIO(data))
            problem = size_problem(img.size, max_pixels, max_aspect)
            if not problem:
                img.load()
                problem = size_problem(img.size, max_pixels, max_aspect)  # ICO / ICNS pick a size on load
            if problem:
                return None, problem
            orientation = exif_orientation(img)
            img = to_rgb8(img)  # by mode: 16-bit, float, alpha, palette, CMYK (meta.data.image_decode)
        if min(img.size) == 0:
            return None, EMPTY_IMAGE
        return upright(img, orientation), ""
    except Exception as err:  # noqa: BLE001 - see docstring
        return None, type(err).__name__


def to_clip_uint8(img: Image.Image, size: int) -> np.ndarray:
    """Shorter side to ``size`` (bicubic), centre crop -> uint8 ``[size, size, 3]``."""
    w, h = img.size
    scale = size / min(w, h)
    new_w, new_h = max(size, round(w * scale)), max(size, round(h * scale))
    if (new_w, new_h) != (w, h):
        img = img.resize((new_w, new_h), Image.BICUBIC)
    left, top = (new_w - size) // 2, (new_h - size) // 2
    img = img.crop((left, top, left + size, top + size))
    return np.asarray(img, dtype=np.uint8)


def _decode_one(
    data: Optional[bytes], size: int, max_pixels: int = MAX_PIXELS, max_aspect: float = MAX_ASPECT
) -> tuple[Optional[np.ndarray], str]:
    img, why = decode_image_why(data, max_pixels, max_aspect)
    if img is None:
        return None, why
    try:
        return to_clip_uint8(img, size), ""
    except Exception as err:  # noqa: BLE001 - a resize failure is still this image's problem
        return None, type(err).__name__


def decode_batch(
    blobs: Sequence[Optional[bytes]],
    size: int,
    workers: int = 0,
    reasons: Optional[list] = None,
    max_pixels: int = MAX_PIXELS,
    max_aspect: float = MAX_ASPECT,
) -> tuple[np.ndarray, np.ndarray]:
    """Decode a list of image byte strings (upright, as :func:`decode_image_why`) to ``size x size`` pixels.

    ``workers``: decoding threads (0 = the calling thread; same result); ``reasons``, if given, receives ``""`` or
    why per blob; ``max_pixels`` / ``max_aspect``: the caps of :func:`size_problem`.  Returns ``(pixels, ok)``: uint8
    ``[n, size, size, 3]`` (zeros where unreadable) and bool ``[n]``.
    """
    pixels = np.zeros((len(blobs), size, size, 3), dtype=np.uint8)
    ok = np.zeros(len(blobs), dtype=bool)
    if workers and workers > 0 and len(blobs) > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=int(workers)) as pool:
            decoded = list(pool.map(lambda b: _decode_one(b, size, max_pixels, max_aspect), blobs))
    else:
        decoded = [_decode_one(b, size, max_pixels, max_aspect) for b in blobs]
    for i, (arr, why) in enumerate(decoded):
        if arr is not None:
            pixels[i] = arr
            ok[i] = True
        if reasons is not None:
            reasons.append(why)
    return pixels, ok


def normalize_uint8(
    pixels: np.ndarray | torch.Tensor,
    mean: Sequence[float] = CLIP_MEAN,
    std: Sequence[float] = CLIP_STD,
    dtype: torch.dtype = torch.float32,
    device="cpu",
) -> torch.Tensor:
    """uint8 ``[n, H, W, 3]`` (numpy, or a tensor on any device) -> normalised float ``[n, 3, H, W]`` on ``device``
    for a CLIP image tower."""
    x = pixels if torch.is_tensor(pixels) else torch.from_numpy(np.ascontiguousarray(pixels))
    x = x.to(device).permute(0, 3, 1, 2).to(torch.float32) / 255.0
    m = torch.tensor(mean, device=device).view(1, 3, 1, 1)
    s = torch.tensor(std, device=device).view(1, 3, 1, 1)
    return ((x - m) / s).to(dtype)


def clip_norm_stats(clip) -> tuple[tuple, tuple]:
    """(mean, std) from an open_clip model's ``visual.preprocess_cfg``, OpenAI's if absent."""
    cfg = getattr(getattr(clip, "visual", None), "preprocess_cfg", None) or {}
    return tuple(cfg.get("mean", CLIP_MEAN)), tuple(cfg.get("std", CLIP_STD))


@torch.no_grad()
def encode_images(clip, pixels: np.ndarray | torch.Tensor, mean, std, batch_size: int = 64, device="cpu") -> np.ndarray:
    """L2-normalised CLIP image features float32 ``[n, D]`` of uint8 ``[n, H, W, 3]`` (numpy or a tensor).

    The features stay on ``device`` until the last batch and come back in one copy (no host sync per batch).
    """
    dtype = next(clip.parameters()).dtype
    out = []
    for start in range(0, len(pixels), batch_size):
        x = normalize_uint8(pixels[start : start + batch_size], mean, std, dtype=dtype, device=device)
        f = clip.encode_image(x).float()
        out.append(torch.nn.functional.normalize(f, dim=-1))
    if not out:
        return np.zeros((0, int(clip.visual.output_dim)), dtype=np.float32)
    return torch.cat(out).cpu().numpy().astype(np.float32, copy=False)
