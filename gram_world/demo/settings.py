"""What the demo computes and with which settings: the meta-training variants, the method rows of
every table (:data:`METHODS`: stable key, paper label, evaluator preset, meta variant), the table groups
of ``--tables`` and :class:`DemoSettings` (every hyper-parameter the paper does not give, with where it
came from), plus the world / tiny-CLIP settings a demo runs on and the settings hash of its folder.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Optional

from meta.finetune.regulated import DEFAULT_LAUNCH, DEFAULT_REG_WINDOW
from meta.finetune.testtime import TestTimeSpec
from meta.method import methods
from meta.method.gram import DEFAULT_QUERY_BEFORE_WEIGHT
from meta.method.learners import DEFAULT_LEARNER
from meta.method.prompts import PromptSpec

from ..pretrain import PretrainSettings, pretrain_settings
from ..settings import WorldSettings, world_settings


@dataclass(frozen=True)
class MetaVariant:
    """One meta-training run: its name (a key of the method table, ``meta/method/methods.yaml``) and META/TASKS
    overrides.  θ's shape (token counts, depths, coupling) is the table row's, read from there."""

    name: str
    overrides: tuple = ()  # extra KEY, VALUE, ... for the meta config
    regulated: bool = True  # whether the exported file carries φ

    @property
    def n_ctx_text(self) -> int:
        return methods.get(self.name).text_tokens

    @property
    def n_ctx_vision(self) -> int:
        return methods.get(self.name).visual_tokens

    @property
    def prompt_overrides(self) -> tuple:
        """``META.PROMPT`` keys of the row's structure: token counts, and depths / coupling / learner where they
        differ from the meta config's defaults (1, 1, none, the built-in learner)."""
        row = methods.get(self.name)
        out: tuple = ("META.PROMPT.N_CTX_TEXT", row.text_tokens, "META.PROMPT.N_CTX_VISION", row.visual_tokens)
        for key, value, default in (
            ("TEXT_DEPTH", row.text_depth, 1),
            ("VISION_DEPTH", row.vision_depth, 1),
            ("COUPLING", row.coupling, "none"),
            ("LEARNER", row.learner, DEFAULT_LEARNER),
        ):
            if value != default:
                out += (f"META.PROMPT.{key}", value)
        return out

    @property
    def meta_learned(self) -> bool:
        """False for prompt pre-training (Table 4 row 3): its θ* has no inner step to launch."""
        pairs = dict(zip(self.overrides[::2], self.overrides[1::2]))
        return pairs.get("META.MODE", "gram") != "pretrain"


# θ shapes follow the paper (section 4.1): 4 tokens for CoOp / VPT, 2 + 2 for UNIGRAM (the method table's rows);
# CoCoOp's θ* is its 4 context vectors and its meta-net (the table's learner ``cocoop``).
META_VARIANTS = (
    MetaVariant("gram_coop"),
    MetaVariant("gram_cocoop"),
    MetaVariant("gram_vpt"),
    MetaVariant("unigram"),
    MetaVariant("unigram_no_shift", ("TASKS.DOMAIN_SHIFT", False)),  # Table 4 row 1
    MetaVariant("unigram_no_reg", ("META.REGULATE", False), regulated=False),  # Table 4 row 2
    MetaVariant("unigram_pretrain", ("META.MODE", "pretrain"), regulated=False),  # Table 4 row 3
    MetaVariant("unigram_supervised", ("TASKS.SOURCE", "image_folder")),  # Table 4 row 4
)

