"""Importing ``datasets`` without Dassl gives a one-line error (checked in a child with Dassl hidden)."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_import_without_dassl_is_a_one_line_error():
    """Runs in a child with ``dassl`` hidden, so it checks the message whether or not Dassl is installed."""
    code = (
        "import sys, importlib.abc\n"
        "class Hide(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'dassl' or name.startswith('dassl.'):\n"
        "            raise ModuleNotFoundError(\"No module named 'dassl'\")\n"
        "sys.meta_path.insert(0, Hide())\n"
        "try:\n"
        "    import datasets\n"
        "except ImportError as e:\n"
        "    print('ERR', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip()
    assert line.startswith("ERR Dassl is not installed") and "\n" not in line, line
    assert "meta.coop_data" in line
