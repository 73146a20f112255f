"""The procedural world on disk: consistency of images, captions, ground truth and CoOp splits."""

import hashlib
import json
import tarfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from gram_world import build_world, load_world, read_chc_shards, world_settings
from gram_world.captions import named_category
from gram_world.items import STYLES
from gram_world.render import CAPTURES, FRAME_COLOUR, capture
from gram_world.shapes import CATEGORIES, FAMILIES


def _tiny(seed: int):
    """A very small world for byte-level determinism checks (a few seconds to build)."""
    return replace(
        world_settings(quick=True, seed=seed),
        pretrain_size=120,
        chc_size=60,
        chc_shard_size=25,
        labelled_per_class=1,
        val_per_class=1,
        test_per_class=1,
    )


def _tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(root)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def test_categories_and_styles_are_organised_in_families():
    assert len(FAMILIES) == 4 and all(len(f) == 10 for f in FAMILIES.values())
    assert len(CATEGORIES) == 40
    assert all(" " not in n for n in CATEGORIES)  # class names are folder names
    assert set(STYLES) == {"shaded", "sketch", "noisy", "cartoon", "textured"}


@pytest.mark.slow
def test_manifest_lists_every_dataset_and_the_settings_hash(quick_world):
    m = json.loads(quick_world.manifest.read_text())
    s = world_settings(quick=True, seed=0)
    assert m["hash"] == s.checksum() == quick_world.root.name
    assert m["settings"]["seed"] == 0 and m["settings"]["image_size"] == 32
    assert {d["name"] for d in m["datasets"]} == set(quick_world.datasets)
    roles = {r for d in m["datasets"] for r in d["roles"]}
    assert {"base2new", "cross_domain_source", "cross_domain_target", "cross_dataset_target"} <= roles
    for d in m["datasets"]:
        assert (quick_world.root / d["split_file"]).is_file()
        assert len(d["classnames"]) >= 10
    # a second call with the same settings finds the cache and writes nothing
    before = quick_world.manifest.stat().st_mtime_ns
    again = build_world(quick=True, root=quick_world.root.parent, seed=0)
    assert again.root == quick_world.root and quick_world.manifest.stat().st_mtime_ns == before


@pytest.mark.slow
def test_coop_split_files_are_well_formed_and_every_file_opens(quick_world):
    s = world_settings(quick=True)
    for ds in quick_world.datasets.values():
        split = json.loads(ds.split_file.read_text())
        assert ds.split_file.name == f"split_zhou_{ds.name}.json" and ds.image_dir == ds.dataset_dir / "images"
        assert set(split) == {"train", "val", "test"}
        assert list(ds.classnames) == sorted(ds.classnames)
        seen = set()
        for name, per_class in (("train", s.train_per_class), ("val", s.val_per_class), ("test", s.test_per_class)):
            rows = split[name]
            assert len(rows) == per_class * len(ds.classnames)
            for rel, label, cls in rows:
                assert isinstance(label, int) and ds.classnames[label] == cls
                assert rel.split("/")[0] == cls
                with Image.open(ds.image_dir / rel) as im:
                    assert im.format == "JPEG" and im.size == (32, 32) and im.mode == "RGB"
                seen.add(rel)
            counts = np.bincount([r[1] for r in rows], minlength=len(ds.classnames))
            assert (counts == per_class).all()
        assert len(seen) == sum(len(v) for v in split.values())  # no file listed twice
        assert len(list(ds.image_dir.rglob("*.jpg"))) == len(seen)  # no unlisted file


