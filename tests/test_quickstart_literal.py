"""README's fork quickstart done as a user does it, in the unchanged CoOp repository (skipped without its archive).

The block's ``mkdir`` / ``cp`` lines run as written from a ``gram`` folder beside ``my-fork``; ``train.py`` gets
exactly the lines the block's comment names; then ``python -m gram_tools.smoke --fork ../my-fork`` runs for two
of the methods it offers, in turn and twice each (a method after another one, and again in its own folder), and
every other offered method finds its config in the fork.  The block's last command, run as written without
OpenAI's CLIP file, stops before any data is read with the line naming ``TRAINER.GRAM.WEIGHTS`` and the file.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.dassl, pytest.mark.slow]
pytest.importorskip("dassl", reason="Dassl is not installed (scripts/setup.sh --with-dassl)")

from helpers_forks import _insert_at_end_of_extend_cfg, fork_env  # noqa: E402

from gram_tools import smoke  # noqa: E402
from meta.method import methods  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RUN_IN_TURN = ("gram_coop", "gram_vpt", "gram_coop", "gram_vpt")


def quickstart() -> list[str]:
    """The lines of README's first code block (the fork quickstart), continuation lines joined."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    part = text[text.index("## In a CoOp / Dassl fork") :]
    block = re.search(r"```bash\n(.*?)```", part, re.S).group(1)
    return [ln for ln in block.replace("\\\n", " ").splitlines() if ln.strip()]


def train_py_edits(lines: list[str]) -> tuple[str, list[str], list[str]]:
    """(anchor import, the imports to add after it, the lines to end extend_cfg with), read from the comment."""
    start = next(i for i, ln in enumerate(lines) if ln.startswith("#  ../my-fork/train.py:"))
    comment = " ".join(ln.lstrip("# ") for ln in lines[start : start + 3])
    head, _, tail = comment.partition("at the end of extend_cfg(cfg):")
    imports = [s for s in re.findall(r"`([^`]+)`", head) if s.startswith("import trainers.gram")]
    anchor = re.search(r"beside `([^`]+)`", head).group(1)
    return anchor, imports, ["    " + s for s in re.findall(r"`([^`]+)`", tail)]


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_readme_quickstart_as_written_in_the_coop_fork(tmp_path, upstream_fork):
    lines = quickstart()
    assert lines[0] == "git clone <this repository> gram && cd gram"  # the test's checkout is this repository
    assert lines[1].startswith("bash scripts/setup.sh --with-dassl")  # and its interpreter the one setup.sh built
    assert "--with-dassl dassl-0.6.3-py3-none-any.whl" in lines[2]  # the offline form: a built wheel
    shutil.copytree(upstream_fork("CoOp"), tmp_path / "my-fork")
    gram = tmp_path / "gram"  # the clone: its trainers/ and configs/ are this repository's
    gram.mkdir()
    for name in ("trainers", "configs"):
        (gram / name).symlink_to(REPO / name)
    copies = [ln for ln in lines if ln.split()[0] in ("cp", "mkdir")]
    assert len(copies) >= 2
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", "\n".join(copies)], cwd=gram, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    fork = tmp_path / "my-fork"
    anchor, imports, extend = train_py_edits(lines)
    assert imports == ["import trainers.gram", "import trainers.gram.dassl_compat"]
    train_py = fork / "train.py"
    text = train_py.read_text()
    assert text.count(anchor + "\n") == 1, anchor
    text = text.replace(anchor + "\n", anchor + "\n" + "\n".join(imports) + "\n")
    train_py.write_text(_insert_at_end_of_extend_cfg(text, extend))

    smoke_line = next(ln for ln in lines if ln.startswith("python -m gram_tools.smoke"))
    command = smoke_line.split("#")[0].split()
    assert command == ["python", "-m", "gram_tools.smoke", "--fork", "../my-fork"]
    offered = re.search(r"--method ([\w, ]+)", " ".join(lines)).group(1).replace(",", " ").split()
    assert ["gram_coop", *offered] == list(smoke.smoke_methods())  # one per learner of the method table
    for key in offered:  # the copies above hold every offered method's config where the smoke looks
        row = methods.get(key)
        assert smoke.trainer_config(fork, row.trainer, row.config).parent == fork / "configs/trainers" / row.trainer

    env = fork_env()
    out = fork / "output" / "gram_smoke"
    inits: dict[str, str] = {}
    for key in RUN_IN_TURN:
        argv = [sys.executable, *command[1:]] + ([] if key == "gram_coop" else ["--method", key])
        r = subprocess.run(argv, cwd=gram, env=env, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stdout[-1500:] + r.stderr[-2500:]
        trainer = methods.get(key).trainer
        assert r.stdout.strip().splitlines()[-1].startswith(f"smoke ok: {trainer} ("), r.stdout[-500:]
        base_log = (out / key / "train_base.log").read_text()
        assert "Found checkpoint" not in base_log and "epoch [1/1]" in base_log  # trained afresh, not resumed
        for other, digest in inits.items():  # another method's run left this one's init file alone
            assert sha(out / other / "init.safetensors") == digest, (key, other)
        inits[key] = sha(out / key / "init.safetensors")

    # the block's last command as written, with $DATA and $INIT given and no CLIP file under $HOME
    last = next(ln for ln in lines if ln.startswith("cd ../my-fork && python train.py"))
    home = tmp_path / "home"
    home.mkdir()
    env = dict(
        env,
        HOME=str(home),
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}",  # `python`: as source .venv/bin/activate
        DATA=str(out / "data"),
        INIT=str(out / "gram_coop" / "init.safetensors"),
    )
    r = subprocess.run(["bash", "-c", last], cwd=gram, env=env, capture_output=True, text=True, timeout=600)
    clip_dir = home / ".cache" / "clip"
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]  # one line, no traceback
    assert r.stderr.strip().splitlines()[-1] == (
        f"error: TRAINER.GRAM.WEIGHTS: CLIP weights file not found: {clip_dir}/ViT-B-16.pt "
        f"(TRAINER.GRAM.WEIGHTS is unset: put OpenAI's ViT-B-16.pt in {clip_dir}, or pass TRAINER.GRAM.WEIGHTS "
        "/path/to/ViT-B-16.pt)"
    ), r.stderr[-2000:]
    assert "Reading split from" not in r.stdout + r.stderr  # CoOp's DTD class never read the data
    assert "GRAM effective settings" not in r.stdout  # the trainer's loaders were never built
