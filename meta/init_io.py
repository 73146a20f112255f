"""Export and import of the meta-learned initialisation θ* and regulator φ.

File format (one ``.safetensors`` file, nothing is unpickled on load):

* tensors ``prompt.ctx`` ``[M, d_t]`` and/or ``prompt.vpt`` ``[D, n, d_v]``;
  ``regulator.<ctx|vpt>.{gamma,beta}.{weight,bias}`` when φ was learned (plus the 0-d
  ``regulator.<name>.mix_logit`` with ``RegulatorSpec.mix``; the spec in the header carries every
  option the test-time regulator needs, and files written before an option existed load with its
  "off" default);
* header metadata key ``"gram"``: JSON with ``format_version``, ``backbone``
  (model name, weights file name, widths), ``prompt`` (token counts, depth),
  ``regulator`` (spec or null), ``shapes`` and free-form ``provenance``.

Loading validates the file against what the caller is about to build and
names every mismatching field in one error.

Also: :func:`export_coop_context` writes θ*_T in the form stock CoOp/CoCoOp
trainers load through ``MODEL.INIT_WEIGHTS`` (Dassl's ``load_pretrained_weights``
matches state-dict keys by name and shape: ``ctx`` ``[n_ctx, 512]`` for ViT-B/16),
as a plain tensor dict that ``torch.load(weights_only=True)`` accepts.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from safetensors import safe_open

from .backbone import ClipDims
from .prompts import PromptParams
from .regulator import GradientRegulator, RegulatorSpec

FORMAT_VERSION = 1


class InitMismatchError(ValueError):
    """The initialisation file does not fit the model being built."""


@dataclass
class GramInit:
    """A loaded initialisation: θ*, optional φ, and its metadata."""

    prompt: dict[str, torch.Tensor]
    regulators: dict[str, dict[str, torch.Tensor]]
    metadata: dict[str, Any]
    path: Optional[Path] = None

    def prompt_module(self) -> PromptParams:
        return PromptParams(ctx=self.prompt.get("ctx"), vpt=self.prompt.get("vpt"))

    def regulator_modules(self) -> dict[str, GradientRegulator]:
        """``{"ctx"|"vpt": R_φ}`` rebuilt from the stored spec and weights."""
        spec_d = self.metadata.get("regulator")
        if not spec_d or not self.regulators:
            return {}
        spec = RegulatorSpec(**spec_d)
        out = {}
        for name, tensors in self.regulators.items():
            reg = GradientRegulator(tensors["gamma.weight"].shape[0], spec)
            reg.load_state_dict(tensors)
            out[name] = reg
        return out


def export_gram_init(path: Union[str, Path], prompts: PromptParams,
                     regulators: Optional[Mapping[str, GradientRegulator]], dims: ClipDims,
                     provenance: Optional[dict] = None, weights: str = "") -> Path:
    """Write θ* (and φ) with metadata; returns the path written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, p in prompts.named_parameters():
        tensors[f"prompt.{name}"] = p.detach().float().cpu().contiguous()
    reg_spec = None
    for name, reg in (regulators or {}).items():
        reg_spec = reg.spec.as_dict()
        for k, v in reg.state_dict().items():
            tensors[f"regulator.{name}.{k}"] = v.detach().float().cpu().contiguous()
    meta = {
        "format_version": FORMAT_VERSION,
        "backbone": {"model_name": dims.model_name, "weights": Path(weights).name if weights else "",
                     "text_width": dims.text_width, "vision_width": dims.vision_width,
                     "vision_layers": dims.vision_layers},
        "prompt": {"n_ctx_text": prompts.n_ctx_text,
                   "n_ctx_vision": 0 if prompts.vpt is None else prompts.vpt.shape[1],
                   "vision_depth": 0 if prompts.vpt is None else prompts.vpt.shape[0]},
        "regulator": reg_spec,
        "shapes": {k: list(v.shape) for k, v in tensors.items()},
        "provenance": provenance or {},
    }
    tmp = path.with_suffix(path.suffix + ".tmp")
    save_file(tensors, str(tmp), metadata={"gram": json.dumps(meta, sort_keys=True)})
    tmp.replace(path)
    return path


def load_gram_init(path: Union[str, Path], expect: Optional[Mapping[str, Any]] = None,
                   config_key: str = "init") -> GramInit:
    """Read an initialisation file and check it against ``expect``.

    ``expect`` may hold any of ``text_width``, ``vision_width``, ``n_ctx_text``,
    ``n_ctx_vision``, ``vision_depth``, ``model_name``; each given value must match
    (``model_name`` only warns: the same widths can come from differently named configs).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{config_key}: GRAM initialisation file not found: {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise InitMismatchError(f"{config_key}: {path} is not a readable safetensors file ({err})") from err
    if "gram" not in header:
        raise InitMismatchError(f"{config_key}: {path} has no 'gram' metadata; was it written by export_gram_init?")
    meta = json.loads(header["gram"])
    if meta.get("format_version") != FORMAT_VERSION:
        raise InitMismatchError(f"{config_key}: {path} has format_version {meta.get('format_version')}, "
                                f"this code reads {FORMAT_VERSION}")
    prompt = {k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith("prompt.")}
    regs: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in tensors.items():
        if k.startswith("regulator."):
            _, pname, rest = k.split(".", 2)
            regs.setdefault(pname, {})[rest] = v
    found = {**meta["backbone"], **meta["prompt"]}
    problems = []
    for key, want in (expect or {}).items():
        if key == "model_name" or want is None:
            continue
        if key not in found:
            problems.append(f"{key}: file does not record it")
        elif found[key] != want:
            problems.append(f"{key}: file has {found[key]}, model expects {want}")
    if problems:
        raise InitMismatchError(f"{config_key}: {path} does not fit this model: " + "; ".join(problems))
    if expect and expect.get("model_name") and expect["model_name"] != found.get("model_name"):
        import warnings
        warnings.warn(f"{config_key}: {path} was meta-trained on {found.get('model_name')}, "
                      f"loading into {expect['model_name']} (widths match)", stacklevel=2)
    return GramInit(prompt=prompt, regulators=regs, metadata=meta, path=path)


def export_coop_context(path: Union[str, Path], ctx: torch.Tensor, epoch: int = 0) -> Path:
    """Write ``{"state_dict": {"ctx": [M, d_t]}, "epoch": epoch}`` for stock CoOp/CoCoOp ``MODEL.INIT_WEIGHTS``.

    Only plain tensors and ints: loadable with ``torch.load(..., weights_only=True)``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": {"ctx": ctx.detach().float().cpu().clone()}, "epoch": int(epoch)}, str(path))
    return path
