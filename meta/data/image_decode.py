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

EXIF orientation (:func:`exif_orientation`, :func:`upright`, :func:`open_upright`): a photo is turned as its
Orientation tag (2-8) says; who asks for it when is in docs/input_rules.md ("EXIF orientation").

This module depends on Pillow and numpy only, so every decoding path (CHC, the image-folder
hierarchy, the evaluation loader, the Dassl trainers) can share it.
"""

from __future__ import annotations

import os
from typing import Callable, Union

import numpy as np
from PIL import Image

SIXTEEN_BIT_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I")
ALPHA_MODES = ("LA", "La", "PA", "RGBA", "RGBa")
BACKGROUND = (255, 255, 255)  # alpha is composited over white (img2dataset's resizer does the same)

EXIF_ORIENTATION = 0x0112  # the EXIF Orientation tag
# Orientation value -> the transpose that shows the stored pixels upright (as PIL.ImageOps.exif_transpose)
UPRIGHT = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


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


def exif_orientation(img: Image.Image) -> int:
    """The EXIF Orientation (1-8) of an opened image; 1 when absent, out of range or unreadable.

    A damaged EXIF block leaves the image as stored: it is no reason to lose the image.
    """
    try:
        value = img.getexif().get(EXIF_ORIENTATION, 1)
    except Exception:  # noqa: BLE001 - any failure parsing EXIF means "no orientation"
        return 1
    return value if isinstance(value, int) and value in UPRIGHT else 1


def upright(img: Image.Image, orientation: int) -> Image.Image:
    """``img`` turned as EXIF ``orientation`` says (a viewer's view); ``img`` itself for 1 or unknown."""
    method = UPRIGHT.get(orientation)
    return img if method is None else img.transpose(method)


def open_upright(
    path: Union[str, os.PathLike], exif_upright: bool, convert: Callable[[Image.Image], Image.Image] = to_rgb8
) -> Image.Image:
    """The image file at ``path`` decoded by ``convert``, turned upright by its EXIF orientation when ``exif_upright``.

    The one reader of the evaluation loader (``convert`` = :func:`to_rgb8`) and of the Dassl trainers under
    ``TRAINER.GRAM.EXIF_UPRIGHT`` (``convert`` = Dassl's ``read_image`` conversion, ``Image.convert("RGB")``), so
    that both turn a photo the same way.  The orientation is read from the opened file, before ``convert``
    (a conversion may drop the EXIF block).  ``exif_upright=False`` reads the pixels as stored, as Dassl's
    ``read_image`` does.  Raises what Pillow raises for a missing or undecodable file.
    """
    with Image.open(path) as f:
        orientation = exif_orientation(f) if exif_upright else 1
        return upright(convert(f), orientation)
