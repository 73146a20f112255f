"""Write the world to disk: pretraining corpus, CHC tar shards, CoOp datasets, labelled set, manifest.

Layout under ``<parent>/<settings checksum>/``::

    world.json                                   manifest (settings, hash, every dataset)
    pretrain/images.npy                          [N, S, S, 3] uint8, JPEG round-tripped
    pretrain/pairs.jsonl                         one {"key", "caption", ground truth...} per row
    corpus_chc/shard-00000.tar ...               webdataset: <key>.jpg / <key>.txt / <key>.json
    downstream/<dir>/images/<class>/<file>.jpg   CoOp layout (like DTD)
    downstream/<dir>/split_zhou_<Name>.json      {"train"|"val"|"test": [[rel path, label, class]]}
    labelled_meta/<class>/<file>.jpg             image folder for the supervised-meta ablation
    labelled_meta_truth.jsonl                    style etc. of each labelled image (evaluation only)

The world is built in a temporary sibling directory ``.<checksum>.partial-<pid>-<hex>`` and renamed into
place when complete, so an interrupted or concurrent build never leaves a half-written world that looks
finished; a build first removes the partial folders of builds that were killed (their process is gone:
:mod:`gram_world.lifeline`), never one a live build is writing.  Rendering workers die with the build.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np
from PIL import Image
from tqdm import tqdm

from .captions import write_caption
from .items import item_rng, sample_spec
from .lifeline import clean_stale_partials, die_with_parent, lock_partial, partial_name, release_partial
from .render import capture, render
from .settings import DatasetPlan, WorldSettings, world_settings
from .shapes import CATEGORIES

WORLD_CACHE_ENV = "GRAM_WORLD_CACHE"


def default_world_parent() -> Path:
    """Parent directory of cached worlds: ``$GRAM_WORLD_CACHE`` when set, else ``.cache/world`` under the
    current working directory (the checkout, for ``scripts/demo.sh`` and commands run from its root)."""
    env = os.environ.get(WORLD_CACHE_ENV, "")
    return Path(env) if env else Path.cwd() / ".cache" / "world"


MANIFEST = "world.json"

# Random-stream ids of the corpora; downstream split ids are 100 * (dataset index + 1) + split index.
PRETRAIN_ID, CHC_ID, LABELLED_ID = 1, 2, 3
SPLITS = ("train", "val", "test")


@dataclass(frozen=True)
class DatasetPaths:
    """One downstream dataset on disk (CoOp layout)."""

    name: str
    dataset_dir: Path  # <root>/downstream/<dir>; CoOp's DATASET.ROOT is its parent
    image_dir: Path  # dataset_dir / "images"
    split_file: Path  # dataset_dir / f"split_zhou_{name}.json"
    classnames: tuple[str, ...]
    styles: tuple[str, ...]
    roles: tuple[str, ...]


@dataclass(frozen=True)
class WorldPaths:
    """Every path of a built world plus its settings."""

    root: Path
    manifest: Path
    settings_hash: str
    settings: dict
    pretrain_images: Path
    pretrain_pairs: Path
    chc_dir: Path
    chc_shards: tuple[Path, ...]
    downstream_dir: Path
    datasets: dict = field(default_factory=dict)  # name -> DatasetPaths
    labelled_meta_dir: Path = Path()
    labelled_meta_truth: Path = Path()
    clip_dir: Path = Path()  # pretrained tiny CLIP weights live here

    def dataset(self, name: str) -> DatasetPaths:
        if name not in self.datasets:
            raise KeyError(f"{self.manifest}: no dataset {name!r}; have {sorted(self.datasets)}")
        return self.datasets[name]

    def with_role(self, role: str) -> list[DatasetPaths]:
        return [d for d in self.datasets.values() if role in d.roles]


# --------------------------------------------------------------------------- items


def jpeg_bytes(img: np.ndarray, quality: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def make_pair(
    settings_: WorldSettings,
    corpus_id: int,
    index: int,
    categories: Sequence[str],
    styles: Sequence[str],
    mismatched: bool,
) -> tuple[np.ndarray, str, dict]:
    """Render one image-caption pair: ``(image [S,S,3] uint8, caption, ground truth dict)``."""
    rng = item_rng(settings_.seed, corpus_id, index)
    spec = sample_spec(rng, categories, styles)
    img = render(spec, rng, settings_.image_size)
    described = spec
    if mismatched:
        others = [c for c in categories if c != spec.category]
        described = sample_spec(rng, others, styles)
    truth = spec.as_dict()
    truth.update(matched=not mismatched, caption_category=described.category)
    return img, write_caption(described, rng), truth


def make_labelled(
    settings_: WorldSettings, corpus_id: int, index: int, category: str, styles: Sequence[str]
) -> tuple[np.ndarray, dict]:
    """Render one image of a fixed ``category``: ``(image [S,S,3] uint8, ground truth dict)``."""
    rng = item_rng(settings_.seed, corpus_id, index)
    spec = sample_spec(rng, [category], styles, category=category)
    return render(spec, rng, settings_.image_size), spec.as_dict()


def mismatch_mask(n: int, fraction: float, seed: int, corpus_id: int) -> np.ndarray:
    """Exactly ``round(fraction * n)`` True entries at seeded random positions."""
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), int(corpus_id), 2**31 - 1]))
    mask = np.zeros(n, dtype=bool)
    mask[rng.permutation(n)[: int(round(fraction * n))]] = True
    return mask


def _pair_job(args):
    settings_, corpus_id, start, stop, categories, styles, mask = args
    out = []
    for i in range(start, stop):
        img, caption, truth = make_pair(settings_, corpus_id, i, categories, styles, bool(mask[i - start]))
        data = jpeg_bytes(img, settings_.jpeg_quality)
        out.append((data, caption, truth))
    return out


def _pairs(
    settings_: WorldSettings, corpus_id: int, n: int, styles: Sequence[str], fraction: float, workers: int, desc: str
) -> Iterable[tuple[bytes, str, dict]]:
    """Yield ``(jpeg bytes, caption, truth)`` for items ``0..n-1`` in order (2 processes by default)."""
    categories = sorted(CATEGORIES)
    mask = mismatch_mask(n, fraction, settings_.seed, corpus_id)
    chunk = 250
    jobs = [
        (settings_, corpus_id, s, min(n, s + chunk), categories, tuple(styles), mask[s : s + chunk])
        for s in range(0, n, chunk)
    ]
    bar = tqdm(total=n, desc=desc, unit="img", leave=False)
    if workers > 1:
        with ProcessPoolExecutor(workers, initializer=die_with_parent, initargs=(os.getpid(),)) as pool:
            for part in pool.map(_pair_job, jobs):
                bar.update(len(part))
                yield from part
    else:
        for job in jobs:
            part = _pair_job(job)
            bar.update(len(part))
            yield from part
    bar.close()


def _decode(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


# --------------------------------------------------------------------------- writers


def write_pretrain(s: WorldSettings, root: Path, workers: int) -> dict:
    """Corpus (1): all styles, all categories, decoded JPEGs cached as one uint8 array."""
    out = root / "pretrain"
    out.mkdir(parents=True)
    images = np.empty((s.pretrain_size, s.image_size, s.image_size, 3), dtype=np.uint8)
    with open(out / "pairs.jsonl", "w") as f:
        for i, (data, caption, truth) in enumerate(
            _pairs(s, PRETRAIN_ID, s.pretrain_size, s.styles, s.pretrain_mismatch, workers, "pretrain corpus")
        ):
            images[i] = _decode(data)
            f.write(json.dumps({"key": f"{i:07d}", "caption": caption, **truth}) + "\n")
    np.save(out / "images.npy", images)
    return {
        "dir": "pretrain",
        "size": s.pretrain_size,
        "styles": list(s.styles),
        "categories": sorted(CATEGORIES),
        "mismatch_fraction": s.pretrain_mismatch,
    }


def _tar_add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    tar.addfile(info, io.BytesIO(data))


def write_chc_corpus(s: WorldSettings, root: Path, workers: int) -> dict:
    """Corpus (2): seen styles only, webdataset tar shards of jpg/txt/json triples."""
    out = root / "corpus_chc"
    out.mkdir(parents=True)
    shards: list[str] = []
    tar = None
    for i, (data, caption, truth) in enumerate(
        _pairs(s, CHC_ID, s.chc_size, s.seen_styles, s.chc_mismatch, workers, "CHC corpus")
    ):
        if i % s.chc_shard_size == 0:
            if tar is not None:
                tar.close()
            shards.append(f"shard-{len(shards):05d}.tar")
            tar = tarfile.open(out / shards[-1], "w", format=tarfile.USTAR_FORMAT)
        key = f"{i:09d}"
        _tar_add(tar, f"{key}.jpg", data)
        _tar_add(tar, f"{key}.txt", caption.encode())
        _tar_add(tar, f"{key}.json", json.dumps({"key": key, **truth}, sort_keys=True).encode())
    if tar is not None:
        tar.close()
    return {
        "dir": "corpus_chc",
        "size": s.chc_size,
        "shards": shards,
        "styles": list(s.seen_styles),
        "categories": sorted(CATEGORIES),
        "mismatch_fraction": s.chc_mismatch,
    }


def _save_jpeg(img: np.ndarray, path: Path, quality: int) -> None:
    path.write_bytes(jpeg_bytes(img, quality))


def write_dataset(s: WorldSettings, root: Path, index: int, plan: DatasetPlan) -> dict:
    """One downstream dataset in CoOp's DTD layout; labels follow sorted class order."""
    ddir = root / "downstream" / plan.dirname
    classnames = sorted(plan.classnames)
    counts = {"train": s.train_per_class, "val": s.val_per_class, "test": s.test_per_class}
    split: dict[str, list] = {}
    for si, name in enumerate(SPLITS):
        corpus_id = 100 * (index + 1) + si
        rows = []
        for label, cls in enumerate(classnames):
            (ddir / "images" / cls).mkdir(parents=True, exist_ok=True)
            for k in range(counts[name]):
                item = label * counts[name] + k
                img, _ = make_labelled(s, corpus_id, item, cls, plan.styles)
                img = capture(img, plan.capture)
                rel = f"{cls}/{cls}_{name}_{k:04d}.jpg"
                _save_jpeg(img, ddir / "images" / rel, s.jpeg_quality)
                rows.append([rel, label, cls])
        split[name] = rows
    split_file = ddir / f"split_zhou_{plan.name}.json"
    split_file.write_text(json.dumps(split, indent=1))
    return {
        "name": plan.name,
        "dir": f"downstream/{plan.dirname}",
        "split_file": f"downstream/{plan.dirname}/{split_file.name}",
        "classnames": classnames,
        "styles": list(plan.styles),
        "roles": list(plan.roles),
        "capture": plan.capture,
        "sizes": {k: len(v) for k, v in split.items()},
    }


