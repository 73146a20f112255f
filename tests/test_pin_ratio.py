"""gram_tools.pin_ratio: the child environments of each mode, the alternation and its table."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gram_tools import pin_ratio
from meta.infra.numerics import PINS, SWITCH

_STATE = "import json, torch; from meta.infra import numerics, products; " + (
    "print(json.dumps({'mode': numerics.mode(), 'kernel': products.state()['kernel']}))"
)


def test_child_environments_really_switch_the_kernels():
    fast, pinned = pin_ratio.child_env("fast"), pin_ratio.child_env("pinned")
    assert fast[SWITCH] == "fast" and not any(k in fast for k in PINS)
    assert all(pinned[k] == v for k, v in PINS.items()) and SWITCH not in pinned

    def state(mode):
        out = subprocess.run(
            [sys.executable, "-c", _STATE], env=pin_ratio.child_env(mode), capture_output=True, text=True
        )
        return json.loads(out.stdout.strip().splitlines()[-1])

    runs = pin_ratio.alternate(state, repeats=1)
    assert [r["mode"] for r in runs] == ["pinned", "fast"]
    assert runs[0]["numbers"] == {"mode": "pinned", "kernel": "numpy OpenBLAS (Haswell kernels, 1 thread)"}
    assert runs[1]["numbers"] == {"mode": "fast", "kernel": "torch"}


def test_table_gives_each_run_and_the_ratio_of_medians():
    runs = [
        {"mode": "pinned", "numbers": {"step": 3.0, "wall": 10.0}},
        {"mode": "fast", "numbers": {"step": 1.0, "wall": 5.0}},
        {"mode": "pinned", "numbers": {"step": 5.0, "wall": 10.0}},
        {"mode": "fast", "numbers": {"step": 3.0}},
    ]
    rows = pin_ratio.table(runs).splitlines()
    assert rows[0].startswith("| quantity (s) | pinned 1 | fast 1 | pinned 2 | fast 2 |")
    assert rows[2] == "| step | 3.000 | 1.000 | 5.000 | 3.000 | 2.00 |"  # median 4 / median 2
    assert rows[3] == "| wall | 10.000 | 5.000 | 10.000 | - | 2.00 |"


def test_bad_repeats_is_one_line(capsys):
    assert pin_ratio.main(["bench", "--repeats", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --repeats: expected an integer >= 1, got 0"]


def test_a_failing_child_is_named(monkeypatch):
    monkeypatch.setattr(pin_ratio, "sys", type("S", (), {"executable": sys.executable}))
    with pytest.raises(pin_ratio.UserError, match="the fast run failed with exit 2"):
        pin_ratio._run([sys.executable, "-c", "import sys; sys.exit(2)"], "fast")
