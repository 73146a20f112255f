"""What is built from the ``META`` config node (meta-training / prompt pre-training): the loop's, the
regulator's and the prompts' specs, the checks yacs cannot do, and the config hash a resume compares.
The node's defaults, each with where it came from, are in :func:`meta.config.add_metatrain_cfg`.
"""
from __future__ import annotations

import hashlib
import json
import math
from typing import TYPE_CHECKING, Any

from yacs.config import CfgNode as CN

from meta.config import add_metatrain_cfg, get_meta_cfg_default
from meta.precision import resolve_autocast
from meta.prompts import COUPLINGS, VPT_INITS, PromptSpec
from meta.regulator import RegulatorSpec

if TYPE_CHECKING:
    from meta.gram import MetaSpec

__all__ = ["MODES", "RUN_CONTROL_KEYS", "add_metatrain_cfg", "cfg_differences", "check_meta_cfg", "config_hash",
           "flatten_cfg", "meta_spec", "prompt_spec", "regulator_spec", "result_defining_cfg"]

MODES = ("gram", "pretrain")

# Keys that steer how a run is executed/observed but not the numbers it produces; they may
# change between a run and its ``--resume`` (e.g. extend META.STEPS, checkpoint more often).
# Where the task source lives (META.HIERARCHY, TASKS.IMAGE_FOLDER, CHC.*) may change too: a resume
# compares the hierarchy's content fingerprint instead (data.hierarchy_fingerprint).
RUN_CONTROL_KEYS = frozenset({
    "OUTPUT_DIR", "MODEL.DEVICE", "META.STEPS", "META.CHECKPOINT_EVERY", "META.LOG_DETAIL_EVERY",
    "META.VAL_EVERY", "META.VAL_TASKS", "META.VAL_FT_STEPS", "META.VAL_FT_LR", "META.VAL_FT_MOMENTUM",
    "META.VAL_PROTOCOL", "META.VAL_EPOCHS", "META.VAL_FT_WEIGHT_DECAY", "META.VAL_RRCROP_SCALE", "META.VAL_REG_WINDOW",
    "META.VAL_LAUNCH", "META.FEATURE_CHECK", "META.PROGRESS", "META.TENSORBOARD",
    "META.EXPORT_NAME", "META.COOP_CTX_NAME", "META.HIERARCHY", "TASKS.IMAGE_FOLDER",
})
RUN_CONTROL_PREFIXES = ("CHC.",)

# Keys added after runs were saved without them, with the behaviour those runs had (the value the key
# would have held then), when that differs from today's default: a resume compares against it.
BEHAVIOUR_BEFORE_KEY: dict[str, Any] = {"META.PROMPT.VPT_INIT": "normal"}
# Keys that change nothing while the count named here is 0 in both runs (no visual tokens to initialise).
UNUSED_WHILE_ZERO: dict[str, str] = {"META.PROMPT.VPT_INIT": "META.PROMPT.N_CTX_VISION"}


