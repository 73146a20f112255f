"""Rasterise an :class:`~gram_world.items.ItemSpec` into a small RGB image (numpy + PIL).

Silhouettes are drawn with PIL at ``SUPERSAMPLE`` times the output side and
box-filtered down, which gives anti-aliased edges at 32 px.  Each style then
composes background, fill and outline differently and post-processes the
result (blur, noise), so styles differ in colour statistics, contrast and
high-frequency energy - the cues k-means on image features can pick up.
"""

from __future__ import annotations

import colorsys
import math

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from .items import COLOURS, ItemSpec, object_layout
from .shapes import CATEGORIES, Primitive

SUPERSAMPLE = 4


def _transform(
    points, cx: float, cy: float, r: float, angle: float, sx: float, sy: float, jitter: np.ndarray
) -> list[tuple[float, float]]:
    pts = np.asarray(points, dtype=np.float64) * (sx, sy)
    pts = pts + jitter[: len(pts)]
    c, s = math.cos(angle), math.sin(angle)
    x = pts[:, 0] * c - pts[:, 1] * s
    y = pts[:, 0] * s + pts[:, 1] * c
    return list(zip((cx + r * x) * SUPERSAMPLE, (cy + r * y) * SUPERSAMPLE))


def silhouette(
    spec: ItemSpec, layout: list[tuple[float, float, float]], rng: np.random.Generator, side: int
) -> Image.Image:
    """The objects' union as an 8-bit mask of side ``side * SUPERSAMPLE`` (255 = object).

    ``layout`` holds one ``(cx, cy, r)`` per object copy, in output pixels.
    """
    big = side * SUPERSAMPLE
    mask = Image.new("L", (big, big), 0)
    draw = ImageDraw.Draw(mask)
    prims: list[Primitive] = CATEGORIES[spec.category].draw()
    for cx, cy, r in layout:
        angle = math.radians(rng.uniform(-12.0, 12.0))
        sx, sy = rng.uniform(0.9, 1.1, size=2)
        for prim in prims:
            jitter = rng.normal(0.0, 0.025, size=(len(prim.points), 2))
            pts = _transform(prim.points, cx, cy, r, angle, sx, sy, jitter)
            fill = 255 if prim.add else 0
            if prim.kind == "poly":
                draw.polygon(pts, fill=fill)
            else:
                width = max(2, int(round(2 * prim.width * r * SUPERSAMPLE)))
                draw.line(pts, fill=fill, width=width, joint="curve")
                rad = width / 2.0
                for px, py in (pts[0], pts[-1]):  # round caps
                    draw.ellipse([px - rad, py - rad, px + rad, py + rad], fill=fill)
    return mask


def _down(mask: Image.Image, side: int) -> np.ndarray:
    """Box-filter a supersampled mask to ``[side, side]`` floats in [0, 1]."""
    return np.asarray(mask.resize((side, side), Image.BOX), dtype=np.float32) / 255.0


def _band(mask: Image.Image, half_width: int) -> Image.Image:
    """Outline of a supersampled mask: dilation minus erosion, ``2*half_width`` px wide."""
    k = 2 * half_width + 1
    outer = np.asarray(mask.filter(ImageFilter.MaxFilter(k)), dtype=np.int16)
    inner = np.asarray(mask.filter(ImageFilter.MinFilter(k)), dtype=np.int16)
    return Image.fromarray((outer - inner).clip(0, 255).astype(np.uint8))


def _hsv(h: float, s: float, v: float) -> np.ndarray:
    return np.array(colorsys.hsv_to_rgb(h % 1.0, s, v), dtype=np.float32) * 255.0


def _object_colour(spec: ItemSpec, rng: np.random.Generator) -> np.ndarray:
    return np.clip(np.array(COLOURS[spec.colour], np.float32) + rng.normal(0, 10, 3), 0, 255)


def _grid(side: int) -> tuple[np.ndarray, np.ndarray]:
    y, x = np.mgrid[0:side, 0:side].astype(np.float32)
    return x + 0.5, y + 0.5


def _paint(bg: np.ndarray, alpha: np.ndarray, fg: np.ndarray) -> np.ndarray:
    a = alpha[..., None]
    return bg * (1.0 - a) + fg * a


