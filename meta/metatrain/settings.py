"""The ``META`` config node (meta-training / prompt pre-training) and what is built from it.

:func:`add_metatrain_cfg` adds the node to a meta config (``meta.config.get_meta_cfg_default``
calls it).  Values the paper does not give carry a comment naming where they come from.

Sources cited below:
  [GRAM]    the paper (Li et al., "Gradient-Regulated Meta-Prompt Learning for Generalizable
            Vision-Language Models", ICCV 2023), section 4 "Training Details".
  [SUPMER]  beepkh/SUPMER ``scripts/meta-train.sh`` - the same group's meta-prompt learner for NLP
            (OUTER_BATCH_SIZE=4, SAVE_STEP=100, TEST_STEP=1000, TOTAL_STEPS=100000).
  [MAML]    Finn et al. 2017, miniImageNet: meta-batch 4 tasks, 5-way.
  [CoCoOp]  KaiyangZhou/CoOp CoCoOp ViT-B/16 schedule: lr 0.002, N_CTX 4
            (``configs/trainers/CoCoOp/vit_b16_c4_ep10_batch1_ctxv1.yaml``).
  [core]    meta.gram.MetaSpec / meta.regulator.RegulatorSpec defaults chosen by the core's author.
"""
from __future__ import annotations

import hashlib
import json
import math
from typing import TYPE_CHECKING, Any

from yacs.config import CfgNode as CN

if TYPE_CHECKING:
    from meta.gram import MetaSpec
from meta.prompts import VPT_INITS, PromptSpec
from meta.regulator import RegulatorSpec

MODES = ("gram", "pretrain")

# Keys that steer how a run is executed/observed but not the numbers it produces; they may
# change between a run and its ``--resume`` (e.g. extend META.STEPS, checkpoint more often).
# Where the task source lives (META.HIERARCHY, TASKS.IMAGE_FOLDER, CHC.*) may change too: a resume
# compares the hierarchy's content fingerprint instead (data.hierarchy_fingerprint).
RUN_CONTROL_KEYS = frozenset({
    "OUTPUT_DIR", "MODEL.DEVICE", "META.STEPS", "META.CHECKPOINT_EVERY", "META.LOG_DETAIL_EVERY",
    "META.VAL_EVERY", "META.VAL_TASKS", "META.VAL_FT_STEPS", "META.VAL_FT_LR", "META.VAL_FT_MOMENTUM", "META.FEATURE_CHECK", "META.PROGRESS", "META.TENSORBOARD",
    "META.EXPORT_NAME", "META.COOP_CTX_NAME", "META.HIERARCHY", "TASKS.IMAGE_FOLDER",
})
RUN_CONTROL_PREFIXES = ("CHC.",)

# Keys added after runs were saved without them, with the behaviour those runs had (the value the key
# would have held then), when that differs from today's default: a resume compares against it.
BEHAVIOUR_BEFORE_KEY: dict[str, Any] = {"META.PROMPT.VPT_INIT": "normal"}
# Keys that change nothing while the count named here is 0 in both runs (no visual tokens to initialise).
UNUSED_WHILE_ZERO: dict[str, str] = {"META.PROMPT.VPT_INIT": "META.PROMPT.N_CTX_VISION"}


