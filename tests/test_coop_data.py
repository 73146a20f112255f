"""Dassl-free tests of meta.data.coop_data: split reading, few-shot sampling and its cache, base/new, H."""

from __future__ import annotations

import json
import math
import pickle
import random
import shutil
import statistics
import sys
import types
from collections import Counter
from pathlib import Path

import pytest
from helpers import make_dtd, make_imagenet_tree, relpaths, write_classnames

from meta.data import coop_data as cd


class NoDraws:
    """An rng that fails the test if anything is drawn from it (proves a cache hit)."""

    def sample(self, population, k):  # noqa: D401
        raise AssertionError("drew from the rng although the cache should have been used")


# ----------------------------------------------------------------------------- split reading
def test_read_split_file_gives_absolute_records(tmp_path):
    split = make_dtd(tmp_path, n_classes=3, real_images=False)
    image_dir = tmp_path / "dtd" / "images"
    out = cd.read_split_file(str(tmp_path / "dtd" / "split_zhou_DescribableTextures.json"), str(image_dir))
    assert set(out) == {"train", "val", "test"}
    for key in out:
        assert len(out[key]) == len(split[key])
        for rec, (rel, label, cname) in zip(out[key], split[key]):
            assert rec.impath == str(image_dir / rel)
            assert rec.label == label and rec.classname == cname
    assert cd.missing_files(out["train"]) == []


def test_missing_split_file_and_folders_are_named(tmp_path):
    make_dtd(tmp_path, n_classes=2, real_images=False)
    split_path = tmp_path / "dtd" / "split_zhou_DescribableTextures.json"
    with pytest.raises(FileNotFoundError, match="nowhere"):  # no dataset folder under the root
        cd.load_coop_splits(str(tmp_path / "nowhere"), "dtd")
    shutil.move(str(tmp_path / "dtd" / "images"), str(tmp_path / "moved"))
    with pytest.raises(FileNotFoundError, match=r"image folder not found: expected the folder .*dtd/images"):
        cd.load_coop_splits(str(tmp_path), "DescribableTextures")
    shutil.move(str(tmp_path / "moved"), str(tmp_path / "dtd" / "images"))
    split_path.unlink()
    with pytest.raises(FileNotFoundError, match="split_zhou_DescribableTextures.json"):
        cd.load_coop_splits(str(tmp_path), "dtd")


def test_malformed_split_names_file_and_key(tmp_path):
    split = make_dtd(tmp_path, n_classes=2, real_images=False)
    path = tmp_path / "dtd" / "split_zhou_DescribableTextures.json"
    del split["val"]
    path.write_text(json.dumps(split))
    with pytest.raises(ValueError, match=r"split_zhou_DescribableTextures.json: missing key 'val'"):
        cd.read_split_file(str(path), str(tmp_path / "dtd" / "images"))
    split["val"] = [["a.jpg", 0]]
    path.write_text(json.dumps(split))
    with pytest.raises(ValueError, match=r"val\[0\] must be \[impath, label, classname\]"):
        cd.read_split_file(str(path), str(tmp_path / "dtd" / "images"))


def test_fgvc_reader_uses_variant_order(tmp_path):
    ds = tmp_path / "fgvc_aircraft"
    (ds / "images").mkdir(parents=True)
    (ds / "variants.txt").write_text("707-320\nA300B4\nDC-3\n")
    rows = {"train": ["0001 DC-3", "0002 707-320"], "val": ["0003 A300B4"], "test": ["0004 DC-3"]}
    for key, lines in rows.items():
        (ds / f"images_variant_{key}.txt").write_text("\n".join(lines) + "\n")
        for line in lines:
            (ds / "images" / (line.split(" ")[0] + ".jpg")).touch()
    out = cd.read_full_splits(str(tmp_path), cd.get_layout("fgvc_aircraft"))
    assert [(r.label, r.classname) for r in out["train"]] == [(2, "DC-3"), (0, "707-320")]
    assert out["val"][0].impath == str(ds / "images" / "0003.jpg")
    (ds / "images_variant_test.txt").write_text("0004 B-52\n")
    with pytest.raises(ValueError, match="'B-52' is not in"):
        cd.read_full_splits(str(tmp_path), cd.get_layout("fgvc_aircraft"))


