"""CoOp-layout benchmark data without Dassl: split reading, few-shot sampling, base/new, H.

The one place that knows how the CoOp benchmarks lie on disk and how CoOp/CoCoOp sample them, so the Dassl datasets
in ``datasets/`` and a standalone evaluator read the same images.  Facts follow KaiyangZhou/CoOp @ ff61507
(``datasets/*.py``, ``DATASETS.md``) and Dassl.pytorch @ c61a1b5 (``dassl/data/datasets/base_dataset.py``).
:func:`load_coop_splits` runs CoOp's order: full splits, few-shot draws, base/new half, size caps.  Unlike CoOp's
``shot_K-seed_S.pkl`` the few-shot cache stores paths relative to the dataset folder and a SHA-256 of the records it
was drawn from: a changed split is redrawn with a message, never silently reused (CoOp pitfall: reference §8 item 13).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import random
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol, Sequence

from meta.data.image_caps import file_size_problem
from meta.infra.fileio import write_json_atomic

FEWSHOT_CACHE_FORMAT = "gram-fewshot-v1"
SUBSAMPLE_CHOICES = ("all", "base", "new")


@dataclass(frozen=True)
class Record:
    """One labelled image: absolute ``impath``, integer ``label`` and its ``classname``."""

    impath: str
    label: int
    classname: str


@dataclass
class CoopSplits:
    """The three splits of one dataset as Dassl's ``DatasetBase`` receives them.

    ``val`` is ``None`` for the test-only ImageNet variants (CoOp passes no val split there);
    for ImageNet it is the test split, as in CoOp (``datasets/imagenet.py``).  ``oversized``: ``{image path:
    reason}`` of the images left out as over the size caps (:func:`meta.data.image_caps.size_problem`).
    """

    train: list[Record]
    val: list[Record] | None
    test: list[Record]
    oversized: dict[str, str] = field(default_factory=dict)

    @property
    def classnames(self) -> list[str]:
        """Class names ordered by label, from ``train`` (as Dassl's ``get_lab2cname``)."""
        return classnames_of(self.train)

    @property
    def num_classes(self) -> int:
        """``max(train label) + 1``, as Dassl's ``DatasetBase.get_num_classes``."""
        return max(r.label for r in self.train) + 1


@dataclass(frozen=True)
class CoopLayout:
    """Where one dataset lives under ``DATASET.ROOT`` and how it is read (``reader``: one of :data:`_READERS`, see
    :func:`read_full_splits`).  ``image_dir`` is relative to ``dataset_dir`` (``""``: the dataset folder itself,
    StanfordCars); ``config_key`` names ``configs/datasets/<config_key>.yaml``; ``label`` is the paper's column name
    (``""``: ``name``)."""

    name: str
    dataset_dir: str
    image_dir: str
    reader: str = "split"
    split_file: str | None = None
    config_key: str = ""
    ignored_folders: tuple[str, ...] = ()
    label: str = ""

    @property
    def title(self) -> str:
        """The name tables print: ``label``, else ``name``."""
        return self.label or self.name

    @property
    def test_only(self) -> bool:
        """True for the ImageNet variants, which CoOp never few-shot samples nor subsamples."""
        return self.reader in ("imagenet_folders", "imagenetv2")


_READERS = ("split", "fgvc", "imagenet", "imagenet_folders", "imagenetv2")

# Folder and file names: CoOp @ ff61507 datasets/*.py and DATASETS.md.
COOP_LAYOUTS: "OrderedDict[str, CoopLayout]" = OrderedDict()


def register_layout(layout: CoopLayout, replace: bool = True) -> CoopLayout:
    """Add ``layout`` to ``COOP_LAYOUTS`` under its ``name``; a different layout of that name replaces the old one
    when ``replace``, else raises ``ValueError``."""
    if layout.reader not in _READERS:
        raise ValueError(f"layout {layout.name!r}: reader must be one of {_READERS}, got {layout.reader!r}")
    if layout.reader == "split" and not layout.split_file:
        raise ValueError(f"layout {layout.name!r}: reader 'split' needs split_file (e.g. 'split_zhou_X.json')")
    old = COOP_LAYOUTS.get(layout.name)
    if old is not None and old != layout and not replace:
        raise ValueError(f"layout {layout.name!r} is already registered as {old}")
    COOP_LAYOUTS[layout.name] = layout
    return layout


# The one list of the 15 benchmarks, in the paper's order: 11 base-to-new / cross-dataset (ImageNet first), then the
# 4 ImageNet variants.  Rows: name, dataset_dir, image_dir, reader, config_key, label, ignored folders.
_STANDARD_ROWS = (
    ("ImageNet", "imagenet", "images", "imagenet", "imagenet", "ImageNet"),
    ("Caltech101", "caltech-101", "101_ObjectCategories", "split", "caltech101", "Caltech101"),
    ("OxfordPets", "oxford_pets", "images", "split", "oxford_pets", "OxfordPets"),
    ("StanfordCars", "stanford_cars", "", "split", "stanford_cars", "StanfordCars"),
    ("OxfordFlowers", "oxford_flowers", "jpg", "split", "oxford_flowers", "Flowers102"),
    ("Food101", "food-101", "images", "split", "food101", "Food101"),
    ("FGVCAircraft", "fgvc_aircraft", "images", "fgvc", "fgvc_aircraft", "FGVCAircraft"),
    ("SUN397", "sun397", "SUN397", "split", "sun397", "SUN397"),
    ("DescribableTextures", "dtd", "images", "split", "dtd", "DTD"),
    ("EuroSAT", "eurosat", "2750", "split", "eurosat", "EuroSAT"),
    ("UCF101", "ucf101", "UCF-101-midframes", "split", "ucf101", "UCF101"),
    ("ImageNetV2", "imagenetv2", "imagenetv2-matched-frequency-format-val", "imagenetv2", "imagenetv2", "ImageNetV2"),
    ("ImageNetSketch", "imagenet-sketch", "images", "imagenet_folders", "imagenet_sketch", "ImageNet-Sketch"),
    ("ImageNetA", "imagenet-adversarial", "imagenet-a", "imagenet_folders", "imagenet_a", "ImageNet-A", "README.txt"),
    ("ImageNetR", "imagenet-rendition", "imagenet-r", "imagenet_folders", "imagenet_r", "ImageNet-R", "README.txt"),
)


def _standard(name: str, dataset_dir: str, image_dir: str, reader: str, key: str, label: str, *ignored) -> CoopLayout:
    split_file = f"split_zhou_{name}.json" if reader == "split" else None
    return CoopLayout(name, dataset_dir, image_dir, reader, split_file, key, tuple(ignored), label)


STANDARD_LAYOUTS: tuple[CoopLayout, ...] = tuple(_standard(*row) for row in _STANDARD_ROWS)
for _layout in STANDARD_LAYOUTS:
    register_layout(_layout)

# Dataset groups of the benchmark protocols, as config keys (paper order).
BENCHMARK_KEYS: tuple[str, ...] = tuple(x.config_key for x in STANDARD_LAYOUTS if not x.test_only)
TRANSFER_SOURCE: str = BENCHMARK_KEYS[0]  # ImageNet, all classes, few shots
CROSS_DATASET_TARGETS: tuple[str, ...] = BENCHMARK_KEYS[1:]  # the other 10 benchmarks
CROSS_DOMAIN_TARGETS: tuple[str, ...] = tuple(x.config_key for x in STANDARD_LAYOUTS if x.test_only)
STANDARD_KEYS: tuple[str, ...] = BENCHMARK_KEYS + CROSS_DOMAIN_TARGETS


def get_layout(name: str) -> CoopLayout:
    """The layout registered as ``name`` (Dassl ``DATASET.NAME``) or with that ``config_key``."""
    if name in COOP_LAYOUTS:
        return COOP_LAYOUTS[name]
    for layout in COOP_LAYOUTS.values():
        if layout.config_key and layout.config_key == name:
            return layout
    known = ", ".join(COOP_LAYOUTS)
    raise KeyError(f"unknown CoOp dataset {name!r}; known: {known}")


# ---- readers of the full splits
def _require_dir(path: str, what: str) -> None:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{what} not found: expected the folder {path}")


def _require_file(path: str, what: str) -> None:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what} not found: expected the file {path}")


