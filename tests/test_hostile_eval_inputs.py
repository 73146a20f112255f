"""Hostile inputs of the downstream datasets, through what a user runs: ``python -m meta.evaluation base2new`` and
the Dassl dataset ``train.py`` builds.

An image whose header declares more pixels or a longer aspect ratio than the caps (``meta.data.input_limits``)
is left out, counted and named, never decoded; a class with fewer train images than the shots asked is named
with its count, and the evaluator's records hold the shots each class really got.
"""

from __future__ import annotations

import json
import struct
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from meta.data.input_limits import MAX_IMAGE_ASPECT, MAX_IMAGE_PIXELS

REPO = Path(__file__).resolve().parents[1]
CLASSES = ["apple", "boat", "cat", "drum"]  # base = apple, boat; new = cat, drum
TRAIN = {"apple": 1, "boat": 3, "cat": 3, "drum": 3}
WIDE = "apple/test_wide.png"  # 420 x 20: aspect 21 > 20
HUGE = "cat/test_huge.png"  # declares 8000 x 8000 = 64,000,000 pixels > 50,000,000 (68 bytes on disk)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_declaring(width: int, height: int) -> bytes:
    """A PNG whose header declares ``width x height`` RGB pixels, with almost no pixel data."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(b"\0" * 8)) + _chunk(b"IEND", b"")
    )


def write_data(dataset_dir: Path, train: dict = TRAIN, extra: dict | None = None) -> dict:
    """DTD's layout with 32-px PNGs; ``extra`` = ``{split: [(relative path, class)]}`` of the hostile files."""
    rng = np.random.default_rng(0)
    split = {"train": [], "val": [], "test": []}
    counts = {"train": train, "val": dict.fromkeys(CLASSES, 1), "test": dict.fromkeys(CLASSES, 2)}
    for name, per_class in counts.items():
        for label, cname in enumerate(CLASSES):
            for k in range(per_class[cname]):
                rel = f"{cname}/{name}_{k}.png"
                (dataset_dir / "images" / cname).mkdir(parents=True, exist_ok=True)
                Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(dataset_dir / "images" / rel)
                split[name].append([rel, label, cname])
    for name, rows in (extra or {}).items():
        for rel, cname in rows:
            path = dataset_dir / "images" / rel
            if "huge" in rel:
                path.write_bytes(png_declaring(8000, 8000))
            else:
                Image.new("RGB", (420, 20), (200, 10, 10)).save(path)
            split[name].append([rel, CLASSES.index(cname), cname])
    (dataset_dir / "split_zhou_DescribableTextures.json").write_text(json.dumps(split))
    return split


def warning_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("warning: DescribableTextures")]


def test_caps_are_the_shared_defaults():
    # the cases below are over the caps only at these values (one source: meta.data.input_limits)
    assert (MAX_IMAGE_PIXELS, MAX_IMAGE_ASPECT) == (50_000_000, 20.0)
    assert 8000 * 8000 > MAX_IMAGE_PIXELS and 420 > MAX_IMAGE_ASPECT * 20


def test_evaluator_skips_over_cap_images_and_records_the_shots_each_class_got(tmp_path, capsys):
    from meta.evaluation.cli import main

    data = tmp_path / "dtd"
    write_data(data, extra={"test": [(WIDE, "apple"), (HUGE, "cat")]})
    out = tmp_path / "runs.jsonl"
    argv = ["base2new", "--dataset", str(data), "--model", "GRAM-Test-Tiny", "--methods", "coop", "--shots", "3"]
    argv += ["--seeds", "1", "2", "--epochs", "1", "--final-eval-only", "--no-progress", "--no-split-cache"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = main([*argv, "--output", str(out)])
    err = capsys.readouterr().err
    assert code == 0 and "Traceback" not in err, err
    # one line per kind and class half, printed once for both seeds
    assert warning_lines(err) == [
        f"warning: DescribableTextures (base classes): 1 image(s) over the size caps skipped, "
        f"e.g. {data / 'images' / WIDE} (aspect ratio above 20)",
        "warning: DescribableTextures (base classes): 1 class(es) with fewer images than --shots 3: 'apple' has 1",
        f"warning: DescribableTextures (new classes): 1 image(s) over the size caps skipped, "
        f"e.g. {data / 'images' / HUGE} (more than 50000000 pixels)",
    ]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["seed"] for r in rows] == [1, 2]
    for r in rows:
        assert r["shots"] == 3 and r["shots_per_class"] == {"apple": 1, "boat": 3}
        assert r["n_train"] == 4 and r["skipped_oversized"] == 2
        assert (r["n_test_base"], r["n_test_new"]) == (4, 4)  # 2 per class, the over-cap ones left out


def test_evaluators_reader_refuses_an_over_cap_file_it_is_handed(tmp_path):
    """The loader's own guard, for a file that grew past a cap after the listing."""
    from meta.evaluation.images import ImageLoader

    wide = tmp_path / "wide.png"
    Image.new("RGB", (420, 20)).save(wide)
    with pytest.raises(OSError, match=f"cannot read image {wide}: aspect ratio above 20"):
        ImageLoader(32).test_view(str(wide))


def _dassl_dataset(tmp_path: Path, shots: int, subsample: str = "base"):
    """The Dassl dataset as ``train.py`` builds it: its config (``setup_cfg``), then Dassl's ``build_dataset``."""
    pytest.importorskip("dassl", reason="Dassl is not installed")
    from dassl.data.datasets import build_dataset

    import train

    args = ["--root", str(tmp_path), "--seed", "1", "--trainer", "GRAM_CoOp", "--output-dir", str(tmp_path / "o")]
    args += ["--dataset-config-file", str(REPO / "configs/datasets/dtd.yaml")]
    args += ["--config-file", str(REPO / "configs/trainers/coop.yaml")]
    args += ["DATASET.NUM_SHOTS", str(shots), "DATASET.SUBSAMPLE_CLASSES", subsample]
    return build_dataset(train.setup_cfg(train.build_parser().parse_args(args)))


def test_dassl_dataset_names_short_classes_and_never_lists_an_over_cap_image(tmp_path, capsys):
    huge_train = "boat/train_huge.png"
    write_data(tmp_path / "dtd", extra={"train": [(huge_train, "boat")], "test": [(WIDE, "apple")]})
    ds = _dassl_dataset(tmp_path, shots=16)
    err = capsys.readouterr().err
    images = tmp_path / "dtd" / "images"
    assert warning_lines(err) == [
        f"warning: DescribableTextures (base classes): 2 image(s) over the size caps skipped, "
        f"e.g. {images / huge_train} (more than 50000000 pixels)",
        "warning: DescribableTextures (base classes): 2 class(es) with fewer images than DATASET.NUM_SHOTS 16: "
        "'apple' has 1, 'boat' has 3",
    ]
    listed = {d.impath for split in (ds.train_x, ds.val, ds.test) for d in split}
    assert str(images / huge_train) not in listed and str(images / WIDE) not in listed
    assert len(ds.train_x) == 4 and len(ds.test) == 4  # what Dassl's loader will read
    assert ds.shots_per_class == {"apple": 1, "boat": 3}


def test_dassl_dataset_refuses_a_class_whose_every_train_image_is_over_a_cap(tmp_path):
    write_data(tmp_path / "dtd", train={**TRAIN, "apple": 0}, extra={"train": [("apple/train_huge.png", "apple")]})
    with pytest.raises(ValueError, match=r"class 'apple' has no train image within the size caps \(e\.g\. .*"):
        _dassl_dataset(tmp_path, shots=2)
