"""Build the frozen open_clip CLIP that every GRAM component shares.

The project's own architectures (tiny test and CPU-world models) live as JSON configs in ``meta/model/model_configs/``
and are registered with open_clip's model registry (``open_clip.add_model_config``), exactly like open_clip's built-in
configs.  Nothing here ever downloads: ``pretrained`` must be ``None`` (random weights, with a warning), a local file,
or a tag whose weights already sit in open_clip's cache.
"""

from __future__ import annotations

import logging
import os
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import open_clip
import torch
from torch import nn

from meta.model.clip_weights import looks_like_file

log = logging.getLogger(__name__)

MODEL_CONFIG_DIR = Path(__file__).resolve().parent / "model_configs"
_REGISTERED = False


def register_model_configs() -> None:
    """Add ``meta/model/model_configs`` to open_clip's registry (idempotent)."""
    global _REGISTERED
    if not _REGISTERED:
        open_clip.add_model_config(MODEL_CONFIG_DIR)
        _REGISTERED = True


@dataclass(frozen=True)
class ClipDims:
    """Widths and token counts of a CLIP that prompt shapes depend on."""

    model_name: str
    text_width: int  # d_t, width of token embeddings / text transformer
    vision_width: int  # d_v, width of the vision transformer tokens (a ResNet's: its attention pool's)
    embed_dim: int  # joint embedding width
    context_length: int  # text tokens (77 for OpenAI CLIP)
    text_layers: int
    vision_layers: int  # vision transformer blocks (a ResNet's: residual blocks)
    image_size: int  # input resolution in pixels
    num_patches: int  # patch tokens (without CLS)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class WeightsError(RuntimeError, ValueError):
    """CLIP weights that cannot be loaded (a ``RuntimeError`` as before; a ``ValueError`` for CLIs)."""


def check_model_name(model_name: str, key: str = "MODEL.BACKBONE") -> None:
    """Raise a one-line ``ValueError`` naming ``key`` if open_clip has no architecture ``model_name``."""
    register_model_configs()
    known = open_clip.list_models()
    if model_name not in known:
        import difflib

        close = difflib.get_close_matches(str(model_name), known, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else " (see open_clip.list_models())"
        raise ValueError(f"{key}: unknown open_clip architecture {model_name!r}{hint}")


def check_precision(precision: str, key: str = "MODEL.PRECISION") -> None:
    if precision not in ("fp32", "fp16", "bf16", "amp"):
        raise ValueError(f"{key}: expected fp32 | fp16 | bf16 | amp, got {precision!r}")


def resolve_device(name: str, key: str = "MODEL.DEVICE") -> str:
    """``auto`` -> ``cuda:<LOCAL_RANK>`` when CUDA is available, else ``cpu``; other names are checked.

    A malformed name (``gpu``) or a CUDA device this machine lacks raises a one-line ``ValueError`` naming ``key``.
    """
    if not name or name == "auto":
        return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ValueError(f"{key}: expected auto, cpu, cuda or cuda:<index>, got {name!r}") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"{key}: {name!r} asked for, but no CUDA GPU is available here; use cpu or auto")
        if device.index is not None and device.index >= count:
            raise ValueError(f"{key}: {name!r} asked for, but this machine has {count} CUDA device(s)")
    return name


def image_tower(model_name: str) -> str:
    """The image tower ``model_name``'s open_clip config builds, read from the config alone (no model is built):
    ``"ViT"`` (``VisionTransformer``), ``"ResNet"`` (``ModifiedResNet``: ``vision_cfg.layers`` lists its 4 stage
    depths, RN50 / RN101), ``"timm"``, or ``""`` for a name open_clip does not know."""
    register_model_configs()
    vision = (open_clip.get_model_config(model_name) or {}).get("vision_cfg")
    if vision is None:
        return ""
    return (
        "timm" if vision.get("timm_model_name") else "ResNet" if isinstance(vision["layers"], (list, tuple)) else "ViT"
    )


def check_visual_prompts(model_name: str, key: str, learner: str, runs_there: Sequence[str]) -> None:
    """Refuse ``learner``, which prompts the image tower, on a CLIP whose tower is no ViT (visual prompt tokens enter
    a ViT's token sequence: :mod:`meta.model.visual_encoder`): a one-line ``ValueError`` naming ``key`` and the
    learners that do run there (``runs_there``, text prompts only).  Reads the config alone: call it before any work."""
    tower = image_tower(model_name)
    if tower not in ("", "ViT"):
        raise ValueError(
            f"{key}: {model_name} has a {tower} image tower, which visual prompt tokens cannot enter, and {learner} "
            f"prompts it; on {model_name} run {', '.join(runs_there)} (text prompts only), or pick a ViT backbone"
        )