def _listdir_nohidden(path: str, sort: bool = False) -> list[str]:
    """``os.listdir`` without dot-files; unsorted unless asked (Dassl's ``listdir_nohidden``)."""
    items = [f for f in os.listdir(path) if not f.startswith(".")]
    return sorted(items) if sort else items


def read_split_file(split_path: str, image_dir: str) -> dict[str, list[Record]]:
    """``{"train"|"val"|"test": [Record]}`` of a CoOp ``split_zhou_*.json`` (lists of ``[relative impath, label,
    classname]``, CoOp ``OxfordPets.read_split``), paths joined onto ``image_dir``."""
    _require_file(split_path, "split file")
    _require_dir(image_dir, "image folder")
    try:
        with open(split_path, "r", encoding="utf-8") as f:
            raw = json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(f"{split_path}: not valid JSON ({err})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{split_path}: expected a JSON object with keys train/val/test")
    image_dir = os.path.abspath(image_dir)
    out: dict[str, list[Record]] = {}
    for key in ("train", "val", "test"):
        if key not in raw:
            raise ValueError(f"{split_path}: missing key {key!r} (expected train, val and test lists)")
        items = raw[key]
        if not isinstance(items, list):
            raise ValueError(f"{split_path}: key {key!r} must be a list of [impath, label, classname]")
        records = []
        for i, item in enumerate(items):
            if not (isinstance(item, (list, tuple)) and len(item) == 3):
                raise ValueError(f"{split_path}: {key}[{i}] must be [impath, label, classname], got {item!r}")
            impath, label, classname = item
            records.append(Record(os.path.join(image_dir, str(impath)), int(label), str(classname)))
        out[key] = records
    return out


