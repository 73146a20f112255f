"""Our Dassl datasets against real Dassl (and CoOp's own dataset classes when their source is present)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import random
import sys
from pathlib import Path

import pytest
from helpers import make_dtd, make_imagenet_tree, write_classnames

REPO = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.dassl
dassl = pytest.importorskip("dassl", reason="Dassl is not installed (these tests compare against Dassl)")

from dassl.config import get_cfg_default  # noqa: E402
from dassl.data import DataManager  # noqa: E402
from dassl.data.datasets import DATASET_REGISTRY, DatasetBase, Datum, build_dataset  # noqa: E402
from dassl.utils import set_random_seed  # noqa: E402

import datasets as gram_datasets  # noqa: E402

gram_datasets.register_all()
from meta.data import coop_data as cd  # noqa: E402


def make_cfg(root, name, shots=-1, seed=1, subsample="all"):
    cfg = get_cfg_default()
    cfg.DATASET.SUBSAMPLE_CLASSES = "all"  # CoOp's extend_cfg adds this key
    cfg.DATASET.ROOT = str(root)
    cfg.DATASET.NAME = name
    cfg.DATASET.NUM_SHOTS = shots
    cfg.DATASET.SUBSAMPLE_CLASSES = subsample
    cfg.SEED = seed
    return cfg


def triples(items):
    return [(d.impath, d.label, d.classname) for d in items] if items is not None else None


def test_fewshot_draws_equal_dassl_generate_fewshot_dataset(tmp_path):
    make_dtd(tmp_path, n_classes=6, real_images=False)
    full = cd.read_full_splits(str(tmp_path), cd.get_layout("dtd"))
    datums = {k: [Datum(r.impath, r.label, classname=r.classname) for r in v] for k, v in full.items()}
    helper = DatasetBase(train_x=datums["train"])
    for seed in (1, 2, 3):
        for shots in (1, 4, 16):
            set_random_seed(seed)
            d_train = helper.generate_fewshot_dataset(datums["train"], num_shots=shots)
            d_val = helper.generate_fewshot_dataset(datums["val"], num_shots=min(shots, 4))
            ours_train, ours_val = cd.few_shot_splits(full["train"], full["val"], shots, random.Random(seed))
            assert triples(d_train) == [(r.impath, r.label, r.classname) for r in ours_train]
            assert triples(d_val) == [(r.impath, r.label, r.classname) for r in ours_val]


def test_all_benchmarks_registered_and_reregistration_is_safe():
    names = set(DATASET_REGISTRY.registered_names())
    assert set(gram_datasets.STANDARD_DATASETS) <= names
    assert list(gram_datasets.STANDARD_DATASETS) == [x.name for x in cd.STANDARD_LAYOUTS]  # the one dataset list
    importlib.reload(importlib.import_module("datasets.coop_layout"))  # a second import must not raise
    assert DATASET_REGISTRY.get("DescribableTextures").layout == cd.get_layout("DescribableTextures")


def test_register_coop_layout_dataset_factory(tmp_path):
    make_dtd(tmp_path, n_classes=4, real_images=False)
    os.rename(tmp_path / "dtd", tmp_path / "proc_world")
    (tmp_path / "proc_world" / "split_zhou_DescribableTextures.json").rename(
        tmp_path / "proc_world" / "split_proc.json"
    )
    for _ in range(2):  # twice: no crash
        cls = gram_datasets.register_coop_layout_dataset("ProcWorldTest", "proc_world", "images", "split_proc.json")
    assert DATASET_REGISTRY.get("ProcWorldTest") is cls
    ds = build_dataset(make_cfg(tmp_path, "ProcWorldTest", shots=2, seed=1, subsample="new"))
    assert ds.classnames == ["texture_2", "texture_3"] and ds.num_classes == 2
    assert len(ds.train_x) == 4 and len(ds.val) == 4
    assert cd.get_layout("ProcWorldTest").split_file == "split_proc.json"  # visible to the Dassl-free side


def test_dataset_equals_meta_reader_and_loads_batches(tmp_path):
    make_dtd(tmp_path, n_classes=5, real_images=True)
    cfg = make_cfg(tmp_path, "DescribableTextures", shots=2, seed=7, subsample="base")
    cfg.DATALOADER.NUM_WORKERS = 0
    cfg.DATALOADER.TRAIN_X.BATCH_SIZE = 4
    cfg.INPUT.SIZE = (32, 32)
    set_random_seed(7)
    dm = DataManager(cfg)
    ref = cd.load_coop_splits(str(tmp_path), "dtd", num_shots=2, seed=7, subsample="base", log=lambda m: None)
    assert triples(dm.dataset.train_x) == [(r.impath, r.label, r.classname) for r in ref.train]
    assert triples(dm.dataset.test) == [(r.impath, r.label, r.classname) for r in ref.test]
    assert dm.dataset.classnames == ["texture_0", "texture_1", "texture_2"] and dm.num_classes == 3
    batch = next(iter(dm.train_loader_x))
    assert tuple(batch["img"].shape) == (4, 3, 32, 32)
    assert set(batch["label"].tolist()) <= {0, 1, 2}


def test_missing_image_is_named(tmp_path):
    split = make_dtd(tmp_path, n_classes=2, real_images=False)
    gone = tmp_path / "dtd" / "images" / split["test"][1][0]
    gone.unlink()
    with pytest.raises(
        FileNotFoundError, match=r"DescribableTextures test: 1 image\(s\) .* missing, e\.g\. .*" + gone.name
    ):
        build_dataset(make_cfg(tmp_path, "DescribableTextures"))


# ----------------------------------------------------------------------------- against CoOp's classes
@pytest.fixture()
def coop_classes(upstream_fork):
    """CoOp's own dataset classes (its archive, or GRAM_COOP_SRC), imported under another package name."""
    coop = upstream_fork("CoOp")
    saved = dict(DATASET_REGISTRY._obj_map)
    pkg = "coop_upstream_datasets"
    try:
        for name in gram_datasets.STANDARD_DATASETS:
            DATASET_REGISTRY._obj_map.pop(name, None)
        spec = importlib.util.spec_from_file_location(
            pkg, coop / "datasets" / "__init__.py", submodule_search_locations=[str(coop / "datasets")]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[pkg] = module
        spec.loader.exec_module(module)
        yield {
            "DescribableTextures": importlib.import_module(f"{pkg}.dtd").DescribableTextures,
            "ImageNet": importlib.import_module(f"{pkg}.imagenet").ImageNet,
            "ImageNetA": importlib.import_module(f"{pkg}.imagenet_a").ImageNetA,
        }
    finally:
        DATASET_REGISTRY._obj_map.clear()
        DATASET_REGISTRY._obj_map.update(saved)
        for name in [m for m in sys.modules if m == pkg or m.startswith(pkg + ".")]:
            del sys.modules[name]


@pytest.mark.parametrize("subsample", ["base", "new", "all"])
def test_same_images_and_rng_state_as_coop_dtd(tmp_path, coop_classes, subsample):
    make_dtd(tmp_path, n_classes=5, counts={"train": 9, "val": 5, "test": 3}, real_images=False)
    for seed in (1, 2):
        cfg = make_cfg(tmp_path, "DescribableTextures", shots=4, seed=seed, subsample=subsample)
        set_random_seed(seed)
        theirs = coop_classes["DescribableTextures"](cfg)
        their_state = random.getstate()
        set_random_seed(seed)
        ours = gram_datasets.DescribableTextures(cfg)
        assert random.getstate() == their_state  # the global stream advanced identically
        for split in ("train_x", "val", "test"):
            assert triples(getattr(ours, split)) == triples(getattr(theirs, split)), split
        assert ours.classnames == theirs.classnames


def test_same_images_as_coop_imagenet_and_variant(tmp_path, coop_classes):
    wnids = ["n03", "n01", "n02", "n04"]
    write_classnames(tmp_path / "imagenet" / "classnames.txt", {w: f"name {w}" for w in sorted(wnids)})
    make_imagenet_tree(tmp_path / "imagenet" / "images" / "train", wnids, 6)
    make_imagenet_tree(tmp_path / "imagenet" / "images" / "val", wnids, 2)
    cfg = make_cfg(tmp_path, "ImageNet", shots=3, seed=2, subsample="new")
    set_random_seed(2)
    ours = gram_datasets.ImageNet(cfg)  # scans folders (no pkl yet)
    set_random_seed(2)
    theirs = coop_classes["ImageNet"](cfg)  # scans and writes preprocessed.pkl
    for split in ("train_x", "val", "test"):
        assert triples(getattr(ours, split)) == triples(getattr(theirs, split)), split
    assert (tmp_path / "imagenet" / "preprocessed.pkl").is_file()
    os.remove(tmp_path / "imagenet" / "split_fewshot" / "shot_3-seed_2.gram.json")
    set_random_seed(2)
    from_pkl = gram_datasets.ImageNet(cfg)  # now reads CoOp's pkl
    assert triples(from_pkl.train_x) == triples(theirs.train_x)
    a = tmp_path / "imagenet-adversarial"
    write_classnames(a / "classnames.txt", {w: f"name {w}" for w in sorted(wnids)})
    make_imagenet_tree(a / "imagenet-a", ["n04", "n02"], 2)
    (a / "imagenet-a" / "README.txt").write_text("x")
    cfg_a = make_cfg(tmp_path, "ImageNetA")
    assert triples(gram_datasets.ImageNetA(cfg_a).test) == triples(coop_classes["ImageNetA"](cfg_a).test)
