"""docs/dassl_plugin.md's commands against what the code and CoOp's scripts expect (no Dassl needed)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import yaml

from meta.method import methods

REPO = Path(__file__).resolve().parents[1]
DOC = (REPO / "docs" / "dassl_plugin.md").read_text()


def blocks_after(heading: str) -> list[str]:
    part = DOC[DOC.index(heading) :]
    part = part[: part.index("\n## ", 1)] if "\n## " in part[1:] else part
    return re.findall(r"```(?:bash|python)?\n(.*?)```", part, re.S)


def method_trainers() -> dict[str, str]:
    """key -> trainer of the methods with a Dassl trainer, as the method table (meta/method/methods.yaml) gives it."""
    return {key: methods.get(key).trainer for key in methods.dassl_keys()}


def test_config_copy_commands_give_the_layout_fork_scripts_read(tmp_path):
    """CoOp's scripts read configs/trainers/${TRAINER}/${CFG}.yaml: the doc's copy commands must produce it."""
    os.symlink(REPO, tmp_path / "gram")
    (tmp_path / "my-coop-fork").mkdir()
    script = blocks_after("## 4. Add the configs")[0]
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    for key, trainer in method_trainers().items():
        config = Path(methods.get(key).config)  # configs/trainers/<key>.yaml, or a fork's name in <trainer>/
        copied = tmp_path / "my-coop-fork" / "configs" / "trainers" / trainer / config.name
        assert copied.is_file(), f"method {key}: {copied} missing"
        assert copied.read_text() == (REPO / config).read_text()


def test_documented_train_commands_use_that_layout_and_pass_the_init():
    commands = [
        shlex.split(b.replace("\\\n", " "))
        for block in blocks_after("## 4. Add the configs")[1:]
        for b in block.split("\n\n")
        if "train.py" in b
    ]
    assert len(commands) == 2
    for argv in commands:
        trainer = argv[argv.index("--trainer") + 1]
        cfg = argv[argv.index("--config-file") + 1]
        assert re.fullmatch(rf"configs/trainers/{trainer}/(\w+)\.yaml", cfg), cfg
        key = Path(cfg).stem
        assert method_trainers()[key] == trainer
        assert argv[-2] == "TRAINER.GRAM.INIT"  # yacs options last, as a fork script appends them
        out = argv[argv.index("--output-dir") + 1]
        assert f"/{trainer}/{key}/seed1" in out  # the fork scripts' layout, which parse_results.py reads


def test_install_section_uses_the_tested_setup_command():
    install = "\n".join(blocks_after("## 1. Install"))
    setup_lines = [ln for ln in install.splitlines() if "setup.sh" in ln]
    assert setup_lines and all(
        shlex.split(ln, comments=True)[:3] == ["bash", "scripts/setup.sh", "--with-dassl"] for ln in setup_lines
    )
    assert "pip install" not in install  # one documented way
    ci = (REPO / ".ci" / "run").read_text()
    assert "scripts/setup.sh --with-dassl" in ci  # CI runs the same command with the shared wheel
    r = subprocess.run(["bash", str(REPO / "scripts" / "setup.sh"), "--no-such-flag"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: scripts/setup.sh: unknown argument '--no-such-flag' (expected: [--with-dassl [SRC]])"
    ]


def test_fork_sections_commands_fit_the_configs_and_the_parsers():
    """Each fork section's commands (run by tests/test_forks.py when the archives exist), checked without them."""
    from helpers_forks import FORKS, arg_value, doc_recipe, expand

    for key in FORKS:
        recipe = doc_recipe(key)
        assert recipe.import_lines[0].startswith("import trainers.gram") and len(recipe.scripts) % 2 == 0, key
        assert all(line.startswith("    ") for line in recipe.extend_lines), "extend_cfg lines go inside the function"
        runs = {}
        for command in recipe.commands:
            argv = expand(command, {"DATA": "data", "INIT": "init.safetensors", "CTX": "ctx.pth"})
            trainer, cfg = arg_value(argv, "--trainer"), arg_value(argv, "--config-file")
            out = arg_value(argv, "--output-dir")
            stem = Path(cfg).stem
            assert cfg == f"configs/trainers/{trainer}/{stem}.yaml", cfg  # the forks' scripts' layout
            side = "test_new" if "--eval-only" in argv else "train_base"
            assert out == f"output/base2new/{side}/dtd/shots_16/{trainer}/{stem}/seed1", out
            assert argv[argv.index("DATASET.SUBSAMPLE_CLASSES") + 1] == ("new" if side == "test_new" else "base")
            runs.setdefault(trainer, {})[side] = out
            if side == "test_new":
                assert arg_value(argv, "--model-dir") == runs[trainer]["train_base"]
            if trainer in method_trainers().values():  # one of ours: a method table config, with the init
                keys = [
                    k
                    for k, tr in method_trainers().items()
                    if tr == trainer and Path(methods.get(k).config).name == f"{stem}.yaml"
                ]
                assert len(keys) == 1, f"{cfg}: not one method of the table (meta/method/methods.yaml)"
                assert argv[-2:] == ["TRAINER.GRAM.INIT", "init.safetensors"]
                if side == "test_new":
                    optim = yaml.safe_load((REPO / methods.get(keys[0]).config).read_text())["OPTIM"]
                    assert arg_value(argv, "--load-epoch") == str(optim["MAX_EPOCH"])
        assert runs and all(set(r) == {"train_base", "test_new"} for r in runs.values()), key
        folders = {str(Path(out).parent) for r in runs.values() for out in r.values()}
        parsed = {expand(c, {})[0] for c in recipe.parser_commands}
        assert parsed == folders, (key, parsed, folders)  # the parser gets each folder of seed runs