# Table A3 varies UNIGRAM's total prompt-token count over 2 / 4 / 6 / 8.  The paper does not say how
# a count is split between the towers; ours: half text, half visual (n // 2 + n - n // 2), so 4 is
# UNIGRAM's own 2 + 2 and needs no extra run.
TOKEN_COUNTS = (2, 4, 6, 8)
TOKEN_VARIANTS = tuple(MetaVariant(f"unigram_{n}tok") for n in TOKEN_COUNTS if n != 4)
# Deep prompt learners (opt-in table group "deep", docs/deep_prompts.md): every learner of the method table whose
# reference shape is deep (methods.Learner.deep): 2 + 2 IVLP tokens in every layer of both towers, and MaPLe's 2
# text tokens in every layer with their coupled visual prompts; the presets' depth 0 (meta/method/methods.yaml) is
# every layer of the world's tiny CLIP.  Each one's GRAM preset (a row whose preset is itself and starts from θ*)
# is meta-trained.
DEEP_TRAINERS = tuple(name for name, row in methods.learners().items() if row.deep)
DEEP_VARIANTS = tuple(
    MetaVariant(m.key)
    for m in methods.methods().values()
    if m.trainer in DEEP_TRAINERS and m.preset == m.key and m.init and m.regulate
)
# The paper-literal GRAM ("one-step objective" rows): meta-trained on the query loss after one inner step
# only, whatever the settings' query_before_weight (with the default weight 0 the demo trains each once:
# stage_meta finds the equal config).
ONE_STEP = ("META.QUERY_BEFORE_WEIGHT", 0.0)
ONE_STEP_VARIANTS = (
    MetaVariant("gram_coop_one_step", ONE_STEP),
    MetaVariant("gram_vpt_one_step", ONE_STEP),
    MetaVariant("unigram_one_step", ONE_STEP),
)
# Test-time GRAM (the "testtime" group): θ*, R_φ of CoOp meta-trained with META.MODE testtime.  Its views: 8 per
# query image with 3 kept (share 0.375), chosen on val over 16 / 6 kept (the confident views TPT's 64 / 10 % keep
# at test time, from fewer candidates) by gram_world.study_testtime select (docs/study/testtime_selection.md; ours,
# for the CPU: each query image takes its own second-order step).  A task's query images take their steps in one stacked
# pass (META.TASK_BATCHING on; the loop's gradients up to the order of float sums; several times faster in a rough
# timing here).  Its "_proto" twin conditions R_φ on the image's relation to CHC prototypes
# (META.TEST_TIME.PROTOTYPES nearest, meta.method.prototypes), all else equal.
TESTTIME_META = ("META.MODE", "testtime", "META.TEST_TIME.VIEWS", 8, "META.TEST_TIME.CONFIDENT_SHARE", 0.375)
TESTTIME_META += ("META.TASK_BATCHING", "on")
TESTTIME_VARIANTS = (
    MetaVariant("gram_coop_testtime", TESTTIME_META),
    MetaVariant("gram_coop_testtime_proto", TESTTIME_META + ("META.TEST_TIME.PROTOTYPES", "nearest")),
)
ALL_VARIANTS = META_VARIANTS + ONE_STEP_VARIANTS + TOKEN_VARIANTS + DEEP_VARIANTS + TESTTIME_VARIANTS
VARIANT_BY_NAME = {v.name: v for v in ALL_VARIANTS}


@dataclass(frozen=True)
class MethodRow:
    """One row of the paper's tables: stable key (results.json, run folders), paper label,
    evaluator preset and the meta variant whose θ*/φ it starts from ("" = none).

    A derived row (:func:`method_row` of a key such as ``coop@ct4``) is a table row fine-tuned with extra
    :class:`meta.evaluation.MethodSpec` fields: ``table_key`` names the method table's row it is built from and
    ``spec_overrides`` holds the extra fields as ``(field, value)`` pairs."""

    key: str
    label: str
    preset: str
    variant: str = ""
    table_key: str = ""  # the method table's row (meta/method/methods.yaml) of a derived row; "" = ``key`` itself
    spec_overrides: tuple = ()  # ((MethodSpec field, value), ...) on top of the row's spec

    @property
    def method_key(self) -> str:
        """The method table's key of this row (``meta/method/methods.yaml``)."""
        return self.table_key or self.key

    @property
    def standalone_label(self) -> str:
        """``label`` as it reads outside the paper's tables (a summary row, a sentence): the method table's
        ``full_label`` in place of a Table 4 ablation's "- ..." label, a derived row's suffix kept."""
        method = methods.get(self.method_key)
        if not self.label.startswith(method.label):
            return self.label
        return method.standalone_label + self.label[len(method.label) :]


def _method_row(key: str, variant: str = "") -> MethodRow:
    """A table row whose label and evaluator preset come from the method table (``meta/method/methods.yaml``);
    the demo adds only which meta variant it starts from."""
    method = methods.get(key)
    return MethodRow(key, method.label, method.preset, variant)