# ----------------------------------------------------------------------------- ImageNet family
def _imagenet(tmp_path, per_class=3):
    wnids = ["n02", "n01", "n03"]
    write_classnames(
        tmp_path / "imagenet" / "classnames.txt", {"n01": "tench", "n02": "goldfish", "n03": "great white shark"}
    )
    make_imagenet_tree(tmp_path / "imagenet" / "images" / "train", wnids, per_class)
    make_imagenet_tree(tmp_path / "imagenet" / "images" / "val", wnids, 2)
    return tmp_path / "imagenet"


def test_imagenet_folders_sorted_and_val_is_test(tmp_path):
    ds = _imagenet(tmp_path)
    splits = cd.load_coop_splits(str(tmp_path), "ImageNet")
    assert splits.classnames == ["tench", "goldfish", "great white shark"]
    assert splits.val is splits.test and len(splits.test) == 6
    assert all(Path(r.impath).parent.name == ["n01", "n02", "n03"][r.label] for r in splits.train)
    assert all(r.impath.startswith(str(ds / "images" / "val")) for r in splits.test)


def test_imagenet_preprocessed_pkl_is_read_without_dassl_and_rebased(tmp_path, monkeypatch):
    ds = _imagenet(tmp_path)
    # Build a pkl the way CoOp does (Datum objects pickled), from a stand-in dassl module.
    mod = types.ModuleType("dassl.data.datasets.base_dataset")

    class Datum:
        def __init__(self, impath, label, classname):
            self._impath, self._label, self._domain, self._classname = impath, label, 0, classname

    Datum.__module__ = mod.__name__
    Datum.__qualname__ = "Datum"
    mod.Datum = Datum
    for name in ("dassl", "dassl.data", "dassl.data.datasets"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name, types.ModuleType(name)))
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    old = "/old/root/imagenet/images"
    # Reverse order on purpose: the pkl's order must be kept (it fixes which images a seed draws).
    train = [Datum(f"{old}/train/n0{c + 1}/img_{i}.jpg", c, f"c{c}") for c in range(3) for i in reversed(range(3))]
    test = [Datum(f"{old}/val/n0{c + 1}/img_{i}.jpg", c, f"c{c}") for c in range(3) for i in range(2)]
    with open(ds / "preprocessed.pkl", "wb") as f:
        pickle.dump({"train": train, "test": test}, f, protocol=pickle.HIGHEST_PROTOCOL)
    monkeypatch.delitem(sys.modules, mod.__name__)  # reading must not need the class
    out = cd.read_full_splits(str(tmp_path), cd.get_layout("ImageNet"))
    assert [r.impath for r in out["train"]] == [str(ds / "images" / d._impath[len(old) + 1 :]) for d in train]
    assert [r.label for r in out["test"]] == [d._label for d in test]
    assert cd.missing_files(out["train"] + out["test"]) == []
    # A foreign class in the pickle is refused instead of being executed.
    with open(ds / "preprocessed.pkl", "wb") as f:
        pickle.dump({"train": [Counter()], "test": []}, f)
    with pytest.raises(ValueError, match="preprocessed.pkl: cannot read"):
        cd.read_full_splits(str(tmp_path), cd.get_layout("ImageNet"))


