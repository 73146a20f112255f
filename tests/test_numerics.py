"""meta.infra.numerics and meta.fingerprint.golden: the kernel pins, the record, and the golden fingerprint.

The golden test is the cross-machine check: whatever machine runs CI computes the fixed meta-training +
fine-tuning run of every learner and both task loops under the pins and must reproduce the committed digests
bit for bit (meta/fingerprint/golden.json).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meta.fingerprint.golden import GOLDEN, LEARNERS, LOOPS
from meta.infra import numerics

ROOT = Path(__file__).resolve().parents[1]


def _env(**extra: str) -> dict:
    """This environment without the pins (so the command under test must set them itself), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in numerics.PINS and k != numerics.SWITCH}
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def _run(args: list[str], **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=_env(**extra), capture_output=True, text=True, timeout=600
    )


def test_golden_fingerprint_holds_on_this_machine():
    done = _run(["-m", "meta.fingerprint", "--check"])
    found = json.loads(done.stdout)
    golden = json.loads(GOLDEN.read_text())
    assert set(golden["runs"]) == {f"{lr}/{lp}" for lr in LEARNERS for lp in LOOPS}
    assert found["numerics"]["pinned"] is True
    assert done.returncode == 0, (
        f"{done.stderr.strip()}\nthis machine: {found['numerics']['cpu_model']} "
        f"{found['numerics']['cpu_kernel_flags']}; golden written on {golden['written_on']}"
    )
    assert found["digest"] == golden["digest"]


def test_one_ulp_in_a_start_tensor_changes_every_digest():
    args = ["-m", "meta.fingerprint", "--check", "--perturb-ulp", "--learners", "coop", "maple"]
    done = _run(args)
    found = json.loads(done.stdout)
    golden = json.loads(GOLDEN.read_text())["runs"]
    assert done.returncode == 1
    assert len(done.stderr.strip().splitlines()) == 1 and "differs from golden.json in 4 of 4" in done.stderr
    assert sorted(found["runs"]) == ["coop/sequential", "coop/stacked", "maple/sequential", "maple/stacked"]
    assert all(digest != golden[key] for key, digest in found["runs"].items())


def test_fast_mode_runs_unpinned_and_says_so():
    done = _run(["-m", "meta.infra.numerics", "record"], GRAM_NUMERICS="fast")
    record = json.loads(done.stdout)
    assert done.returncode == 0
    assert record["mode"] == "fast" and record["pinned"] is False
    assert all(value is None for value in record["pins"].values())


def test_the_record_names_cpu_pins_and_builds():
    done = _run(["-m", "meta.infra.numerics", "record"])
    record = json.loads(done.stdout)
    assert record["pinned"] is True and record["pins"] == numerics.PINS
    assert record["aten_cpu_capability"] == "AVX2"  # ATEN_CPU_CAPABILITY=avx2 took effect
    assert record["cpu_model"] and len(record["cpu_flags_sha256"]) == 16
    assert set(record["cpu_kernel_flags"]) <= set(numerics.KERNEL_FLAGS)
    assert record["packages"]["torch"] and record["torch_threads"] == 1


def test_pin_process_sets_the_pins_or_starts_the_command_again():
    # torch imported first: the process cannot take the pins any more, so it starts itself again with them
    code = (
        "import os, torch\n"
        "from meta.infra.numerics import pin_process\n"
        "print('start', os.environ.get('MKL_CBWR'), flush=True)\n"
        "pin_process()\n"
        "print('pinned', os.environ['MKL_CBWR'], torch.backends.cpu.get_cpu_capability())\n"
    )
    done = _run(["-c", code])
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:3] == ["start None", "start COMPATIBLE", "pinned COMPATIBLE AVX2"]
    refused = _run(["-c", "import torch\nfrom meta.infra.numerics import pin_process\npin_process(reexec=False)"])
    last = refused.stderr.strip().splitlines()[-1]
    assert refused.returncode == 1 and "NumericsError: torch" in last and "started before the numerics pins" in last


def test_pinned_env_and_mode():
    env = {"GRAM_NUMERICS": "pinned", "MKL_CBWR": "AVX2", "OTHER": "x"}
    out = numerics.pinned_env(env)
    assert out["OTHER"] == "x" and all(out[k] == v for k, v in numerics.PINS.items())  # pins replace the caller's
    assert env["MKL_CBWR"] == "AVX2"  # the argument is not changed
    fast = {"GRAM_NUMERICS": "fast", "MKL_CBWR": "AVX2"}
    assert numerics.pinned_env(fast) == fast
    target: dict = {}
    assert numerics.pin_process(target) == "pinned" and numerics.pinned(target)
    with pytest.raises(numerics.NumericsError, match=r"GRAM_NUMERICS='quick': expected one of pinned, fast"):
        numerics.mode({"GRAM_NUMERICS": "quick"})


def test_the_test_suite_itself_runs_pinned():
    assert numerics.pinned() or numerics.mode() == "fast"


def _threads_after_umap(guarded: bool) -> tuple[int, int]:
    """torch's thread count before and after a UMAP fit in a fresh process (numba's pool starts in it): through
    CHC's topics code (``guarded``) or UMAP bare, with CHC's arguments."""
    fit = (
        "topics.fit_sample_clusters(x, min_cluster_size=10, n_neighbors=5)"
        if guarded
        else "umap.UMAP(n_neighbors=5, random_state=0, n_jobs=1).fit_transform(x)"
    )
    code = (
        "import numpy as np, torch\n"
        "from meta.chc import topics\n"
        "umap = topics._umap_with_jit_cache()\n"
        "x = np.random.default_rng(0).normal(size=(200, 8)).astype(np.float32)\n"
        "before = torch.get_num_threads()\n"
        f"{fit}\n"
        "print(before, torch.get_num_threads())\n"
    )
    done = _run(["-c", code])
    assert done.returncode == 0, done.stderr
    before, after = done.stdout.split()[-2:]
    return int(before), int(after)


def test_chc_umap_leaves_torch_on_its_thread_count():
    """numba's OpenMP pool (UMAP's kernels) changes the OpenMP thread count that torch shares: bare UMAP leaves torch
    on more threads than it had on a machine with several cores (every later op of the process, e.g. the next
    world's CLIP pretraining, on other last bits); CHC's calls give torch back its one thread."""
    assert _threads_after_umap(guarded=True) == (1, 1)
    if (os.cpu_count() or 1) > 1:  # the hazard the guard is for, shown where it can occur
        before, after = _threads_after_umap(guarded=False)
        assert before == 1 and after > 1
