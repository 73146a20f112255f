"""Where a Dassl run's CLIP weights come from: names and paths only (no torch), so a launcher can check the file
before it starts a single run.

``TRAINER.GRAM.WEIGHTS`` (``trainers/gram/config.py``): ``""`` = the file OpenAI's ``clip`` package caches for the
backbone (``~/.cache/clip/ViT-B-16.pt`` for ``ViT-B/16``, as CoOp's ``load_clip_to_cpu`` reads it), ``none`` /
``random`` = random weights (tests), else a local file or a cached open_clip tag (:func:`looks_like_file`
tells them apart, as :func:`meta.model.backbone.load_clip` does).
"""

from __future__ import annotations

import os
from typing import Optional

RANDOM_WEIGHTS = ("none", "random")  # TRAINER.GRAM.WEIGHTS values that mean "no pretrained weights"
OPENAI_CACHE_DIR = "~/.cache/clip"  # where OpenAI's clip package (CoOp's load_clip_to_cpu) keeps its .pt files
WEIGHTS_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")


def open_clip_name(backbone_name: str) -> str:
    """OpenAI/CoOp backbone name -> open_clip architecture name ("ViT-B/16" -> "ViT-B-16")."""
    return backbone_name.strip().replace("/", "-")


def default_weights_path(backbone_name: str) -> str:
    """Where OpenAI's clip package caches ``backbone_name``: ``~/.cache/clip/ViT-B-16.pt`` for "ViT-B/16"."""
    return os.path.join(os.path.expanduser(OPENAI_CACHE_DIR), open_clip_name(backbone_name) + ".pt")


def looks_like_file(value: str) -> bool:
    """A path (has a separator or a weights suffix) rather than an open_clip pretrained tag."""
    return os.sep in value or value.endswith(WEIGHTS_SUFFIXES)


def resolve_weights_key(weights_key: object, backbone: str, model_name: str) -> Optional[str]:
    """The weights ``TRAINER.GRAM.WEIGHTS`` names: ``None`` for random weights, else a path (``~`` expanded) or a tag.

    ``backbone``: ``MODEL.BACKBONE.NAME``; ``model_name``: the open_clip architecture it runs (for the default path
    when the backbone name is empty).
    """
    key = str(weights_key).strip()  # a yaml null reaches the trainer as "None": random weights
    if key.lower() in RANDOM_WEIGHTS:
        return None
    return os.path.expanduser(key) if key else default_weights_path(backbone or model_name)


def check_weights_file(weights: Optional[str], key: str, unset: bool = False) -> None:
    """A one-line ``FileNotFoundError`` naming ``key`` when ``weights`` (as :func:`resolve_weights_key` returns it)
    is a path with no file; ``unset``: the key was empty, so the path is the default in OpenAI's cache."""
    if weights is None or not looks_like_file(weights) or os.path.isfile(weights):
        return
    name, folder = os.path.basename(weights), os.path.dirname(weights)
    hint = f"{key} is unset: put OpenAI's {name} in {folder}, or pass {key} /path/to/{name}" if unset else ""
    hint = hint or "expected a local open_clip checkpoint or OpenAI's TorchScript .pt"
    raise FileNotFoundError(f"{key}: CLIP weights file not found: {weights} ({hint})")