def test_imagenet_variants_labels(tmp_path):
    wnids = [f"n{i:02d}" for i in range(6)]
    names = {w: f"class {w}" for w in wnids}
    a = tmp_path / "imagenet-adversarial"
    write_classnames(a / "classnames.txt", names)
    make_imagenet_tree(a / "imagenet-a", ["n04", "n01", "n03"], 2)
    (a / "imagenet-a" / "README.txt").write_text("ignored")
    splits = cd.load_coop_splits(str(tmp_path), "ImageNetA", subsample="base", log=lambda m: None)
    assert splits.val is None and splits.train is splits.test
    assert splits.classnames == ["class n01", "class n03", "class n04"]  # labels 0..2 over sorted folders
    v2 = tmp_path / "imagenetv2"
    write_classnames(v2 / "classnames.txt", {w: names[w] for w in wnids[:3]})
    make_imagenet_tree(v2 / "imagenetv2-matched-frequency-format-val", ["0", "1", "2"], 2)
    s2 = cd.load_coop_splits(str(tmp_path), "imagenetv2")
    assert s2.classnames == ["class n00", "class n01", "class n02"]
    assert all(Path(r.impath).parent.name == str(r.label) for r in s2.test)


# ----------------------------------------------------------------------------- few-shot sampling
def _records(n_per_label):
    return [cd.Record(f"/x/{y}/{i}.jpg", y, f"c{y}") for y, n in n_per_label for i in range(n)]


def test_sample_few_shot_counts_seeding_and_small_classes():
    recs = _records([(3, 10), (0, 2), (1, 7)])
    out = cd.sample_few_shot(recs, 4, random.Random(5))
    counts = Counter(r.label for r in out)
    assert counts == {3: 4, 0: 2, 1: 4}
    assert set(out) <= set(recs) and len(set(out)) == len(out)
    assert [r.label for r in out[:4]] == [3, 3, 3, 3]  # labels in first-appearance order
    assert out == cd.sample_few_shot(recs, 4, random.Random(5))
    assert out != cd.sample_few_shot(recs, 4, random.Random(6))
    # A label with too few items draws nothing: removing it leaves the other labels' picks unchanged.
    without_small = cd.sample_few_shot([r for r in recs if r.label != 0], 4, random.Random(5))
    assert without_small == [r for r in out if r.label != 0]
    assert cd.sample_few_shot(recs, 0, NoDraws()) == recs


def test_few_shot_splits_train_then_val_from_one_stream():
    train, val = _records([(0, 20), (1, 20)]), _records([(0, 9), (1, 9)])
    t, v = cd.few_shot_splits(train, val, 16, random.Random(1))
    assert Counter(r.label for r in v) == {0: 4, 1: 4}  # min(16, 4) per label
    rng = random.Random(1)
    assert t == cd.sample_few_shot(train, 16, rng)
    assert v == cd.sample_few_shot(val, 4, rng)


def test_fewshot_cache_survives_a_moved_root_but_not_a_changed_split(tmp_path):
    make_dtd(tmp_path / "a", n_classes=3, real_images=False)
    msgs: list[str] = []
    first = cd.load_coop_splits(str(tmp_path / "a"), "dtd", num_shots=2, seed=3, log=msgs.append)
    cache = tmp_path / "a" / "dtd" / "split_fewshot" / "shot_2-seed_3.gram.json"
    assert cache.is_file() and any("Saving" in m for m in msgs)
    stored = json.loads(cache.read_text())
    assert [row[0] for row in stored["train"]] == relpaths(first.train, tmp_path / "a" / "dtd")
    # Moved data root: the cache is read (no draws) and re-rooted.
    shutil.move(str(tmp_path / "a"), str(tmp_path / "b"))
    msgs.clear()
    moved = cd.load_coop_splits(str(tmp_path / "b"), "dtd", num_shots=2, seed=3, rng=NoDraws(), log=msgs.append)
    assert any("Loading few-shot sample" in m for m in msgs)
    assert relpaths(moved.train, tmp_path / "b" / "dtd") == relpaths(first.train, tmp_path / "a" / "dtd")
    assert cd.missing_files(moved.train + moved.val) == []
    # Changed split (one image relabelled): the stale sample is redrawn with a message.
    split_path = tmp_path / "b" / "dtd" / "split_zhou_DescribableTextures.json"
    split = json.loads(split_path.read_text())
    split["train"][0][1] = 2
    split_path.write_text(json.dumps(split))
    msgs.clear()
    with pytest.raises(AssertionError, match="drew from the rng"):
        cd.load_coop_splits(str(tmp_path / "b"), "dtd", num_shots=2, seed=3, rng=NoDraws(), log=msgs.append)
    assert any("drawn from different data" in m for m in msgs)
    redrawn = cd.load_coop_splits(str(tmp_path / "b"), "dtd", num_shots=2, seed=3, log=lambda m: None)
    moved_cache = tmp_path / "b" / "dtd" / "split_fewshot" / "shot_2-seed_3.gram.json"
    assert json.loads(moved_cache.read_text())["source_sha256"] != stored["source_sha256"]
    assert Counter(r.label for r in redrawn.train) == {0: 2, 1: 2, 2: 2}


