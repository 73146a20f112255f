"""The regulated fine-tuning engine shared by the Dassl trainers and the standalone evaluator.

One front door for test-time use of GRAM, so that what ``train.py`` runs is what the evaluator measured:

* :func:`build_start` turns one :class:`StartSpec` into a :class:`Start`: θ (scratch, word-initialised, a GRAM init
  file's θ*, or an in-memory :class:`StartPoint`), R_φ, the regulation window in images (0 resolved to the
  meta-training support size), the launch step and a JSON-able provenance dict;
* :class:`RegulatedStepper` and :func:`window_batches` (from :mod:`meta.finetune.regulated`) are the update of every
  training batch and the one conversion of a window in images into backward passes;
* :func:`start_rule_problems` holds the rules that the evaluator's ``MethodSpec`` and the Dassl ``TRAINER.GRAM`` keys
  share; each caller words the key names its own way.

Dassl's loop, loaders and transforms stay in ``trainers/gram``; cached features, batch order and augmented views
in ``meta.evaluation``.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch
from torch import nn

from meta.finetune.init_io import load_gram_init
from meta.finetune.regulated import (  # noqa: F401  (RegulatedStepper, window_batches: re-exported)
    DEFAULT_REG_WINDOW,
    GradientRegulation,
    LaunchStep,
    RegulatedStepper,
    launch_step_of,
    resolve_window,
    window_batches,
)
from meta.method.learners import check_start_structure, init_expectations
from meta.method.metrics import count_correct  # noqa: F401  (re-exported with RegulatedStepper: the loops use both)
from meta.method.prompts import VPT_INITS, PromptParams, PromptSpec
from meta.method.regulator import GradientRegulator
from meta.model.backbone import ClipDims


# ------------------------------------------------------------------------------------------------ rules
def start_rule_problems(
    *,
    vpt_init: str,
    reg_window: Any,
    template: str,
    has_text: bool,
    has_init: bool,
    init_prompts: bool,
    regulate: bool,
    ctx_init: str,
) -> list[tuple[str, str]]:
    """Problems with the fields that say where fine-tuning starts, as ``(field, "must be ...")`` pairs.

    ``field`` is one of ``vpt_init``, ``reg_window``, ``template``, ``ctx_init`` and ``init_prompts``; the
    caller prefixes its own key name (``MethodSpec 'x': reg_window`` / ``TRAINER.GRAM.REG_WINDOW_IMAGES``).
    ``has_text``: the method learns a text context; ``has_init``: θ* / φ come from a GRAM init file.
    """
    bad_window = isinstance(reg_window, bool) or not isinstance(reg_window, int) or reg_window < 0
    rules = [
        (vpt_init not in VPT_INITS, "vpt_init", f"must be one of {', '.join(VPT_INITS)}, got {vpt_init!r}"),
        (
            bad_window,
            "reg_window",
            f"must be >= 0 images (an integer; 0 = the meta-training support size), got {reg_window!r}",
        ),
        (
            not has_text and "{}" not in template,
            "template",
            f"must contain '{{}}' for the class name, got {template!r}",
        ),
        (
            has_init and init_prompts and ctx_init and has_text,
            "ctx_init",
            "must be empty when θ* comes from the init file (both initialise the text context); give only one, or "
            "take only R_φ from the file (init_prompts False)",
        ),
        (
            has_init and not (init_prompts or regulate),
            "init_prompts",
            "or regulate must be on when an init file is given: neither θ* (init_prompts) nor R_φ (regulate) is "
            "taken from it",
        ),
    ]
    return [(name, what) for bad, name, what in rules if bad]


# ------------------------------------------------------------------------------------------------ start
@dataclass
class StartPoint:
    """An in-memory θ (and φ, ``{name: R_φ}`` as ``GRAMMetaLearner.regulators()``) to fine-tune from, e.g. the live
    meta-parameters during meta-validation; copied before use, so the caller's tensors are never modified nor frozen.
    """

    prompts: PromptParams
    regulators: Mapping[str, GradientRegulator] = field(default_factory=dict)
    label: str = "in_memory"
    launch: Optional[LaunchStep] = None  # the meta-trained inner step (needed by a required launch)
    support_size: int = 0  # images per meta-training support set (for reg_window 0)
    prototypes: Optional[Any] = None  # meta.method.prototypes.Prototypes of a conditioned R_φ


@dataclass(frozen=True)
class Naming:
    """How one interface names the start fields in errors: ``where`` prefixes a sentence (``"method 'x'"``,
    ``"TRAINER.GRAM"``), ``keys`` maps a field to the interface's key (unlisted: its own name), ``dotted`` spells full
    keys ``where.KEY`` (yacs) rather than ``where KEY``."""

    where: str
    keys: Mapping[str, str] = field(default_factory=dict)
    dotted: bool = False

    def key(self, name: str) -> str:
        return self.keys.get(name, name)

    def full(self, name: str) -> str:
        return f"{self.where}{'.' if self.dotted else ' '}{self.key(name)}"


@dataclass(frozen=True)
class StartSpec:
    """Where fine-tuning starts: θ's structure and scratch start (``prompt``), a GRAM init file (``init_path``, ``""`` =
    none), θ from θ* (``init_prompts``), R_φ on (``regulate``), the window in images (``reg_window``, 0 = the support
    size), the meta-trained inner step (``launch``; ``launch_required``: a missing one is an error) and how errors
    name the fields (``naming``)."""

    prompt: PromptSpec
    init_path: str = ""
    init_prompts: bool = True
    regulate: bool = False
    reg_window: int = DEFAULT_REG_WINDOW
    launch: bool = False
    launch_required: bool = False
    naming: Naming = Naming("start")


@dataclass
class Start:
    """What :func:`build_start` built: θ (trainable), R_φ or None, ``window`` images per regulated step (1 without
    R_φ), the launch step or None, ``info`` (JSON-able: ``source``, ``reg_window``, ``launch``, ``prompt_sha256``,
    ...) and the init file's ``metadata`` (``{}`` without one)."""

    prompts: PromptParams
    regulation: Optional[GradientRegulation]
    window: int
    launch: Optional[LaunchStep]
    info: dict
    metadata: dict = field(default_factory=dict)


