"""What is built from the ``META`` config node (meta-training / prompt pre-training): the loop's, the
regulator's and the prompts' specs, the checks yacs cannot do, and the config hash a resume compares.
The node's defaults, each with where it came from, are in :func:`meta.config.add_metatrain_cfg`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from yacs.config import CfgNode as CN

from meta.config import (
    CONSISTENCY_SPEC,
    META_SPEC,
    OUTER_SPEC,
    PROMPT_SPEC,
    REGULATOR_SPEC,
    REMOVED,
    START_SPEC,
    TEST_TIME_SPEC,
    TRAIN_SPEC,
    add_metatrain_cfg,  # noqa: F401 (re-exported: the META schema beside its specs)
    config_value,
    get_meta_cfg_default,
    saved_removed_problem,
    table_fields,
)
from meta.data.input_limits import image_caps
from meta.finetune.engine import Naming, StartSpec
from meta.method.consistency import ConsistencySpec
from meta.method.learners import DEFAULT_LEARNER, get_learner, import_learner_modules, learner_keys
from meta.method.prompts import COUPLINGS, VPT_INITS, PromptSpec
from meta.method.prototypes import CONTEXT_DIM
from meta.method.regulator import RegulatorSpec
from meta.model.clip_config import ClipSettings
from meta.model.precision import resolve_autocast

if TYPE_CHECKING:
    from meta.evaluation.spec import TrainSpec
    from meta.metatrain.data import HierarchySource
    from meta.metatrain.outer import OuterSpec
    from meta.metatrain.tasks import TaskSampler
    from meta.method.gram import MetaSpec

MODES = ("gram", "pretrain", "testtime")  # testtime: GRAM meta-trained for test-time tuning

# Keys that steer how a run is executed or observed, not its numbers: they may change on ``--resume``; where the tasks
# come from (META.HIERARCHY, TASKS.IMAGE_FOLDER, CHC.*) too, compared by content (data.hierarchy_fingerprint).
RUN_CONTROL_KEYS = frozenset(
    """OUTPUT_DIR MODEL.DEVICE META.STEPS META.CHECKPOINT_EVERY META.LOG_DETAIL_EVERY META.VAL_EVERY META.VAL_TASKS
    META.VAL_FT_STEPS META.VAL_FT_LR META.VAL_FT_MOMENTUM META.VAL_PROTOCOL META.VAL_EPOCHS META.VAL_FT_WEIGHT_DECAY
    META.VAL_RRCROP_SCALE META.VAL_REG_WINDOW META.VAL_LAUNCH META.FEATURE_CHECK META.PROGRESS META.TENSORBOARD
    META.FINGERPRINT META.EXPORT_NAME META.COOP_CTX_NAME META.HIERARCHY TASKS.IMAGE_FOLDER""".split()
)
RUN_CONTROL_PREFIXES = ("CHC.",)

# Keys added after runs were saved without them: the value they had then, where not today's default.
BEHAVIOUR_BEFORE_KEY: dict[str, Any] = {"META.PROMPT.VPT_INIT": "normal"}
# Keys that change nothing while the count named here is 0 in both runs (no visual tokens to initialise).
UNUSED_WHILE_ZERO: dict[str, str] = {"META.PROMPT.VPT_INIT": "META.PROMPT.N_CTX_VISION"}


INDEX_BYTES = 16  # bytes a step holds per image before any tensor exists: int64 item index and label
# CLIP's text: start, M context tokens, class name (>= 1), full stop, end; reaching the last position reads as
# truncated (meta.model.text_encoder), so M <= context length - 5.
TEXT_TOKENS_BESIDES_CONTEXT = 5


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


# The checks of one key each, as (key, holds, what it must be): ``KEY: expected WHAT, got VALUE`` when one fails.
_RULES: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("OUTPUT_DIR", lambda v: bool(str(v).strip()), "a folder path (empty would write into the current folder)"),
    ("META.MODE", lambda v: v in MODES, " | ".join(MODES)),
    ("META.STEPS", lambda v: v >= 1, "an integer >= 1 (0 steps would export the untrained prompts)"),
    ("META.META_BATCH", lambda v: v >= 1, "an integer >= 1"),
    ("META.INNER_STEPS", lambda v: v >= 1, "an integer >= 1"),
    ("META.INNER_MOMENTUM", lambda v: 0.0 <= v < 1.0, "a number in [0, 1)"),
    ("META.INNER_WEIGHT_DECAY", lambda v: v >= 0, "a number >= 0"),
    ("META.INNER_SUPPORT", lambda v: v in ("repeat", "split"), "repeat | split"),
    ("META.QUERY_BEFORE_WEIGHT", lambda v: v >= 0, "a number >= 0"),
    ("META.TASK_BATCHING", lambda v: v in ("auto", "on", "off"), "auto | on | off"),
    ("META.REGULATOR.WEIGHT_DECAY", lambda v: v >= 0, "a number >= 0"),
    ("META.VAL_FT_STEPS", lambda v: v >= 0, "an integer >= 0"),
    ("META.VAL_PROTOCOL", lambda v: v in ("downstream", "one_step"), "downstream | one_step"),
    ("META.VAL_EPOCHS", lambda v: v >= 1, "an integer >= 1"),
    ("META.VAL_REG_WINDOW", lambda v: v >= 0, "an integer >= 0 (0 = the support size)"),
    ("META.VAL_RRCROP_SCALE", lambda v: len(v) == 2 and 0 < v[0] <= v[1] <= 1, "(lo, hi) with 0 < lo <= hi <= 1"),
    ("META.CHECKPOINT_EVERY", lambda v: v >= 1, "an integer >= 1"),
    ("META.OPTIMIZER", lambda v: v in ("adam", "sgd"), "adam | sgd"),
    *((f"META.{k}", _finite, "a finite number >= 0") for k in ("INNER_LR", "OUTER_LR_PROMPT", "OUTER_LR_REGULATOR")),
    ("META.GRAD_CLIP", _finite, "a finite number >= 0 (0 = off)"),
    *((f"META.{k}", _finite, "a finite number >= 0") for k in ("PRETRAIN.LR", "PROMPT.INIT_STD", "REGULATOR.INIT_STD")),
    ("META.AUTOCAST", lambda v: v in ("none", "bf16", "fp16"), "none | bf16 | fp16"),
    ("META.PROMPT.VPT_INIT", lambda v: v in VPT_INITS, " | ".join(VPT_INITS)),
    ("META.PROMPT.TEXT_DEPTH", lambda v: v >= 0, "an integer >= 0 (0 = every layer)"),
    ("META.PROMPT.VISION_DEPTH", lambda v: v >= 0, "an integer >= 0 (0 = every layer)"),
    ("META.PROMPT.COUPLING", lambda v: v in COUPLINGS, " | ".join(COUPLINGS)),
    ("META.PRETRAIN.BATCH_SIZE", lambda v: v >= 1, "an integer >= 1"),
    ("META.PRETRAIN.WAYS", lambda v: v == 0 or v >= 2, "0 (all) or >= 2"),
    ("TASKS.K_WAY", lambda v: v >= 2, "an integer >= 2"),
    ("TASKS.N_SUPPORT", lambda v: v >= 1, "an integer >= 1"),
    ("TASKS.N_QUERY", lambda v: v >= 1, "an integer >= 1"),
    ("TASKS.SOURCE", lambda v: v in ("chc", "image_folder"), "chc | image_folder"),
    (
        "TASKS.QUERY_NEW_SHARE",
        lambda v: 0.0 <= float(v) <= 1.0,
        "a share in [0, 1] (0 = the query holds the support's classes, 1 = disjoint topics)",
    ),
    ("META.VAL_TASKS", lambda v: v >= 0, "an integer >= 0 (0 = no validation)"),
)


def _need(cond: bool, key: str, what: str, value: Any) -> None:
    """Raise ``ValueError("KEY: expected WHAT, got VALUE")`` unless ``cond``."""
    if not cond:
        raise ValueError(f"{key}: expected {what}, got {value!r}")


def check_meta_cfg(cfg: CN) -> "TrainSettings":
    """One-line errors (``KEY: expected ..., got ...``) for values yacs cannot type-check, before any work (ranges,
    :func:`check_text_context`, :func:`check_step_size`; the hierarchy's: :func:`check_task_sizes`); returns the
    typed settings of the checked config."""
    m = cfg.META
    for key, ok, what in _RULES:
        value = config_value(cfg, key)
        _need(ok(value), key, what, value)
    _need(
        m.INNER_SUPPORT != "split" or cfg.TASKS.N_SUPPORT >= m.INNER_STEPS,
        "TASKS.N_SUPPORT",
        f"an integer >= META.INNER_STEPS ({m.INNER_STEPS}) with META.INNER_SUPPORT split",
        cfg.TASKS.N_SUPPORT,
    )
    _need(
        not (m.VAL_LAUNCH and m.VAL_PROTOCOL == "downstream" and m.INNER_SUPPORT == "split" and m.INNER_STEPS > 1),
        "META.VAL_LAUNCH",
        "False with META.INNER_SUPPORT split and META.INNER_STEPS > 1 (the launch step sees the whole support)",
        m.VAL_LAUNCH,
    )
    _need(
        m.PROMPT.N_CTX_TEXT > 0 or m.PROMPT.N_CTX_VISION > 0 or bool(m.PROMPT.CTX_INIT),
        "META.PROMPT",
        "N_CTX_TEXT > 0, N_CTX_VISION > 0 or CTX_INIT (no prompt to learn)",
        (m.PROMPT.N_CTX_TEXT, m.PROMPT.N_CTX_VISION),
    )
    import_learner_modules(m.PROMPT.get("LEARNER_MODULES", []), "META.PROMPT.LEARNER_MODULES")
    learner = m.PROMPT.get("LEARNER", DEFAULT_LEARNER)
    _need(
        learner in learner_keys(),
        "META.PROMPT.LEARNER",
        "a registered prompt learner: " + " | ".join(learner_keys()),
        learner,
    )
    try:
        spec = prompt_spec(cfg)
    except ValueError as err:
        raise ValueError(f"META.PROMPT: {err}") from None
    if get_learner(spec.learner).spec_prompts_vision(spec):
        from meta.model.backbone import check_visual_prompts

        what = "META.PROMPT.N_CTX_VISION 0 (CoOp's text prompts) or META.PROMPT.LEARNER cocoop"
        check_visual_prompts(cfg.MODEL.BACKBONE, "MODEL.BACKBONE", f"META.PROMPT.LEARNER {spec.learner}", [what])
    regulator_spec(cfg)  # raises on bad FORM / INIT
    consistency = consistency_spec(cfg)
    _need(
        m.REGULATOR.FORM != "gate" or not m.REGULATE or m.MODE != "gram" or consistency.active,
        "META.REGULATOR.FORM",
        "residual or paper without a consistency regulariser (gate regulates its gradient: set "
        "META.CONSISTENCY.TEXT_WEIGHT or IMAGE_WEIGHT > 0)",
        m.REGULATOR.FORM,
    )
    _need(
        m.REGULATOR.FORM != "gate" or not m.REGULATE or m.MODE != "testtime",
        "META.REGULATOR.FORM",
        "residual or paper under META.MODE testtime (its entropy step has no regulariser for a gate)",
        m.REGULATOR.FORM,
    )
    _need(
        m.TEST_TIME.PROTOTYPES == "none" or (m.MODE == "testtime" and m.REGULATE),
        "META.TEST_TIME.PROTOTYPES",
        "none unless META.MODE testtime with META.REGULATE True (the prototypes condition R_φ's test-time step)",
        m.TEST_TIME.PROTOTYPES,
    )
    check_text_context(cfg)
    run = _train_settings(cfg)
    check_step_size(run)
    return run


def _model_config(backbone: str) -> Optional[dict]:
    """open_clip's config of architecture ``backbone`` (no model built); None if unknown (the build names the key)."""
    import open_clip

    from meta.model.backbone import register_model_configs

    register_model_configs()
    return open_clip.get_model_config(backbone) or None


def model_context_length(backbone: str) -> Optional[int]:
    """Text tokens of open_clip architecture ``backbone``; None if unknown."""
    config = _model_config(backbone)
    if config is None:
        return None
    text = config.get("text_cfg") or {}  # open_clip's CLIPTextCfg defaults the context to 77 tokens
    return int(text["context_length"]) if "context_length" in text else 77


def model_image_size(backbone: str) -> Optional[int]:
    """Input resolution (pixels) of open_clip architecture ``backbone``; None if unknown."""
    config = _model_config(backbone)
    size = None if config is None else (config.get("vision_cfg") or {}).get("image_size")
    return int(size[0] if isinstance(size, (list, tuple)) else size) if size else None


def context_tokens(words: str) -> int:
    """BPE tokens of ``words`` as :func:`meta.model.text_encoder.context_from_words` embeds them (no start/end)."""
    import open_clip

    return len(open_clip.get_tokenizer("ViT-B-16").encode(words.replace("_", " ")))


def check_text_context(cfg: CN, context_length: Optional[int] = None) -> None:
    """Refuse a text context (``META.PROMPT.CTX_INIT`` or ``N_CTX_TEXT``) that leaves no room for a class name in
    ``context_length`` tokens (default: ``MODEL.BACKBONE``'s, 77 for CLIP; unknown: left to the build)."""
    p = cfg.META.PROMPT
    length = context_length if context_length is not None else model_context_length(cfg.MODEL.BACKBONE)
    if length is None:
        return
    most = length - TEXT_TOKENS_BESIDES_CONTEXT
    room = f"CLIP's {length}-token text context also holds the start and end tokens, a class name and its full stop"
    if p.CTX_INIT:
        n = context_tokens(p.CTX_INIT)
        words = p.CTX_INIT if len(p.CTX_INIT) <= 40 else p.CTX_INIT[:37] + "..."
        _need(n >= 1, "META.PROMPT.CTX_INIT", "words with at least one BPE token", p.CTX_INIT)
        if n > most:
            raise ValueError(
                f"META.PROMPT.CTX_INIT: expected at most {most} BPE tokens ({room}), got {n} tokens ({words!r})"
            )
    else:
        _need(p.N_CTX_TEXT <= most, "META.PROMPT.N_CTX_TEXT", f"at most {most} context tokens ({room})", p.N_CTX_TEXT)


def memory_bytes(device: str = "cpu") -> Optional[int]:
    """Total memory of ``device`` in bytes: the GPU's for ``cuda[:i]``, physical RAM otherwise; None if unknown."""
    if str(device).startswith("cuda"):
        import torch

        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows): no limit known
        return None


