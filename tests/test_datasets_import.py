"""The ``datasets`` package without Dassl: a free import, a one-line error on use, and no HF shadowing breakage.

Both child processes hide ``dassl`` with a meta-path finder, so they check the Dassl-less
behaviour whether or not Dassl is installed here.
"""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HIDE_DASSL = (
    "import sys, importlib.abc\n"
    "class Hide(importlib.abc.MetaPathFinder):\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name == 'dassl' or name.startswith('dassl.'):\n"
    "            raise ModuleNotFoundError(\"No module named 'dassl'\")\n"
    "sys.meta_path.insert(0, Hide())\n"
)


def run_child(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", HIDE_DASSL + code], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_import_is_free_and_use_without_dassl_is_a_one_line_error():
    line = run_child(
        "import datasets\n"
        "assert 'dassl' not in sys.modules\n"
        "try:\n"
        "    datasets.register_all()\n"
        "except ImportError as e:\n"
        "    print('ERR', e)\n"
    )
    assert line.startswith("ERR Dassl is not installed") and "\n" not in line, line
    assert "meta.data.coop_data" in line


def test_sentence_transformers_imports_from_the_repo_root_without_dassl():
    """transformers imports whatever ``datasets`` resolves to while probing for Hugging Face datasets."""
    out = run_child("from sentence_transformers import SentenceTransformer\nprint(sys.modules['datasets'].__file__)\n")
    assert out.endswith(str(Path("datasets") / "__init__.py"))


def test_standard_names_match_the_layout_table():
    import datasets
    from meta.data.coop_data import COOP_LAYOUTS

    # the built-in layouts are registered first, in table order; tests may append custom ones after them
    assert len(datasets.STANDARD_NAMES) == 15
    assert tuple(COOP_LAYOUTS)[:15] == datasets.STANDARD_NAMES


def test_dataset_configs_and_groups_follow_the_one_dataset_list():
    """configs/datasets/<key>.yaml exist for exactly the standard layouts and name their DATASET.NAME;
    the protocol groups are the paper's (11 base-to-new benchmarks, ImageNet source, 4 ImageNet variants)."""
    import yaml

    from meta.data import coop_data

    on_disk = {
        p.stem: yaml.safe_load(p.read_text())["DATASET"]["NAME"] for p in (REPO / "configs" / "datasets").glob("*.yaml")
    }
    assert on_disk == {x.config_key: x.name for x in coop_data.STANDARD_LAYOUTS}
    assert len(coop_data.BENCHMARK_KEYS) == 11 and coop_data.TRANSFER_SOURCE == "imagenet"
    assert coop_data.CROSS_DATASET_TARGETS == coop_data.BENCHMARK_KEYS[1:]
    assert coop_data.CROSS_DOMAIN_TARGETS == ("imagenetv2", "imagenet_sketch", "imagenet_a", "imagenet_r")
    assert [coop_data.get_layout(k).title for k in ("oxford_flowers", "dtd", "imagenet_sketch")] == [
        "Flowers102",
        "DTD",
        "ImageNet-Sketch",
    ]  # the paper's column names
    assert all(coop_data.COOP_LAYOUTS[x.name] == x for x in coop_data.STANDARD_LAYOUTS)
