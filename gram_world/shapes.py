"""The object categories of the procedural world, as 2-D outlines.

Every category is a function ``draw(jitter) -> list[Primitive]`` in a
normalised object frame: x to the right, y downwards, the object fits in the
disc of radius 1 around the origin.  A primitive either adds area to the
object's silhouette or cuts area out of it (holes: ring, key, house door).
Rendering (``gram_world.render``) rotates, scales and rasterises them.

Categories are grouped in four families so that downstream datasets can own
a family each and one family can serve as the cross-dataset target.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

Point = tuple[float, float]


@dataclass(frozen=True)
class Primitive:
    """One filled region of a silhouette.

    ``kind`` is ``"poly"`` (closed polygon through ``points``) or ``"line"``
    (open polyline of half-width ``width``, in object units).  ``add=False``
    cuts the region out of what was drawn before it.
    """

    kind: str
    points: tuple[Point, ...]
    add: bool = True
    width: float = 0.0


@dataclass(frozen=True)
class Category:
    """A nameable object class: its caption words and its outline."""

    name: str  # singular, one word, as used in class names and prompts
    plural: str
    family: str
    draw: Callable[[], list[Primitive]]


def _poly(points, add: bool = True) -> Primitive:
    return Primitive("poly", tuple((float(x), float(y)) for x, y in points), add)


def _line(points, width: float, add: bool = True) -> Primitive:
    return Primitive("line", tuple((float(x), float(y)) for x, y in points), add, float(width))


def _ellipse(
    cx: float, cy: float, rx: float, ry: float, start: float = 0.0, stop: float = 360.0, n: int = 40
) -> list[Point]:
    """Points on an elliptic arc, angles in degrees (0 = +x, 90 = +y i.e. down)."""
    t = np.radians(np.linspace(start, stop, n, endpoint=(stop - start) < 360.0))
    return [(cx + rx * math.cos(a), cy + ry * math.sin(a)) for a in t]


def _regular(n: int, radius: float = 1.0, phase_deg: float = -90.0) -> list[Point]:
    return _ellipse(0.0, 0.0, radius, radius, phase_deg, phase_deg + 360.0, n)


def _rect(x0: float, y0: float, x1: float, y1: float) -> list[Point]:
    return [(x0, y0), (x1, y0), (x1, y1), (x0, y1)]


def _star(points: int, inner: float) -> list[Point]:
    out = []
    for k in range(2 * points):
        r = 1.0 if k % 2 == 0 else inner
        a = math.radians(-90.0 + 180.0 * k / points)
        out.append((r * math.cos(a), r * math.sin(a)))
    return out


def _heart() -> list[Point]:
    t = np.linspace(0.0, 2.0 * math.pi, 48, endpoint=False)
    x = 16 * np.sin(t) ** 3
    y = -(13 * np.cos(t) - 5 * np.cos(2 * t) - 2 * np.cos(3 * t) - np.cos(4 * t))
    return [(float(a) / 17.0, float(b) / 17.0 + 0.1) for a, b in zip(x, y)]


def _spiral() -> list[Point]:
    t = np.linspace(0.0, 2.3 * 2.0 * math.pi, 70)
    r = 0.12 + 0.8 * t / t[-1]
    return [(float(a), float(b)) for a, b in zip(r * np.cos(t), r * np.sin(t))]


# --- family: polygons -------------------------------------------------------
POLYGONS = {
    "triangle": lambda: [_poly(_regular(3, 1.0, -90.0))],
    "square": lambda: [_poly(_rect(-0.72, -0.72, 0.72, 0.72))],
    "pentagon": lambda: [_poly(_regular(5))],
    "hexagon": lambda: [_poly(_regular(6, 1.0, 0.0))],
    "octagon": lambda: [_poly(_regular(8, 1.0, 22.5))],
    "diamond": lambda: [_poly([(0, -1), (0.62, 0), (0, 1), (-0.62, 0)])],
    "rectangle": lambda: [_poly(_rect(-1.0, -0.5, 1.0, 0.5))],
    "trapezoid": lambda: [_poly([(-0.45, -0.55), (0.45, -0.55), (1.0, 0.55), (-1.0, 0.55)])],
    "parallelogram": lambda: [_poly([(-0.45, -0.5), (1.0, -0.5), (0.45, 0.5), (-1.0, 0.5)])],
    "kite": lambda: [_poly([(0, -1), (0.62, -0.35), (0, 1), (-0.62, -0.35)])],
}

# --- family: curves ---------------------------------------------------------
CURVES = {
    "circle": lambda: [_poly(_ellipse(0, 0, 0.95, 0.95))],
    "ellipse": lambda: [_poly(_ellipse(0, 0, 1.0, 0.52))],
    "ring": lambda: [_poly(_ellipse(0, 0, 0.95, 0.95)), _poly(_ellipse(0, 0, 0.55, 0.55), add=False)],
    "crescent": lambda: [_poly(_ellipse(0, 0, 0.95, 0.95)), _poly(_ellipse(0.45, -0.2, 0.8, 0.8), add=False)],
    "heart": lambda: [_poly(_heart())],
    "teardrop": lambda: [_poly(_ellipse(0, 0.3, 0.62, 0.62, -25.0, 205.0, 30) + [(0.0, -1.0)])],
    "semicircle": lambda: [_poly(_ellipse(0, 0.35, 1.0, 1.0, 180.0, 360.0, 30))],
    "spiral": lambda: [_line(_spiral(), 0.11)],
    "cloud": lambda: [
        _poly(_ellipse(-0.5, 0.12, 0.45, 0.42)),
        _poly(_ellipse(0.05, -0.18, 0.55, 0.52)),
        _poly(_ellipse(0.55, 0.15, 0.42, 0.4)),
        _poly(_rect(-0.5, 0.1, 0.55, 0.55)),
    ],
    "flower": lambda: (
        [
            _poly(_ellipse(0.58 * math.cos(a), 0.58 * math.sin(a), 0.38, 0.38))
            for a in np.radians(np.arange(5) * 72.0 - 90.0)
        ]
        + [_poly(_ellipse(0, 0, 0.4, 0.4))]
    ),
}

# --- family: symbols --------------------------------------------------------
SYMBOLS = {
    "star": lambda: [_poly(_star(5, 0.42))],
    "cross": lambda: [_poly(_rect(-0.2, -0.95, 0.2, 0.95)), _poly(_rect(-0.95, -0.2, 0.95, 0.2))],
    "arrow": lambda: [_poly(_rect(-1.0, -0.18, 0.15, 0.18)), _poly([(0.1, -0.62), (1.0, 0.0), (0.1, 0.62)])],
    "bolt": lambda: [
        _poly([(0.15, -1.0), (-0.55, 0.15), (-0.05, 0.15), (-0.3, 1.0), (0.6, -0.25), (0.1, -0.25), (0.5, -1.0)])
    ],
    "hourglass": lambda: [_poly([(-0.7, -1), (0.7, -1), (0.1, 0), (0.7, 1), (-0.7, 1), (-0.1, 0)])],
    "bowtie": lambda: [_poly([(-1, -0.7), (0, -0.1), (1, -0.7), (1, 0.7), (0, 0.1), (-1, 0.7)])],
    "chevron": lambda: [_line([(-0.85, -0.45), (0.0, 0.45), (0.85, -0.45)], 0.2)],
    "asterisk": lambda: [
        _line([(0.95 * math.cos(a), 0.95 * math.sin(a)), (-0.95 * math.cos(a), -0.95 * math.sin(a))], 0.12)
        for a in np.radians([90.0, 30.0, 150.0])
    ],
    "checkmark": lambda: [_line([(-0.8, 0.0), (-0.25, 0.6), (0.85, -0.7)], 0.17)],
    "zigzag": lambda: [_line([(-1, 0.4), (-0.5, -0.4), (0, 0.4), (0.5, -0.4), (1, 0.4)], 0.13)],
}

# --- family: icons ----------------------------------------------------------
ICONS = {
    "house": lambda: [
        _poly(_rect(-0.68, -0.1, 0.68, 0.9)),
        _poly([(-0.95, -0.05), (0, -0.95), (0.95, -0.05)]),
        _poly(_rect(-0.16, 0.38, 0.16, 0.9), add=False),
    ],
    "tree": lambda: [_poly([(0, -1.0), (0.78, 0.45), (-0.78, 0.45)]), _poly(_rect(-0.15, 0.4, 0.15, 1.0))],
    "key": lambda: [
        _poly(_ellipse(-0.55, 0, 0.42, 0.42)),
        _poly(_ellipse(-0.55, 0, 0.2, 0.2), add=False),
        _poly(_rect(-0.18, -0.1, 1.0, 0.1)),
        _poly(_rect(0.58, 0.05, 0.72, 0.38)),
        _poly(_rect(0.82, 0.05, 0.96, 0.3)),
    ],
    "umbrella": lambda: [
        _poly(_ellipse(0, 0.05, 1.0, 0.85, 180.0, 360.0, 30)),
        _line([(0, 0.0), (0, 0.75), (-0.12, 0.9), (-0.3, 0.78)], 0.07),
    ],
    "mushroom": lambda: [_poly(_ellipse(0, 0.0, 0.95, 0.8, 180.0, 360.0, 30)), _poly(_rect(-0.25, -0.05, 0.25, 0.9))],
    "bell": lambda: [
        _poly(
            [
                (-0.2, -0.85),
                (0.2, -0.85),
                (0.5, -0.35),
                (0.58, 0.35),
                (0.9, 0.62),
                (-0.9, 0.62),
                (-0.58, 0.35),
                (-0.5, -0.35),
            ]
        ),
        _poly(_ellipse(0, 0.8, 0.17, 0.17)),
    ],
    "flag": lambda: [_poly(_rect(-0.8, -1.0, -0.64, 1.0)), _poly(_rect(-0.64, -1.0, 0.85, -0.12))],
    "cup": lambda: [
        _poly([(-0.62, -0.65), (0.45, -0.65), (0.35, 0.8), (-0.52, 0.8)]),
        _poly(_ellipse(0.55, 0.0, 0.36, 0.36)),
        _poly(_ellipse(0.55, 0.0, 0.18, 0.18), add=False),
    ],
    "boat": lambda: [
        _poly([(-1, 0.3), (1, 0.3), (0.65, 0.78), (-0.65, 0.78)]),
        _poly([(0.05, -1.0), (0.05, 0.2), (0.75, 0.2)]),
        _poly(_rect(-0.06, -1.0, 0.05, 0.3)),
    ],
    "fish": lambda: [
        _poly(_ellipse(-0.15, 0, 0.72, 0.42)),
        _poly([(0.4, 0), (1.0, -0.5), (1.0, 0.5)]),
        _poly(_ellipse(-0.52, -0.1, 0.09, 0.09), add=False),
    ],
}

FAMILIES: dict[str, dict[str, Callable[[], list[Primitive]]]] = {
    "polygons": POLYGONS,
    "curves": CURVES,
    "symbols": SYMBOLS,
    "icons": ICONS,
}

_IRREGULAR_PLURALS = {"cross": "crosses", "fish": "fish"}


def _build_categories() -> dict[str, Category]:
    out: dict[str, Category] = {}
    for family, table in FAMILIES.items():
        for name, draw in table.items():
            out[name] = Category(name, _IRREGULAR_PLURALS.get(name, name + "s"), family, draw)
    return out


CATEGORIES: dict[str, Category] = _build_categories()


def family_of(name: str) -> str:
    """The family a category belongs to; KeyError names the unknown category."""
    try:
        return CATEGORIES[name].family
    except KeyError:
        raise KeyError(f"unknown world category {name!r}; known: {sorted(CATEGORIES)}") from None


def categories_in(families) -> list[str]:
    """Sorted category names of the given families."""
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise KeyError(f"unknown world families {unknown}; known: {sorted(FAMILIES)}")
    return sorted(n for f in families for n in FAMILIES[f])