def prompt_digest(prompts: Optional[nn.Module]) -> str:
    """SHA-256 (hex) of the prompt tensors' fp32 bytes, in parameter-name order ("" for no prompts)."""
    if prompts is None:
        return ""
    h = hashlib.sha256()
    for name, p in sorted(prompts.named_parameters()):
        t = p.detach().float().cpu().contiguous()
        h.update(f"{name}|{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).numpy().tobytes())
    return h.hexdigest()


def build_start(
    spec: StartSpec,
    clip: nn.Module,
    dims: ClipDims,
    generator: Optional[torch.Generator] = None,
    point: Optional[StartPoint] = None,
    device: Optional[torch.device] = None,
) -> Start:
    """θ, R_φ, the window (images), the launch step and provenance at the start of fine-tuning.

    Scratch θ is drawn first, from ``generator`` (None = torch's global RNG), so an "R_φ only" run starts where its
    baseline does; a GRAM file is validated against ``spec.prompt`` before anything is built, a ``point`` copied and
    shape-checked.  ``device``: where θ and R_φ live (default: the CLIP's).
    """
    n = spec.naming
    if spec.prompt.n_ctx_vision and not 0 <= spec.prompt.vision_depth <= dims.vision_layers:
        raise ValueError(
            f"{n.full('vision_depth')}: expected 0 (all) or 1..{dims.vision_layers}, got {spec.prompt.vision_depth}"
        )
    device = device if device is not None else clip.token_embedding.weight.device
    from_file = bool(spec.init_path)
    scratch = None
    if not ((from_file or point is not None) and spec.init_prompts):
        scratch = PromptParams.from_spec(spec.prompt, clip, dims, generator=generator)
    regulators: Mapping[str, GradientRegulator] = {}
    prototypes = None  # of a conditioned R_φ (meta.method.prototypes.Prototypes)
    launch: Optional[LaunchStep] = None
    metadata: dict = {}
    window = 1
    if point is not None:
        if from_file or spec.prompt.ctx_init:
            raise ValueError(
                f"{n.where}: a start point replaces {n.key('init_path')}/{n.key('ctx_init')}; give one of them"
            )
        if spec.init_prompts:
            prompts = copy.deepcopy(point.prompts)
            for p in prompts.parameters():
                p.requires_grad_(True)
                p.grad = None  # a live meta-learner's θ may carry its outer gradient along
        else:
            prompts = scratch
        check_start_structure(spec.prompt, dims, prompts, n.where)
        if spec.regulate:
            if not point.regulators:
                raise ValueError(f"{n.where}: {n.key('regulate')}=True but the start point has no regulators")
            regulators, prototypes = dict(point.regulators), point.prototypes
            if spec.reg_window == 0 and point.support_size < 1:
                raise ValueError(
                    f"{n.where}: {n.key('reg_window')} 0 (the meta-training support size) needs StartPoint.support_size"
                )
            window = spec.reg_window or point.support_size
        if spec.launch and (spec.launch_required or point.launch is not None):
            if point.launch is None:
                raise ValueError(f"{n.where}: {n.key('launch')}=True but the start point has no LaunchStep")
            launch = point.launch
        info = {"source": "in_memory" if spec.init_prompts else "scratch", "label": point.label}
    elif from_file:
        source = f"{n.full('init_path')} {spec.init_path}"
        init = load_gram_init(
            spec.init_path, expect=init_expectations(spec.prompt, dims), config_key=n.full("init_path")
        )
        metadata = init.metadata
        prompts = init.prompt_module() if spec.init_prompts else scratch
        if spec.regulate:
            regulators, prototypes = init.regulator_modules(), init.prototypes()
            if not regulators:
                raise ValueError(
                    f"{n.where}: {n.key('regulate')}=True but {spec.init_path} holds no regulator φ; "
                    f"set {n.key('regulate')} False (θ* only)"
                )
            window = resolve_window(spec.reg_window, metadata, source=source)
        if spec.launch:
            launch = launch_step_of(metadata, source=source, explicit=spec.launch_required)
        info = {
            "source": "gram_file" if spec.init_prompts else "scratch",
            "path": str(spec.init_path),
            "provenance": metadata.get("provenance", {}),
            "regulator": metadata.get("regulator"),
        }
        if not spec.init_prompts:
            info.update(_scratch_info(spec.prompt))
    else:
        if spec.regulate or spec.launch_required:
            what = f"{n.key('regulate')}=True needs φ" if spec.regulate else f"{n.key('launch')}=True needs α"
            raise ValueError(f"{n.where}: {what}: set {n.key('init_path')} (a GRAM init file) or pass a StartPoint")
        prompts = scratch
        info = {"source": "words" if spec.prompt.ctx_init else "scratch", **_scratch_info(spec.prompt)}
    prompts = prompts.to(device)
    regulation = GradientRegulation(regulators, prototypes).to(device) if regulators else None
    if launch is not None:
        info["launch"] = {"alpha": launch.alpha, "steps": launch.steps, "momentum": launch.momentum}
    if regulation is not None:
        info["reg_window"] = window  # images per regulated step, resolved
    info["prompt_sha256"] = prompt_digest(prompts)
    return Start(prompts, regulation, window if regulation is not None else 1, launch, info, metadata)


def _scratch_info(prompt: PromptSpec) -> dict:
    return {
        "ctx_init": prompt.ctx_init,
        "init_std": prompt.init_std,
        "vpt_init": prompt.vpt_init if prompt.n_ctx_vision else "",
    }
