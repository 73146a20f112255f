"""``python -m gram_tools.smoke``, README's one-minute check of a fork's wiring, run as a user runs it.

In this repository's own layout (``train.py`` at the root, flat trainer configs) and inside the unchanged CoOp
fork with GRAM added as docs/dassl_plugin.md says (skipped without its archive): it writes the tiny dataset, CLIP
and init files, trains on base classes, evaluates on new ones and ends with ``smoke ok``.  A fork whose
``train.py`` lacks the doc's GRAM lines gets a one-line error and exit status 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.dassl, pytest.mark.slow]
pytest.importorskip("dassl", reason="Dassl is not installed (scripts/setup.sh --with-dassl)")

from helpers_forks import add_gram  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def smoke(fork: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
    argv = [sys.executable, "-m", "gram_tools.smoke", "--fork", str(fork), "--out", str(out), *extra]
    return subprocess.run(argv, capture_output=True, text=True, timeout=900, env=env, cwd=out.parent)


def check_ok(proc: subprocess.CompletedProcess, out: Path, trainer: str) -> None:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith(f"smoke ok: {trainer} ("), last
    split = json.loads((out / "data" / "dtd" / "split_zhou_DescribableTextures.json").read_text())
    assert {len(split[k]) for k in ("train", "val", "test")} == {4 * 3, 4 * 2}
    assert (out / "tiny_clip.pt").is_file() and (out / "init.safetensors").is_file()
    base = (out / "train_base.log").read_text()
    new = (out / "test_new.log").read_text()
    assert "subsample=base" in base and "subsample=new" in new  # the GRAM data line of each run
    assert f"GRAM init: {out / 'init.safetensors'}" in base
    assert any((out / "train_base").rglob("model.pth.tar-1")), "no checkpoint of the trained epoch"


def test_smoke_in_this_repository(tmp_path):
    out = tmp_path / "smoke"
    check_ok(smoke(REPO, out), out, "GRAM_CoOp")


def test_smoke_in_the_coop_fork_and_its_one_line_error_without_the_gram_lines(tmp_path, upstream_fork):
    fork = add_gram(upstream_fork("CoOp"), tmp_path, "CoOp")
    out = tmp_path / "smoke"
    check_ok(smoke(fork, out, "--method", "unigram"), out, "UNIGRAM")
    train_py = fork / "train.py"
    lines = train_py.read_text().split("\n")
    gram_lines = ("trainers.gram", "extend_gram_cfg")  # the doc's two imports and its extend_cfg lines
    lines = [ln[: len(ln) - len(ln.lstrip())] + "pass" if any(g in ln for g in gram_lines) else ln for ln in lines]
    train_py.write_text("\n".join(lines))
    proc = smoke(fork, tmp_path / "smoke_broken")
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {fork / 'train.py'} exited with 1: "), err
    assert "TRAINER.GRAM" in err[0]  # yacs refuses the GRAM keys extend_gram_cfg would have added