def _variant_of(method: methods.Method) -> Optional[str]:
    """The meta variant a table row starts from: its own (a row meta-trained for itself, :data:`ALL_VARIANTS`), its
    preset's for a row reading a GRAM init file (the θ*-only / R_φ-only components), ``""`` for a row without one;
    ``None`` when the row reads a GRAM file the demo meta-trains no variant for."""
    if method.key in VARIANT_BY_NAME:
        return method.key
    if not method.gram_file:
        return ""
    return method.preset if method.preset in VARIANT_BY_NAME else None


# Every row the demo evaluates: every row of the method table (meta/method/methods.yaml) whose θ* / R_φ, if it reads
# them, come from a meta variant above; the table's key order is the paper's row order.
METHODS = tuple(
    _method_row(m.key, variant) for m in methods.methods().values() if (variant := _variant_of(m)) is not None
)
METHOD_BY_KEY = {m.key: m for m in METHODS}

# Rows fine-tuned with the zero-shot consistency terms (meta/method/consistency.py) are evaluated under derived keys,
# ``<row>@ct<λ text>_ci<λ image>`` with a zero weight left out: ``coop@ct4``, ``vpt@ci2.5``, ``joint@ct1_ci1.25``,
# ``gram_coop@ct4`` (a gate-meta-trained CoOp + GRAM fine-tuned with the weights it was meta-trained with).  The
# key keeps their runs, records and tables apart from the row's own.
CONSISTENCY_TAGS = (("ct", "consistency_text", "text"), ("ci", "consistency_image", "image"))


def consistency_key(key: str, text: float = 0.0, image: float = 0.0) -> str:
    """The record key of row ``key`` fine-tuned with consistency weights λ ``text`` / ``image``
    (:class:`meta.evaluation.MethodSpec` ``consistency_text`` / ``consistency_image``); ``key`` itself when both are
    0.  The one spelling :func:`method_row` reads back (numbers as ``format(λ, ".12g")``: 4, 2.5)."""
    if key not in METHOD_BY_KEY:
        raise KeyError(f"unknown demo row {key!r}: expected one of {', '.join(METHOD_BY_KEY)}")
    parts = []
    for (tag, _, what), value in zip(CONSISTENCY_TAGS, (text, image)):
        value = float(value)
        if not value >= 0 or value == float("inf"):
            raise ValueError(f"consistency_key {key!r}: the {what} weight must be a finite number >= 0, got {value!r}")
        if value:
            parts.append(f"{tag}{value:.12g}")
    return f"{key}@{'_'.join(parts)}" if parts else key


def consistency_weights(key: str) -> tuple[float, float]:
    """``(λ text, λ image)`` of a record key (:func:`consistency_key`); ``(0, 0)`` for a plain row."""
    overrides = dict(method_row(key).spec_overrides)
    return tuple(float(overrides.get(field, 0.0)) for _, field, _ in CONSISTENCY_TAGS)


def _consistency_tags(tags: str) -> dict:
    """``{MethodSpec field: λ}`` of the part of a derived key after ``@`` (``ct4_ci5``); {} when it is not one."""
    by_tag = {tag: field for tag, field, _ in CONSISTENCY_TAGS}
    out: dict = {}
    for part in tags.split("_"):
        field = by_tag.get(part[:2])
        try:
            value = float(part[2:])
        except ValueError:
            return {}
        if field is None or field in out or not 0 < value < float("inf"):
            return {}
        out[field] = value
    return out


def method_row(key: str) -> MethodRow:
    """The row of a record key: a :data:`METHODS` row, or a derived row ``<row>@<weights>`` (:func:`consistency_key`):
    the row's preset, meta variant and method-table row, fine-tuned with those consistency weights, labelled
    ``"<label>, λ text 4"``.  Any other key (or another spelling of one) is a one-line error."""
    if key in METHOD_BY_KEY:
        return METHOD_BY_KEY[key]
    name, _, tags = key.partition("@")
    weights = _consistency_tags(tags)
    text, image = (weights.get(field, 0.0) for _, field, _ in CONSISTENCY_TAGS)
    if name not in METHOD_BY_KEY or not weights or consistency_key(name, text, image) != key:
        raise KeyError(
            f"unknown demo row {key!r}: expected a row key ({', '.join(METHOD_BY_KEY)}) or <row>@ct<λ>_ci<λ> "
            "as consistency_key spells it (e.g. coop@ct4, vpt@ci2.5, joint@ct1_ci1.25)"
        )
    base = METHOD_BY_KEY[name]
    what = ", ".join(f"{w} {weights[field]:g}" for _, field, w in CONSISTENCY_TAGS if field in weights)
    return replace(
        base,
        key=key,
        label=f"{base.label}, λ {what}",
        table_key=base.key,
        spec_overrides=tuple((field, weights[field]) for _, field, _ in CONSISTENCY_TAGS if field in weights),
    )