def _sketch(rng, side, mask, colour, layout):
    paper = np.array([242, 238, 228], np.float32) + rng.normal(0, 4, 3)
    img = np.broadcast_to(paper, (side, side, 3)).copy()
    strokes = Image.new("L", (side * SUPERSAMPLE,) * 2, 0)
    d = ImageDraw.Draw(strokes)
    for _ in range(int(rng.integers(2, 6))):
        p = rng.uniform(0, side * SUPERSAMPLE, size=4)
        d.line(list(p), fill=int(rng.integers(60, 140)), width=2)
    img = _paint(img, _down(strokes, side), np.array([90, 90, 90], np.float32))
    line = _down(_band(mask, 2), side)
    img = _paint(img, np.clip(line * 1.6, 0, 1), colour * 0.6)
    return img + rng.normal(0, 3, img.shape)


def _noisy(rng, side, mask, colour, layout):
    grey = rng.uniform(95, 160)
    bg = np.full(3, grey, np.float32) + rng.normal(0, 8, 3)
    img = np.broadcast_to(bg, (side, side, 3)).copy()
    fg = bg + 0.55 * (colour - bg)
    img = _paint(img, _down(mask.filter(ImageFilter.GaussianBlur(SUPERSAMPLE * 0.7)), side), fg)
    return img + rng.normal(0, 14, img.shape)


def _cartoon(rng, side, mask, colour, layout):
    bg = _hsv(rng.random(), rng.uniform(0.15, 0.3), rng.uniform(0.9, 1.0))
    img = np.broadcast_to(bg, (side, side, 3)).copy()
    img = _paint(img, _down(mask, side), np.clip(colour * 1.1, 0, 255))
    return _paint(img, np.clip(_down(_band(mask, 4), side) * 1.3, 0, 1), np.array([25, 25, 25], np.float32))


def _texture(rng: np.random.Generator, side: int) -> np.ndarray:
    """A two-colour stripe / checker / dot pattern, ``[side, side, 3]`` floats."""
    x, y = _grid(side)
    c1 = _hsv(rng.random(), rng.uniform(0.2, 0.6), rng.uniform(0.45, 0.85))
    c2 = _hsv(rng.random(), rng.uniform(0.2, 0.6), rng.uniform(0.45, 0.85))
    period = rng.uniform(3.5, 7.0)
    kind = int(rng.integers(3))
    if kind == 0:
        a = rng.uniform(0, math.pi)
        t = np.sin(2 * math.pi * (x * math.cos(a) + y * math.sin(a)) / period) > 0
    elif kind == 1:
        t = ((np.floor(x / period) + np.floor(y / period)) % 2) > 0
    else:
        t = np.hypot((x % period) - period / 2, (y % period) - period / 2) < period / 3.2
    t = t.astype(np.float32)[..., None]
    return c1 * (1 - t) + c2 * t


def _textured(rng, side, mask, colour, layout):
    img = _texture(rng, side)
    img = _paint(img, _down(mask, side), colour)
    return _paint(img, np.clip(_down(_band(mask, 2), side) * 1.2, 0, 1), np.array([30, 30, 30], np.float32))


def render(spec: ItemSpec, rng: np.random.Generator, side: int = 32) -> np.ndarray:
    """Draw ``spec`` as a ``[side, side, 3]`` uint8 RGB array.

    ``rng`` supplies every continuous choice (placement jitter, rotation,
    colours of backgrounds, noise); the same spec and generator state give the
    same pixels.
    """
    if spec.style not in _STYLE_PAINTERS:
        raise KeyError(f"unknown world style {spec.style!r}; known: {sorted(_STYLE_PAINTERS)}")
    layout = object_layout(spec, rng, side)
    mask = silhouette(spec, layout, rng, side)
    colour = _object_colour(spec, rng)
    img = _STYLE_PAINTERS[spec.style](rng, side, mask, colour, layout)
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def _shaded(rng, side, mask, colour, layout):
    x, y = _grid(side)
    top, bottom = (_hsv(rng.random(), rng.uniform(0.15, 0.4), rng.uniform(0.35, 0.8)) for _ in range(2))
    t = (y / side)[..., None]
    img = top * (1 - t) + bottom * t
    alpha = _down(mask, side)
    shadow = np.roll(_down(mask.filter(ImageFilter.GaussianBlur(SUPERSAMPLE * 1.2)), side), (1, 1), (0, 1))
    img = img * (1.0 - 0.45 * shadow[..., None])
    # One light from the upper left: brightness falls off with the distance to a
    # highlight up-left of each object's centre; each pixel follows its nearest object.
    best = np.full((side, side), np.inf, np.float32)
    shade = np.ones((side, side), np.float32)
    for cx, cy, r in layout:
        d_obj = np.hypot(x - cx, y - cy)
        d_light = np.hypot(x - (cx - 0.4 * r), y - (cy - 0.4 * r)) / (1.5 * r)
        shade = np.where(d_obj < best, 1.35 - 0.85 * np.clip(d_light, 0, 1), shade)
        best = np.minimum(best, d_obj)
    fg = np.clip(colour * shade[..., None], 0, 255)
    return _paint(img, alpha, fg)


