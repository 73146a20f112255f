"""Shared pytest fixtures.  Tests run on CPU with one OpenMP thread."""

import os
import sys
import warnings
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # trainers/ and datasets/ import from the repo root, CoOp style
    sys.path.insert(0, str(ROOT))

from meta.infra.numerics import pin_process  # noqa: E402

pin_process()  # the suite runs with the numerics pins, as the entry points it starts in subprocesses do

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

TINY_MODEL = "GRAM-Test-Tiny"


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` skip on a machine without CUDA (one line each in ``-rs``)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="CUDA not available")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not `in item.keywords`: that also holds path names
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _same_global_rng_for_every_test():
    """Every test starts from torch's global RNG at seed 0, whatever ran before it.

    Tests that draw from the global RNG (``torch.randn`` without a generator) then see the same
    numbers in a full run as alone; a tolerance that held alone once failed in a full run.
    """
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_clip():
    """A frozen 3.4 M-parameter open_clip CLIP (random weights), built once per session."""
    from meta.model.backbone import load_clip

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        clip, dims = load_clip(TINY_MODEL, pretrained=None)
    return clip, dims


@pytest.fixture(scope="session")
def upstream_fork(tmp_path_factory):
    """``upstream_fork(key)`` -> unchanged source tree of the CoOp, MaPLe or PromptSRC fork, unpacked once.

    Skips the test with a one-line reason when the archive is absent (tests/helpers_forks.py).
    """
    from helpers_forks import ForkSources

    return ForkSources(tmp_path_factory.mktemp("upstream"))


@pytest.fixture(scope="session")
def quick_world(tmp_path_factory):
    """The quick world (seed 0), built once per test run and shared by the pytest-xdist workers (tests/helpers.py)."""
    import helpers

    return helpers.quick_world(tmp_path_factory)


@pytest.fixture(scope="session")
def quick_world_weights(quick_world):
    """The quick world's CLIP weights (6 epochs over its 16k pairs, ~2-4 min) with their zero-shot sidecar, trained
    once per test run and shared by the pytest-xdist workers (tests/helpers.py)."""
    import helpers

    return helpers.quick_world_weights(quick_world)


@pytest.fixture(scope="module")
def init_file(tiny_clip, tmp_path_factory):
    """A valid init file (the module's own writer): prompts and a regulator, float32."""
    from meta.finetune.init_io import export_gram_init
    from meta.method.gram import GRAMMetaLearner, MetaSpec
    from meta.method.prompts import PromptParams, PromptSpec
    from meta.method.regulator import RegulatorSpec

    clip, dims = tiny_clip
    prompts = PromptParams.from_spec(PromptSpec(n_ctx_text=2, n_ctx_vision=2, vision_depth=2), clip, dims)
    ml = GRAMMetaLearner(prompts, MetaSpec(regulator=RegulatorSpec(init="normal")))
    return export_gram_init(tmp_path_factory.mktemp("init") / "init.safetensors", prompts, ml.regulators(), dims)
