"""The CPU-sized procedural image-text world and the tiny CLIP pretrained on it.

* ``build_world(quick, root, seed) -> WorldPaths`` writes (or finds cached) the
  pretraining corpus, the CHC corpus (webdataset tar shards), six CoOp-layout
  downstream datasets, a labelled image folder and ``world.json``.
* ``pretrain_clip(world, quick) -> Path`` trains the open_clip model
  ``GRAM-World-ViT-T`` contrastively on the pretraining corpus (cached
  safetensors state dict, loadable with ``meta.model.backbone.load_clip``).
* ``zeroshot_accuracy(world, weights) -> dict`` evaluates it with the prompt
  ``"a photo of a {}."`` on every downstream test split.

What goes where (see ``gram_world.settings`` for the full statement): all 40
categories (4 families x 10) appear in every training corpus; the held-out
style (``sketch``) appears only in the pretraining corpus and in the
cross-domain target dataset; no image is shared between corpora or splits.

CLI: ``python -m gram_world generate|pretrain|zeroshot [--quick] [--root DIR] [--seed N]``.
"""

from .build import DatasetPaths, WorldPaths, build_world, load_world, read_chc_shards
from .clip_io import WORLD_MODEL
from .pretrain import PretrainSettings, pretrain_clip, pretrain_settings
from .settings import WorldSettings, world_settings
from .zeroshot import style_clustering, zeroshot_accuracy

__all__ = [
    "DatasetPaths",
    "PretrainSettings",
    "WORLD_MODEL",
    "WorldPaths",
    "WorldSettings",
    "build_world",
    "load_world",
    "pretrain_clip",
    "pretrain_settings",
    "read_chc_shards",
    "style_clustering",
    "world_settings",
    "zeroshot_accuracy",
]
