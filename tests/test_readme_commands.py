"""The README's meta-training block, run as written on a tiny synthetic corpus.

Each ``python -m meta`` line of the block is run from a scratch folder (relative paths as a user
has them), with tiny-model and short-schedule ``KEY VALUE`` overrides appended; the next command
must find what the previous one wrote, and the fork section's ``INIT=`` file must exist at the end.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import tiny_meta_opts

from gram_tools.synthetic import write_synthetic_shards
from meta.finetune.init_io import load_gram_init

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
TINY = {  # appended to each command: the README's configs with a tiny random CLIP and few steps
    "cluster": [
        "MODEL.BACKBONE",
        "GRAM-Test-Tiny",
        "MODEL.DEVICE",
        "cpu",
        "CHC.TOPICS.MIN_CLUSTER_SIZE",
        "30",
        "CHC.TOPICS.PLOT_POINTS",
        "300",
        "CHC.DOMAINS.MIN_PER_DOMAIN",
        "5",
        "CHC.TEXT.BATCH_SIZE",
        "64",
        "CHC.IMAGES.BATCH_SIZE",
        "64",
    ],
    "train": tiny_meta_opts(
        "META.STEPS",
        "2",
        "META.CHECKPOINT_EVERY",
        "2",
        "META.META_BATCH",
        "1",
        "TASKS.K_WAY",
        "3",
        "TASKS.N_SUPPORT",
        "2",
        "TASKS.N_QUERY",
        "2",
        "META.VAL_TASKS",
        "0",
        "META.FEATURE_CHECK",
        "2",
    ),
    "export": [],
}


def block_after(heading: str) -> list[str]:
    """Lines of the first fenced code block after ``heading`` in the README."""
    part = README[README.index(heading) :]
    body = re.search(r"```(?:bash|python)?\n(.*?)```", part, re.S)
    assert body, f"no code block after {heading!r}"
    return [ln for ln in body.group(1).splitlines() if ln.strip()]


@pytest.mark.slow
def test_readme_meta_training_commands_chain(tmp_path):
    lines = block_after("## Meta-training from image-text pairs")
    commands = [shlex.split(ln, comments=True) for ln in lines]
    assert [c[:4] for c in commands] == [
        ["python", "-m", "meta", "cluster"],
        ["python", "-m", "meta", "train"],
        ["python", "-m", "meta", "export"],
    ]
    shards = commands[0][commands[0].index("CHC.INPUT.SHARDS") + 1]
    assert shards == "['cc3m/*.tar']"
    write_synthetic_shards(tmp_path / "cc3m", n_pairs=600, n_shards=2, seed=0)
    os.symlink(REPO / "configs", tmp_path / "configs")
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    for cmd in commands:
        argv = [sys.executable, *cmd[1:], *TINY[cmd[3]]]
        proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"{shlex.join(cmd)}\n{proc.stdout[-1500:]}\n{proc.stderr[-2500:]}"
    fork = " ".join(block_after("## In a CoOp / Dassl fork"))
    init = re.search(r"INIT=(\S+)", fork).group(1).removeprefix("$PWD/")  # the gram checkout's folder
    assert load_gram_init(tmp_path / init).prompt["ctx"].shape[0] == 4  # train_coop.yaml: 4 context vectors
    assert (tmp_path / init).with_name("coop_ctx_nctx4.pth").is_file()
    assert "MODEL.INIT_WEIGHTS" in proc.stdout and "TRAINER.COOP.N_CTX 4" in proc.stdout  # export prints the options


def test_readme_core_in_five_lines_runs(tiny_clip):
    """The README's core example as written, with the tiny test CLIP instead of ViT-B-16's weights and a
    3-way task of cached image features for its ``support`` / ``query``; one meta-step changes θ."""
    import torch

    code = "\n".join(block_after("## The core in five lines"))
    weights = 'load_clip("ViT-B-16", pretrained="~/.cache/clip/ViT-B-16.pt")'
    assert code.startswith("from meta import ") and weights in code
    clip, dims = tiny_clip
    g = torch.Generator().manual_seed(0)

    def part(n):
        feats = torch.nn.functional.normalize(torch.randn(3 * n, dims.embed_dim, generator=g), dim=-1)
        return {"classnames": ["cat", "dog", "car"], "label": torch.arange(3).repeat_interleave(n), "features": feats}

    scope = {"support": part(2), "query": part(2), "_tiny": (clip, dims)}
    *setup, step = code.replace(weights, "_tiny").splitlines()
    exec(compile("\n".join(setup), "README.md", "exec"), scope)
    before = scope["learner"].prompt_module.ctx.detach().clone()
    assert before.shape == (4, dims.text_width)
    exec(compile(step, "README.md", "exec"), scope)
    assert not torch.equal(scope["learner"].prompt_module.ctx.detach(), before)  # the outer step moved θ
    assert scope["metrics"], "meta_step returned no metrics"


def test_import_meta_is_lazy_and_exports_the_core():
    """``import meta`` loads no torch; each public name resolves to the object of its defining module."""
    code = (
        "import sys, meta; assert 'torch' not in sys.modules, 'torch imported'; "
        "import importlib; bad = [n for n, m in meta._EXPORTS.items() "
        "if getattr(meta, n) is not getattr(importlib.import_module(m), n)]; assert not bad, bad; "
        "assert sorted(meta.__all__) == sorted([*meta._EXPORTS, '__version__']), 'meta.__all__'; "
        "print(len(meta._EXPORTS))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert int(proc.stdout.split()[-1]) >= 15
