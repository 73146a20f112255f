"""The main job: GRAM end to end in the CPU-sized world, ``python -m gram_world.demo [--quick]``.

Stages (each cached on disk, so a rerun or an interrupted run redoes only what is missing):

1. generate the procedural world (``gram_world.build_world``) from ``--world-seed`` (and optionally
   another held-out style / mixed-dataset classes), each world in its own cache folder;
2. pretrain the world's tiny open_clip CLIP on its pretraining corpus and measure zero-shot accuracy;
3. Cross-modal Hierarchical Clustering of the unlabelled image-text corpus (``meta.chc``);
4. meta-train θ*/φ for CoOp, VPT and UNIGRAM, the paper's Table 4 ablations (no domain-shift
   simulation, no regulator, prompt pre-training, supervised meta-learning) and, for Table A3,
   UNIGRAM with 2 / 6 / 8 prompt tokens;
5. evaluation (``meta.evaluation``, CoOp's protocols) over seeds, split over ``--jobs`` worker
   processes (meta-training too): base-to-new on every base2new dataset (Tables 1, 4, A3) and
   transfer - fine-tune on all classes of the mixed source, test on its held-out-style twin and
   on the four family datasets (Tables 2, 3 and, at fewer shots, A1, A2);
6. ``results.md`` / ``results.json`` (every table with the paper's row names, mean ± std over seeds)
   and PNG plots (:mod:`.report`).

``--tables`` picks the table groups (:data:`TABLE_GROUPS`); the method rows of every table are
defined once, in :data:`METHODS` (stable key, paper label, evaluator preset, meta variant).
Every hyper-parameter the paper does not give is in :class:`DemoSettings` with where it came from.

Modules: :mod:`.settings` (variants, method rows, table groups, :class:`DemoSettings`), :mod:`.stages`
(stages 1-5 and the folder checks), :mod:`.pool` (worker processes with one progress bar),
:mod:`.report` (tables, markdown, plots), :mod:`.cli` (command line, :func:`run`).
"""

from .cli import default_out, main, run, settings_from_args
from .settings import (
    ALL_VARIANTS,
    DEFAULT_TABLES,
    META_VARIANTS,
    METHOD_BY_KEY,
    METHODS,
    TABLE1_KEYS,
    TABLE4_KEYS,
    TABLE_GROUPS,
    TOKEN_KEYS,
    TRANSFER_KEYS,
    VARIANT_BY_NAME,
    DemoSettings,
    MetaVariant,
    MethodRow,
    b2n_keys,
    demo_pretrain_settings,
    demo_world_settings,
    settings_hash,
    settings_record,
    transfer_keys,
    variants_needed,
)
from .stages import method_spec, stage_world

__all__ = [
    "ALL_VARIANTS",
    "DEFAULT_TABLES",
    "META_VARIANTS",
    "METHOD_BY_KEY",
    "METHODS",
    "TABLE1_KEYS",
    "TABLE4_KEYS",
    "TABLE_GROUPS",
    "TOKEN_KEYS",
    "TRANSFER_KEYS",
    "VARIANT_BY_NAME",
    "DemoSettings",
    "MetaVariant",
    "MethodRow",
    "b2n_keys",
    "default_out",
    "demo_pretrain_settings",
    "demo_world_settings",
    "main",
    "method_spec",
    "run",
    "settings_from_args",
    "settings_hash",
    "settings_record",
    "stage_world",
    "transfer_keys",
    "variants_needed",
]
