"""``python -m gram_tools.smoke``, README's one-minute check of a fork's wiring, run as a user runs it.

In this repository's own layout (``train.py`` at the root, flat trainer configs) and inside the unchanged CoOp
fork with GRAM added as docs/dassl_plugin.md says (skipped without its archive): it writes the tiny dataset, CLIP
and init files, trains on base classes, evaluates on new ones and ends with ``smoke ok``, in one folder per method.
A fork whose ``train.py`` lacks the doc's GRAM lines gets a one-line error and exit status 2; its ``train.py``
with a missing CLIP file stops in one ``error:`` line before reading data.  Without a fork: the
methods offered come from the method table, a failed run that Dassl resumed names the resumed folder, a method
folder the check did not write is never emptied, and ``--write-init`` writes a placeholder for any architecture.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.dassl, pytest.mark.slow]
pytest.importorskip("dassl", reason="Dassl is not installed (scripts/setup.sh --with-dassl)")

from helpers_forks import add_gram  # noqa: E402

from gram_tools import smoke as smoke_module  # noqa: E402
from meta.finetune.init_io import load_gram_init  # noqa: E402
from meta.method import methods  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def smoke(fork: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
    argv = [sys.executable, "-m", "gram_tools.smoke", "--fork", str(fork), "--out", str(out), *extra]
    return subprocess.run(argv, capture_output=True, text=True, timeout=900, env=env, cwd=out.parent)


def check_ok(proc: subprocess.CompletedProcess, out: Path, method: str, clip_name: str = "GRAM-Test-Tiny") -> None:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith(f"smoke ok: {methods.get(method).trainer} ("), last
    assert last.endswith(f"logs in {out / method})"), last
    split = json.loads((out / "data" / "dtd" / "split_zhou_DescribableTextures.json").read_text())
    assert {len(split[k]) for k in ("train", "val", "test")} == {4 * 3, 4 * 2}
    folder = out / method  # every file of one method's run in its own folder
    assert (out / "clip" / f"{clip_name}.pt").is_file() and (folder / "init.safetensors").is_file()
    base = (folder / "train_base.log").read_text()
    new = (folder / "test_new.log").read_text()
    assert "subsample=base" in base and "subsample=new" in new  # the GRAM data line of each run
    assert f"GRAM init: {folder / 'init.safetensors'}" in base
    assert any((folder / "train_base").rglob("model.pth.tar-1")), "no checkpoint of the trained epoch"


def test_smoke_in_this_repository(tmp_path):
    out = tmp_path / "smoke"
    check_ok(smoke(REPO, out), out, "gram_coop")


def test_smoke_in_the_coop_fork_and_its_one_line_error_without_the_gram_lines(tmp_path, upstream_fork):
    fork = add_gram(upstream_fork("CoOp"), tmp_path, "CoOp")
    out = tmp_path / "smoke"
    check_ok(smoke(fork, out, "--method", "unigram"), out, "unigram")
    # the README's train.py command without the CLIP file: one error line before any data is read, no traceback
    files = smoke_module.write_inputs(out, "unigram")
    missing = tmp_path / "no_such" / "ViT-B-16.pt"
    argv = ["--root", str(files.data_root), "--seed", "1", "--trainer", "UNIGRAM", "--output-dir", str(tmp_path / "o")]
    argv += ["--dataset-config-file", str(fork / "configs/datasets/dtd.yaml")]
    argv += ["--config-file", str(smoke_module.trainer_config(fork, "UNIGRAM", methods.get("unigram").config))]
    argv += [*smoke_module.tiny_options(files, "UNIGRAM"), "TRAINER.GRAM.WEIGHTS", str(missing)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "train.py", *argv], cwd=fork, capture_output=True, text=True, env=env)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith(f"error: TRAINER.GRAM.WEIGHTS: CLIP weights file not found: {missing} (")
    ), proc.stderr[-2000:]
    assert "Loading dataset" not in proc.stdout and not (tmp_path / "o" / "prompt_learner").exists()
    # a ResNet CLIP: the text-prompt learner runs there, a visual-prompt one is refused before anything is written
    rn = tmp_path / "smoke_rn"
    proc = smoke(fork, rn, "--method", "gram_coop", "--backbone", "GRAM-Test-RN")
    check_ok(proc, rn, "gram_coop", clip_name="GRAM-Test-RN")
    assert "GRAM backbone: GRAM-Test-RN weights=" in (rn / "gram_coop" / "train_base.log").read_text()
    proc = smoke(fork, tmp_path / "smoke_rn_vpt", "--method", "gram_vpt", "--backbone", "GRAM-Test-RN")
    assert proc.returncode == 2 and not (tmp_path / "smoke_rn_vpt").exists()
    assert proc.stderr.strip() == (
        "error: --backbone: GRAM-Test-RN has a ResNet image tower, which visual prompt tokens cannot enter, and "
        "gram_vpt prompts it; on GRAM-Test-RN run gram_coop, gram_cocoop (text prompts only), or pick a ViT backbone"
    )
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


def test_the_methods_offered_are_one_per_learner_of_the_method_table():
    offered = [methods.get(k) for k in smoke_module.smoke_methods()]
    assert [m.trainer for m in offered] == list(methods.learners())  # every Dassl learner once, in table order
    assert all(m.init and m.regulate and not m.one_step for m in offered)  # θ* and R_φ: the GRAM row itself
    assert {"gram_coop", "gram_vpt", "unigram", "gram_cocoop"} <= {m.key for m in offered}


def test_a_failed_run_that_dassl_resumed_names_the_resumed_folder(tmp_path):
    log = tmp_path / "train_base.log"
    output = (
        "Loading trainer: GRAM_VPT\nFound checkpoint at /x/gram_smoke/gram_coop/train_base (will resume training)\n"
        "RuntimeError: /x/gram_smoke/gram_coop/train_base/prompt_learner/model.pth.tar-1 does not fit this model\n"
    )
    line = smoke_module.failure_line(tmp_path, 1, output, log)
    assert line == (
        f"{tmp_path / 'train.py'} exited with 1: RuntimeError: /x/gram_smoke/gram_coop/train_base/prompt_learner/"
        "model.pth.tar-1 does not fit this model; Dassl resumed the checkpoint in /x/gram_smoke/gram_coop/train_base, "
        f"left there by an earlier run (full log: {log})"
    )
    assert "resumed" not in smoke_module.failure_line(tmp_path, 1, "RuntimeError: boom\n", log)


def test_a_method_folder_is_redone_only_when_the_smoke_check_wrote_it(tmp_path):
    mine = tmp_path / "gram_coop"
    (mine / "train_base" / "prompt_learner").mkdir(parents=True)
    with pytest.raises(smoke_module.SmokeError, match=rf"^{re.escape(str(mine))}: exists but was not written"):
        smoke_module.fresh_method_folder(tmp_path, "gram_coop")
    assert (mine / "train_base" / "prompt_learner").is_dir()  # left as it was
    (mine / ".gram_smoke").write_text("")
    (mine / "keep.txt").write_text("a file of the folder, not a run folder")
    assert smoke_module.fresh_method_folder(tmp_path, "gram_coop") == mine
    assert not (mine / "train_base").exists() and (mine / "keep.txt").is_file()


def test_write_init_writes_a_placeholder_for_the_architecture_asked(tmp_path, capsys):
    target = tmp_path / "inits" / "maple.safetensors"
    assert smoke_module.main(["--write-init", str(target), "--method", "gram_maple", "--model", "GRAM-Test-Tiny"]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {target}: a placeholder GRAM init for gram_maple (GRAM_MaPLe)")
    init = load_gram_init(target)
    assert init.metadata["backbone"]["model_name"] == "GRAM-Test-Tiny"
    assert "not meta-trained" in init.metadata["provenance"]["note"]
    assert {k: tuple(v.shape) for k, v in init.prompt.items()} == {  # MaPLe: 2 tokens in both text layers of 64
        "ctx": (2, 64), "ctx_deep": (1, 2, 64), "proj_weight": (2, 64, 64), "proj_bias": (2, 64)
    }  # fmt: skip
    for argv, where in (
        (["--method", "coop"], "--method coop: expected a GRAM method with a Dassl trainer"),
        (["--method", "gram_coop", "--model", "ViT-B-61"], "--model: unknown open_clip architecture 'ViT-B-61'"),
    ):
        assert smoke_module.main(["--write-init", str(tmp_path / "x.safetensors"), *argv]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {where}"), err
    assert not (tmp_path / "x.safetensors").exists()
