"""Unchanged upstream prompt-learning forks for tests: unpack, add GRAM as docs/dassl_plugin.md says, run.

The forks come from source archives in ``../shared/upstream/`` beside the repository (override the
folder with ``GRAM_UPSTREAM_DIR``; a CoOp checkout named by ``GRAM_COOP_SRC`` replaces CoOp's
archive).  :class:`ForkSources` unpacks each archive once per test session (the ``upstream_fork``
fixture in ``conftest.py``) and skips the test with a one-line reason when it is absent.

:func:`add_gram` applies exactly the lines of the fork's section of ``docs/dassl_plugin.md`` to a
copy (the two imports after the anchor the doc names, the two lines at the end of ``extend_cfg``,
step 4's config copies) and nothing else; :func:`run_train` runs the fork's own ``train.py``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "dassl_plugin.md"
UPSTREAM_ENV = "GRAM_UPSTREAM_DIR"
FORK_TIMEOUT_S = 300  # one train.py run on a tiny CLIP takes ~10 s; a hang fails instead of blocking CI

# Test harness only: the forks' clip/clip.py downloads OpenAI's weights (``_download``); here it
# returns a local file (argv[1]), then the fork's train.py runs as ``python train.py ...`` would.
_CLIP_RUNNER = """import runpy, sys
weights = sys.argv.pop(1)
sys.argv[0] = "train.py"
from clip import clip as _clip
_clip._download = lambda url, root=None: weights
runpy.run_path("train.py", run_name="__main__")
"""


@dataclass(frozen=True)
class Fork:
    """One upstream fork: its section title in the doc, archive and the folder it unpacks into."""

    key: str  # section "### <key> (<repository>)" of docs/dassl_plugin.md
    archive: str
    folder: str
    checkout_env: str = ""  # an environment variable naming a checkout that replaces the archive


FORKS = {
    f.key: f
    for f in (
        Fork("CoOp", "CoOp-ff61507.tar.gz", "CoOp", checkout_env="GRAM_COOP_SRC"),
        Fork("MaPLe", "multimodal-prompt-learning-69bce21.tar.gz", "multimodal-prompt-learning"),
        Fork("PromptSRC", "PromptSRC-bb95c77.tar.gz", "PromptSRC"),
    )
}


def upstream_dir() -> Path:
    """Where the archives lie: ``$GRAM_UPSTREAM_DIR``, else ``../shared/upstream`` beside the repository."""
    return Path(os.environ.get(UPSTREAM_ENV) or REPO.parent / "shared" / "upstream")


class ForkSources:
    """``sources(key)`` -> the unchanged source tree of a fork, unpacked under ``root`` on first use."""

    def __init__(self, root: Path):
        self.root = root
        self._trees: dict[str, Path] = {}

    def __call__(self, key: str) -> Path:
        if key not in self._trees:
            self._trees[key] = self._locate(FORKS[key])
        return self._trees[key]

    def _locate(self, fork: Fork) -> Path:
        checkout = os.environ.get(fork.checkout_env, "") if fork.checkout_env else ""
        if checkout:
            if not (Path(checkout) / "train.py").is_file():
                pytest.fail(f"{fork.checkout_env}={checkout}: no train.py there (expected a {fork.key} checkout)")
            return Path(checkout)
        archive = upstream_dir() / fork.archive
        if not archive.is_file():
            alt = f" or {fork.checkout_env} to a checkout" if fork.checkout_env else ""
            pytest.skip(f"{archive} absent: set {UPSTREAM_ENV} to the folder of the upstream fork archives{alt}")
        with tarfile.open(archive) as tar:
            tar.extractall(self.root, filter="data")
        tree = self.root / fork.folder
        if not (tree / "train.py").is_file():
            pytest.fail(f"{archive}: expected it to unpack into {fork.folder}/ with a train.py")
        return tree


# ------------------------------------------------------------------------------ the doc's recipe
def doc_section(key: str) -> str:
    """Text of the doc's ``### <key> (...)`` section, up to the next heading."""
    text = DOC.read_text()
    start = re.search(rf"^### {re.escape(key)} \(", text, re.M)
    assert start, f"{DOC.name}: no section '### {key} (...)'"
    end = re.search(r"^##", text[start.end() :], re.M)
    return text[start.start() : start.end() + end.start() if end else len(text)]


def doc_blocks(text: str) -> list[str]:
    return re.findall(r"```(?:bash|python)?\n(.*?)```", text, re.S)


@dataclass(frozen=True)
class Recipe:
    """What a fork section of the doc tells a user to add and run."""

    anchor: str  # the train.py line the imports follow
    import_lines: list[str]
    extend_lines: list[str]  # indented: the last lines of extend_cfg(cfg)
    commands: list[str]  # "python train.py ..." commands, continuation lines joined
    parser_commands: list[str]  # "python parse_test_res.py ..." commands
    scripts: list[str]  # the fork's scripts the section names