def write_labelled_meta(s: WorldSettings, root: Path) -> dict:
    """Labelled image folder (WebVision's role in the paper's Table 4 row 4): seen styles, all classes."""
    out = root / "labelled_meta"
    truth_rows = []
    for ci, cls in enumerate(sorted(CATEGORIES)):
        (out / cls).mkdir(parents=True)
        for k in range(s.labelled_per_class):
            img, truth = make_labelled(s, LABELLED_ID, ci * s.labelled_per_class + k, cls, s.seen_styles)
            rel = f"{cls}/{cls}_{k:04d}.jpg"
            _save_jpeg(img, out / rel, s.jpeg_quality)
            truth_rows.append({"file": rel, **truth})
    with open(root / "labelled_meta_truth.jsonl", "w") as f:
        for row in truth_rows:
            f.write(json.dumps(row) + "\n")
    return {
        "dir": "labelled_meta",
        "per_class": s.labelled_per_class,
        "styles": list(s.seen_styles),
        "classnames": sorted(CATEGORIES),
    }


# --------------------------------------------------------------------------- world


def load_world(root: Path) -> WorldPaths:
    """Read ``<root>/world.json`` into :class:`WorldPaths`."""
    root = Path(root)
    manifest = root / MANIFEST
    if not manifest.is_file():
        raise FileNotFoundError(f"{manifest}: no world manifest (run `python -m gram_world generate`)")
    m = json.loads(manifest.read_text())
    try:
        datasets = {
            d["name"]: DatasetPaths(
                d["name"],
                root / d["dir"],
                root / d["dir"] / "images",
                root / d["split_file"],
                tuple(d["classnames"]),
                tuple(d["styles"]),
                tuple(d["roles"]),
            )
            for d in m["datasets"]
        }
        chc = m["corpora"]["chc"]
        return WorldPaths(
            root=root,
            manifest=manifest,
            settings_hash=m["hash"],
            settings=m["settings"],
            pretrain_images=root / "pretrain" / "images.npy",
            pretrain_pairs=root / "pretrain" / "pairs.jsonl",
            chc_dir=root / chc["dir"],
            chc_shards=tuple(root / chc["dir"] / s for s in chc["shards"]),
            downstream_dir=root / "downstream",
            datasets=datasets,
            labelled_meta_dir=root / "labelled_meta",
            labelled_meta_truth=root / "labelled_meta_truth.jsonl",
            clip_dir=root / "clip",
        )
    except KeyError as err:
        raise KeyError(f"{manifest}: missing key {err}; expected a manifest written by gram_world") from None


