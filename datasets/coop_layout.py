"""Dassl ``DatasetBase`` classes over ``meta.data.coop_data``: the CoOp benchmarks and a factory for more.

Every class here only converts what ``meta.data.coop_data.load_coop_splits`` returns into Dassl
``Datum`` lists, so Dassl runs and the Dassl-free evaluator see the same images.  The few-shot
draws use the global ``random`` module, which Dassl's ``set_random_seed(cfg.SEED)`` seeded: the
global stream advances exactly as in CoOp's own dataset classes.  Images whose header is over the pixel or
aspect cap are left out before Dassl's loader sees them, and a class with fewer train images than
``DATASET.NUM_SHOTS`` is named, each in one stderr line (``meta.data.coop_data.warn_inputs``).
"""

from __future__ import annotations

import os
import random
import warnings
from typing import Any, Sequence

from meta.data.coop_data import (
    STANDARD_LAYOUTS,
    CoopLayout,
    Record,
    fewshot_cache_path,
    load_coop_splits,
    missing_files,
    register_layout,
    warn_inputs,
)

from ._dassl import DATASET_REGISTRY, DatasetBase, Datum

__all__ = ["CoopLayoutDataset", "register_coop_layout_dataset", "register_all", "STANDARD_DATASETS", "to_datums"]


def to_datums(records: Sequence[Record] | None, split: str, dataset: str) -> list[Datum] | None:
    """Dassl ``Datum`` objects for ``records``; a missing image is a one-line FileNotFoundError."""
    if records is None:
        return None
    missing = missing_files(records)
    if missing:
        raise FileNotFoundError(
            f"{dataset} {split}: {len(missing)} image(s) listed by the split are missing, e.g. {missing[0]}"
        )
    return [Datum(impath=r.impath, label=r.label, classname=r.classname) for r in records]


class CoopLayoutDataset(DatasetBase):
    """A CoOp-layout dataset; subclasses set ``layout`` (a ``meta.data.coop_data.CoopLayout``).

    cfg keys read: ``DATASET.ROOT``, ``DATASET.NUM_SHOTS``, ``SEED``, and
    ``DATASET.SUBSAMPLE_CLASSES`` (added by CoOp-style ``extend_cfg``; ``"all"`` when absent).
    """

    layout: CoopLayout
    dataset_dir = ""

    def __init__(self, cfg: Any) -> None:
        layout = self.layout
        root = os.path.abspath(os.path.expanduser(cfg.DATASET.ROOT))
        self.dataset_dir = os.path.join(root, layout.dataset_dir)
        self.image_dir = os.path.join(self.dataset_dir, layout.image_dir) if layout.image_dir else self.dataset_dir
        self.split_fewshot_dir = os.path.dirname(fewshot_cache_path(root, layout, 1, 0))
        subsample = getattr(cfg.DATASET, "SUBSAMPLE_CLASSES", "all")
        splits = load_coop_splits(
            root,
            layout,
            num_shots=cfg.DATASET.NUM_SHOTS,
            seed=cfg.SEED,
            subsample=subsample,
            rng=random,  # the global stream that set_random_seed seeded, as CoOp's classes use
        )
        where = layout.name if subsample == "all" or layout.test_only else f"{layout.name} ({subsample} classes)"
        shots = -1 if layout.test_only else cfg.DATASET.NUM_SHOTS  # the variants are never few-shot sampled
        self.shots_per_class = warn_inputs(where, splits, shots, "DATASET.NUM_SHOTS")
        super().__init__(
            train_x=to_datums(splits.train, "train", layout.name),
            val=to_datums(splits.val, "val", layout.name),
            test=to_datums(splits.test, "test", layout.name),
        )


def _register(cls: type) -> None:
    """Register ``cls`` by its name; re-registering (a package imported twice) replaces quietly."""
    name = cls.__name__
    if name in DATASET_REGISTRY.registered_names():
        old = DATASET_REGISTRY.get(name)
        if not (isinstance(old, type) and issubclass(old, DatasetBase) and hasattr(old, "layout")):
            warnings.warn(f"Dassl dataset {name!r} ({old.__module__}) is replaced by GRAM's CoOp-layout reader")
    DATASET_REGISTRY.register(cls, force=True)


def _make_class(layout: CoopLayout) -> type:
    cls = type(layout.name, (CoopLayoutDataset,), {"layout": layout, "dataset_dir": layout.dataset_dir})
    cls.__module__ = __name__
    cls.__doc__ = f"CoOp's {layout.name}: ``DATASET.ROOT/{layout.dataset_dir}`` ({layout.reader} reader)."
    return cls


def register_coop_layout_dataset(
    name: str,
    dataset_dir: str,
    image_dir: str,
    split_file: str | None,
    reader: str = "split",
    config_key: str = "",
) -> type:
    """Register a new CoOp-layout dataset as ``DATASET.NAME = name`` and return its class.

    ``DATASET.ROOT/<dataset_dir>/<image_dir>/`` holds the images and
    ``DATASET.ROOT/<dataset_dir>/<split_file>`` a ``split_zhou``-style json
    (``{"train"|"val"|"test": [[relative impath, label, classname], ...]}``).  The layout is also
    added to ``meta.data.coop_data.COOP_LAYOUTS`` so the Dassl-free evaluator finds it.  Calling it again
    with the same name replaces the earlier registration (no crash on double import).
    """
    layout = register_layout(CoopLayout(name, dataset_dir, image_dir, reader, split_file, config_key))
    cls = _make_class(layout)
    _register(cls)
    return cls


STANDARD_DATASETS: dict[str, type] = {}
for _layout in STANDARD_LAYOUTS:  # meta.data.coop_data's dataset list
    STANDARD_DATASETS[_layout.name] = _make_class(_layout)
    _register(STANDARD_DATASETS[_layout.name])
globals().update(STANDARD_DATASETS)


def register_all() -> dict[str, type]:
    """The 15 CoOp benchmark classes by ``DATASET.NAME``; they were registered when this module loaded."""
    return dict(STANDARD_DATASETS)
