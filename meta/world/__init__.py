"""The CPU-sized procedural image-text world and the tiny CLIP pretrained on it.

``build_world`` writes the corpora and CoOp-layout datasets, ``pretrain_clip``
trains the tiny open_clip model on the pretraining corpus, and
``zeroshot_accuracy`` measures it on the downstream datasets.
CLI: ``python -m meta.world generate|pretrain|zeroshot [--quick] [--root DIR] [--seed N]``.
"""
from .build import DatasetPaths, WorldPaths, build_world, load_world, read_chc_shards
from .settings import WorldSettings, world_settings

__all__ = ["DatasetPaths", "WorldPaths", "WorldSettings", "build_world", "load_world",
           "read_chc_shards", "world_settings"]