_STYLE_PAINTERS = {"shaded": _shaded, "sketch": _sketch, "noisy": _noisy, "cartoon": _cartoon, "textured": _textured}


# Capture conditions of downstream datasets (none of them occurs in the pretraining corpus):
# how a specialised benchmark's images differ from web images (satellite views, scans, ...),
# applied to the rendered image ``[S, S, 3]`` uint8.  Every condition measured when the world's
# conditions were chosen is kept here, so the scan (``python -m gram_world captures``) can be
# rerun; ``settings.FAMILY_CAPTURES`` says which four the world uses (docs/notes/world_baseline.md).
SEPIA = np.array([[0.393, 0.349, 0.272], [0.769, 0.686, 0.534], [0.189, 0.168, 0.131]], dtype=np.float32)
FRAME_COLOUR = (40, 90, 160)


def _resized(img: np.ndarray, side: int) -> np.ndarray:
    return np.asarray(Image.fromarray(img).resize((side, side), Image.BILINEAR))


def _zoomed(img: np.ndarray, keep: float = 0.6) -> np.ndarray:
    """Close-up: the centre ``keep`` of the side, scaled back to the full side (bilinear)."""
    side = img.shape[0]
    crop = int(round(side * keep))
    off = (side - crop) // 2
    return _resized(np.ascontiguousarray(img[off : off + crop, off : off + crop]), side)


def _framed(img: np.ndarray, keep: float = 0.7) -> np.ndarray:
    """Mounted: the whole image shrunk to ``keep`` of the side inside a flat :data:`FRAME_COLOUR` border."""
    side = img.shape[0]
    inner = int(round(side * keep))
    off = (side - inner) // 2
    out = np.empty_like(img)
    out[:] = FRAME_COLOUR
    out[off : off + inner, off : off + inner] = _resized(img, inner)
    return out


def _scaled(img: np.ndarray, gain: float, offset: float = 0.0) -> np.ndarray:
    return np.clip(img.astype(np.float32) * gain + offset, 0, 255).astype(np.uint8)


CAPTURES = {
    "none": lambda img: img,
    "grayscale": lambda img: np.repeat(np.rint(img.mean(axis=-1, keepdims=True)), 3, axis=-1).astype(np.uint8),
    "rotated": lambda img: np.ascontiguousarray(np.rot90(img)),  # a quarter turn anticlockwise
    "negative": lambda img: 255 - img,
    "dark": lambda img: _scaled(img, 0.35),  # under-exposed: 35 % of the light
    "low_contrast": lambda img: _scaled(img, 0.3, 0.7 * 128),  # 30 % contrast around mid-grey
    "sepia": lambda img: np.clip(img.astype(np.float32) @ SEPIA, 0, 255).astype(np.uint8),
    "solarized": lambda img: np.where(img > 128, 255 - img, img).astype(np.uint8),
    "posterized": lambda img: (img & 0xC0) + 32,  # 2 bits per channel
    "blurred": lambda img: np.asarray(Image.fromarray(img).filter(ImageFilter.GaussianBlur(1.2))),
    "zoomed": _zoomed,
    "framed": _framed,
}


def capture(img: np.ndarray, condition: str) -> np.ndarray:
    """``img`` ``[S, S, 3]`` uint8 as seen under a downstream capture ``condition`` (:data:`CAPTURES`)."""
    if condition not in CAPTURES:
        raise KeyError(f"unknown capture condition {condition!r}; known: {sorted(CAPTURES)}")
    return CAPTURES[condition](img)