def check_meta_cfg(cfg: CN) -> None:
    """One-line errors for values yacs cannot type-check."""
    m = cfg.META

    def need(cond: bool, key: str, what: str, value: Any) -> None:
        if not cond:
            raise ValueError(f"{key}: expected {what}, got {value!r}")

    need(m.MODE in MODES, "META.MODE", " | ".join(MODES), m.MODE)
    need(m.STEPS >= 0, "META.STEPS", "an integer >= 0", m.STEPS)
    need(m.META_BATCH >= 1, "META.META_BATCH", "an integer >= 1", m.META_BATCH)
    need(m.INNER_STEPS >= 1, "META.INNER_STEPS", "an integer >= 1", m.INNER_STEPS)
    need(0.0 <= m.INNER_MOMENTUM < 1.0, "META.INNER_MOMENTUM", "a number in [0, 1)", m.INNER_MOMENTUM)
    need(m.QUERY_BEFORE_WEIGHT >= 0, "META.QUERY_BEFORE_WEIGHT", "a number >= 0", m.QUERY_BEFORE_WEIGHT)
    need(m.TASK_BATCHING in ("auto", "on", "off"), "META.TASK_BATCHING", "auto | on | off", m.TASK_BATCHING)
    need(m.REGULATOR.WEIGHT_DECAY >= 0, "META.REGULATOR.WEIGHT_DECAY", "a number >= 0", m.REGULATOR.WEIGHT_DECAY)
    need(m.VAL_FT_STEPS >= 0, "META.VAL_FT_STEPS", "an integer >= 0", m.VAL_FT_STEPS)
    need(m.VAL_PROTOCOL in ("downstream", "one_step"), "META.VAL_PROTOCOL", "downstream | one_step", m.VAL_PROTOCOL)
    need(m.VAL_EPOCHS >= 1, "META.VAL_EPOCHS", "an integer >= 1", m.VAL_EPOCHS)
    need(m.VAL_REG_WINDOW >= 0, "META.VAL_REG_WINDOW", "an integer >= 0 (0 = the support size)", m.VAL_REG_WINDOW)
    need(len(m.VAL_RRCROP_SCALE) == 2 and 0 < m.VAL_RRCROP_SCALE[0] <= m.VAL_RRCROP_SCALE[1] <= 1,
         "META.VAL_RRCROP_SCALE", "(lo, hi) with 0 < lo <= hi <= 1", m.VAL_RRCROP_SCALE)
    need(m.CHECKPOINT_EVERY >= 1, "META.CHECKPOINT_EVERY", "an integer >= 1", m.CHECKPOINT_EVERY)
    need(m.OPTIMIZER in ("adam", "sgd"), "META.OPTIMIZER", "adam | sgd", m.OPTIMIZER)
    for key in ("INNER_LR", "OUTER_LR_PROMPT", "OUTER_LR_REGULATOR", "GRAD_CLIP", "PRETRAIN.LR", "PROMPT.INIT_STD",
                "REGULATOR.INIT_STD"):
        node, leaf = (m, key) if "." not in key else (m[key.split(".")[0]], key.split(".")[1])
        value = node[leaf]
        need(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
             and value >= 0, f"META.{key}", "a finite number >= 0" + (" (0 = off)" if leaf == "GRAD_CLIP" else ""),
             value)
    need(m.AUTOCAST in ("none", "bf16", "fp16"), "META.AUTOCAST", "none | bf16 | fp16", m.AUTOCAST)
    need(m.PROMPT.N_CTX_TEXT > 0 or m.PROMPT.N_CTX_VISION > 0 or bool(m.PROMPT.CTX_INIT),
         "META.PROMPT", "N_CTX_TEXT > 0, N_CTX_VISION > 0 or CTX_INIT (no prompt to learn)",
         (m.PROMPT.N_CTX_TEXT, m.PROMPT.N_CTX_VISION))
    need(m.PROMPT.VPT_INIT in VPT_INITS, "META.PROMPT.VPT_INIT", " | ".join(VPT_INITS), m.PROMPT.VPT_INIT)
    need(m.PROMPT.TEXT_DEPTH >= 0, "META.PROMPT.TEXT_DEPTH", "an integer >= 0 (0 = every layer)", m.PROMPT.TEXT_DEPTH)
    need(m.PROMPT.VISION_DEPTH >= 0, "META.PROMPT.VISION_DEPTH", "an integer >= 0 (0 = every layer)",
         m.PROMPT.VISION_DEPTH)
    need(m.PROMPT.COUPLING in COUPLINGS, "META.PROMPT.COUPLING", " | ".join(COUPLINGS), m.PROMPT.COUPLING)
    try:
        prompt_spec(cfg)
    except ValueError as err:
        raise ValueError(f"META.PROMPT: {err}") from None
    need(m.PRETRAIN.BATCH_SIZE >= 1, "META.PRETRAIN.BATCH_SIZE", "an integer >= 1", m.PRETRAIN.BATCH_SIZE)
    need(m.PRETRAIN.WAYS == 0 or m.PRETRAIN.WAYS >= 2, "META.PRETRAIN.WAYS", "0 (all) or >= 2", m.PRETRAIN.WAYS)
    need(cfg.TASKS.K_WAY >= 2, "TASKS.K_WAY", "an integer >= 2", cfg.TASKS.K_WAY)
    need(cfg.TASKS.N_SUPPORT >= 1, "TASKS.N_SUPPORT", "an integer >= 1", cfg.TASKS.N_SUPPORT)
    need(cfg.TASKS.N_QUERY >= 1, "TASKS.N_QUERY", "an integer >= 1", cfg.TASKS.N_QUERY)
    need(cfg.TASKS.SOURCE in ("chc", "image_folder"), "TASKS.SOURCE", "chc | image_folder", cfg.TASKS.SOURCE)
    regulator_spec(cfg)  # raises on bad FORM / INIT