@pytest.mark.slow
def test_chc_shards_hold_consistent_jpg_txt_json_triples(quick_world):
    s = world_settings(quick=True)
    assert [p.name for p in quick_world.chc_shards] == [
        f"shard-{i:05d}.tar" for i in range(s.chc_size // s.chc_shard_size)
    ]
    with tarfile.open(quick_world.chc_shards[0]) as tar:
        names = tar.getnames()
    assert names[:3] == ["000000000.jpg", "000000000.txt", "000000000.json"]
    pairs = read_chc_shards(quick_world)
    assert len(pairs) == s.chc_size
    matched = [p for p in pairs if p["truth"]["matched"]]
    assert len(pairs) - len(matched) == round(s.chc_mismatch * s.chc_size)
    for p in pairs:
        t = p["truth"]
        assert t["style"] != s.holdout_style and t["family"] == CATEGORIES[t["category"]].family
        assert named_category(p["caption"]) == [t["caption_category"]]
        assert (t["caption_category"] == t["category"]) == t["matched"]
        assert p["image"].shape == (32, 32, 3)


@pytest.mark.slow
def test_pretrain_corpus_captions_name_the_drawn_category_when_matched(quick_world):
    s = world_settings(quick=True)
    images = np.load(quick_world.pretrain_images)
    rows = [json.loads(line) for line in open(quick_world.pretrain_pairs)]
    assert images.shape == (s.pretrain_size, 32, 32, 3) and images.dtype == np.uint8 and len(rows) == len(images)
    assert sum(not r["matched"] for r in rows) == round(s.pretrain_mismatch * s.pretrain_size)
    for r in rows:
        assert named_category(r["caption"]) == [r["caption_category"]]
        assert (r["category"] == r["caption_category"]) == r["matched"]
    assert {r["style"] for r in rows} == set(s.styles)
    assert {r["category"] for r in rows} == set(CATEGORIES)
    assert len({r["caption"] for r in rows}) > 0.5 * len(rows)  # varied wording


@pytest.mark.slow
def test_styles_change_image_statistics(quick_world):
    images = np.load(quick_world.pretrain_images).astype(np.float32)
    styles = np.array([json.loads(line)["style"] for line in open(quick_world.pretrain_pairs)])
    diffs = np.abs(np.diff(images, axis=2)).reshape(len(images), -1)
    hf = diffs.mean(1)  # edges and noise
    noise = np.median(diffs, axis=1)  # per-pixel noise (edges are a minority of pixels)
    sat = (images.max(-1) - images.min(-1)).mean(axis=(1, 2))
    bright = images.mean(axis=(1, 2, 3))
    by = {s: styles == s for s in STYLES}
    others = [s for s in STYLES if s != "noisy"]
    assert noise[by["noisy"]].mean() > 1.5 * max(noise[by[s]].mean() for s in others)
    assert bright[by["sketch"]].mean() > max(bright[by[s]].mean() for s in STYLES if s != "sketch") + 20
    assert hf[by["shaded"]].mean() < 0.5 * min(hf[by[s]].mean() for s in STYLES if s != "shaded")
    # a nearest-centroid rule on two crude statistics already separates styles well above chance
    feats = np.stack([hf, sat, images.mean(axis=(1, 2, 3)), images.std(axis=(1, 2, 3))], 1)
    feats = (feats - feats.mean(0)) / feats.std(0)
    cents = np.stack([feats[styles == s].mean(0) for s in STYLES])
    pred = np.array(list(STYLES))[((feats[:, None] - cents[None]) ** 2).sum(-1).argmin(1)]
    assert (pred == styles).mean() > 0.6


@pytest.mark.slow
def test_downstream_roles_follow_the_protocol(quick_world):
    s = world_settings(quick=True)
    src = quick_world.with_role("cross_domain_source")[0]
    tgt = quick_world.with_role("cross_domain_target")[0]
    assert src.classnames == tgt.classnames and tgt.styles == (s.holdout_style,)
    assert s.holdout_style not in src.styles
    src_families = {CATEGORIES[c].family for c in src.classnames}
    icons = quick_world.dataset("WorldIcons")
    assert "cross_dataset_target" in icons.roles and not (
        {CATEGORIES[c].family for c in icons.classnames} & src_families
    )
    truth = [json.loads(line) for line in open(quick_world.labelled_meta_truth)]
    assert len(truth) == 40 * s.labelled_per_class and {t["style"] for t in truth} == set(s.seen_styles)
    assert sorted(p.name for p in quick_world.labelled_meta_dir.iterdir()) == sorted(CATEGORIES)


@pytest.mark.slow
def test_no_downstream_test_image_appears_in_a_training_corpus(quick_world):
    def digest(a: np.ndarray) -> str:
        return hashlib.md5(a.tobytes()).hexdigest()

    train = {digest(a) for a in np.load(quick_world.pretrain_images)}
    train |= {digest(p["image"]) for p in read_chc_shards(quick_world)}
    train |= {digest(np.asarray(Image.open(p).convert("RGB"))) for p in quick_world.labelled_meta_dir.rglob("*.jpg")}
    test = [
        digest(np.asarray(Image.open(ds.image_dir / r[0]).convert("RGB")))
        for ds in quick_world.datasets.values()
        for r in json.loads(ds.split_file.read_text())["test"]
    ]
    assert len(set(test)) == len(test) and not (set(test) & train)


@pytest.mark.slow
def test_same_seed_same_bytes_different_seed_different(tmp_path):
    a = build_world(root=tmp_path / "a", settings=_tiny(0), workers=1)
    b = build_world(root=tmp_path / "b", settings=_tiny(0), workers=2)
    c = build_world(root=tmp_path / "c", settings=_tiny(1), workers=1)
    assert a.settings_hash == b.settings_hash != c.settings_hash
    assert _tree_digest(a.root) == _tree_digest(b.root)
    assert _tree_digest(a.root) != _tree_digest(c.root)
    assert not np.array_equal(np.load(a.pretrain_images), np.load(c.pretrain_images))
    assert load_world(a.root).datasets.keys() == a.datasets.keys()


def test_bad_settings_and_missing_manifest_give_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match="holdout_style"):
        replace(world_settings(), holdout_style="watercolour")
    with pytest.raises(ValueError, match="train_per_class"):
        replace(world_settings(), train_per_class=8)
    with pytest.raises(FileNotFoundError, match="world.json"):
        load_world(tmp_path)
    bad = replace(world_settings().plans[0], capture="infrared")
    with pytest.raises(ValueError, match="unknown capture conditions.*infrared"):
        replace(world_settings(), datasets=(bad,))


