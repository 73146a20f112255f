"""One rule for turning a decoded PIL image of any mode into 8-bit RGB.

``Image.convert("RGB")`` alone is wrong for several modes Pillow opens: a 16-bit greyscale PNG
(mode ``I;16``, values 0..65535) is clipped at 255, so a full ramp decodes almost white; a
float image (``F``, usually 0..1) decodes almost black; an alpha channel is dropped, showing
whatever colour the transparent pixels happen to store.  :func:`to_rgb8` decodes by mode:

========================== ===========================================================================
mode                       8-bit RGB value of a pixel
========================== ===========================================================================
``RGB``, ``L``, ``1``      as Pillow converts them (``1``: 0 -> 0, 1 -> 255)
``CMYK``                   Pillow's conversion, ``(255 - C) * (255 - K) / 255`` per channel
``YCbCr``                  Pillow's conversion
``I;16``, ``I;16B/L/N``    16-bit samples: ``round(v * 255 / 65535)``
``I`` (32-bit integer)     read as 16-bit samples (what Pillow opens from 16-bit PNG / TIFF):
                           clipped to 0..65535, then as above
``F`` (32-bit float)       ``round(v * 255)`` when every finite value lies in [0, 1], else ``round(v)``;
                           clipped to 0..255, NaN -> 0
``P`` (palette)            the palette colour
alpha: ``LA``, ``La``,     composited over white: ``a * colour + (1 - a) * 255`` (as img2dataset's
``PA``, ``RGBA``,          resizer does for images with an alpha channel, github.com/rom1504/img2dataset
``RGBa``, or a             ``img2dataset/resizer.py``); ``La`` / ``RGBa`` are un-premultiplied first
``transparency`` entry
(``P``, ``L``, ``RGB``)
anything else (``LAB``,    Pillow's ``convert("RGB")``; a mode it cannot convert raises (the caller
``HSV``, ...)              counts the image as unreadable)
========================== ===========================================================================

This module depends on Pillow and numpy only, so every decoding path (CHC, the image-folder
hierarchy, the evaluation loader) can share it.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

SIXTEEN_BIT_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I")
ALPHA_MODES = ("LA", "La", "PA", "RGBA", "RGBa")
BACKGROUND = (255, 255, 255)  # alpha is composited over white (img2dataset's resizer does the same)


def _grey_to_rgb(grey: np.ndarray) -> Image.Image:
    """uint8 ``[H, W]`` -> RGB image."""
    return Image.fromarray(np.ascontiguousarray(grey, dtype=np.uint8), mode="L").convert("RGB")


def _sixteen_bit(img: Image.Image) -> Image.Image:
    values = np.asarray(img).astype(np.int64)
    values = np.clip(values, 0, 65535)
    return _grey_to_rgb((values * 255 + 32767) // 65535)  # round(v * 255 / 65535)


def _float(img: Image.Image) -> Image.Image:
    values = np.asarray(img, dtype=np.float64)
    finite = values[np.isfinite(values)]
    unit = finite.size > 0 and finite.min() >= 0.0 and finite.max() <= 1.0
    scaled = np.nan_to_num(values * (255.0 if unit else 1.0), nan=0.0, posinf=255.0, neginf=0.0)
    return _grey_to_rgb(np.clip(np.rint(scaled), 0, 255))


def _over_white(img: Image.Image) -> Image.Image:
    rgba = img.convert("RGBA")  # La / RGBa are un-premultiplied by this conversion
    background = Image.new("RGBA", rgba.size, BACKGROUND + (255,))
    return Image.alpha_composite(background, rgba).convert("RGB")


def to_rgb8(img: Image.Image) -> Image.Image:
    """The 8-bit RGB image of ``img`` decoded by its mode (table in the module docstring).

    Returns a new ``RGB`` PIL image of the same size (a copy, also for an ``RGB`` input, so it
    outlives a closed source file).  Raises what Pillow raises for a mode it cannot convert.
    """
    mode = img.mode
    if mode in SIXTEEN_BIT_MODES:
        return _sixteen_bit(img)
    if mode == "F":
        return _float(img)
    if mode in ALPHA_MODES or (mode in ("P", "L", "RGB") and "transparency" in img.info):
        return _over_white(img)
    return img.convert("RGB")