# Which rows each table holds (keys of METHODS), in the paper's order.  CoCoOp (Zhou et al., CVPR 2022) follows
# CoOp as in the paper's Tables 1-3, with its θ*-only row (CoCoOp fine-tuned from the meta-learned ctx and
# meta-net, raw gradients) beside it.
TABLE1_KEYS = ("zsclip", "coop", "gram_coop", "cocoop", "gram_cocoop_init_only", "vpt", "gram_vpt", "unigram")
# Each GRAM row's components (θ* only: meta-learned start, raw gradients; R_φ only: the baseline's start,
# regulated gradients) next to it in Table 1; UNIGRAM's θ*-only row is Table 4's "- gradient regulating".
INIT_ONLY_KEYS = ("gram_coop_init_only", "gram_vpt_init_only", "gram_cocoop_init_only")
REG_ONLY_KEYS = ("gram_coop_reg_only", "gram_vpt_reg_only", "unigram_reg_only", "gram_cocoop_reg_only")
# CoCoOp + GRAM with R_φ (its θ*-only row is the default's): a diagnostics row, beside its R_φ-only row
COCOOP_REGULATED_KEYS = ("gram_cocoop",)
COMPONENT_KEYS = INIT_ONLY_KEYS + REG_ONLY_KEYS
# The paper-literal GRAM of each prompt type ("one-step objective": R_φ on every image's gradient, no launch
# step, θ*/φ meta-trained on the one-step query loss only), beside the GRAM row that follows the defaults.
ONE_STEP_KEYS = ("gram_coop_one_step", "gram_vpt_one_step", "unigram_one_step")
TABLE1_ROWS = (
    "zsclip",
    "coop",
    "gram_coop",
    "gram_coop_init_only",
    "gram_coop_reg_only",
    "gram_coop_one_step",
    "cocoop",
    "gram_cocoop",
    "gram_cocoop_init_only",
    "gram_cocoop_reg_only",
    "vpt",
    "gram_vpt",
    "gram_vpt_init_only",
    "gram_vpt_reg_only",
    "gram_vpt_one_step",
    "unigram",
    "unigram_no_reg",
    "unigram_reg_only",
    "unigram_one_step",
    "joint",
)
# What R_φ adds to θ*: each GRAM row against its θ*-only row (meta-learned start, raw gradients)
REG_ADDS_PAIRS = (
    ("gram_coop", "gram_coop_init_only"),
    ("gram_vpt", "gram_vpt_init_only"),
    ("unigram", "unigram_no_reg"),
)
# Rows of Fig. 3a (accuracy vs fine-tuning epoch): only their runs (and zero-shot's) are tested after every epoch;
# the other runs are tested once, after the last epoch (the same final numbers, fewer test passes)
EPOCH_PLOT_KEYS = ("coop", "gram_coop", "vpt", "gram_vpt", "unigram")  # as in the paper's figure
EPOCH_CURVE_KEYS = EPOCH_PLOT_KEYS + ("zsclip",)
# (GRAM or component row, its baseline): the paired differences the study reports
PAIRS = (
    ("gram_coop", "coop"),
    ("gram_coop_init_only", "coop"),
    ("gram_coop_reg_only", "coop"),
    ("gram_vpt", "vpt"),
    ("gram_vpt_init_only", "vpt"),
    ("gram_vpt_reg_only", "vpt"),
    ("unigram", "joint"),
    ("unigram_no_reg", "joint"),
    ("unigram_reg_only", "joint"),
    ("gram_coop_one_step", "coop"),
    ("gram_vpt_one_step", "vpt"),
    ("unigram_one_step", "joint"),
    ("gram_coop", "gram_coop_one_step"),
    ("gram_vpt", "gram_vpt_one_step"),
    ("unigram", "unigram_one_step"),
) + REG_ADDS_PAIRS
TABLE4_KEYS = ("unigram", "unigram_no_shift", "unigram_no_reg", "unigram_pretrain", "unigram_supervised", "joint")
# Table 1's rows that only the diagnostics group computes (the default's Table 1 is the rest)
DIAGNOSTIC_KEYS = REG_ONLY_KEYS + ONE_STEP_KEYS + COCOOP_REGULATED_KEYS
TRANSFER_KEYS = TABLE1_KEYS
TOKEN_KEYS = {n: ("unigram" if n == 4 else f"unigram_{n}tok") for n in TOKEN_COUNTS}
# every demo row of the deep learners (DEEP_TRAINERS), in table order: each baseline, its GRAM row and components
DEEP_KEYS = tuple(m.key for m in METHODS if methods.get(m.key).trainer in DEEP_TRAINERS)


