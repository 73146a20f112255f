"""The one check of an image's declared size against the pixel and aspect caps (:mod:`meta.data.input_limits`),
before a pixel is decoded: CHC's decoders, the evaluation loader and the CoOp-layout datasets of the evaluator and
``train.py`` all ask :func:`size_problem`, so a 257-byte 60000x1 PNG never asks for a 13,440,000x224 resize."""

from __future__ import annotations

import os
import warnings
from typing import Optional, Union

from PIL import Image

from meta.data.input_limits import MAX_IMAGE_ASPECT, MAX_IMAGE_PIXELS

EMPTY_IMAGE = "empty image (0 pixels)"


def size_problem(
    size: tuple[int, int], max_pixels: int = MAX_IMAGE_PIXELS, max_aspect: Optional[float] = MAX_IMAGE_ASPECT
) -> str:
    """Why an image of ``size`` = ``(width, height)`` in pixels is refused before decoding; ``""`` if it is not.

    ``max_aspect`` is longer side / shorter side (``None`` = no cap).  The reasons are fixed texts per cap (they
    are counted by reason): :data:`EMPTY_IMAGE`, ``"more than <max_pixels> pixels"``,
    ``"aspect ratio above <max_aspect>"``.
    """
    w, h = int(size[0]), int(size[1])
    if min(w, h) <= 0:
        return EMPTY_IMAGE
    if w * h > max_pixels:
        return f"more than {max_pixels} pixels"
    if max_aspect is not None and max(w, h) > max_aspect * min(w, h):
        return f"aspect ratio above {max_aspect:g}"
    return ""


def file_size_problem(path: Union[str, os.PathLike]) -> str:
    """:func:`size_problem` (default caps) of the size the header of the image file at ``path`` declares (Pillow's
    lazy ``Image.open``); ``""`` for a file Pillow cannot open (its reader reports it).  Pillow's own bomb refusal
    (far above the default cap) counts as the pixel cap."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DecompressionBombWarning
            with Image.open(path) as img:
                return size_problem(img.size)
    except Image.DecompressionBombError:
        return f"more than {MAX_IMAGE_PIXELS} pixels"
    except Exception:  # noqa: BLE001 - unreadable is the reader's problem, not a cap's
        return ""