def add_metatrain_cfg(cfg: CN) -> CN:
    """Add the ``META`` node to ``cfg`` (in place) and return ``cfg``."""
    m = CN()
    m.MODE = "gram"              # gram = bi-level GRAM (Alg. 1) | pretrain = Table 4 row 3 baseline
    m.HIERARCHY = ""             # CHC output dir ("" = CHC.OUTPUT_DIR); unused for TASKS.SOURCE image_folder
    m.STEPS = 10000              # outer steps; [SUPMER] uses 100k at B=4 - we default to a 10x shorter run
    m.META_BATCH = 4             # B tasks per outer step: [SUPMER] OUTER_BATCH_SIZE=4, [MAML] miniImageNet 4

    # ---- the bi-level loop (meta.gram.MetaSpec) -------------------------------------------
    m.INNER_STEPS = 1            # Alg. 1 shows one regulated step per task [GRAM]
    m.INNER_LR = 0.1             # alpha [core]
    m.OUTER_LR_PROMPT = 2e-3     # lambda_1 [core]; same value as CoOp/CoCoOp's prompt lr [CoCoOp]
    m.OUTER_LR_REGULATOR = 1e-3  # lambda_2 [core]
    m.OPTIMIZER = "adam"         # adam | sgd [core]
    m.FIRST_ORDER = False        # True drops the second-order term (cheaper, not the paper's Eq. 10)
    m.GRAD_CLIP = 1.0            # max global norm over theta and phi; 0 = off [core]
    m.REGULATE = True            # False = "w/o gradient regulating" (Table 4 row 2)
    m.AUTOCAST = "none"          # none | bf16 | fp16 autocast of the CLIP passes on CUDA (CPU: fp32, one log line);
    #                              bf16 is the safer choice: fp16 scales only the outer loss (meta.precision)
    m.INNER_MOMENTUM = 0.0       # heavy-ball inner SGD as the test-time optimiser (0.9 there); needs INNER_STEPS > 1

    m.REGULATOR = CN()           # R_phi (meta.regulator.RegulatorSpec) [core]
    m.REGULATOR.FORM = "residual"   # residual | paper (literal Eq. 5)
    m.REGULATOR.INPUT_NORM = True
    m.REGULATOR.BETA_SCALE = 0.0    # 0 = beta in units of rms(g) (core default); > 0 = fixed scale (1.0 = paper)
    m.REGULATOR.INIT = "zero"       # zero | normal
    m.REGULATOR.INIT_STD = 0.01
    m.REGULATOR.GAMMA_BOUND = 1.0   # residual form: gamma in (1 - bound, 1 + bound); 1.0 = unbounded tanh
    m.REGULATOR.NORM_PRESERVE = False  # rescale the regulated gradient to the raw one's norm (per tensor)
    m.REGULATOR.MIX = False         # learned c = sigmoid(m): (1 - c) * regulated + c * raw
    m.REGULATOR.MIX_INIT = 0.0      # initial m (0 -> c = 0.5)
    m.REGULATOR.WEIGHT_DECAY = 0.0  # L2 on phi in the outer step: keeps R_phi near the identity (residual form)

    # ---- theta (meta.prompts.PromptSpec): CoOp = text only, VPT = vision only, UNIGRAM = both
    m.PROMPT = CN()
    m.PROMPT.N_CTX_TEXT = 4      # [GRAM] 4 prompt tokens for CoOp/VPT; UNIGRAM 2 text + 2 visual
    m.PROMPT.CTX_INIT = ""       # e.g. "a photo of a" (then M = its token count)
    m.PROMPT.N_CTX_VISION = 0
    m.PROMPT.VISION_DEPTH = 1    # 1 = shallow VPT
    m.PROMPT.INIT_STD = 0.02     # CoOp's N(0, 0.02^2) context init
    m.PROMPT.TEMPLATE = "a photo of a {}."  # text side when N_CTX_TEXT == 0 (paper's VPT baseline)
    m.PROMPT.VPT_INIT = PromptSpec.vpt_init  # visual tokens' start: normal | zeros | cls | patch_mean (meta.prompts)

    # ---- Table 4 row 3: plain classification over the topics --------------------------------
    m.PRETRAIN = CN()
    m.PRETRAIN.WAYS = 0          # classes per step (0 = all training topics)
    m.PRETRAIN.BATCH_SIZE = 32   # images per step (uniform over the step's classes, all domains)
    m.PRETRAIN.LR = 2e-3         # Adam/SGD lr on theta, = OUTER_LR_PROMPT so both baselines share lambda_1

    # ---- bookkeeping ---------------------------------------------------------------------------
    m.CHECKPOINT_EVERY = 100     # [SUPMER] SAVE_STEP=100; a killed run loses at most this many steps
    m.LOG_DETAIL_EVERY = 50      # grad cosine (Fig. 3b) + before/after on both sets: ~1.5x a step's cost
    m.VAL_EVERY = 1000           # [SUPMER] TEST_STEP=1000
    m.VAL_TASKS = 50             # fixed held-out tasks per validation (same tasks every time)
    # validation as test-time use: query accuracy after VAL_FT_STEPS regulated SGD steps (lr VAL_FT_LR,
    # momentum VAL_FT_MOMENTUM: CoCoOp's 0.002 / 0.9) on the support set; 0 = off
    m.VAL_FT_STEPS = 0
    m.VAL_FT_LR = 0.002
    m.VAL_FT_MOMENTUM = 0.9
    m.FEATURE_CHECK = 8          # images re-encoded to prove cached features match this CLIP (0 = skip)
    m.PROGRESS = True            # tqdm bar
    m.TENSORBOARD = True
    m.EXPORT_NAME = "gram_init.safetensors"
    m.COOP_CTX_NAME = "coop_ctx_nctx{n_ctx}.pth"  # {n_ctx}: the text context length stock CoOp must be given
    cfg.META = m
    return cfg


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
    need(m.REGULATOR.WEIGHT_DECAY >= 0, "META.REGULATOR.WEIGHT_DECAY", "a number >= 0", m.REGULATOR.WEIGHT_DECAY)
    need(m.VAL_FT_STEPS >= 0, "META.VAL_FT_STEPS", "an integer >= 0", m.VAL_FT_STEPS)
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
    from meta.gram import MetaSpec  # lazy: keeps learn2learn out of config-only imports
    from meta.precision import resolve_autocast

    m = cfg.META
    autocast = m.AUTOCAST if device is None else resolve_autocast(m.AUTOCAST, device, "META.AUTOCAST")
    pretrain = m.MODE == "pretrain"
    return MetaSpec(inner_steps=int(m.INNER_STEPS), inner_lr=float(m.INNER_LR),
                    outer_lr_prompt=float(m.PRETRAIN.LR if pretrain else m.OUTER_LR_PROMPT),
                    outer_lr_regulator=float(m.OUTER_LR_REGULATOR), optimizer=m.OPTIMIZER,
                    first_order=bool(m.FIRST_ORDER), grad_clip=float(m.GRAD_CLIP),
                    regulate=bool(m.REGULATE) and not pretrain, regulator=regulator_spec(cfg), autocast=autocast,
                    inner_momentum=float(m.INNER_MOMENTUM),
                    regulator_weight_decay=float(m.REGULATOR.WEIGHT_DECAY))


def prompt_spec(cfg: CN) -> PromptSpec:
    p = cfg.META.PROMPT
    return PromptSpec(n_ctx_text=int(p.N_CTX_TEXT), ctx_init=p.CTX_INIT, n_ctx_vision=int(p.N_CTX_VISION),
                      vision_depth=int(p.VISION_DEPTH), init_std=float(p.INIT_STD), template=p.TEMPLATE,
                      vpt_init=str(p.VPT_INIT))


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
                from meta.config import get_meta_cfg_default

                defaults = result_defining_cfg(get_meta_cfg_default())
            if defaults.get(k, absent) == new:
                continue
        out.append(f"{k}: {old!r} -> {new!r}")
    return out