# The test-time rows (opt-in group "testtime"): TPT (Shu et al., NeurIPS 2022; azshue/TPT) on every test image of the
# cross-domain target (the held-out style, fine-tuned on its source) and of base-to-new's base and new classes, from
# each start; zero-shot CLIP is the reference without tuning.  (record key, demo row, label, fine-tuned on the
# few-shot train split first).  "TPT from the hand prompt" is CoOp's context started from the zero-shot words.
@dataclass(frozen=True)
class TestTimeRow:
    key: str
    row: str  # the METHODS row whose start (and φ) it uses
    label: str
    fine_tuned: bool  # the few-shot schedule first (CoOp's prompts), else the start as it is (no labelled data)
    optimizer: str = "adamw"  # TPT's AdamW, or meta: the init file's meta-trained step θ − α R_φ(g)
    prototypes: str = "none"  # nearest: R_φ reads the image's relation to the init file's CHC prototypes
    adapt: str = "tpt"  # cache: nothing tuned, TDA's caches over the test stream (meta.finetune.cache)

    __test__ = False  # not a pytest test class


TESTTIME_ROWS = (
    TestTimeRow("zsclip", "zsclip", "Zero-shot CLIP (no tuning)", False),
    TestTimeRow("tpt_hand", "coop", "TPT from the hand prompt", False),
    TestTimeRow("tpt_coop", "coop", "TPT from CoOp's prompts", True),
    TestTimeRow("tpt_init", "gram_coop_init_only", "TPT from GRAM's θ*", False),
    TestTimeRow("tpt_init_reg", "gram_coop", "TPT from GRAM's θ* with R_φ", False),
    TestTimeRow("tt_gram", "gram_coop_testtime", "Test-time GRAM (meta-trained for it, its own step)", False, "meta"),
    TestTimeRow(
        "tt_gram_proto",
        "gram_coop_testtime_proto",
        "Test-time GRAM with CHC prototypes (R_φ reads the image's relation to them)",
        False,
        "meta",
        "nearest",
    ),
    # TDA (Karmanov et al., CVPR 2024; kdiAAA/TDA): its ImageNet-variant setting, TPT's views and 10 % kept
    TestTimeRow("tda_cache", "zsclip", "TDA's caches on zero-shot CLIP (training-free, online)", False, adapt="cache"),
)
TESTTIME_BY_KEY = {r.key: r for r in TESTTIME_ROWS}
HAND_PROMPT = "a photo of a"  # the world's zero-shot template "a photo of a {}." as CoOp's 4 context words
TESTTIME_SPEC = TestTimeSpec()  # TPT's protocol as published: 64 views, 10 % kept, one AdamW step at 5e-3


# The fixed-λ zero-shot-consistency comparators (meta/method/consistency.py): CoOp, VPT and joint tuning fine-tuned with
# the consistency terms at the λ the base-to-new sweep chose on val splits for each (``fixed`` in the committed
# docs/study/selection_b2n.json; its rule: docs/study/selection_b2n_rule.md).  Until that file is committed (or when
# it is partial), the published weights: KgCoOp's text 8 (Yao et al., CVPR 2023) and PromptSRC's image 10 (Khattak
# et al., ICCV 2023), joint tuning both.
CONSISTENCY_BASELINES = ("coop", "vpt", "joint")
PUBLISHED_LAMBDA = {"coop": (8.0, 0.0), "vpt": (0.0, 10.0), "joint": (8.0, 10.0)}
SELECTION_B2N = Path(__file__).resolve().parents[2] / "docs" / "study" / "selection_b2n.json"


