"""Dassl datasets for the CoOp benchmarks (``DATASET.NAME`` as in CoOp), registered on import.

``import datasets`` registers ImageNet, Caltech101, OxfordPets, StanfordCars, OxfordFlowers,
Food101, FGVCAircraft, SUN397, DescribableTextures, EuroSAT, UCF101, ImageNetV2, ImageNetSketch,
ImageNetA and ImageNetR in Dassl's ``DATASET_REGISTRY``; ``register_coop_layout_dataset`` adds a
new CoOp-layout dataset in one call.  All reading, sampling and base/new logic lives in the
Dassl-free ``meta.coop_data``.  Without Dassl, importing this package raises a one-line
ImportError.

Name clash with Hugging Face ``datasets`` (reference dassl_coop_protocol.md §8 item 17): like every
CoOp fork, this repository has a top-level ``datasets/`` package, and the repository root comes
first on ``sys.path`` when running ``python train.py`` (or ``python -c``/pytest) there.  If the
Hugging Face ``datasets`` distribution is *installed*, ``import sentence_transformers`` from the
repo root fails with ``ImportError: cannot import name 'Dataset' from 'datasets'``, because it
sees the installed distribution but imports this package.  Our environment therefore does not
install Hugging Face ``datasets`` (nothing here needs it).  If you must have it, compute text
embeddings in a process started outside the repository root, or uninstall it
(``pip uninstall datasets``).
"""
from .coop_layout import STANDARD_DATASETS, CoopLayoutDataset, register_coop_layout_dataset, to_datums

globals().update(STANDARD_DATASETS)

__all__ = ["CoopLayoutDataset", "register_coop_layout_dataset", "STANDARD_DATASETS", "to_datums", *STANDARD_DATASETS]
