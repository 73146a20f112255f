"""The CoOp layout table (``meta.data.coop_data.COOP_LAYOUTS``): every dataset config names a layout, and an
unknown name lists the known ones."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_every_dataset_config_names_a_registered_layout():
    import yaml

    from meta.data.coop_data import COOP_LAYOUTS, get_layout

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
        "ImageNet",
        "Caltech101",
        "OxfordPets",
        "StanfordCars",
        "OxfordFlowers",
        "Food101",
        "FGVCAircraft",
        "SUN397",
        "DescribableTextures",
        "EuroSAT",
        "UCF101",
        "ImageNetV2",
        "ImageNetSketch",
        "ImageNetA",
        "ImageNetR",
    }
    assert seen <= set(COOP_LAYOUTS)


def test_unknown_dataset_name_lists_the_known_ones():
    import pytest

    from meta.data.coop_data import get_layout

    with pytest.raises(KeyError, match="DescribableTextures"):
        get_layout("NoSuchSet")
