"""Dassl datasets for the CoOp benchmarks (``DATASET.NAME`` as in CoOp).

``datasets.register_all()`` (or ``import datasets.coop_layout``) registers ImageNet, Caltech101,
OxfordPets, StanfordCars, OxfordFlowers, Food101, FGVCAircraft, SUN397, DescribableTextures,
EuroSAT, UCF101, ImageNetV2, ImageNetSketch, ImageNetA and ImageNetR in Dassl's
``DATASET_REGISTRY``; ``datasets.register_coop_layout_dataset(...)`` adds a new CoOp-layout
dataset in one call.  All reading, sampling and base/new logic lives in the Dassl-free
``meta.data.coop_data``.

Importing this package is free of side effects and works without Dassl: Dassl is imported only
when one of the names above is first used (PEP 562 ``__getattr__``), and without Dassl that use
raises a one-line ImportError.  This matters because of the name clash below.

Name clash with Hugging Face ``datasets``: like every
CoOp fork, this repository has a top-level ``datasets/`` package, and the repository root comes
first on ``sys.path`` when running ``python train.py`` (or ``python -c``/pytest) there.
- transformers 5.x probes for Hugging Face ``datasets`` by *importing* whatever ``datasets``
  resolves to when no distribution metadata is found, so ``import sentence_transformers`` from the
  repo root imports this package.  That is why its import must stay cheap and must not fail.
- If the Hugging Face ``datasets`` distribution is *installed*, ``import sentence_transformers``
  from the repo root fails with ``ImportError: cannot import name 'Dataset' from 'datasets'``.
  Our environment therefore does not install Hugging Face ``datasets`` (nothing here needs it).
  If you must have it, compute text embeddings in a process started outside the repository root,
  or ``pip uninstall datasets``.
"""

from __future__ import annotations

from typing import Any

_API = {"CoopLayoutDataset", "register_coop_layout_dataset", "register_all", "STANDARD_DATASETS", "to_datums"}

__all__ = sorted(_API) + ["STANDARD_NAMES"]


def _standard_names() -> tuple:
    """``DATASET.NAME`` of the 15 benchmarks, from meta.data.coop_data's dataset list (read on first use)."""
    from meta.data.coop_data import STANDARD_LAYOUTS

    return tuple(layout.name for layout in STANDARD_LAYOUTS)


def __getattr__(name: str) -> Any:
    """Load the Dassl side on first use of one of its names (one-line ImportError without Dassl)."""
    if name.startswith("__"):  # probes such as __version__ or __path__ lookups stay free
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name == "STANDARD_NAMES":
        return _standard_names()
    if name in _API or name in _standard_names():
        from . import coop_layout

        return getattr(coop_layout, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
