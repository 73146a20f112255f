"""Config keys of the GRAM Dassl trainers (``TRAINER.GRAM.*``) and their resolved view.

:func:`extend_cfg` is what a CoOp fork calls from its own ``extend_cfg`` (CoOp ``train.py``
L77-102 adds ``TRAINER.COOP`` etc. the same way, before any yaml is merged: yacs refuses keys that
do not exist yet).  It only *adds* missing keys, so keys a
fork already defined keep their values.

Which prompts a trainer learns is fixed by its name; the token counts come from the keys:

=============  ==========================  ===============================================
trainer        text context ``ctx``        visual prompts ``vpt``
=============  ==========================  ===============================================
GRAM_CoOp      ``N_CTX_TEXT`` vectors      none (image tower untouched)
GRAM_VPT       none (fixed ``TEMPLATE``)   ``N_CTX_VISION`` tokens, shallow or deep
UNIGRAM        ``N_CTX_TEXT`` vectors      ``N_CTX_VISION`` tokens
GRAM_IVLP      ``N_CTX_TEXT`` vectors in   ``N_CTX_VISION`` tokens in ``VPT_DEPTH`` layers
               ``TEXT_DEPTH`` layers       (``VPT_DEEP``), independent of the text prompts
GRAM_MaPLe     ``N_CTX_TEXT`` vectors in   none of its own: layer i < ``TEXT_DEPTH`` gets a learned
               ``TEXT_DEPTH`` layers       linear map of the text prompts of layer i (MaPLe)
=============  ==========================  ===============================================

``TEXT_DEPTH`` is IVLP's ``PROMPT_DEPTH_TEXT`` / MaPLe's ``PROMPT_DEPTH`` (0 = every layer).

``ENABLED False`` gives the plain baselines (CoOp, VPT, joint text+visual tuning: paper Table 4
row 5) with the very same code: no meta-initialisation, no gradient regulation.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from typing import Any, Optional

from yacs.config import CfgNode as CN

from meta.config import (
    CONSISTENCY_SPEC,
    GRAM_SETTINGS,
    PROMPT_SPEC,
    REMOVED,
    REMOVED_KEYS,
    START_SPEC,
    TEST_TIME_SPEC,
    table_fields,
)
from meta.finetune.engine import Naming, StartSpec, start_rule_problems
from meta.finetune.regulated import DEFAULT_LAUNCH, DEFAULT_REG_WINDOW
from meta.finetune.testtime import TestTimeSpec, spec_from
from meta.method import methods
from meta.method.consistency import ConsistencySpec
from meta.method.learners import import_learner_modules, learner_keys
from meta.method.prompts import DEFAULT_TEMPLATE, PromptSpec
from meta.model.backbone import quick_gelu_flag
from meta.model.clip_weights import (  # noqa: F401  (re-exported: the names this module always offered)
    OPENAI_CACHE_DIR,
    RANDOM_WEIGHTS,
    default_weights_path,
    open_clip_name,
    resolve_weights_key,
)
from meta.model.precision import DASSL_PRECISIONS as PRECISIONS
from meta.model.precision import resolve_precision  # noqa: F401  (re-exported: the trainers' name for it)

# Trainer name -> (learns text context, learns visual prompts), and the trainers whose visual prompts are
# produced from the text prompts (meta.method.prompts.PromptSpec.coupling): read from the learner table of
# meta/method/methods.yaml, the one place a prompt learner's structure is written down.
TRAINER_PROMPTS: dict[str, tuple[bool, bool]] = {
    name: (row.text, row.vision) for name, row in methods.learners().items()
}
TRAINER_COUPLING: dict[str, str] = {
    name: row.coupling for name, row in methods.learners().items() if row.coupling != "none"
}
# How errors name the engine's start fields (meta.finetune.engine.Naming): TRAINER.GRAM.<KEY>.
GRAM_NAMING = Naming(
    "TRAINER.GRAM",
    {
        "init_path": "INIT",
        "regulate": "REGULATE",
        "reg_window": "REG_WINDOW_IMAGES",
        "launch": "LAUNCH",
        "ctx_init": "CTX_INIT",
        "init_prompts": "INIT_PROMPTS",
        "vpt_init": "VPT_INIT",
        "vision_depth": "VPT_DEPTH",
        "template": "TEMPLATE",
    },
    dotted=True,
)
# TRAINER.GRAM.REG_WINDOW counted batches until the window was given in images everywhere; it stays in the
# node (unset) only so that a config that still sets it stops with a one-line error instead of meaning
# something else (gram_settings).
RENAMED_KEYS = {"REG_WINDOW": "REG_WINDOW_IMAGES"}
# Keys of options that were measured and dropped (meta.config.REMOVED_KEYS, the one table with the reason): they stay
# in the node unset (None) only so that a config that still sets one stops with that table's one-line error.
REMOVED_GRAM_KEYS = tuple(r.key.rsplit(".", 1)[1] for r in REMOVED_KEYS if r.key.startswith("TRAINER.GRAM."))


def _gram_defaults() -> CN:
    # A key that a spec field is built from takes that field's default (meta.settings_map says which key maps onto
    # which field and where the spelling differs from META's; tests/test_one_default.py fails on a second literal).
    node = CN()
    # --- GRAM on/off ------------------------------------------------------------------------
    node.ENABLED = False  # False = plain baseline (CoOp / VPT / joint); True needs INIT
    node.INIT = StartSpec.init_path  # meta-learned θ* (+ φ) from meta.finetune.init_io.export_gram_init (.safetensors)
    node.REGULATE = True  # with ENABLED: apply R_φ to every prompt gradient (paper Eq. 7); False = ablation
    node.INIT_PROMPTS = StartSpec.init_prompts  # with ENABLED: θ starts from the file's θ*; False = scratch θ, R_φ
    # from the file
    node.REG_WINDOW_IMAGES = DEFAULT_REG_WINDOW  # R_φ on the mean gradient of this many images (whole batches:
    # W / DATALOADER.TRAIN_X.BATCH_SIZE, rounded, >= 1), one step per window; 0 = the init file's meta-training
    # support size (k_way x n_support images)
    node.REG_WINDOW = None  # renamed REG_WINDOW_IMAGES (it counted batches): setting it is an error
    node.LAUNCH = DEFAULT_LAUNCH  # take the meta-trained step θ − α R_φ(mean train gradient) once before epoch 1
    node.NORM_PRESERVE = None  # removed (REMOVED_GRAM_KEYS): setting it is an error
    # --- prompts (paper §4 "Training Details": 4 tokens; UNIGRAM 2 text + 2 visual) ------------
    node.N_CTX_TEXT = PromptSpec.n_ctx_text  # M text context vectors (GRAM_CoOp, UNIGRAM): 4
    node.N_CTX_VISION = 4  # n visual prompt tokens per prompted layer (GRAM_VPT, UNIGRAM)
    node.VPT_DEEP = False  # False = shallow VPT (prompts at the input only)
    node.VPT_DEPTH = 0  # with VPT_DEEP: prompted layers; 0 = every layer of the vision tower
    node.TEXT_DEPTH = PromptSpec.text_depth  # J (1) text layers with learnable context (IVLP / MaPLe
    # PROMPT_DEPTH); 0 = every layer
    node.CTX_INIT = PromptSpec.ctx_init  # words to initialise the text context (e.g. "a photo of a"); "" = N(0, σ²),
    # σ = PromptSpec.init_std
    node.TEMPLATE = DEFAULT_TEMPLATE  # fixed text prompt when there is no text context (GRAM_VPT)
    node.VPT_INIT = (
        PromptSpec.vpt_init
    )  # baselines' visual tokens: normal | zeros | cls | patch_mean (meta.method.prompts)
    node.LEARNER = PromptSpec.learner  # prompt learner (meta.method.learners registry key): "clip" = the built-in one
    # the trainers above configure; a learner registered by your code is named here and reads these keys
    node.LEARNER_MODULES = []  # modules imported first that register your learners, e.g. ['my_learners']
    # --- zero-shot consistency (meta.method.consistency; fine-tuning loss CE + λ_t L_text + λ_v L_image) ---------
    node.CONSISTENCY_TEXT = ConsistencySpec.text_weight  # λ_t: 1 - mean cos to the hand-made prompt's text features
    # (KgCoOp uses 8.0)
    node.CONSISTENCY_IMAGE = ConsistencySpec.image_weight  # λ_v: L1 to the frozen image features, visual prompts only
    # (PromptSRC uses 10)
    # --- backbone ------------------------------------------------------------------------------
    node.MODEL_NAME = ""  # open_clip architecture; "" = from MODEL.BACKBONE.NAME ("ViT-B/16" -> "ViT-B-16")
    node.WEIGHTS = ""  # "" = ~/.cache/clip/<ViT-B-16>.pt (OpenAI TorchScript, as CoOp uses);
    #                            a local file; a cached open_clip tag; "none" = random weights (tests only)
    node.QUICK_GELU = "auto"  # auto | on | off  (auto: on for OpenAI weights, which were trained with it)
    node.PREC = "fp16"  # fp16 | fp32 | amp, as CoOp's PREC; CPU always runs fp32 (with a warning)
    # --- images --------------------------------------------------------------------------------
    # True = turn every image upright by its EXIF orientation before the transforms (meta.data.image_decode.
    # open_upright, the reader of `python -m meta.evaluation --exif-upright`); False = as stored, as Dassl's
    # read_image reads them (published CoOp-family numbers)
    node.EXIF_UPRIGHT = GramSettings.exif_upright
    # --- test-time tuning (meta.finetune.testtime, TPT's protocol): with ENABLED, every test image is scored after
    # TPT from the trained θ (R_φ on the entropy gradient when GRAM regulates); --eval-only does it for a saved θ
    node.TEST_TIME = CN()
    node.TEST_TIME.ENABLED = False
    node.TEST_TIME.VIEWS = TestTimeSpec.views  # the image and VIEWS - 1 random resized crops with flips
    node.TEST_TIME.CONFIDENT_SHARE = TestTimeSpec.confident_share  # views of lowest entropy the loss keeps
    node.TEST_TIME.STEPS = TestTimeSpec.steps  # AdamW steps per image
    node.TEST_TIME.LR = TestTimeSpec.lr
    node.TEST_TIME.WEIGHT_DECAY = TestTimeSpec.weight_decay
    node.TEST_TIME.OPTIMIZER = TestTimeSpec.optimizer  # adamw (TPT) | meta: the init file's step (LAUNCH True)
    node.TEST_TIME.PROTOTYPES = TestTimeSpec.prototypes  # none | nearest: R_φ reads the init file's CHC prototypes
    return node


def _merge_missing(node: CN, defaults: CN) -> None:
    """Add every key of ``defaults`` that ``node`` lacks (recursively); existing values stay."""
    for key, value in defaults.items():
        if key not in node:
            node[key] = value
        elif isinstance(value, CN) and isinstance(node[key], CN):
            _merge_missing(node[key], value)


def extend_cfg(cfg: CN) -> CN:
    """Add ``TRAINER.GRAM.*`` and ``DATASET.SUBSAMPLE_CLASSES`` to a Dassl config (idempotent).

    Call it after ``get_cfg_default()`` and before merging yaml files, like CoOp's
    ``extend_cfg``.  Keys that already exist (added by a fork or an earlier call) keep their values.
    """
    if cfg.is_frozen():
        raise RuntimeError("extend_cfg(cfg): cfg is frozen; call it before cfg.freeze() (and before merging yaml)")
    if "TRAINER" not in cfg:
        cfg.TRAINER = CN()
    if "GRAM" not in cfg.TRAINER:
        cfg.TRAINER.GRAM = CN()
    _merge_missing(cfg.TRAINER.GRAM, _gram_defaults())
    if "DATASET" not in cfg:
        cfg.DATASET = CN()
    if "SUBSAMPLE_CLASSES" not in cfg.DATASET:
        cfg.DATASET.SUBSAMPLE_CLASSES = "all"  # all | base | new (CoOp train.py L102)
    return cfg


def available_cpus() -> int:
    """CPUs this process may run on (the count torch's DataLoader compares ``num_workers`` with)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def effective_num_workers(wanted: int, device_type: str, cpus: int) -> int:
    """``DATALOADER.NUM_WORKERS`` for this machine: the configs' 8 exceed small machines' cores.

    At most ``cpus`` (torch's DataLoader warns above that); on CPU at most ``cpus - 1``, leaving one
    core to the model, which computes on the same cores.
    """
    limit = cpus if device_type == "cuda" else cpus - 1
    return max(0, min(int(wanted), limit))


def effective_settings_line(device_type: str, prec: tuple[str, str], workers: tuple[int, int], cpus: int) -> str:
    """One log line with the values that run where they differ from the config: ``(config, effective)`` pairs."""
    changes = []
    if prec[0] != prec[1]:
        changes.append(f"TRAINER.GRAM.PREC {prec[1]} (config {prec[0]})")
    if workers[0] != workers[1]:
        changes.append(f"DATALOADER.NUM_WORKERS {workers[1]} (config {workers[0]}, {cpus} CPUs)")
    return f"GRAM effective settings on {device_type}: " + ("; ".join(changes) if changes else "as configured")


@dataclass(frozen=True)
class GramSettings:
    """``TRAINER.GRAM`` resolved for one trainer: what to build, from which files."""

    trainer: str
    enabled: bool
    init_path: str
    regulate: bool
    n_ctx_text: int  # 0 when the trainer learns no text context
    n_ctx_vision: int  # 0 when the trainer learns no visual prompts
    vpt_deep: bool
    vpt_depth: int  # requested deep depth (0 = all layers); see vision_depth()
    ctx_init: str
    template: str
    model_name: str
    weights: Optional[str]  # None = random weights
    quick_gelu: Optional[bool]
    precision: str  # as requested; resolve_precision() gives what runs
    vpt_init: str  # start of scratch visual prompts (meta.method.prompts.VPT_INITS)
    text_depth: int  # J (0 = every layer); 0 without text context
    coupling: str  # "maple" for GRAM_MaPLe
    init_prompts: bool  # θ from the init file's θ* (False: scratch θ, R_φ only)
    reg_window_images: int  # images per regulated step (0 = support size; meta.finetune.engine.window_batches)
    launch: bool  # meta-trained step once before training (meta.finetune.regulated.launch_)
    start: StartSpec  # the engine's view of the start (θ's PromptSpec, depths 0 = all layers); errors name the keys
    consistency: ConsistencySpec = ConsistencySpec()  # zero-shot consistency weights (0 = off)
    learner: str = PromptSpec.learner  # prompt learner (meta.method.learners registry key)
    exif_upright: bool = False  # images turned upright by their EXIF orientation (False: as stored, as Dassl)
    test_time: Optional[TestTimeSpec] = None  # TPT on each test image (None: TRAINER.GRAM.TEST_TIME.ENABLED False)

    def vision_depth(self, vision_layers: int) -> int:
        """D, prompted vision layers: 0 without visual prompts, 1 shallow, else VPT_DEPTH (0 = all)."""
        if self.n_ctx_vision == 0:
            return 0
        if not self.vpt_deep:
            return 1
        depth = self.vpt_depth or vision_layers
        if not 1 <= depth <= vision_layers:
            raise ValueError(f"TRAINER.GRAM.VPT_DEPTH: expected 0 (all) or 1..{vision_layers}, got {self.vpt_depth}")
        return depth

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# The flags read as flags (True / False only); the keys that are spec fields are read by meta.config.table_fields.
FLAG_KEYS = ("ENABLED", "REGULATE", "LAUNCH", "VPT_DEEP")


def _check_node(g: CN, trainer: str, text: bool) -> dict[str, bool]:
    """The one-line errors of ``TRAINER.GRAM`` that need no other module: renamed and removed keys, flags,
    precision, consistency weights, text depth.  Returns the flags of :data:`FLAG_KEYS` by key."""
    for old, new in RENAMED_KEYS.items():
        if g[old] is not None:
            raise ValueError(
                f"TRAINER.GRAM.{old}: renamed TRAINER.GRAM.{new}, which counts images ({old} counted "
                f"batches); set {new} to the old value x DATALOADER.TRAIN_X.BATCH_SIZE, or 0 for the "
                f"meta-training support size"
            )
    for key in REMOVED_GRAM_KEYS:
        if g.get(key) is not None:
            raise ValueError(REMOVED[f"TRAINER.GRAM.{key}"].message())
    flags = {}
    for key in FLAG_KEYS:
        if not isinstance(g[key], bool):
            raise TypeError(f"TRAINER.GRAM.{key}: expected True or False, got {g[key]!r}")
        flags[key] = g[key]
    if g.PREC not in PRECISIONS:
        raise ValueError(f"TRAINER.GRAM.PREC: expected one of {'|'.join(PRECISIONS)}, got {g.PREC!r}")
    for key in ("CONSISTENCY_TEXT", "CONSISTENCY_IMAGE"):
        value = g[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"TRAINER.GRAM.{key}: expected a finite number >= 0 (0 = off), got {value!r}")
    if isinstance(g.VPT_DEPTH, bool) or not isinstance(g.VPT_DEPTH, int) or g.VPT_DEPTH < 0:
        raise ValueError(f"TRAINER.GRAM.VPT_DEPTH: expected 0 (all layers) or a layer count >= 1, got {g.VPT_DEPTH!r}")
    depth = g.TEXT_DEPTH
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0 or (depth != 1 and not text):
        raise ValueError(
            f"TRAINER.GRAM.TEXT_DEPTH: expected 0 (all layers) or >= 1 "
            f"{'' if text else '(1 for ' + trainer + ', which learns no text context) '}got {depth!r}"
        )
    return flags


def gram_settings(cfg: CN, trainer: Optional[str] = None) -> GramSettings:
    """Read and check ``cfg.TRAINER.GRAM`` for ``trainer`` (default ``cfg.TRAINER.NAME``), once: the keys that are
    spec fields through the key table (:data:`meta.config.KEY_FIELDS`), the Dassl spellings by hand."""
    trainer = trainer or cfg.TRAINER.NAME
    if trainer not in TRAINER_PROMPTS:
        raise KeyError(f"TRAINER.NAME: {trainer!r} is not a GRAM trainer ({', '.join(TRAINER_PROMPTS)})")
    if "GRAM" not in cfg.TRAINER:
        raise KeyError("TRAINER.GRAM is missing: call trainers.gram.extend_cfg(cfg) in your train.py's extend_cfg")
    g = cfg.TRAINER.GRAM
    text, vision = TRAINER_PROMPTS[trainer]
    flags = _check_node(g, trainer, text)
    node = "TRAINER.GRAM"
    prompt = table_fields(cfg, PROMPT_SPEC, node)  # n_ctx_text, ctx_init, template, vpt_init, text_depth, learner
    start = table_fields(cfg, START_SPEC, node)  # init_path, init_prompts, reg_window
    consistency = ConsistencySpec(**table_fields(cfg, CONSISTENCY_SPEC, node))
    exif_upright = table_fields(cfg, GRAM_SETTINGS, node)["exif_upright"]
    test_time = _test_time(cfg)
    n_vision = int(g.N_CTX_VISION) if vision else 0  # OWN: its default is the trainers' 4
    if not text:
        prompt.update(n_ctx_text=0, ctx_init="")
    if text and prompt["n_ctx_text"] < 1 and not prompt["ctx_init"]:
        raise ValueError(
            f"TRAINER.GRAM.N_CTX_TEXT: {trainer} needs at least 1 text context vector, got {prompt['n_ctx_text']}"
        )
    if vision and n_vision < 1:
        raise ValueError(f"TRAINER.GRAM.N_CTX_VISION: {trainer} needs at least 1 visual prompt token, got {n_vision}")
    enabled = flags["ENABLED"]
    init_path = os.path.expanduser(start["init_path"]) if start["init_path"] else ""
    if enabled and not init_path:
        raise ValueError(
            "TRAINER.GRAM.INIT: GRAM is enabled (TRAINER.GRAM.ENABLED True) but no meta-learned "
            "init file is given; set TRAINER.GRAM.INIT path/to/init.safetensors"
        )
    if not enabled and init_path:
        raise ValueError(
            f"TRAINER.GRAM.INIT is set ({init_path}) but TRAINER.GRAM.ENABLED is False; "
            "set ENABLED True to use it, or clear INIT for the plain baseline"
        )
    backbone = cfg.MODEL.BACKBONE.NAME
    model_name = g.MODEL_NAME or open_clip_name(backbone)
    if not model_name:
        raise ValueError(
            "TRAINER.GRAM.MODEL_NAME: empty, and MODEL.BACKBONE.NAME is empty too (expected e.g. ViT-B/16)"
        )
    # SPELLED: D as VPT_DEEP + VPT_DEPTH (False = shallow, D 1; 0 = every layer, as PromptSpec's 0)
    vpt_depth = g.VPT_DEPTH
    vision_depth = (vpt_depth if flags["VPT_DEEP"] else 1) if n_vision else 1
    weights = resolve_weights_key(g.WEIGHTS, backbone, model_name)
    try:
        quick_gelu = quick_gelu_flag(g.QUICK_GELU)
    except ValueError:
        raise ValueError(f"TRAINER.GRAM.QUICK_GELU: expected auto|on|off, got {g.QUICK_GELU!r}") from None
    import_learner_modules(g.LEARNER_MODULES, "TRAINER.GRAM.LEARNER_MODULES")
    if prompt["learner"] not in learner_keys():
        raise ValueError(f"TRAINER.GRAM.LEARNER: expected one of {'|'.join(learner_keys())}, got {prompt['learner']!r}")
    problems = start_rule_problems(
        vpt_init=prompt["vpt_init"],
        reg_window=start["reg_window"],
        template=prompt["template"],
        has_text=text,
        has_init=enabled,
        init_prompts=start["init_prompts"],
        regulate=flags["REGULATE"],
        ctx_init=prompt["ctx_init"],
    )
    if problems:
        key, what = problems[0]
        raise ValueError(f"{GRAM_NAMING.full(key)}: {what}")
    coupling = TRAINER_COUPLING.get(trainer, "none")
    spec = PromptSpec(
        **{**prompt, "text_depth": prompt["text_depth"] if text else 1},
        n_ctx_vision=n_vision,
        vision_depth=vision_depth,
        coupling=coupling,
    )
    regulate, launch = flags["REGULATE"] and enabled, flags["LAUNCH"] and enabled
    init_prompts = start["init_prompts"] or not enabled
    return GramSettings(
        trainer=trainer,
        enabled=enabled,
        init_path=init_path,
        regulate=regulate,
        n_ctx_text=spec.n_ctx_text,
        n_ctx_vision=n_vision,
        vpt_deep=flags["VPT_DEEP"],
        vpt_depth=vpt_depth,
        ctx_init=spec.ctx_init,
        template=spec.template,
        model_name=model_name,
        weights=weights,
        quick_gelu=quick_gelu,
        precision=str(g.PREC),
        vpt_init=spec.vpt_init,
        text_depth=prompt["text_depth"] if text else 0,
        coupling=coupling,
        init_prompts=init_prompts,
        reg_window_images=start["reg_window"],
        launch=launch,
        start=StartSpec(
            prompt=spec,
            init_path=init_path,
            init_prompts=init_prompts,
            regulate=regulate,
            reg_window=start["reg_window"],
            launch=launch,
            naming=GRAM_NAMING,
        ),
        consistency=consistency,
        learner=spec.learner,
        exif_upright=exif_upright,
        test_time=test_time,
    )


def _test_time(cfg: CN) -> Optional[TestTimeSpec]:
    """``TRAINER.GRAM.TEST_TIME`` as a :class:`TestTimeSpec` (None when not ENABLED); errors name the key."""
    node = "TRAINER.GRAM.TEST_TIME"
    enabled = cfg.TRAINER.GRAM.TEST_TIME.ENABLED
    if not isinstance(enabled, bool):
        raise TypeError(f"{node}.ENABLED: expected True or False, got {enabled!r}")
    if not enabled:
        return None
    return spec_from(table_fields(cfg, TEST_TIME_SPEC, node), lambda field: f"{node}.{field.upper()}")