def _write_world(s: WorldSettings, tmp: Path, workers: int) -> None:
    corpora = {
        "pretrain": write_pretrain(s, tmp, workers),
        "chc": write_chc_corpus(s, tmp, workers),
        "labelled_meta": write_labelled_meta(s, tmp),
    }
    datasets = [
        write_dataset(s, tmp, i, p) for i, p in enumerate(tqdm(s.plans, desc="downstream datasets", leave=False))
    ]
    manifest = {
        "hash": s.checksum(),
        "settings": s.as_dict(),
        "corpora": corpora,
        "datasets": datasets,
        "holdout_style": s.holdout_style,
        "protocol": (
            "All 40 categories appear in every training corpus (as ImageNet classes do in CC3M); "
            f"the held-out style {s.holdout_style!r} appears only in the pretraining corpus and the "
            "cross-domain target; no image is shared between corpora or splits (per-item random "
            "streams keyed by seed, corpus id and index)."
        ),
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))


def build_world(
    quick: bool = False,
    root: Optional[Path] = None,
    seed: int = 0,
    settings: Optional[WorldSettings] = None,
    workers: Optional[int] = None,
) -> WorldPaths:
    """Generate the world (or find it cached) and return its paths.

    Args:
        quick: the small world of tests / ``--quick`` (ignored when ``settings`` is given).
        root: parent directory; the world goes to ``root / <settings checksum>``
            (default :func:`default_world_parent`).
        seed: world seed (ignored when ``settings`` is given).
        settings: explicit settings instead of ``world_settings(quick, seed)``.
        workers: rendering processes for the two corpora (default: min(2, CPUs)).
    """
    s = settings if settings is not None else world_settings(quick=quick, seed=seed)
    parent = Path(root) if root is not None else default_world_parent()
    final = parent / s.checksum()
    clean_stale_partials(parent)  # left by killed builds; a live build's folder is kept
    if (final / MANIFEST).is_file():
        return load_world(final)
    parent.mkdir(parents=True, exist_ok=True)
    tmp = parent / partial_name(s.checksum())
    tmp.mkdir()
    lock = lock_partial(tmp)
    try:
        _write_world(s, tmp, workers if workers is not None else min(2, os.cpu_count() or 1))
        release_partial(tmp, lock)
        lock = None
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / MANIFEST).is_file():  # not a concurrent winner: a real error
                raise
    finally:
        if lock is not None:
            lock.close()
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return load_world(final)


def read_chc_shards(world: WorldPaths) -> list[dict]:
    """All CHC pairs in key order: ``{"key", "image" [S,S,3] uint8, "caption", "truth"}``."""
    items: dict[str, dict] = {}
    for shard in world.chc_shards:
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                key, ext = member.name.rsplit(".", 1)
                data = tar.extractfile(member).read()
                row = items.setdefault(key, {"key": key})
                if ext == "jpg":
                    row["image"] = _decode(data)
                elif ext == "txt":
                    row["caption"] = data.decode()
                elif ext == "json":
                    row["truth"] = json.loads(data)
    return [items[k] for k in sorted(items)]
