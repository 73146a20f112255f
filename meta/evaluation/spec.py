"""What to evaluate: the method (:class:`MethodSpec`) and how it is fine-tuned (:class:`TrainSpec`).

Defaults follow the paper's fine-tuning protocol, "the same training epochs (i.e. 10 epochs), training schedule, and
data augmentation settings in CoCoOp" (GRAM paper, Training Details), i.e. CoOp's
``configs/trainers/CoCoOp/vit_b16_c4_ep10_batch1_ctxv1.yaml`` (KaiyangZhou/CoOp): SGD, LR 0.002, 10 epochs, batch 1,
cosine schedule with one constant warm-up epoch at 1e-5, ``random_resized_crop`` + ``random_flip``; momentum 0.9 and
weight decay 5e-4 are Dassl's ``OPTIM`` defaults, the crop scale (0.08, 1.0) is Dassl's ``INPUT.RRCROP_SCALE`` default
(Dassl.pytorch ``dassl/config/defaults.py``).  Token counts: 4 per method, UNIGRAM 2 + 2 (paper, Training Details).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Optional

from meta.config import FINETUNE_EPOCHS, FINETUNE_LR, FINETUNE_MOMENTUM, FINETUNE_WEIGHT_DECAY, RRCROP_SCALE
from meta.finetune.engine import Naming, StartSpec, start_rule_problems
from meta.finetune.regulated import DEFAULT_LAUNCH
from meta.method import methods
from meta.method.consistency import ConsistencySpec
from meta.method.learners import get_learner
from meta.method.methods import Method
from meta.method.prompts import PromptSpec

OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULERS = ("cosine", "constant")
ORDERS = ("random", "sequential")
AUGMENTS = ("coop", "none")
CHOICES = {"optimizer": OPTIMIZERS, "scheduler": SCHEDULERS, "order": ORDERS, "augment": AUGMENTS}  # TrainSpec


@dataclass(frozen=True)
class MethodSpec:
    """One prompt-learning method.  Besides ``name`` (the label of result records and tables; presets: the paper's
    row name from ``meta/method/methods.yaml``) its fields are those of :class:`meta.method.prompts.PromptSpec` (θ's
    structure and scratch / word start; depths 0 = all layers) and :class:`meta.finetune.engine.StartSpec`, under the
    same names and with their defaults, plus ``launch`` and the consistency weights:

    Attributes:
        init_path: a GRAM init file (``meta.finetune.init_io.export_gram_init``); its θ* replaces the scratch / word
            start and its shapes must match the token counts.
        regulate: R_φ(gradient) before every optimiser step (paper Eq. 7), φ from ``init_path`` or an in-memory
            ``StartPoint`` passed to the evaluation (checked when the run starts).
        init_prompts: with ``init_path``, θ starts from θ* (True) or from the scratch / word start while R_φ still
            comes from the file (False: the "R_φ only" component rows).
        reg_window: regulation window W in images (:class:`meta.finetune.regulated.UpdateWindow`): R_φ once on the mean
            gradient of W images; 1 = the paper's literal Eq. 7 under batch 1; 0 = the init file's support size.
        launch: the meta-trained inner step once before the schedule (:func:`meta.finetune.regulated.launch_`); True
            needs ``init_path`` or a start point; None = ``DEFAULT_LAUNCH`` where θ / φ come from one (``launch_on``).
        consistency_text, consistency_image: λ of the zero-shot consistency terms of the fine-tuning loss
            (:mod:`meta.method.consistency`; 0 = off); the launch step keeps the meta-trained loss.

    With no prompt at all (``n_ctx_text == n_ctx_vision == 0``) the method is zero-shot CLIP: nothing is trained.
    """

    # defaults: the specs' these fields are built into (meta.settings_map, tests/test_one_default.py)
    name: str
    n_ctx_text: int = PromptSpec.n_ctx_text
    n_ctx_vision: int = PromptSpec.n_ctx_vision
    vision_depth: int = PromptSpec.vision_depth
    ctx_init: str = PromptSpec.ctx_init
    init_path: str = StartSpec.init_path
    regulate: bool = StartSpec.regulate
    template: str = PromptSpec.template
    init_std: float = PromptSpec.init_std
    vpt_init: str = PromptSpec.vpt_init
    text_depth: int = PromptSpec.text_depth
    coupling: str = PromptSpec.coupling
    init_prompts: bool = StartSpec.init_prompts
    reg_window: int = StartSpec.reg_window
    launch: Optional[bool] = None  # None = DEFAULT_LAUNCH where θ / φ come from a file or start point (launch_on)
    consistency_text: float = ConsistencySpec.text_weight
    consistency_image: float = ConsistencySpec.image_weight
    learner: str = PromptSpec.learner

    def consistency(self) -> ConsistencySpec:
        """The zero-shot consistency weights of the fine-tuning loss."""
        return ConsistencySpec(self.consistency_text, self.consistency_image)

    def launch_on(self, has_start: bool) -> bool:
        """Whether the launch step runs: ``launch`` when given, else the default where θ / φ come from an
        init file or start point (``has_start``)."""
        return bool(self.launch) if self.launch is not None else (DEFAULT_LAUNCH and has_start)

    def __post_init__(self) -> None:
        same = {
            k: getattr(self, k) for k in ("vpt_init", "reg_window", "template", "init_prompts", "regulate", "ctx_init")
        }
        problems = start_rule_problems(
            **same, has_text=bool(self.n_ctx_text or self.ctx_init), has_init=bool(self.init_path)
        )
        if problems:
            key, what = problems[0]
            raise ValueError(f"MethodSpec {self.name!r}: {key} {what}")
        for key in ("n_ctx_text", "n_ctx_vision"):
            if getattr(self, key) < 0:
                raise ValueError(f"MethodSpec {self.name!r}: {key} must be >= 0, got {getattr(self, key)}")
        if self.vision_depth < 0 or self.text_depth < 0:
            raise ValueError(
                f"MethodSpec {self.name!r}: vision_depth and text_depth must be >= 0 (0 = all layers), "
                f"got {self.vision_depth} and {self.text_depth}"
            )
        if self.init_path and self.zero_shot:
            raise ValueError(f"MethodSpec {self.name!r}: init_path given but the method has no prompts")
        try:
            self.consistency()
        except ValueError as err:
            raise ValueError(f"MethodSpec {self.name!r}: {err}") from None

    @property
    def zero_shot(self) -> bool:
        """True when the method has no learnable prompts (hand-made template, no training)."""
        return self.n_ctx_text == 0 and self.n_ctx_vision == 0 and not self.ctx_init

    @property
    def visual_prompts(self) -> bool:
        """True when the image tower carries prompts (image features cannot be cached)."""
        return get_learner(self.learner).spec_prompts_vision(self.prompt_spec())

    def prompt_spec(self) -> PromptSpec:
        """The :class:`meta.method.prompts.PromptSpec` of a scratch / word initialisation: every field of
        PromptSpec is a field of the same name here (:data:`SAME_NAMED`)."""
        return PromptSpec(**{name: getattr(self, name) for name in SAME_NAMED[PromptSpec]})

    def start_spec(self) -> StartSpec:
        """Where this method's fine-tuning starts, as the engine's one view of a start
        (:class:`meta.finetune.engine.StartSpec`: prompts, init file, R_φ, window, launch); errors name
        ``method '<name>'`` and the field."""
        return StartSpec(
            prompt=self.prompt_spec(),
            **{name: getattr(self, name) for name in SAME_NAMED[StartSpec]},
            launch=self.launch_on(True),
            launch_required=self.launch is True,
            naming=Naming(f"method {self.name!r}"),
        )

    def as_dict(self) -> dict:
        """The fields; the consistency weights only when set, so records of methods without them (and the keys
        derived from those records) read as they did before the terms existed."""
        out = asdict(self)
        for key in ("consistency_text", "consistency_image"):
            if not out[key]:
                del out[key]
        if out["learner"] == PromptSpec.learner:
            del out["learner"]
        return out


# The spec fields MethodSpec holds under the same name (its defaults are theirs); StartSpec's prompt, launch,
# launch_required and naming are built by start_spec.  A spec field MethodSpec lacks is an error at import.
SAME_NAMED: dict[type, tuple[str, ...]] = {
    PromptSpec: tuple(f.name for f in fields(PromptSpec)),
    StartSpec: tuple(
        f.name for f in fields(StartSpec) if f.name not in ("prompt", "launch", "launch_required", "naming")
    ),
}
_missing = [name for names in SAME_NAMED.values() for name in names if name not in MethodSpec.__dataclass_fields__]
if _missing:
    raise TypeError(f"MethodSpec lacks the spec fields {_missing}")


@dataclass(frozen=True)
class TrainSpec:
    """Few-shot fine-tuning schedule, augmentation and evaluation cadence.

    Attributes:
        epochs, batch_size: passes over the few-shot train set, images per step; as Dassl, the last incomplete batch
            is dropped when the train set holds at least one full batch.
        optimizer: ``sgd`` (CoOp) | ``adam`` | ``adamw``.
        lr, momentum, weight_decay: optimiser settings (SGD momentum; Adam ignores momentum).
        scheduler: ``cosine`` (CosineAnnealingLR, T_max = epochs, stepped per epoch) | ``constant``.
        warmup_epochs, warmup_lr: constant warm-up at ``warmup_lr`` before the schedule starts
            (Dassl's ConstantWarmupScheduler with WARMUP_RECOUNT, the trainers' schedule
            ``meta.finetune.schedule.epoch_scheduler``: epoch lrs 1e-5, 0.002, η(1), ...).
        augment: ``coop`` = random resized crop (``rrcrop_scale``, bicubic) + horizontal flip, as
            CoOp's ``["random_resized_crop", "random_flip", "normalize"]``; ``none`` = test transform.
        aug_views: with a frozen image tower, augmented views per train image encoded once (cached); image i uses view
            ``(offset_i + epoch) % aug_views`` (random ``offset_i``); 10 = CoCoOp's epochs, a fresh crop every epoch.
            Ignored with visual prompts (crops drawn online).
        eval_every_epoch: test after every epoch (and before the first), for paper Fig. 3a; else after the last.
        test_batch_size: images per forward at test time.
        order: batch order of every epoch: ``random`` (a permutation drawn from the run's seed) or
            ``sequential`` (the train set's own order, Dassl's ``DATALOADER.TRAIN_X.SAMPLER SequentialSampler``:
            with it and ``augment="none"`` the evaluator replays a Dassl trainer's run, tests/test_engine_agreement.py).
    """

    # the schedule's numbers shared with META.VAL_* are written once, in meta.config (FINETUNE_*, RRCROP_SCALE)
    epochs: int = FINETUNE_EPOCHS
    batch_size: int = 1
    optimizer: str = "sgd"
    lr: float = FINETUNE_LR
    momentum: float = FINETUNE_MOMENTUM
    weight_decay: float = FINETUNE_WEIGHT_DECAY
    scheduler: str = "cosine"
    warmup_epochs: int = 1
    warmup_lr: float = 1e-5
    augment: str = "coop"
    aug_views: int = 10
    rrcrop_scale: tuple = RRCROP_SCALE
    eval_every_epoch: bool = True
    test_batch_size: int = 100
    order: str = "random"

    def __post_init__(self) -> None:
        if self.epochs < 0:
            raise ValueError(f"TrainSpec.epochs must be >= 0, got {self.epochs}")
        if self.batch_size < 1:
            raise ValueError(f"TrainSpec.batch_size must be >= 1, got {self.batch_size}")
        for key, allowed in CHOICES.items():
            if getattr(self, key) not in allowed:
                raise ValueError(f"TrainSpec.{key} must be one of {allowed}, got {getattr(self, key)!r}")
        if self.augment == "coop" and self.aug_views < 1:
            raise ValueError(f"TrainSpec.aug_views must be >= 1 with augment='coop', got {self.aug_views}")
        if self.warmup_epochs < 0 or self.lr < 0 or self.warmup_lr < 0:
            raise ValueError("TrainSpec: warmup_epochs, lr and warmup_lr must be >= 0")
        lo, hi = self.rrcrop_scale
        if not 0 < lo <= hi <= 1:
            raise ValueError(f"TrainSpec.rrcrop_scale must satisfy 0 < lo <= hi <= 1, got {self.rrcrop_scale}")
        object.__setattr__(self, "rrcrop_scale", (float(lo), float(hi)))

    def as_dict(self) -> dict:
        d = asdict(self)
        d["rrcrop_scale"] = list(self.rrcrop_scale)
        return d

    def replace(self, **changes) -> "TrainSpec":
        return replace(self, **changes)


def _preset_fields(method: Method) -> dict:
    """The MethodSpec fields of a preset row: its label, token counts, and the rest of θ's structure where the row
    differs from MethodSpec's default (:data:`meta.method.methods.STRUCTURE_FIELDS`); ``regulate`` when on."""
    out = {"name": method.label}
    for row_field, field in methods.STRUCTURE_FIELDS.items():
        value = getattr(method, row_field)
        if row_field in ("text_tokens", "visual_tokens") or value != getattr(MethodSpec, field):
            out[field] = value
    if method.regulate:
        out["regulate"] = True
    return out


def table_fields(key: str) -> dict:
    """MethodSpec fields that the method table (``meta/method/methods.yaml``) fixes for row ``key`` beyond its
    preset: its label, token counts, whether θ* starts the prompts (``init``), whether R_φ regulates
    (``regulate``) and, for the paper-literal ``one_step`` rows, regulation window 1 without launch step.  A component
    row (e.g. ``gram_coop_reg_only``) is its preset plus these."""
    method = methods.get(key)
    out = _preset_fields(method)
    out.update({field: getattr(method, row_field) for row_field, field in methods.START_FIELDS.items()})
    if method.one_step:  # the paper-literal test time: R_φ on every image's gradient, no launch step
        out.update(reg_window=1, launch=False)
    return out


# Preset methods (paper Tables 1 and 4): the rows of the method table (meta/method/methods.yaml) that define
# their own preset, named by the paper's row label.
_PRESETS: dict[str, dict] = {key: _preset_fields(methods.get(key)) for key in methods.preset_keys()}
PRESET_NAMES = tuple(_PRESETS)
# Earlier names of presets (the table's ``aliases``), still accepted everywhere a preset key is.
PRESET_ALIASES: dict[str, str] = {alias: key for key in PRESET_NAMES for alias in methods.get(key).aliases}


def preset_key(key: str) -> str:
    """The stable preset key for ``key`` (an alias is mapped to its key); KeyError if unknown."""
    key = PRESET_ALIASES.get(key, key)
    if key not in _PRESETS:
        raise KeyError(f"unknown method preset {key!r}; known: {', '.join(PRESET_NAMES)}")
    return key


def is_gram_preset(key: str) -> bool:
    """True for the presets that start from a GRAM init file and regulate gradients."""
    return bool(_PRESETS[preset_key(key)].get("regulate"))


def method_preset(key: str, init_path: str = "", in_memory: bool = False, **overrides) -> MethodSpec:
    """A named method: ``zsclip``, ``coop``, ``gram_coop``, ``vpt``, ``gram_vpt``, ``joint``, ``unigram``
    (``coop_gram`` / ``vpt_gram`` are accepted aliases, :data:`PRESET_ALIASES`).

    GRAM presets (``gram_*``, ``unigram``) need ``init_path`` unless the run gets an in-memory
    ``StartPoint`` (meta-validation; pass ``in_memory=True``); ``overrides`` replace any field
    (e.g. ``regulate=False`` for the "w/o regulator" ablation, ``vision_depth=12`` for deep VPT).
    """
    key = preset_key(key)
    fields = dict(_PRESETS[key])
    if init_path:
        fields["init_path"] = init_path
    fields.update(overrides)
    if (fields.get("regulate") or fields.get("launch") is True) and not fields.get("init_path") and not in_memory:
        what = "regulate" if fields.get("regulate") else "launch"
        raise ValueError(f"method preset {key!r} needs a GRAM init file (init_path / --init) for {what}")
    return MethodSpec(**fields)