def consistency_lambdas(path: Optional[Path] = None) -> tuple[dict, str]:
    """``({baseline key: (λ text, λ image)}, where they come from)``: the sweep's chosen λ from ``path`` (default
    :data:`SELECTION_B2N`) when it holds a finished rule sweep, else :data:`PUBLISHED_LAMBDA`."""
    path = Path(path or SELECTION_B2N)
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return dict(PUBLISHED_LAMBDA), "published weights (KgCoOp text 8, PromptSRC image 10): no sweep file"
    fixed = {v.get("row"): v.get("lambda") for v in (data.get("fixed") or {}).values() if isinstance(v, dict)}
    if data.get("partial") or data.get("off_rule") or any(fixed.get(k) is None for k in CONSISTENCY_BASELINES):
        return dict(
            PUBLISHED_LAMBDA
        ), "published weights (KgCoOp text 8, PromptSRC image 10): the sweep is not finished"
    return {k: tuple(float(x) for x in fixed[k]) for k in CONSISTENCY_BASELINES}, f"chosen on val splits ({path.name})"


def consistency_keys(path: Optional[Path] = None) -> tuple:
    """Each consistency baseline beside its row at :func:`consistency_lambdas`: ``coop, coop@ct8, vpt, ...``."""
    lambdas, _ = consistency_lambdas(path)
    return tuple(k for base in CONSISTENCY_BASELINES for k in (base, consistency_key(base, *lambdas[base])))


# Table groups of ``--tables``: what each one evaluates and which meta variants it needs.
TABLE_GROUPS = {
    "base2new": "Table 1 (base-to-new, each GRAM row with its θ*-only row), Fig. 3a, Fig. 3b",
    "ablations": "Table 4 (UNIGRAM's ablations; in 'all', not in the default)",
    "diagnostics": "Table 1's R_φ-only rows, paper-literal one-step rows and CoCoOp + GRAM with R_φ (in 'all', "
    "not in the default)",
    "transfer": "Tables 2 and 3 (cross-domain, cross-dataset) and A1 / A2 (the same at fewer shots)",
    "tokens": "Table A3 (UNIGRAM with 2 / 4 / 6 / 8 prompt tokens)",
    "deep": "deep prompts: IVLP and MaPLe, each without and with GRAM (base-to-new; opt-in, not in 'all')",
    "consistency": "CoOp, VPT and joint tuning with the zero-shot consistency terms at the base-to-new sweep's λ "
    "(published KgCoOp / PromptSRC weights before it is committed; opt-in, not in 'all')",
    "testtime": "test-time prompt tuning (TPT) from the hand prompt, CoOp's prompts, θ* and θ* with R_φ, beside "
    "zero-shot: accuracy, ECE, seconds per image (cross-domain target and base-to-new; opt-in, not in 'all')",
}
OPT_IN_TABLES = ("deep", "consistency", "testtime")  # groups that `--tables all` leaves out
DEFAULT_TABLES = ("base2new",)


def b2n_keys(tables: tuple) -> tuple:
    """Method keys evaluated base-to-new for the table groups ``tables``."""
    keys: tuple = ()
    if "base2new" in tables:
        keys += tuple(k for k in TABLE1_ROWS if k not in DIAGNOSTIC_KEYS)
    if "ablations" in tables:
        keys += TABLE4_KEYS
    if "diagnostics" in tables:
        keys += DIAGNOSTIC_KEYS
    if "tokens" in tables:
        keys += tuple(TOKEN_KEYS.values())
    if "deep" in tables:
        keys += DEEP_KEYS
    if "consistency" in tables:
        keys += consistency_keys()
    return tuple(dict.fromkeys(keys))


def transfer_keys(tables: tuple) -> tuple:
    return TRANSFER_KEYS if "transfer" in tables else ()


def testtime_rows(tables: tuple) -> tuple:
    """The METHODS rows the test-time group starts from (empty without it)."""
    return tuple(dict.fromkeys(r.row for r in TESTTIME_ROWS)) if "testtime" in tables else ()


def variants_needed(tables: tuple) -> tuple:
    """Meta variants the table groups start from, in :data:`ALL_VARIANTS` order."""
    keys = b2n_keys(tables) + transfer_keys(tables) + testtime_rows(tables)
    names = {method_row(k).variant for k in keys} - {""}
    return tuple(v for v in ALL_VARIANTS if v.name in names)