def check_step_size(run: "TrainSettings", item_bytes: int = INDEX_BYTES, device: str = "cpu", what: str = "") -> None:
    """Refuse a step (a GRAM step's ``META.META_BATCH`` tasks of ``K_WAY x (N_SUPPORT + N_QUERY)`` images, a
    pre-training step's ``META.PRETRAIN.BATCH_SIZE``) or the up-front ``META.VAL_TASKS`` whose images cannot all be
    held in ``device``'s memory at ``item_bytes`` each (:data:`INDEX_BYTES` from the config alone, else the cached
    feature row or pixels ``what`` names)."""
    total = memory_bytes(device)
    if total is None:
        return
    t = run.tasks
    k, n_s, n_q = t.k_way, t.n_support, t.n_query
    per_task = k * (n_s + n_q)
    unit = f"{item_bytes} bytes per image ({what or 'its int64 index and label'})"
    where = f"the {_size(total)} of {device}"
    if per_task * item_bytes > total:  # not even one task fits: the largest of its sizes is the culprit
        images = total // item_bytes
        most = {
            "TASKS.K_WAY": (k, images // (n_s + n_q)),
            "TASKS.N_SUPPORT": (n_s, images // k - n_q),
            "TASKS.N_QUERY": (n_q, images // k - n_s),
        }
        key = max(most, key=lambda name: most[name][0])
        _need(
            False,
            key,
            f"at most {max(most[key][1], 0)}: one task of K_WAY x (N_SUPPORT + N_QUERY) images, "
            f"{unit}, must fit {where}",
            most[key][0],
        )
    key, value = run.split_key  # what one step holds: the meta-batch's tasks, or pre-training's images
    if run.mode != "pretrain":
        per, holds = per_task, f"tasks of K_WAY x (N_SUPPORT + N_QUERY) = {per_task} images"
    else:
        per, holds = 1, "images"
    _need(
        value * per * item_bytes <= total,
        key,
        f"at most {total // (per * item_bytes)} {holds} per step: one step holds them all at once, {unit}, in {where}",
        value,
    )
    if item_bytes == INDEX_BYTES and run.mode != "pretrain":  # the validation tasks' indices are drawn up front
        _need(
            run.val_tasks * per_task * INDEX_BYTES <= total,
            "META.VAL_TASKS",
            f"at most {total // (per_task * INDEX_BYTES)} tasks of {per_task} images (drawn up front, "
            f"{unit}, in {where})",
            run.val_tasks,
        )


def _size(n_bytes: int) -> str:
    return f"{n_bytes / 2**30:.1f} GiB" if n_bytes >= 2**30 else f"{n_bytes / 2**20:.1f} MiB"


@dataclass(frozen=True)
class TaskSettings:
    """The ``TASKS`` node, typed (:func:`task_settings`): how the K-way meta-training tasks are drawn."""

    source: str  # chc | image_folder
    k_way: int
    n_support: int
    n_query: int
    domain_shift: bool  # the support of a class from one visual domain (paper section 3.3)
    query_new_share: float  # share of a task's query classes absent from its support
    val_fraction: float  # topics held out for meta-validation

    def sampler(self, hierarchy, topics, seed: int, k_way: Optional[int] = None) -> "TaskSampler":
        """The :class:`meta.metatrain.tasks.TaskSampler` of these settings over ``topics`` with ``seed`` (K =
        :attr:`k_way` unless ``k_way`` is given): the one place a sampler is built from settings."""
        from meta.metatrain.tasks import TaskSampler

        shape = (self.k_way if k_way is None else int(k_way), self.n_support, self.n_query)
        rules = {"domain_shift": self.domain_shift, "query_new_share": self.query_new_share}
        return TaskSampler(hierarchy, *shape, topics=topics, seed=int(seed), **rules)

    def val_k_way(self, n_val_topics: int) -> int:
        """K of the validation tasks: the largest K <= :attr:`k_way` the held-out topics can fill, new query
        classes (:attr:`query_new_share`) included; validation needs K >= 2."""
        from meta.metatrain.tasks import largest_k_way

        return largest_k_way(n_val_topics, self.k_way, self.query_new_share)


def check_task_sizes(run: "TrainSettings", hierarchy, device: str = "cpu") -> None:
    """Refuse task sizes the hierarchy cannot supply, before a CLIP is built or a task drawn: ``TASKS.K_WAY`` against
    the training topics ``TASKS.VAL_FRACTION`` leaves, support and query sizes as
    :class:`meta.metatrain.tasks.TaskSampler` (asked) rules for training and validation tasks, and one step's
    features or pixels against ``device``'s memory (:func:`check_step_size`)."""
    from meta.metatrain.tasks import largest_k_way, new_query_classes, split_topics

    t = run.tasks
    k, n_s, n_q, shift = t.k_way, t.n_support, t.n_query, t.domain_shift
    train, val = split_topics(hierarchy, t.val_fraction, run.seed)
    held = (
        f"{len(train)} training topics of the hierarchy's {hierarchy.num_topics} ({len(val)} held out by "
        f"TASKS.VAL_FRACTION {t.val_fraction})"
    )
    if run.mode == "pretrain":
        _need(len(train) >= 2, "TASKS.VAL_FRACTION", f"a fraction leaving >= 2 training topics; {held}", t.val_fraction)
    else:
        share = t.query_new_share
        most = largest_k_way(len(train), k, share) if k + new_query_classes(k, share) > len(train) else k
        new = f", which must also supply round({share} x K) new query classes (TASKS.QUERY_NEW_SHARE)" if share else ""
        _need(k + new_query_classes(k, share) <= len(train), "TASKS.K_WAY", f"at most {most}: {held}{new}", k)
        try:
            t.sampler(hierarchy, train, seed=0)
        except ValueError as err:
            sizes = [sum(len(v) for v in hierarchy.domain_members(tp).values()) for tp in train]
            domains = [max((len(v) for v in hierarchy.domain_members(tp).values()), default=0) for tp in train]
            kth = sorted(sizes, reverse=True)[k - 1]
            if n_s + n_q > kth:
                raise ValueError(
                    f"TASKS.N_QUERY: expected N_SUPPORT + N_QUERY <= {kth} (each of a task's K_WAY {k} topics must "
                    f"hold that many images; {k} training topics hold {kth} or more), got {n_s} + {n_q} = {n_s + n_q}"
                )
            dom_kth = sorted(domains, reverse=True)[k - 1]
            _need(
                not shift or n_s <= dom_kth,
                "TASKS.N_SUPPORT",
                f"at most {dom_kth} (TASKS.DOMAIN_SHIFT takes a class's support from one domain: {k} training "
                f"topics have a domain of {dom_kth} or more images; K_WAY {k})",
                n_s,
            )
            raise ValueError(
                f"TASKS.N_SUPPORT: expected a support size that {k} training topics can supply together "
                f"with N_QUERY {n_q} ({err}), got {n_s}"
            ) from None
        val_k = t.val_k_way(len(val))
        if val_k >= 2 and run.val_tasks > 0:
            try:
                t.sampler(hierarchy, val, seed=0, k_way=val_k)
            except ValueError as err:
                raise ValueError(
                    f"TASKS.VAL_FRACTION: expected held-out topics that can form validation tasks ({err}); hold out "
                    f"more topics or set META.VAL_TASKS 0, got {t.val_fraction!r}"
                ) from None
    width = 2 if str(run.model.precision) in ("fp16", "bf16") else 4
    if run.prompt.has_visual_prompts:
        size = int(hierarchy.meta.get("image_size") or model_image_size(run.model.backbone) or 0)
        item, what = 3 * size * size * width, f"a {size} x {size} RGB image as {8 * width}-bit floats"
    else:
        dim = int(hierarchy.image_features.shape[1])
        item, what = dim * width, f"a {dim}-d cached image feature as {8 * width}-bit floats"
    check_step_size(run, item_bytes=item + INDEX_BYTES, device=device, what=what + " + index and label")


def regulator_spec(cfg: CN) -> RegulatorSpec:
    """R_φ's spec from ``META.REGULATOR``; a saved config (a checkpoint's) that records a removed key
    (:data:`meta.config.REMOVED_KEYS`) at its off value reads as today's default, one that had it on is refused."""
    r = cfg.META.REGULATOR
    problem = saved_removed_problem(flatten_cfg(r, "META.REGULATOR."), "META.REGULATOR.")
    if problem:
        raise ValueError(problem)
    try:  # BETA_SCALE spells beta_scale (meta.config.KEY_FIELDS): <= 0 is "grad_rms"
        beta_scale = "grad_rms" if float(r.BETA_SCALE) <= 0 else float(r.BETA_SCALE)
        fields = table_fields(cfg, REGULATOR_SPEC, "META.REGULATOR")
        if cfg.META.MODE == "testtime" and cfg.META.TEST_TIME.PROTOTYPES != "none":  # R_φ reads s(z) [2]
            fields["context"] = CONTEXT_DIM
        return RegulatorSpec(**fields, beta_scale=beta_scale)
    except ValueError as err:
        raise ValueError(f"META.REGULATOR: {err}") from None


def consistency_spec(cfg: CN) -> ConsistencySpec:
    """The support loss's zero-shot consistency weights (``META.CONSISTENCY``; both 0 = the plain cross-entropy)."""
    try:
        return ConsistencySpec(**table_fields(cfg, CONSISTENCY_SPEC, "META.CONSISTENCY"))
    except (TypeError, ValueError) as err:
        raise ValueError(f"META.CONSISTENCY: {err}") from None


def meta_spec(cfg: CN, device=None) -> "MetaSpec":
    """The bi-level loop's hyper-parameters (``pretrain`` mode: regulation off); with ``device``, ``META.AUTOCAST``
    is what runs there (``none`` off CUDA, logged once)."""
    from meta.method.gram import MetaSpec  # lazy: it imports learn2learn, which config-only users do not need

    m = cfg.META
    problem = saved_removed_problem(flatten_cfg(m, "META."), "META.TRAJECTORY_")  # a saved config's removed keys
    if problem:
        raise ValueError(problem)
    autocast = m.AUTOCAST if device is None else resolve_autocast(m.AUTOCAST, device, "META.AUTOCAST")
    fields = table_fields(cfg, META_SPEC, "META")
    fields["regulate"] = fields["regulate"] and m.MODE != "pretrain"  # pre-training has no inner loop to regulate
    return MetaSpec(**{**fields, "autocast": autocast}, regulator=regulator_spec(cfg))


def outer_spec(cfg: CN) -> "OuterSpec":
    """The outer update's settings (``pretrain`` mode: θ's rate is ``META.PRETRAIN.LR``)."""
    from meta.metatrain.outer import OuterSpec  # lazy: it imports meta.method.gram (learn2learn)

    m = cfg.META
    fields = table_fields(cfg, OUTER_SPEC, "META")
    if m.MODE == "pretrain":
        fields["outer_lr_prompt"] = float(m.PRETRAIN.LR)
    return OuterSpec(**fields, regulator_weight_decay=float(m.REGULATOR.WEIGHT_DECAY))


def test_time_spec(cfg: CN):
    """The views of ``META.MODE testtime`` (``META.TEST_TIME.*``) as a :class:`meta.finetune.testtime.TestTimeSpec`;
    a bad value is a one-line error naming the key."""
    from meta.finetune.testtime import spec_from  # lazy: torchvision, which config-only users do not need

    return spec_from(table_fields(cfg, TEST_TIME_SPEC, "META.TEST_TIME"), lambda f: f"META.TEST_TIME.{f.upper()}")


def prompt_spec(cfg: CN) -> PromptSpec:
    """θ's spec from ``META.PROMPT`` (every key a field of the same name: :func:`meta.config.table_fields`)."""
    return PromptSpec(**table_fields(cfg, PROMPT_SPEC, "META.PROMPT"))


# How errors name the start fields of meta-validation's downstream fine-tuning (meta.finetune.engine.Naming).
VAL_NAMING = Naming(
    "META",
    {"reg_window": "VAL_REG_WINDOW", "launch": "VAL_LAUNCH", "regulate": "REGULATE", "ctx_init": "PROMPT.CTX_INIT"},
    dotted=True,
)


def val_start_spec(cfg: CN) -> StartSpec:
    """Where meta-validation's downstream fine-tuning starts: the live θ and R_φ, the window ``META.VAL_REG_WINDOW``
    (0 = the support size) and the meta-trained step when ``META.VAL_LAUNCH`` (``gram`` mode only)."""
    m = cfg.META
    return StartSpec(
        **table_fields(cfg, START_SPEC, "META"),  # VAL_REG_WINDOW
        prompt=prompt_spec(cfg),
        regulate=True,
        launch=bool(m.VAL_LAUNCH) and m.MODE != "pretrain",
        naming=VAL_NAMING,
    )


def val_train_spec(cfg: CN) -> "TrainSpec":
    """The downstream schedule of meta-validation (``META.VAL_*``; defaults: CoCoOp's, see
    :class:`meta.evaluation.spec.TrainSpec`)."""
    from meta.evaluation.spec import TrainSpec

    # VAL_EPOCHS, VAL_FT_LR / _MOMENTUM / _WEIGHT_DECAY, VAL_RRCROP_SCALE
    return TrainSpec(**table_fields(cfg, TRAIN_SPEC, "META"), batch_size=1, aug_views=1, eval_every_epoch=False)


_CASTS = {"int": int, "float": float, "str": str, "bool": bool}


def _same_named(owner: type, node: CN, names: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """``{field: node[FIELD]}`` for the fields ``names`` of dataclass ``owner`` (default: all), each read from the
    key of ``node`` that spells the field upper-cased and cast to the field's annotated type."""
    types = {f.name: f.type for f in fields(owner)}
    return {name: _CASTS[types[name]](node[name.upper()]) for name in names or types}


def task_settings(cfg: CN) -> TaskSettings:
    """The typed ``TASKS`` node (a field per key of the same name)."""
    return TaskSettings(**_same_named(TaskSettings, cfg.TASKS))


def hierarchy_source(cfg: CN) -> "HierarchySource":
    """Where the tasks come from: ``TASKS.SOURCE`` with ``META.HIERARCHY`` / ``CHC.OUTPUT_DIR`` (a CHC output) or
    ``TASKS.IMAGE_FOLDER`` and the ``CHC`` keys that cluster it (:class:`meta.metatrain.data.HierarchySource`)."""
    from meta.metatrain.data import HierarchySource  # lazy: meta.metatrain.data imports learn2learn's side

    chc = cfg.CHC
    return HierarchySource(
        source=str(cfg.TASKS.SOURCE),
        chc_dir=str(cfg.META.HIERARCHY or chc.OUTPUT_DIR),
        chc_dir_key="META.HIERARCHY" if cfg.META.HIERARCHY else "CHC.OUTPUT_DIR",
        image_folder=cfg.TASKS.IMAGE_FOLDER,
        num_domains=int(chc.DOMAINS.NUM),
        min_per_domain=int(chc.DOMAINS.MIN_PER_DOMAIN),
        batch_size=int(chc.IMAGES.BATCH_SIZE),
        seed=int(cfg.SEED),
        backbone=cfg.MODEL.BACKBONE,
        pretrained=cfg.MODEL.PRETRAINED,
        show_progress=bool(cfg.META.PROGRESS),
        caps=image_caps(chc.INPUT),
    )


@dataclass(frozen=True)
class TrainSettings:
    """Everything a meta-training run reads from its config, typed once at the edge by :func:`read_train_settings`;
    nothing below reads the node (counts are steps or tasks, rates are learning rates)."""

    output_dir: Path  # OUTPUT_DIR
    seed: int  # SEED
    mode: str  # META.MODE: gram | pretrain | testtime
    test_time: Any  # META.TEST_TIME.* as a meta.finetune.testtime.TestTimeSpec (read by META.MODE testtime)
    device: str  # MODEL.DEVICE as given (auto | cpu | cuda[:i]); meta.model.backbone.resolve_device resolves it
    model: ClipSettings  # MODEL.*
    tasks: TaskSettings  # TASKS.*
    hierarchy: "HierarchySource"  # TASKS.SOURCE, META.HIERARCHY, TASKS.IMAGE_FOLDER, CHC.*
    prompt: PromptSpec  # META.PROMPT.*
    meta: "MetaSpec"  # the inner loop and R_φ (META.*, META.REGULATOR.*); autocast as configured, not yet resolved
    outer: "OuterSpec"  # the outer update
    consistency: ConsistencySpec  # META.CONSISTENCY.*
    val_start: StartSpec  # META.VAL_REG_WINDOW, META.VAL_LAUNCH
    val_train: "TrainSpec"  # META.VAL_EPOCHS, VAL_FT_*, VAL_RRCROP_SCALE
    steps: int  # META.STEPS
    meta_batch: int  # META.META_BATCH, tasks per outer step
    pretrain_ways: int  # META.PRETRAIN.WAYS (0 = all training topics)
    pretrain_batch_size: int  # META.PRETRAIN.BATCH_SIZE, images
    log_detail_every: int  # META.LOG_DETAIL_EVERY
    val_every: int  # META.VAL_EVERY
    val_tasks: int  # META.VAL_TASKS
    val_protocol: str  # META.VAL_PROTOCOL: downstream | one_step
    val_ft_steps: int  # META.VAL_FT_STEPS
    val_ft_lr: float  # META.VAL_FT_LR
    val_ft_momentum: float  # META.VAL_FT_MOMENTUM
    checkpoint_every: int  # META.CHECKPOINT_EVERY
    feature_check: int  # META.FEATURE_CHECK, images re-encoded
    progress: bool  # META.PROGRESS
    tensorboard: bool  # META.TENSORBOARD
    fingerprint: bool  # META.FINGERPRINT
    export_name: str  # META.EXPORT_NAME
    coop_ctx_name: str  # META.COOP_CTX_NAME
    config_yaml: str  # the whole node as YAML (config.yaml, the checkpoint's config_yaml)
    config: dict  # result_defining_cfg: what a resume must agree on
    config_hash: str  # config_hash

    @property
    def split_key(self) -> tuple[str, int]:
        """``(key, count)`` that torchrun splits over its processes: the meta-batch's tasks or pre-training's
        images."""
        if self.mode != "pretrain":
            return "META.META_BATCH", self.meta_batch
        return "META.PRETRAIN.BATCH_SIZE", self.pretrain_batch_size


# The TrainSettings fields read from the META key of the same name, upper-cased
_META_SAME_NAMED = tuple(
    "steps meta_batch log_detail_every val_every val_tasks val_protocol val_ft_steps val_ft_lr val_ft_momentum "
    "checkpoint_every feature_check progress tensorboard fingerprint export_name coop_ctx_name".split()
)


def _train_settings(cfg: CN) -> TrainSettings:
    """:class:`TrainSettings` of a config whose values :func:`check_meta_cfg` has checked."""
    m = cfg.META
    return TrainSettings(
        output_dir=Path(cfg.OUTPUT_DIR),
        seed=int(cfg.SEED),
        mode=str(m.MODE),
        test_time=test_time_spec(cfg),
        device=str(cfg.MODEL.DEVICE),
        model=ClipSettings.from_cfg(cfg),
        tasks=task_settings(cfg),
        hierarchy=hierarchy_source(cfg),
        prompt=prompt_spec(cfg),
        meta=meta_spec(cfg),
        outer=outer_spec(cfg),
        consistency=consistency_spec(cfg),
        val_start=val_start_spec(cfg),
        val_train=val_train_spec(cfg),
        pretrain_ways=int(m.PRETRAIN.WAYS),
        pretrain_batch_size=int(m.PRETRAIN.BATCH_SIZE),
        **_same_named(TrainSettings, m, _META_SAME_NAMED),
        config_yaml=cfg.dump(),
        config=result_defining_cfg(cfg),
        config_hash=config_hash(cfg),
    )


def read_train_settings(cfg: CN) -> TrainSettings:
    """Check ``cfg`` (:func:`check_meta_cfg`: one-line errors naming the key) and read it into
    :class:`TrainSettings`, once."""
    return check_meta_cfg(cfg)


def flatten_cfg(node: CN, prefix: str = "") -> dict[str, Any]:
    """``{"META.INNER_LR": 0.1, ...}`` for every leaf of a yacs node."""
    out: dict[str, Any] = {}
    for key, value in node.items():
        name = f"{prefix}{key}"
        if isinstance(value, CN):
            out.update(flatten_cfg(value, name + "."))
        else:
            out[name] = list(value) if isinstance(value, tuple) else value
    return out


def result_defining_cfg(cfg: CN) -> dict[str, Any]:
    """The flattened config without :data:`RUN_CONTROL_KEYS` / ``CHC.*`` (what a resume must agree on)."""
    return {
        k: v
        for k, v in sorted(flatten_cfg(cfg).items())
        if k not in RUN_CONTROL_KEYS and not k.startswith(RUN_CONTROL_PREFIXES)
    }


def config_hash(cfg: CN) -> str:
    """sha256 (first 16 hex) of :func:`result_defining_cfg`."""
    blob = json.dumps(result_defining_cfg(cfg), sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def cfg_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``["META.INNER_LR: 0.1 -> 0.2", ...]`` between two :func:`result_defining_cfg` dicts; a key the saved run
    lacked is no difference at the behaviour it had (:data:`BEHAVIOUR_BEFORE_KEY`, else the default), nor a removed
    key (:data:`meta.config.REMOVED_KEYS`) it had off."""
    absent = "<absent>"
    keys = sorted(set(saved) | set(current))
    defaults: dict[str, Any] = {}
    out = []
    for k in keys:
        old, new = saved.get(k, absent), current.get(k, absent)
        if old == new:
            continue
        if new == absent and k in REMOVED and not REMOVED[k].is_on(saved):
            continue
        count = UNUSED_WHILE_ZERO.get(k)
        if count is not None and not saved.get(count, 0) and not current.get(count, 0):
            continue
        if old == absent and k in BEHAVIOUR_BEFORE_KEY:
            if BEHAVIOUR_BEFORE_KEY[k] == new:
                continue
        elif old == absent:
            if not defaults:
                defaults = result_defining_cfg(get_meta_cfg_default())
            if defaults.get(k, absent) == new:
                continue
        out.append(f"{k}: {old!r} -> {new!r}")
    return out
