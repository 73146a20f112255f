"""Writers of tiny CoOp-layout datasets shared by the data tests, and tests of the layout table."""
from __future__ import annotations

import json
import os
from pathlib import Path

from PIL import Image


def write_image(path: Path, value: int = 0, size: int = 8) -> None:
    """A ``size``x``size`` RGB PNG/JPEG whose pixels all equal ``value`` (mod 256)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (size, size), (value % 256, (3 * value) % 256, (7 * value) % 256)).save(path)


def make_dtd(root: Path, n_classes: int = 5, counts: dict[str, int] | None = None, real_images: bool = True) -> dict:
    """Write ``root/dtd/images/<class>/*.jpg`` and ``split_zhou_DescribableTextures.json``.

    Class ``c`` (0-based) is named ``texture_<c>``; split ``s`` gets ``counts[s] + c`` images of
    class ``c`` so the classes have different sizes.  Returns the split dict as written.
    """
    counts = counts or {"train": 6, "val": 3, "test": 2}
    image_dir = root / "dtd" / "images"
    split: dict[str, list] = {}
    k = 0
    for s, n in counts.items():
        rows = []
        for c in range(n_classes):
            for i in range(n + c):
                rel = f"texture_{c}/{s}_{i:03d}.jpg"
                if real_images:
                    write_image(image_dir / rel, k)
                else:
                    (image_dir / rel).parent.mkdir(parents=True, exist_ok=True)
                    (image_dir / rel).touch()
                rows.append([rel, c, f"texture_{c}"])
                k += 1
        split[s] = rows
    with open(root / "dtd" / "split_zhou_DescribableTextures.json", "w") as f:
        json.dump(split, f)
    return split


def make_imagenet_tree(image_dir: Path, folders: list[str], per_class: int) -> None:
    """``image_dir/<folder>/img_<i>.jpg`` for every folder (empty files)."""
    for folder in folders:
        (image_dir / folder).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            (image_dir / folder / f"img_{i}.jpg").touch()


def write_classnames(path: Path, mapping: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{k} {v}\n" for k, v in mapping.items()))


def relpaths(records, base: Path) -> list[str]:
    return [os.path.relpath(r.impath, base) for r in records]


# ------------------------------------------------------------------ tests of the layout table
REPO = Path(__file__).resolve().parents[1]


def test_every_dataset_config_names_a_registered_layout():
    import yaml

    from meta.coop_data import COOP_LAYOUTS, get_layout

    files = sorted((REPO / "configs" / "datasets").glob("*.yaml"))
    assert len(files) == 15
    seen = set()
    for f in files:
        name = yaml.safe_load(f.read_text())["DATASET"]["NAME"]
        layout = get_layout(name)
        assert layout.config_key == f.stem, f
        assert get_layout(f.stem) is layout
        seen.add(name)
    assert seen == {
        "ImageNet", "Caltech101", "OxfordPets", "StanfordCars", "OxfordFlowers", "Food101", "FGVCAircraft",
        "SUN397", "DescribableTextures", "EuroSAT", "UCF101", "ImageNetV2", "ImageNetSketch", "ImageNetA", "ImageNetR",
    }
    assert seen <= set(COOP_LAYOUTS)


def test_unknown_dataset_name_lists_the_known_ones():
    import pytest

    from meta.coop_data import get_layout

    with pytest.raises(KeyError, match="DescribableTextures"):
        get_layout("NoSuchSet")