@dataclass(frozen=True)
class DemoSettings:
    """Everything the demo's numbers depend on (besides the world and the CLIP settings)."""

    quick: bool = False
    seeds: tuple = (1, 2, 3)  # CoOp / CoCoOp report the mean of seeds 1, 2, 3
    datasets: tuple = ()  # () = every world dataset with the base2new role
    shots: int = 16  # paper: 16 shots
    epochs: int = 10  # paper section 4.1: 10 epochs, CoCoOp's schedule
    batch_size: int = 1  # CoCoOp's schedule; batch 4 gave the same CoOp base (docs/notes/world_baseline.md)
    eval_every_epoch: bool = True  # needed for the accuracy-vs-epoch plot
    # meta-training (values the paper does not give; ours, chosen for the CPU budget)
    meta_steps: int = 300
    meta_batch: int = 4  # [SUPMER] / MAML miniImageNet: 4 tasks per outer step
    k_way: int = 5
    n_support: int = 4
    n_query: int = 8
    inner_lr: float = 0.1  # core default
    checkpoint_every: int = 50
    log_detail_every: int = 25  # grad cosine (Fig. 3b) sampled every 25 steps (a detailed step costs ~1.5x a plain one)
    domains: int = 4  # U visual domains per topic (world has 4 seen styles)
    min_per_domain: int = 8  # CHC default: fewer images per domain -> fewer domains
    min_cluster_size: int = 40  # HDBSCAN: smallest topic wanted (corpus ~ 6000 / 40 categories)
    val_tasks: int = 20  # held-out meta-validation tasks (evaluated at step 0 and at the end)
    # Random-resized-crop area range for fine-tuning.  CoOp/Dassl use (0.08, 1) on 224-px photos; on
    # 32-px world images an 8 % crop is ~9 px and often misses the object.  Measured with a
    # patch-4 world CLIP (zero-shot 18-34 %; CoOp, 16 shots, seeds 1-2, H): (0.08, 1) 30.8 / 30.3 / 36.0 on Mixed /
    # Polygons / Icons,
    # (0.5, 1) 34.2 / 32.7 / 41.9, no augmentation 34.7 / 37.6 / 41.6.  Same setting for every method.
    rrcrop_scale: tuple = (0.5, 1.0)
    # start of scratch visual prompt tokens for every method with visual prompts (meta-training and
    # fine-tuning alike): the library default, chosen on the val splits with VPT alone (docs/notes/world_baseline.md)
    vpt_init: str = PromptSpec.vpt_init
    # how θ* and R_φ are used at test time and what they are meta-trained for (docs/notes/gram_training_match.md):
    reg_window: int = DEFAULT_REG_WINDOW  # R_φ on the mean gradient of this many images, one step per window
    launch: bool = DEFAULT_LAUNCH  # the meta-trained inner step once before the schedule
    query_before_weight: float = (
        DEFAULT_QUERY_BEFORE_WEIGHT  # META.QUERY_BEFORE_WEIGHT of every GRAM variant (0 = paper's Eq. 8)
    )
    meta_seed: int = 0  # SEED of meta-training (task stream, scratch θ): the study varies it
    # extra META / TASKS (KEY, VALUE, ...) of every GRAM meta variant except the paper-literal one-step rows: how
    # R_φ is meta-trained (gram_world.study select --sweep regulator); () = the defaults
    meta_overrides: tuple = ()
    eval_split: str = "test"  # split the base / new accuracies are measured on (val: choosing defaults); the
    # test-time group's transfer runs too (records under runs/testtime_*_val)
    testtime_steps: int = 1  # test-time steps of the rows that take their meta-trained step (TestTimeRow.optimizer)
    testtime_protocols: tuple = ("base2new", "transfer")  # which of the test-time group's runs are computed
    # views per test image of the cache row (TestTimeRow.adapt "cache"), the confident ones' mean its feature: TDA
    # (kdiAAA/TDA utils.py) takes 64 on ImageNet's variants, 1 on its cross-domain datasets; 1 chosen on val by
    # gram_world.study_testtime select-cache (docs/study/testtime_cache_selection.md: 56.67 against 34.72 %)
    cache_views: int = 1
    meta_val_protocol: str = "one_step"  # META.VAL_PROTOCOL: the downstream one costs minutes per variant here; the
    # defaults are chosen by gram_world.study select on val splits instead
    jobs: int = 2  # worker processes for meta-training and evaluation (2 cores)
    # which world: its seed, and (field, value) pairs replacing fields of gram_world.world_settings(quick,
    # world_seed) - e.g. (("holdout_style", "cartoon"), ("mixed_classes", (...))) - or of the tiny CLIP's
    # gram_world.pretrain_settings(quick, world_seed).  All of them change the world's (or the CLIP's)
    # settings hash, hence its cache folder.
    world_seed: int = 0
    world: tuple = ()
    clip: tuple = ()
    tables: tuple = DEFAULT_TABLES  # table groups to compute (TABLE_GROUPS); results do not depend on it
    # shots of Tables 2 / 3 and of Tables A1 / A2; () = (shots, 4) (paper: 16 and 4), or (shots, shots // 2)
    # when shots <= 4 (the quick demo's 4 and 2)
    transfer_shots: tuple = ()

    @property
    def transfer_shot_counts(self) -> tuple:
        if self.transfer_shots:
            return tuple(self.transfer_shots)
        return (self.shots, 4) if self.shots > 4 else (self.shots, max(1, self.shots // 2))

    @classmethod
    def preset(cls, quick: bool) -> "DemoSettings":
        if not quick:
            return cls()
        # the quick world has 10 labelled images per class: small tasks, small domains
        return cls(
            quick=True,
            seeds=(1,),
            datasets=("WorldMixed",),
            shots=4,
            epochs=2,
            meta_steps=10,
            meta_batch=2,
            n_support=2,
            n_query=4,
            checkpoint_every=5,
            log_detail_every=5,
            min_cluster_size=15,
            domains=2,
            min_per_domain=4,
            val_tasks=4,
        )


def _override(base, pairs: tuple, what: str):
    """``dataclasses.replace(base, **dict(pairs))`` with a one-line error naming an unknown field."""
    if not pairs:
        return base
    changes = dict(pairs)
    known = {f.name for f in fields(base)}
    unknown = sorted(set(changes) - known)
    if unknown:
        raise ValueError(
            f"DemoSettings.{what}: {type(base).__name__} has no field {', '.join(unknown)}; "
            f"known: {', '.join(sorted(known))}"
        )
    return replace(base, **{k: tuple(v) if isinstance(v, list) else v for k, v in changes.items()})


def demo_world_settings(settings: DemoSettings) -> WorldSettings:
    """The :class:`gram_world.WorldSettings` of this demo: seed ``world_seed`` plus the ``world`` overrides."""
    return _override(world_settings(quick=settings.quick, seed=settings.world_seed), settings.world, "world")


def demo_pretrain_settings(settings: DemoSettings) -> PretrainSettings:
    """The tiny CLIP's :class:`gram_world.PretrainSettings` (seeded by the world seed) plus ``clip`` overrides."""
    return _override(pretrain_settings(settings.quick, seed=settings.world_seed), settings.clip, "clip")


# Settings added after demo folders were written without them, with the behaviour those folders had:
# a folder without ``vpt_init`` started its visual prompts from N(0, 0.02^2) and must not be reused; one
# without the training-match switches ran the paper-literal GRAM (per-image R_φ, no launch, one-step objective),
# meta-trained with seed 0, measured on test splits, meta-validated after one step.
VALUE_BEFORE_SETTING = {
    "vpt_init": "normal",
    "reg_window": 1,
    "launch": False,
    "query_before_weight": 0.0,
    "meta_seed": 0,
    "eval_split": "test",
    "meta_val_protocol": "one_step",
}

# settings that change what is computed or how fast, never a cached number: cache_views too, as the cache row's
# records at other views than TPT's 64 have their own files (stages.EvalJob.path); settings left out at their
# default, so folders and hashes written before they existed stay valid:
_NOT_RESULTS = ("jobs", "tables", "testtime_protocols", "cache_views")
_LEFT_OUT_AT = {"meta_overrides": [], "testtime_steps": 1}


def settings_record(settings: DemoSettings) -> dict:
    """The settings every cached result depends on, as JSON (what ``demo_settings.json`` holds)."""
    current = json.loads(json.dumps(asdict(settings)))
    for key in _NOT_RESULTS:
        current.pop(key)
    for key, default in _LEFT_OUT_AT.items():
        if current[key] == default:
            current.pop(key)
    return current


def settings_hash(settings: DemoSettings) -> str:
    """First 12 hex digits of the SHA-256 of :func:`settings_record` (canonical JSON)."""
    blob = json.dumps(settings_record(settings), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:12]