def test_capture_conditions_transform_the_rendered_image():
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
    assert np.array_equal(capture(img, "none"), img)
    grey = capture(img, "grayscale")
    assert grey.dtype == np.uint8 and (grey[..., 0] == grey[..., 1]).all() and (grey[..., 1] == grey[..., 2]).all()
    assert np.abs(grey[..., 0].astype(float) - img.mean(-1)).max() <= 0.5
    assert np.array_equal(capture(img, "rotated")[0, :, :], img[:, -1, :])  # quarter turn anticlockwise
    assert np.array_equal(capture(img, "negative").astype(int) + img, np.full(img.shape, 255))
    with pytest.raises(KeyError, match="unknown capture condition"):
        capture(img, "infrared")


def test_exposure_scale_and_layout_captures_against_their_definitions():
    rng = np.random.default_rng(1)
    img = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
    dark = capture(img, "dark").astype(float)
    assert np.abs(dark - 0.35 * img).max() < 1.0 and dark.max() <= 0.35 * 255
    low = capture(img, "low_contrast").astype(float)
    assert np.abs(low - (128 + 0.3 * (img.astype(float) - 128))).max() <= 1.0 and np.ptp(low) <= 0.3 * 255 + 1
    sepia = capture(img, "sepia").astype(float)
    r = np.clip(0.393 * img[..., 0] + 0.769 * img[..., 1] + 0.189 * img[..., 2], 0, 255)
    assert np.abs(sepia[..., 0] - r).max() <= 1.0
    # zoomed: the centre 60 % (19 px of 32, offset 6) scaled back up - a flat image stays flat, and the
    # centre pixel of an image with a bright centre block stays bright while its corners do not
    block = np.zeros((32, 32, 3), np.uint8)
    block[6:25, 6:25] = 200
    zoomed = capture(block, "zoomed")
    assert zoomed.shape == img.shape and (zoomed == 200).all()
    assert np.array_equal(capture(np.full_like(img, 77), "zoomed"), np.full_like(img, 77))
    # framed: a 5-px border of the frame colour around the whole image shrunk to 22 px
    framed = capture(np.full_like(img, 250), "framed")
    frame = np.array(FRAME_COLOUR, np.uint8)
    assert (framed[:5] == frame).all() and (framed[-5:] == frame).all() and (framed[:, :5] == frame).all()
    assert (framed[5:27, 5:27] == 250).all()
    assert (capture(img, "solarized") <= 128).all() and np.array_equal(
        capture(img, "posterized") & 0x3F, np.full_like(img, 32)
    )


def test_family_datasets_are_captured_differently_from_pretraining(quick_world):
    # the mixed source set keeps the web look; each family set has its own capture condition,
    # applied to every image of every split (the generator's spec and random stream are unchanged)
    s = world_settings(quick=True)
    plans = {p.name: p for p in s.plans}
    assert plans["WorldMixed"].capture == plans["WorldMixedSketch"].capture == "none"
    assert {plans[n].capture for n in ("WorldPolygons", "WorldCurves", "WorldSymbols", "WorldIcons")} <= set(
        CAPTURES
    ) - {"none"}
    manifest = json.loads(quick_world.manifest.read_text())
    assert {d["name"]: d["capture"] for d in manifest["datasets"]} == {n: p.capture for n, p in plans.items()}
    ds = quick_world.dataset("WorldPolygons")
    for rel, _, _ in json.loads(ds.split_file.read_text())["train"][:20]:
        a = np.asarray(Image.open(ds.image_dir / rel).convert("RGB")).astype(int)
        assert np.abs(a[..., 0] - a[..., 1]).max() <= 2 and np.abs(a[..., 1] - a[..., 2]).max() <= 2  # JPEG