def clip_dims(clip: nn.Module, model_name: str = "") -> ClipDims:
    """Read the dimensions of an open_clip ``CLIP`` with a ViT or a ResNet image tower.

    A ResNet tower (``ModifiedResNet``) has no token sequence: ``vision_width`` is the width its attention pool
    reads (RN50: 2048), ``vision_layers`` its residual blocks, ``num_patches`` the grid cells pooled."""
    visual = clip.visual
    if hasattr(visual, "attnpool"):
        pos = visual.attnpool.positional_embedding  # [1 + grid², width]
        width, layers = pos.shape[1], sum(len(getattr(visual, f"layer{i}")) for i in range(1, 5))
    elif hasattr(visual, "transformer"):
        pos = visual.positional_embedding  # [1 + patches, width]
        width, layers = visual.conv1.out_channels, len(visual.transformer.resblocks)
    else:
        raise TypeError(
            f"GRAM needs a CLIP with a ViT or ResNet image tower (open_clip VisionTransformer or ModifiedResNet); "
            f"model {model_name!r} has {type(visual).__name__}"
        )
    image_size = visual.image_size
    image_size = image_size[0] if isinstance(image_size, (tuple, list)) else int(image_size)
    return ClipDims(
        model_name=model_name,
        text_width=clip.token_embedding.weight.shape[1],
        vision_width=width,
        embed_dim=clip.text_projection.shape[1]
        if isinstance(clip.text_projection, torch.Tensor)
        else clip.text_projection.out_features,
        context_length=clip.positional_embedding.shape[0],
        text_layers=len(clip.transformer.resblocks),
        vision_layers=layers,
        image_size=image_size,
        num_patches=pos.shape[0] - 1,
    )


def is_torchscript_archive(path: Union[str, Path]) -> bool:
    """True for OpenAI's released CLIP ``.pt`` files (TorchScript zip archives)."""
    try:
        with zipfile.ZipFile(path) as zf:
            return any(n.endswith("constants.pkl") or "/code/" in n for n in zf.namelist())
    except (zipfile.BadZipFile, OSError):
        return False


def freeze(module: nn.Module) -> nn.Module:
    """Switch ``module`` to eval mode and stop gradients to all its parameters."""
    module.eval()
    for p in module.parameters():
        p.requires_grad_(False)
    return module


def load_clip(
    model_name: str = "ViT-B-16",
    pretrained: Optional[str] = None,
    device: Union[str, torch.device] = "cpu",
    precision: str = "fp32",
    quick_gelu: Optional[bool] = None,
    config_key: str = "pretrained",
) -> tuple[nn.Module, ClipDims]:
    """Build a frozen open_clip CLIP without touching the network.

    ``pretrained``: ``None`` (random weights, warns), a local file (open_clip checkpoint, plain state dict or OpenAI's
    TorchScript ``ViT-B-16.pt``) or an already cached open_clip tag; ``quick_gelu`` ``None`` = on for OpenAI
    TorchScript files and ``*-quickgelu`` names; ``config_key`` named in errors.  Returns ``(clip, dims)``, every
    parameter frozen, in eval mode.
    """
    register_model_configs()
    check_precision(precision, "precision")
    oc_precision = "fp32" if precision == "amp" else precision
    if pretrained in ("", "none", "None"):
        pretrained = None
    if pretrained is None:
        warnings.warn(
            f"CLIP {model_name} is built with RANDOM weights (pretrained=None); "
            f"set {config_key} to a local weights file for meaningful numbers.",
            stacklevel=2,
        )
        clip = open_clip.create_model(
            model_name, pretrained=None, precision=oc_precision, device=device, force_quick_gelu=bool(quick_gelu)
        )
    else:
        looks_like_path = looks_like_file(pretrained)
        if looks_like_path and not os.path.isfile(pretrained):
            raise FileNotFoundError(
                f"{config_key}: CLIP weights file not found: {pretrained} "
                f"(expected a local open_clip checkpoint or OpenAI's TorchScript .pt)"
            )
        if looks_like_path and is_torchscript_archive(pretrained):
            if quick_gelu is False:
                warnings.warn(
                    "OpenAI TorchScript weights were trained with QuickGELU; quick_gelu=False is ignored for them",
                    stacklevel=2,
                )
            # open_clip rebuilds the architecture from the state dict, with QuickGELU.
            clip = open_clip.load_openai_model(pretrained, precision=oc_precision, device=device)
        else:
            if quick_gelu is None:
                quick_gelu = model_name.endswith("-quickgelu") or pretrained == "openai"
            try:
                clip = open_clip.create_model(
                    model_name,
                    pretrained=pretrained,
                    precision=oc_precision,
                    device=device,
                    force_quick_gelu=bool(quick_gelu),
                )
            except RuntimeError as err:
                raise WeightsError(
                    f"{config_key}: {pretrained!r} could not be loaded for {model_name}: {' '.join(str(err).split())}"
                ) from err
    clip = freeze(clip)
    return clip, clip_dims(clip, model_name)


def quick_gelu_flag(value: str) -> Optional[bool]:
    """Map ``MODEL.QUICK_GELU`` (auto|on|off) to ``load_clip``'s ``quick_gelu`` argument."""
    v = str(value).strip().lower()
    table = {"auto": None, "": None, "on": True, "true": True, "1": True, "off": False, "false": False, "0": False}
    if v not in table:
        raise ValueError(f"MODEL.QUICK_GELU: expected auto|on|off, got {value!r}")
    return table[v]
