"""The frozen CLIP that a config's ``MODEL`` node names, built the same way by every command.

``python -m meta cluster`` (CHC) and ``python -m meta train`` (meta-training) must see the same tower:
the same name and weights check, the same weight precision and, with ``MODEL.PRETRAINED`` empty, the
same random weights (seeded by ``SEED``), so that cached image features match the tower that reuses them.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from meta.model.backbone import check_model_name, check_precision, load_clip, quick_gelu_flag
from meta.model.precision import apply_tf32, resolve_weights


@dataclass(frozen=True)
class ClipSettings:
    """What builds the frozen CLIP: the ``MODEL`` node's keys and ``SEED``, typed (:meth:`from_cfg` reads them)."""

    backbone: str  # MODEL.BACKBONE, an open_clip architecture
    pretrained: str  # MODEL.PRETRAINED ("" = random weights, seeded by ``seed``)
    precision: str  # MODEL.PRECISION
    quick_gelu: str  # MODEL.QUICK_GELU: auto | on | off
    tf32: bool  # MODEL.TF32
    seed: int  # SEED

    @classmethod
    def from_cfg(cls, cfg) -> "ClipSettings":
        """The typed view of ``cfg.MODEL`` and ``cfg.SEED`` (a yacs node of :mod:`meta.config`)."""
        m = cfg.MODEL  # values as given: the builder's checks name the key of a wrong one
        return cls(m.BACKBONE, m.PRETRAINED, m.PRECISION, m.QUICK_GELU, m.TF32, int(cfg.SEED))


def clip_from_cfg(cfg, device: str, warn_random: bool = True):
    """``(clip, dims)`` for ``cfg.MODEL`` (``BACKBONE``, ``PRETRAINED``, ``PRECISION``, ``QUICK_GELU``): the typed
    view (:class:`ClipSettings`) built by :func:`clip_from_settings`."""
    return clip_from_settings(ClipSettings.from_cfg(cfg), device, warn_random)


def clip_from_settings(model: ClipSettings, device: str, warn_random: bool = True):
    """``(clip, dims)`` of ``model`` (the typed ``MODEL`` node and seed) on ``device`` (a resolved device name);
    ``warn_random`` keeps ``load_clip``'s warning when ``MODEL.PRETRAINED`` is empty (random weights: smoke runs).
    Bad keys raise a one-line ``ValueError`` naming ``MODEL.BACKBONE``, ``MODEL.PRECISION`` or ``MODEL.PRETRAINED``.
    """
    check_model_name(model.backbone, "MODEL.BACKBONE")
    check_precision(model.precision, "MODEL.PRECISION")
    apply_tf32(model.tf32, device)  # before any matmul of this process (meta.model.precision)
    torch.manual_seed(model.seed)  # identical random towers across commands, resumed runs and ranks
    with warnings.catch_warnings():
        if not warn_random and not model.pretrained:
            warnings.simplefilter("ignore")
        return load_clip(
            model.backbone,
            model.pretrained or None,
            device,
            resolve_weights(model.precision, device),
            quick_gelu_flag(model.quick_gelu),
            config_key="MODEL.PRETRAINED",
        )