def regulator_spec(cfg: CN) -> RegulatorSpec:
    r = cfg.META.REGULATOR
    try:
        return RegulatorSpec(form=r.FORM, input_norm=bool(r.INPUT_NORM),
                             beta_scale="grad_rms" if float(r.BETA_SCALE) <= 0 else float(r.BETA_SCALE),
                             init=r.INIT, init_std=float(r.INIT_STD), gamma_bound=float(r.GAMMA_BOUND),
                             norm_preserve=bool(r.NORM_PRESERVE), mix=bool(r.MIX), mix_init=float(r.MIX_INIT))
    except ValueError as err:
        raise ValueError(f"META.REGULATOR: {err}") from None


def meta_spec(cfg: CN, device=None) -> "MetaSpec":
    """The bi-level loop's hyper-parameters; ``pretrain`` mode reuses it with regulation off.

    With ``device``, ``META.AUTOCAST`` is what runs there (``none`` off CUDA, logged once).
    """
    from meta.gram import MetaSpec  # lazy: meta.gram imports learn2learn, which config-only users do not need

    m = cfg.META
    autocast = m.AUTOCAST if device is None else resolve_autocast(m.AUTOCAST, device, "META.AUTOCAST")
    pretrain = m.MODE == "pretrain"
    return MetaSpec(inner_steps=int(m.INNER_STEPS), inner_lr=float(m.INNER_LR),
                    outer_lr_prompt=float(m.PRETRAIN.LR if pretrain else m.OUTER_LR_PROMPT),
                    outer_lr_regulator=float(m.OUTER_LR_REGULATOR), optimizer=m.OPTIMIZER,
                    first_order=bool(m.FIRST_ORDER), grad_clip=float(m.GRAD_CLIP),
                    regulate=bool(m.REGULATE) and not pretrain, regulator=regulator_spec(cfg), autocast=autocast,
                    inner_momentum=float(m.INNER_MOMENTUM),
                    regulator_weight_decay=float(m.REGULATOR.WEIGHT_DECAY),
                    query_before_weight=float(m.QUERY_BEFORE_WEIGHT), task_batching=str(m.TASK_BATCHING))


def prompt_spec(cfg: CN) -> PromptSpec:
    p = cfg.META.PROMPT
    return PromptSpec(n_ctx_text=int(p.N_CTX_TEXT), ctx_init=p.CTX_INIT, n_ctx_vision=int(p.N_CTX_VISION),
                      vision_depth=int(p.VISION_DEPTH), init_std=float(p.INIT_STD), template=p.TEMPLATE,
                      vpt_init=str(p.VPT_INIT), text_depth=int(p.get("TEXT_DEPTH", 1)),
                      coupling=str(p.get("COUPLING", "none")))


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
    return {k: v for k, v in sorted(flatten_cfg(cfg).items())
            if k not in RUN_CONTROL_KEYS and not k.startswith(RUN_CONTROL_PREFIXES)}


def config_hash(cfg: CN) -> str:
    """sha256 (first 16 hex) of :func:`result_defining_cfg`."""
    blob = json.dumps(result_defining_cfg(cfg), sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def cfg_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``["META.INNER_LR: 0.1 -> 0.2", ...]`` between two :func:`result_defining_cfg` dicts.

    A key the saved run did not have yet (added to the defaults later, e.g. ``META.AUTOCAST``) is no
    difference while the current value is the behaviour the old run had: the key's
    :data:`BEHAVIOUR_BEFORE_KEY` entry, else its default.
    """
    absent = "<absent>"
    keys = sorted(set(saved) | set(current))
    defaults: dict[str, Any] = {}
    out = []
    for k in keys:
        old, new = saved.get(k, absent), current.get(k, absent)
        if old == new:
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