def test_seeded_load_matches_an_independent_draw(tmp_path):
    make_dtd(tmp_path, n_classes=4, real_images=False)
    full = cd.read_full_splits(str(tmp_path), cd.get_layout("dtd"))
    got = cd.load_coop_splits(str(tmp_path), "dtd", num_shots=3, seed=11, use_cache=False)
    rng = random.Random(11)  # independent: group by label by hand, draw train then val
    expect_train, expect_val = [], []
    for split, k, out in ((full["train"], 3, expect_train), (full["val"], 3, expect_val)):
        for y in range(4):
            out.extend(rng.sample([r for r in split if r.label == y], k))
    assert got.train == expect_train and got.val == expect_val
    assert got.test == full["test"]  # the test split is never few-shot sampled


# ----------------------------------------------------------------------------- base / new, H
def test_subsample_classes_base_new_relabel():
    train = _records([(4, 1), (0, 1), (2, 1), (1, 1), (3, 1)])
    test = _records([(0, 2), (1, 2), (2, 2), (3, 2), (4, 2), (9, 1)])
    base_train, base_test = cd.subsample_classes(train, test, subsample="base")
    new_train, new_test = cd.subsample_classes(train, test, subsample="new")
    assert sorted({r.classname for r in base_train}) == ["c0", "c1", "c2"]  # ceil(5/2) = 3
    assert cd.classnames_of(base_test) == ["c0", "c1", "c2"]
    assert cd.classnames_of(new_train) == ["c3", "c4"] and cd.classnames_of(new_test) == ["c3", "c4"]
    assert {r.label for r in new_test} == {0, 1}  # relabelled 0..k-1; label 9 (not in train) dropped
    assert cd.subsample_classes(train, None, subsample="all") == [train, None]
    with pytest.raises(ValueError, match="SUBSAMPLE_CLASSES"):
        cd.subsample_classes(train, subsample="half")


def test_base_new_partition_the_classes(tmp_path):
    make_dtd(tmp_path, n_classes=7, real_images=False)
    base = cd.load_coop_splits(str(tmp_path), "dtd", num_shots=2, seed=1, subsample="base", log=lambda m: None)
    new = cd.load_coop_splits(str(tmp_path), "dtd", num_shots=2, seed=1, subsample="new", log=lambda m: None)
    full = cd.load_coop_splits(str(tmp_path), "dtd", num_shots=2, seed=1, log=lambda m: None)
    assert base.classnames == [f"texture_{c}" for c in range(math.ceil(7 / 2))]
    assert base.classnames + new.classnames == full.classnames
    assert base.num_classes == 4 and new.num_classes == 3
    # the cached few-shot sample is shared by base and new (CoOp's cache key ignores SUBSAMPLE_CLASSES)
    assert set(base.train) | {cd.Record(r.impath, r.label + 4, r.classname) for r in new.train} == set(full.train)


@pytest.mark.parametrize("b,n", [(80.0, 60.0), (97.1, 94.2), (0.0, 50.0), (33.3, 33.3)])
def test_harmonic_mean_matches_statistics(b, n):
    assert cd.harmonic_mean(b, n) == pytest.approx(statistics.harmonic_mean([b, n]))


def test_harmonic_mean_edge_cases():
    assert cd.harmonic_mean(0.0, 0.0) == 0.0
    with pytest.raises(ValueError):
        cd.harmonic_mean(-1.0, 3.0)