def read_classnames_file(text_file: str) -> "OrderedDict[str, str]":
    """Read ImageNet's ``classnames.txt`` (``<wnid> <class name>`` per line) into an ordered dict."""
    _require_file(text_file, "ImageNet class-name list")
    names: "OrderedDict[str, str]" = OrderedDict()
    with open(text_file, "r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            parts = line.strip().split(" ")
            if not parts[0]:
                continue
            if len(parts) < 2:
                raise ValueError(f"{text_file}:{lineno}: expected '<folder> <class name>', got {line.strip()!r}")
            names[parts[0]] = " ".join(parts[1:])
    return names


def read_fgvc_aircraft(dataset_dir: str, image_dir: str) -> dict[str, list[Record]]:
    """FGVC-Aircraft: ``variants.txt`` gives the label order, ``images_variant_{split}.txt`` lines are
    ``<image id> <variant name>`` (CoOp ``datasets/fgvc_aircraft.py``)."""
    variants_file = os.path.join(dataset_dir, "variants.txt")
    _require_file(variants_file, "FGVC-Aircraft variant list")
    _require_dir(image_dir, "image folder")
    with open(variants_file, "r", encoding="utf-8") as f:
        classnames = [line.strip() for line in f if line.strip()]
    cname2lab = {c: i for i, c in enumerate(classnames)}
    out: dict[str, list[Record]] = {}
    for key in ("train", "val", "test"):
        list_file = os.path.join(dataset_dir, f"images_variant_{key}.txt")
        _require_file(list_file, "FGVC-Aircraft split list")
        records = []
        with open(list_file, "r", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                parts = line.strip().split(" ")
                if not parts[0]:
                    continue
                classname = " ".join(parts[1:])
                if classname not in cname2lab:
                    raise ValueError(f"{list_file}:{lineno}: variant {classname!r} is not in {variants_file}")
                impath = os.path.join(os.path.abspath(image_dir), parts[0] + ".jpg")
                records.append(Record(impath, cname2lab[classname], classname))
        out[key] = records
    return out


class _DatumStandIn:
    """Receives the attributes of a pickled ``dassl...Datum`` (``_impath``, ``_label``, ``_classname``)."""


class _PreprocessedUnpickler(pickle.Unpickler):
    """Unpickles CoOp's ``preprocessed.pkl`` without Dassl and without running foreign code."""

    def find_class(self, module: str, name: str) -> Any:
        if name == "Datum" and module.startswith("dassl."):
            return _DatumStandIn
        raise pickle.UnpicklingError(f"unexpected class {module}.{name}")


def _rebase_imagenet_path(impath: str, image_dir: str) -> str:
    """Re-root ``.../images/<train|val>/<wnid>/<file>`` onto the current ``image_dir``."""
    parts = impath.replace("\\", "/").split("/")
    return os.path.join(image_dir, *parts[-3:]) if len(parts) >= 3 else impath


def read_imagenet(dataset_dir: str, image_dir: str) -> dict[str, list[Record]]:
    """ImageNet as CoOp reads it (``datasets/imagenet.py``): train = ``images/train``, test = val = ``images/val``;
    CoOp's ``preprocessed.pkl``, when present, fixes the record order (its paths re-rooted onto ``image_dir``)."""
    image_dir = os.path.abspath(image_dir)
    pkl = os.path.join(dataset_dir, "preprocessed.pkl")
    if os.path.isfile(pkl):
        try:
            with open(pkl, "rb") as f:
                data = _PreprocessedUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError) as err:
            raise ValueError(
                f"{pkl}: cannot read CoOp's preprocessed ImageNet file ({err}); delete it to rescan"
            ) from None
        out: dict[str, list[Record]] = {}
        for key in ("train", "test"):
            if key not in data:
                raise ValueError(f"{pkl}: missing key {key!r}")
            out[key] = [
                Record(_rebase_imagenet_path(d._impath, image_dir), int(d._label), d._classname) for d in data[key]
            ]
        probe = out["train"][0].impath if out["train"] else None
        if probe is not None and not os.path.isfile(probe):
            raise FileNotFoundError(f"{pkl} lists {probe}, which does not exist; delete the pkl to rescan {image_dir}")
        out["val"] = out["test"]
        return out
    classnames = read_classnames_file(os.path.join(dataset_dir, "classnames.txt"))
    out = {}
    for key, sub in (("train", "train"), ("test", "val")):
        split_dir = os.path.join(image_dir, sub)
        _require_dir(split_dir, "ImageNet image folder")
        folders = sorted(e.name for e in os.scandir(split_dir) if e.is_dir())
        out[key] = _class_folder_records(split_dir, folders, classnames, dataset_dir)
    out["val"] = out["test"]
    return out


def _class_folder_records(image_dir: str, folders: Sequence[str], classnames: dict, dataset_dir: str) -> list[Record]:
    """``image_dir/<folder>/<file>`` records, label = the folder's place in ``folders``, named by the dataset's
    ``classnames.txt``; each folder listed unsorted (Dassl's ``listdir_nohidden``)."""
    records = []
    for label, folder in enumerate(folders):
        if folder not in classnames:
            raise ValueError(f"{os.path.join(dataset_dir, 'classnames.txt')}: no class name for folder {folder!r}")
        for imname in _listdir_nohidden(os.path.join(image_dir, folder)):
            records.append(Record(os.path.join(image_dir, folder, imname), label, classnames[folder]))
    return records


def read_imagenet_folders(dataset_dir: str, image_dir: str, ignored: Sequence[str] = ()) -> dict[str, list[Record]]:
    """ImageNet-Sketch/-A/-R (CoOp ``imagenet_sketch.py``, ``imagenet_a.py``, ``imagenet_r.py``): label = index among
    the sorted class folders minus ``ignored`` (A and R: 0..199); test-only (train = test)."""
    classnames = read_classnames_file(os.path.join(dataset_dir, "classnames.txt"))
    _require_dir(image_dir, "image folder")
    image_dir = os.path.abspath(image_dir)
    folders = [f for f in _listdir_nohidden(image_dir, sort=True) if f not in ignored]
    records = _class_folder_records(image_dir, folders, classnames, dataset_dir)
    return {"train": records, "test": records}


def read_imagenetv2(dataset_dir: str, image_dir: str) -> dict[str, list[Record]]:
    """ImageNetV2 matched-frequency (CoOp ``imagenetv2.py``): folder ``str(i)`` holds class ``i`` of
    ``classnames.txt``; test-only (train = test)."""
    classnames = read_classnames_file(os.path.join(dataset_dir, "classnames.txt"))
    _require_dir(image_dir, "image folder")
    image_dir = os.path.abspath(image_dir)
    records = []
    for label, classname in enumerate(classnames.values()):
        class_dir = os.path.join(image_dir, str(label))
        _require_dir(class_dir, "ImageNetV2 class folder")
        for imname in _listdir_nohidden(class_dir):
            records.append(Record(os.path.join(class_dir, imname), label, classname))
    return {"train": records, "test": records}


def read_full_splits(root: str, layout: CoopLayout) -> dict[str, list[Record]]:
    """All records of ``layout`` under data root ``root`` before few-shot sampling: ``train``, ``test`` and, except
    for the test-only variants, ``val``."""
    root = os.path.abspath(os.path.expanduser(root))
    dataset_dir = os.path.join(root, layout.dataset_dir)
    _require_dir(dataset_dir, f"{layout.name} dataset folder")
    image_dir = os.path.join(dataset_dir, layout.image_dir) if layout.image_dir else dataset_dir
    if layout.reader == "split":
        split_path = os.path.join(dataset_dir, str(layout.split_file))
        if not os.path.isfile(split_path):  # CoOp would draw a new random split here; we refuse (comparability)
            raise FileNotFoundError(
                f"split file not found: expected the file {split_path} "
                "(CoOp's DATASETS.md links each split_zhou_*.json)"
            )
        return read_split_file(split_path, image_dir)
    if layout.reader == "imagenet_folders":
        return read_imagenet_folders(dataset_dir, image_dir, layout.ignored_folders)
    readers = {"fgvc": read_fgvc_aircraft, "imagenet": read_imagenet, "imagenetv2": read_imagenetv2}
    if layout.reader not in readers:
        raise ValueError(f"layout {layout.name!r}: unknown reader {layout.reader!r}")
    return readers[layout.reader](dataset_dir, image_dir)


def missing_files(records: Iterable[Record]) -> list[str]:
    """Image paths among ``records`` that are not files (what Dassl's ``Datum`` would assert on)."""
    return [r.impath for r in records if not os.path.isfile(r.impath)]


# ---- few-shot sampling and its cache
class _Sampler(Protocol):
    def sample(self, population: Sequence[Any], k: int) -> list[Any]: ...


def sample_few_shot(records: Sequence[Record], num_shots: int, rng: _Sampler) -> list[Record]:
    """Keep ``num_shots`` records per label, as Dassl's ``generate_fewshot_dataset`` does: labels in order of first
    appearance, ``rng.sample(items, num_shots)`` each (a smaller label keeps all, drawing nothing); with ``rng``
    seeded ``s``, the images Dassl picks after ``set_random_seed(s)``."""
    if num_shots < 1:
        return list(records)
    by_label: dict[int, list[Record]] = {}
    for r in records:
        by_label.setdefault(r.label, []).append(r)
    out: list[Record] = []
    for items in by_label.values():
        out.extend(rng.sample(items, num_shots) if len(items) >= num_shots else items)
    return out


def _relative_rows(records: Sequence[Record], base_dir: str) -> list[list[Any]]:
    return [[os.path.relpath(r.impath, base_dir), r.label, r.classname] for r in records]


def _records_hash(rows: dict[str, list[list[Any]]]) -> str:
    blob = json.dumps(rows, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def few_shot_splits(
    train: Sequence[Record],
    val: Sequence[Record] | None,
    num_shots: int,
    rng: _Sampler,
    cache_path: str | None = None,
    base_dir: str | None = None,
    log: Callable[[str], None] = print,
) -> tuple[list[Record], list[Record] | None]:
    """Few-shot train (``num_shots`` per label), then val (``min(num_shots, 4)``) from the same ``rng``, as CoOp
    (``val=None``: ImageNet, train only).  ``cache_path`` (json) stores paths relative to ``base_dir`` and the
    SHA-256 of the full rows drawn from; a cache whose hash, shot count or format differs is redrawn with a message."""
    if num_shots < 1:
        return list(train), (list(val) if val is not None else None)
    if cache_path is not None and base_dir is None:
        raise ValueError("few_shot_splits: base_dir is required with cache_path")
    source_hash = ""
    if cache_path is not None:
        source = {"train": _relative_rows(train, base_dir), "val": _relative_rows(val or [], base_dir)}
        source_hash = _records_hash(source)
        cached = _read_fewshot_cache(cache_path, num_shots, source_hash, base_dir, val is not None, log)
        if cached is not None:
            return cached
    new_train = sample_few_shot(train, num_shots, rng)
    new_val = sample_few_shot(val, min(num_shots, 4), rng) if val is not None else None
    if cache_path is not None:
        payload = {
            "format": FEWSHOT_CACHE_FORMAT,
            "num_shots": num_shots,
            "source_sha256": source_hash,
            "train": _relative_rows(new_train, base_dir),
            "val": _relative_rows(new_val, base_dir) if new_val is not None else None,
        }
        try:  # parallel first runs write identical content; the last one wins whole
            write_json_atomic(cache_path, payload, indent=None)
            log(f"Saving few-shot sample to {cache_path}")
        except OSError as err:
            log(f"Warning: cannot write few-shot cache {cache_path} ({err}); continuing without it")
    return new_train, new_val


def _read_fewshot_cache(
    path: str, num_shots: int, source_hash: str, base_dir: str, with_val: bool, log: Callable[[str], None]
) -> tuple[list[Record], list[Record] | None] | None:
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "r", encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        log(f"Few-shot cache {path} is unreadable ({err}); drawing a new sample")
        return None
    if not isinstance(data, dict) or data.get("format") != FEWSHOT_CACHE_FORMAT:
        log(f"Few-shot cache {path} has an unknown format; drawing a new sample")
        return None
    if data.get("num_shots") != num_shots:
        log(f"Few-shot cache {path} holds {data.get('num_shots')} shots, not {num_shots}; drawing a new sample")
        return None
    if data.get("source_sha256") != source_hash:
        log(
            f"Few-shot cache {path} was drawn from different data (split hash {str(data.get('source_sha256'))[:12]} "
            f"!= current {source_hash[:12]}); drawing a new sample and overwriting it"
        )
        return None
    if (data.get("val") is not None) != with_val:
        log(f"Few-shot cache {path} does not match the splits requested; drawing a new sample")
        return None

    def rows_to_records(rows: list[list[Any]]) -> list[Record]:
        return [Record(os.path.normpath(os.path.join(base_dir, p)), int(y), str(c)) for p, y, c in rows]

    log(f"Loading few-shot sample from {path}")
    val = rows_to_records(data["val"]) if with_val else None
    return rows_to_records(data["train"]), val


# ---- base / new classes and the harmonic mean
def subsample_classes(*splits: Sequence[Record] | None, subsample: str = "all") -> list[list[Record] | None]:
    """Keep the base or new half of the classes in every split, relabelled ``0..k-1`` (CoOp's
    ``OxfordPets.subsample_classes``): of the **first** split's n sorted labels, m = ceil(n/2), ``"base"`` keeps
    ``labels[:m]``, ``"new"`` ``labels[m:]``; ``None`` splits pass through."""
    if subsample not in SUBSAMPLE_CHOICES:
        raise ValueError(f"DATASET.SUBSAMPLE_CLASSES must be one of {SUBSAMPLE_CHOICES}, got {subsample!r}")
    if subsample == "all":
        return [list(s) if s is not None else None for s in splits]
    labels = sorted({r.label for r in splits[0]})
    m = math.ceil(len(labels) / 2)
    selected = labels[:m] if subsample == "base" else labels[m:]
    relabel = {y: i for i, y in enumerate(selected)}
    return [
        None
        if split is None
        else [Record(r.impath, relabel[r.label], r.classname) for r in split if r.label in relabel]
        for split in splits
    ]


def classnames_of(records: Iterable[Record]) -> list[str]:
    """Class names ordered by label (one per distinct label), as Dassl's ``get_lab2cname``."""
    mapping = {r.label: r.classname for r in records}
    return [mapping[y] for y in sorted(mapping)]


def harmonic_mean(base: float, new: float) -> float:
    """H = 2·B·N / (B + N) of base and new accuracies (same unit in, same unit out); 0 if both are 0."""
    if base < 0 or new < 0:
        raise ValueError(f"harmonic_mean: accuracies must be >= 0, got base={base}, new={new}")
    total = base + new
    return 0.0 if total == 0 else 2.0 * base * new / total


# ---- the whole pipeline
def fewshot_cache_path(root: str, layout: CoopLayout, num_shots: int, seed: int) -> str:
    """``<root>/<dataset_dir>/split_fewshot/shot_<K>-seed_<S>.gram.json`` (CoOp's name + ``.gram.json``)."""
    root = os.path.abspath(os.path.expanduser(root))
    return os.path.join(root, layout.dataset_dir, "split_fewshot", f"shot_{num_shots}-seed_{seed}.gram.json")


def load_coop_splits(
    root: str,
    name: str | CoopLayout,
    num_shots: int = -1,
    seed: int = -1,
    subsample: str = "all",
    rng: _Sampler | None = None,
    use_cache: bool = True,
    log: Callable[[str], None] = print,
) -> CoopSplits:
    """Read one dataset the way CoOp's Dassl dataset class does, without Dassl.

    Args:
        root, num_shots, subsample: ``DATASET.ROOT``, ``DATASET.NUM_SHOTS`` (``< 1`` keeps every image) and
            ``DATASET.SUBSAMPLE_CLASSES``; ``name``: Dassl ``DATASET.NAME``, a config key (``"dtd"``) or a layout.
        seed: ``cfg.SEED``; names the cache file (``-1``: unseeded, cached too, as CoOp).
        rng: the draw source; Dassl code passes the seeded ``random`` module (the global stream advances as in
            CoOp); ``None``: ``random.Random(seed)`` for ``seed >= 0`` (same draws), else the global module.
        use_cache: read/write the few-shot cache (:func:`few_shot_splits`).
    """
    layout = name if isinstance(name, CoopLayout) else get_layout(name)
    full = read_full_splits(root, layout)
    if layout.test_only:
        if subsample != "all":
            log(f"{layout.name} is test-only: SUBSAMPLE_CLASSES={subsample} is ignored (as in CoOp)")
        return _without_oversized(CoopSplits(train=full["train"], val=None, test=full["test"]), layout.name)
    if rng is None:
        rng = random.Random(seed) if seed >= 0 else random
    train, test = full["train"], full["test"]
    is_imagenet = layout.reader == "imagenet"
    val = None if is_imagenet else full["val"]
    if num_shots >= 1:
        cache = fewshot_cache_path(root, layout, num_shots, seed) if use_cache else None
        base_dir = os.path.join(os.path.abspath(os.path.expanduser(root)), layout.dataset_dir)
        train, val = few_shot_splits(train, val, num_shots, rng, cache_path=cache, base_dir=base_dir, log=log)
    if is_imagenet:  # CoOp: subsample (train, test) and pass val = test
        train, test = subsample_classes(train, test, subsample=subsample)
        return _without_oversized(CoopSplits(train=train, val=test, test=test), layout.name)
    train, val, test = subsample_classes(train, val, test, subsample=subsample)
    return _without_oversized(CoopSplits(train=train, val=val, test=test), layout.name)


def _without_oversized(splits: CoopSplits, name: str) -> CoopSplits:
    """``splits`` without the images over the size caps (each header read once; a split that is another one, as
    ImageNet's val is its test, stays that one), named in ``oversized``; a ValueError naming the class when one
    loses every train image."""
    why: dict[str, str] = {}
    kept_lists: dict[int, list[Record]] = {}

    def keep(records: list[Record] | None) -> list[Record] | None:
        if records is None or id(records) in kept_lists:
            return None if records is None else kept_lists[id(records)]
        for r in records:
            if r.impath not in why:
                why[r.impath] = file_size_problem(r.impath)
        return kept_lists.setdefault(id(records), [r for r in records if not why[r.impath]])

    out = CoopSplits(keep(splits.train), keep(splits.val), keep(splits.test), {p: w for p, w in why.items() if w})
    kept = {r.label for r in out.train}
    lost = next((r for r in splits.train if r.label not in kept), None)
    if lost is not None:
        raise ValueError(
            f"{name}: class {lost.classname!r} has no train image within the size caps "
            f"(e.g. {lost.impath}: {why[lost.impath]}); resize or remove its images"
        )
    return out


def shots_per_class(records: Iterable[Record]) -> dict[str, int]:
    """Images per class name, in label order: the shots a few-shot train split really holds (a class with
    fewer than K images keeps all of them)."""
    counts: dict[str, int] = {}
    for r in sorted(records, key=lambda r: r.label):
        counts[r.classname] = counts.get(r.classname, 0) + 1
    return counts


def warn_inputs(where: str, splits: CoopSplits, num_shots: int, shots_flag: str, seen: set | None = None) -> dict:
    """One stderr line for the images :func:`load_coop_splits` left out as over the size caps (their count and
    one path) and one naming the classes of ``splits.train`` with fewer than ``num_shots`` images (none when
    ``num_shots < 1``), each printed once per ``seen`` set.  Returns :func:`shots_per_class` of ``splits.train``."""
    counts = shots_per_class(splits.train)
    short = [f"{c!r} has {n}" for c, n in counts.items() if n < num_shots]
    lines = []
    if splits.oversized:
        path, why = next(iter(splits.oversized.items()))
        lines.append(f"{len(splits.oversized)} image(s) over the size caps skipped, e.g. {path} ({why})")
    if short:
        more = f" and {len(short) - 5} more" if len(short) > 5 else ""
        lines.append(
            f"{len(short)} class(es) with fewer images than {shots_flag} {num_shots}: {', '.join(short[:5])}{more}"
        )
    seen = set() if seen is None else seen
    for line in (f"warning: {where}: {x}" for x in lines):
        if line not in seen:
            seen.add(line)
            print(line, file=sys.stderr)
    return counts
