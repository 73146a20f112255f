"""The frozen CLIP that a config's ``MODEL`` node names, built the same way by every command.

``python -m meta cluster`` (CHC) and ``python -m meta train`` (meta-training) must see the same tower:
the same name and weights check, the same weight precision and, with ``MODEL.PRETRAINED`` empty, the
same random weights (seeded by ``SEED``), so that cached image features match the tower that reuses them.
"""

from __future__ import annotations

import warnings

import torch

from meta.model.backbone import check_model_name, check_precision, load_clip, quick_gelu_flag
from meta.model.precision import apply_tf32, resolve_weights


def clip_from_cfg(cfg, device: str, warn_random: bool = True):
    """``(clip, dims)`` for ``cfg.MODEL`` (``BACKBONE``, ``PRETRAINED``, ``PRECISION``, ``QUICK_GELU``).

    Args:
        cfg: a yacs node with ``MODEL`` and ``SEED``.
        device: a resolved device name (:func:`meta.model.backbone.resolve_device`).
        warn_random: keep ``load_clip``'s warning when ``MODEL.PRETRAINED`` is empty (random weights:
            only useful for smoke runs).

    Bad keys raise a one-line ``ValueError`` naming ``MODEL.BACKBONE``, ``MODEL.PRECISION`` or
    ``MODEL.PRETRAINED``.
    """
    check_model_name(cfg.MODEL.BACKBONE, "MODEL.BACKBONE")
    check_precision(cfg.MODEL.PRECISION, "MODEL.PRECISION")
    apply_tf32(cfg.MODEL.TF32, device)  # before any matmul of this process (meta.model.precision)
    torch.manual_seed(int(cfg.SEED))  # identical random towers across commands, resumed runs and ranks
    with warnings.catch_warnings():
        if not warn_random and not cfg.MODEL.PRETRAINED:
            warnings.simplefilter("ignore")
        return load_clip(
            cfg.MODEL.BACKBONE,
            cfg.MODEL.PRETRAINED or None,
            device,
            resolve_weights(cfg.MODEL.PRECISION, device),
            quick_gelu_flag(cfg.MODEL.QUICK_GELU),
            config_key="MODEL.PRETRAINED",
        )
