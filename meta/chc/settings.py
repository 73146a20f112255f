"""Every ``CHC.*`` setting checked and typed, once, before a CHC run does any work.

The defaults and their meaning live in :func:`meta.config.get_meta_cfg_default` (``_chc_node``); this
module holds the values each key accepts and the typed view (:class:`ChcSettings`) that
:func:`read_chc_settings` builds at the edge (:func:`meta.chc.run_chc`), so nothing below reads the yacs
node.  :func:`check_chc_cfg` raises :class:`meta.infra.cli_errors.UserError` for the first bad value, so
``python -m meta cluster`` ends in one line naming the key: ``error: CHC.IMAGES.BATCH_SIZE: expected an integer
>= 1, got 0`` (not a numpy or HDBSCAN message after minutes of work).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, fields
from numbers import Integral, Real
from typing import Mapping, Optional, get_type_hints

from meta.config import config_value
from meta.infra.cli_errors import UserError
from meta.model.clip_config import ClipSettings

# key -> (smallest, largest) for integers; None = no bound on that side
INT_RANGES = {
    "INPUT.MAX_PAIRS": (0, None),  # 0 = all pairs
    "INPUT.MAX_FIELD_CHARS": (1, sys.maxsize),  # csv.field_size_limit takes a C long
    "INPUT.MAX_IMAGE_BYTES": (1, None),
    "INPUT.MAX_IMAGE_PIXELS": (1, None),
    "TEXT.BATCH_SIZE": (1, None),
    "TEXT.CHUNK_SIZE": (1, None),
    "TEXT.MAX_CAPTION_CHARS": (0, None),  # 0 = no cap
    "TOPICS.FIT_SAMPLE": (2, None),
    "TOPICS.UMAP_DIM": (1, None),
    "TOPICS.UMAP_NEIGHBORS": (2, None),  # umap-learn refuses n_neighbors < 2
    "TOPICS.MIN_CLUSTER_SIZE": (2, None),  # hdbscan refuses min_cluster_size < 2
    "TOPICS.MIN_SAMPLES": (0, None),  # 0 = hdbscan's default (= MIN_CLUSTER_SIZE)
    "TOPICS.MIN_WORD_LEN": (1, None),
    "TOPICS.PLOT_POINTS": (0, None),  # 0 = no picture
    "IMAGES.BATCH_SIZE": (1, None),
    "IMAGES.CHUNK_SIZE": (1, None),
    "IMAGES.DECODE_WORKERS": (0, None),  # 0 = decode in the calling thread
    "IMAGES.READ_THREADS": (1, None),  # 1 = read in the calling thread
    "DOMAINS.NUM": (1, None),
    "DOMAINS.MIN_PER_DOMAIN": (1, None),
    "DOMAINS.MINIBATCH_ABOVE": (0, None),
    "DOMAINS.N_INIT": (1, None),
}
# key -> (smallest, largest) for real numbers, both included; all must be finite
REAL_RANGES = {
    "INPUT.MAX_UNREADABLE_FRACTION": (0.0, 1.0),
    "INPUT.MAX_IMAGE_ASPECT": (1.0, None),  # longer side / shorter side: 1 = square images only
    "FILTER.THRESHOLD": (-1.0, 1.0),  # a cosine
    "FILTER.QUANTILE": (0.0, 1.0),
    "TOPICS.UMAP_MIN_DIST": (0.0, 1.0),  # umap-learn: 0 <= min_dist <= spread (1.0)
    "TOPICS.ASSIGN_QUANTILE": (0.0, 1.0),
    "TOPICS.PRESENCE_MIN_FRACTION": (0.0, 1.0),
    "IMAGES.CACHE_MAX_GB": (0.0, None),  # 0 = never cache decoded images
}
CHOICES = {
    "FILTER.MODE": ("none", "threshold", "quantile"),
    "TEXT.DTYPE": ("fp32", "bf16"),
    "TOPICS.UMAP_INIT": ("random", "spectral", "pca", "tswspectral"),  # umap-learn's init strings
    "IMAGES.AUTOCAST": ("none", "bf16", "fp16"),
    "IMAGES.DECODER": ("pil", "torchvision"),  # reference decoder | meta.chc.tensor_decode
}
NON_EMPTY_TEXT = ("INPUT.IMAGE_COLUMN", "INPUT.CAPTION_COLUMN", "TOPICS.UMAP_METRIC")


def _bounds(lo, hi) -> str:
    return f">= {lo}" if hi is None else f"in [{lo}, {hi}]"


def _keys_typed(annotation: str) -> list[str]:
    """``SECTION.KEY`` of each field of the typed sections annotated ``annotation`` (``"bool"``), in field order."""
    return [f"{name}.{f.name.upper()}" for name, kind in SECTIONS.items() for f in fields(kind) if f.type == annotation]


def check_int(key: str, value, lo: Optional[int], hi: Optional[int]) -> None:
    """``value`` is an integer (not a bool) within ``[lo, hi]``; else :class:`UserError` naming ``key``."""
    if (
        not isinstance(value, Integral)
        or isinstance(value, bool)
        or (lo is not None and value < lo)
        or (hi is not None and value > hi)
    ):
        raise UserError(key, f"expected an integer {_bounds(lo, hi)}, got {value!r}")


def check_real(key: str, value, lo: Optional[float], hi: Optional[float]) -> None:
    """``value`` is a finite real number within ``[lo, hi]``; else :class:`UserError` naming ``key``."""
    ok = (
        isinstance(value, Real)
        and not isinstance(value, bool)
        and math.isfinite(float(value))
        and (lo is None or value >= lo)
        and (hi is None or value <= hi)
    )
    if not ok:
        raise UserError(key, f"expected a finite number {_bounds(lo, hi)}, got {value!r}")


def check_chc_cfg(cfg) -> None:
    """Check every ``CHC.*`` value of ``cfg`` (and ``SEED``, which CHC's sampling uses) before any work.

    Raises:
        UserError: ``CHC.<KEY>: expected ..., got ...`` for the first bad value.
    """
    chc = cfg.CHC
    out = chc.OUTPUT_DIR
    if not isinstance(out, str) or not out.strip():
        raise UserError(
            "CHC.OUTPUT_DIR", f"expected a folder path, got {out!r} (an empty path would write into the current folder)"
        )
    for key, (lo, hi) in INT_RANGES.items():
        check_int(f"CHC.{key}", config_value(chc, key), lo, hi)
    for key, (lo, hi) in REAL_RANGES.items():
        check_real(f"CHC.{key}", config_value(chc, key), lo, hi)
    for key, allowed in CHOICES.items():
        value = config_value(chc, key)
        if value not in allowed:
            raise UserError(f"CHC.{key}", f"expected one of {'|'.join(allowed)}, got {value!r}")
    for key in (k for k in _keys_typed("str") if k not in CHOICES):  # CHOICES' keys are checked above
        value = config_value(chc, key)
        if not isinstance(value, str) or (key in NON_EMPTY_TEXT and not value.strip()):
            raise UserError(
                f"CHC.{key}", f"expected {'non-empty ' if key in NON_EMPTY_TEXT else ''}text, got {value!r}"
            )
    for key in _keys_typed("tuple[str, ...]"):
        value = config_value(chc, key)
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise UserError(f"CHC.{key}", f"expected a list of text, got {value!r}")
    for key in _keys_typed("bool"):
        value = config_value(chc, key)
        if not isinstance(value, bool):
            raise UserError(f"CHC.{key}", f"expected True or False, got {value!r}")
    template = chc.FILTER.TEMPLATE
    if template:
        try:
            filled = template.format("x")
        except (IndexError, KeyError, ValueError) as err:
            raise UserError(
                "CHC.FILTER.TEMPLATE",
                f"expected text with one '{{}}' for the caption, got {template!r} ({type(err).__name__}: {err})",
            ) from None
        if filled == template:
            raise UserError("CHC.FILTER.TEMPLATE", f"expected text with one '{{}}' for the caption, got {template!r}")
    topics = chc.TOPICS
    if topics.FIT_SAMPLE < topics.MIN_CLUSTER_SIZE:
        raise UserError(
            "CHC.TOPICS.FIT_SAMPLE",
            f"expected >= CHC.TOPICS.MIN_CLUSTER_SIZE ({topics.MIN_CLUSTER_SIZE}), got {topics.FIT_SAMPLE}",
        )
    check_int("SEED", cfg.SEED, 0, 2**32 - 1)  # numpy's default_rng and umap's random_state take it


@dataclass(frozen=True)
class _Section:
    """One ``CHC.<SECTION>`` node, typed: a field per key (the key lower-cased), values as checked, lists as
    tuples."""

    @classmethod
    def read(cls, node: Mapping):
        return cls(**{key.lower(): tuple(v) if isinstance(v, list) else v for key, v in node.items()})

    def node(self) -> dict:
        """``{KEY: value}`` as the yacs node holds it (lists): what stage fingerprints and ``hierarchy.json``
        record."""
        return {f.name.upper(): list(v) if isinstance(v := getattr(self, f.name), tuple) else v for f in fields(self)}


@dataclass(frozen=True)
class InputSettings(_Section):
    """``CHC.INPUT``: where the pairs are and the caps they pass (meanings: :mod:`meta.config`)."""

    shards: tuple[str, ...]
    manifest: str
    image_column: str
    caption_column: str
    image_root: str
    allow_outside_root: bool
    max_pairs: int
    max_field_chars: int
    max_unreadable_fraction: float
    max_image_bytes: int
    max_image_pixels: int
    max_image_aspect: float


@dataclass(frozen=True)
class FilterSettings(_Section):
    """``CHC.FILTER``: the optional CLIP image-text cosine filter."""

    mode: str
    threshold: float
    quantile: float
    template: str


@dataclass(frozen=True)
class TextSettings(_Section):
    """``CHC.TEXT``: the sentence embeddings of the kept captions."""

    model: str
    dtype: str
    batch_size: int
    chunk_size: int
    max_caption_chars: int


@dataclass(frozen=True)
class TopicSettings(_Section):
    """``CHC.TOPICS``: UMAP -> HDBSCAN on a sample, nearest centroid, cluster TF-IDF words."""

    fit_sample: int
    umap_dim: int
    umap_neighbors: int
    umap_min_dist: float
    umap_metric: str
    umap_init: str
    min_cluster_size: int
    min_samples: int
    assign_quantile: float
    presence_min_fraction: float
    min_word_len: int
    extra_stop_words: tuple[str, ...]
    plot_points: int


@dataclass(frozen=True)
class ImageSettings(_Section):
    """``CHC.IMAGES``: the CLIP image-feature stage."""

    batch_size: int
    chunk_size: int
    cache_max_gb: float
    decode_workers: int
    read_threads: int
    decoder: str
    autocast: str


@dataclass(frozen=True)
class DomainSettings(_Section):
    """``CHC.DOMAINS``: k-means of each topic's image features into visual domains."""

    num: int
    min_per_domain: int
    minibatch_above: int
    n_init: int


@dataclass(frozen=True)
class ChcSettings:
    """Everything a CHC run reads from its config, typed (:func:`read_chc_settings`)."""

    output_dir: str  # CHC.OUTPUT_DIR as given
    seed: int  # SEED
    device: str  # MODEL.DEVICE as given (meta.model.backbone.resolve_device resolves it)
    model: ClipSettings  # MODEL.*, SEED: the frozen CLIP
    input: InputSettings
    filter: FilterSettings
    text: TextSettings
    topics: TopicSettings
    images: ImageSettings
    domains: DomainSettings

    def node(self) -> dict:
        """The ``CHC`` node as plain JSON (``hierarchy.json``'s ``meta.settings.CHC``)."""
        sections = {f.name.upper(): getattr(self, f.name).node() for f in fields(self)[4:]}
        return {"OUTPUT_DIR": self.output_dir, **sections}


# CHC.<SECTION> -> its typed view (ChcSettings' fields after the first four); a section field's annotation also says
# how check_chc_cfg checks its key (ints and reals: INT_RANGES / REAL_RANGES)
SECTIONS = {name.upper(): kind for name, kind in list(get_type_hints(ChcSettings).items())[4:]}


def read_chc_settings(cfg) -> ChcSettings:
    """Check ``cfg`` (:func:`check_chc_cfg`: one-line errors naming the key) and read it into
    :class:`ChcSettings`, once."""
    check_chc_cfg(cfg)
    sections = [kind.read(cfg.CHC[name]) for name, kind in SECTIONS.items()]
    return ChcSettings(cfg.CHC.OUTPUT_DIR, int(cfg.SEED), str(cfg.MODEL.DEVICE), ClipSettings.from_cfg(cfg), *sections)