def doc_recipe(key: str) -> Recipe:
    section = doc_section(key)
    anchor = re.search(r"In `train\.py`, after `(import trainers\.\w+)`", section)
    assert anchor, f"{DOC.name} section {key}: no 'In `train.py`, after `import trainers.<x>`'"
    blocks = doc_blocks(section)
    imports = [b for b in blocks if b.startswith("import trainers.gram")]
    extends = [b for b in blocks if "extend_gram_cfg(cfg)" in b]
    assert len(imports) == 1 and len(extends) == 1, f"{DOC.name} section {key}: one import and one extend_cfg block"
    commands, parsers = [], []
    for block in blocks:
        for cmd in block.replace("\\\n", " ").split("\n"):
            if cmd.startswith("python train.py"):
                commands.append(cmd)
            elif cmd.startswith("python parse_test_res.py"):
                parsers.append(cmd)
    return Recipe(
        anchor.group(1),
        imports[0].strip().splitlines(),
        extends[0].rstrip().splitlines(),
        commands,
        parsers,
        re.findall(r"`(scripts/[\w/.+-]+\.sh)`", section),
    )


def config_copy_script() -> str:
    """Step 4's copy commands (they ``cd my-coop-fork`` and copy from ``../gram``)."""
    text = DOC.read_text()
    return doc_blocks(text[text.index("## 4. Add the configs") :])[0]


def _insert_at_end_of_extend_cfg(source: str, lines: list[str]) -> str:
    rows = source.split("\n")
    start = rows.index("def extend_cfg(cfg):")
    end = next(i for i in range(start + 1, len(rows)) if rows[i] and not rows[i][0].isspace())
    while not rows[end - 1].strip():
        end -= 1
    return "\n".join(rows[:end] + lines + rows[end:])


def add_gram(source: Path, workdir: Path, key: str) -> Path:
    """Copy the fork to ``workdir/my-coop-fork`` and add GRAM to it as the doc's section says."""
    recipe = doc_recipe(key)
    fork = workdir / "my-coop-fork"
    shutil.copytree(source, fork, ignore=shutil.ignore_patterns(".git", "output"))
    shutil.copytree(
        REPO / "trainers" / "gram", fork / "trainers" / "gram", ignore=shutil.ignore_patterns("__pycache__")
    )  # step 2
    train_py = fork / "train.py"
    text = train_py.read_text()
    anchor = recipe.anchor + "\n"
    assert text.count(anchor) == 1, f"{key} train.py: the doc's anchor {recipe.anchor!r} is not one line there"
    text = text.replace(anchor, anchor + "\n".join(recipe.import_lines) + "\n")
    train_py.write_text(_insert_at_end_of_extend_cfg(text, recipe.extend_lines))
    (workdir / "gram").symlink_to(REPO)
    r = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", config_copy_script()], cwd=workdir, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    return fork


def expand(command: str, values: dict[str, str]) -> list[str]:
    """The arguments after ``python <script>`` of a doc command, ``$NAME`` replaced from ``values``."""

    def sub(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        assert name in values, f"doc command uses ${name}, which the test does not provide: {command}"
        return values[name]

    argv = shlex.split(re.sub(r"\$\{(\w+)\}|\$(\w+)", sub, command))
    assert argv[0] == "python", command
    return argv[2:]


def arg_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def script_variables(script: Path) -> dict[str, str]:
    """``NAME=value`` lines of a fork's shell script (TRAINER, CFG, LOADEP, ...), after checking it runs train.py."""
    text = script.read_text()
    assert "python train.py" in text and "DATASET.SUBSAMPLE_CLASSES" in text, f"{script}: not a base-to-new script"
    return dict(re.findall(r"^([A-Z_]+)=(\S*)$", text, re.M))


# ------------------------------------------------------------------------------ running the fork
def fork_env() -> dict[str, str]:
    """This checkout's ``meta`` first on the path (as ``scripts/setup.sh`` installs it), one thread."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")


def run_train(fork: Path, argv: list[str], clip_weights: Path | None = None) -> subprocess.CompletedProcess:
    """``python train.py argv`` in the fork's root; ``clip_weights``: the file its clip loads instead of downloading."""
    head = (
        [sys.executable, "train.py"]
        if clip_weights is None
        else [sys.executable, "-c", _CLIP_RUNNER, str(clip_weights)]
    )
    return subprocess.run(head + argv, capture_output=True, text=True, timeout=FORK_TIMEOUT_S, cwd=fork, env=fork_env())


def run_script(fork: Path, script: str, argv: list[str]) -> subprocess.CompletedProcess:
    """``python <script> argv`` in the fork's root (its ``parse_test_res.py``, or ours by absolute path)."""
    return subprocess.run(
        [sys.executable, script, *argv],
        capture_output=True,
        text=True,
        timeout=FORK_TIMEOUT_S,
        cwd=fork,
        env=fork_env(),
    )


def parse_results(argv: list[str]) -> int:
    """``python scripts/parse_results.py argv``, in this process (the subprocess spends ~6 s importing open_clip)."""
    module = sys.modules.get("parse_results")
    if module is None:
        spec = importlib.util.spec_from_file_location("parse_results", REPO / "scripts" / "parse_results.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["parse_results"] = module  # its dataclasses look the module up while the file executes
        spec.loader.exec_module(module)
    return module.main(argv)


def failure(r: subprocess.CompletedProcess) -> str:
    return f"exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
