"""meta.infra.nvidia_smi: the CSV rows of a (fake) nvidia-smi, and None where it cannot answer."""

import os

from meta.infra import numerics, nvidia_smi


def _fake(tmp_path, monkeypatch, body: str) -> None:
    script = tmp_path / "nvidia-smi"
    script.write_text("#!/bin/bash\n" + body)
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


def test_rows_are_split_and_stripped_and_the_format_flags_appended(tmp_path, monkeypatch):
    _fake(tmp_path, monkeypatch, 'echo "$*" > "$(dirname "$0")/args"; printf "123, 4000\\n\\n77 ,  12\\n"\n')
    assert nvidia_smi.query("--query-compute-apps=pid,used_memory") == [["123", "4000"], ["77", "12"]]
    assert (tmp_path / "args").read_text().split() == [
        "--query-compute-apps=pid,used_memory",
        "--format=csv,noheader,nounits",
    ]


def test_a_failing_or_missing_nvidia_smi_gives_none(tmp_path, monkeypatch):
    _fake(tmp_path, monkeypatch, "echo 'NVIDIA-SMI has failed' >&2; exit 9\n")
    assert nvidia_smi.query("--query-gpu=memory.used") is None and numerics._nvidia_driver() is None
    monkeypatch.setenv("PATH", str(tmp_path / "nothing here"))
    assert nvidia_smi.query("--query-gpu=memory.used") is None


def test_the_numerics_record_reads_the_driver_through_it(tmp_path, monkeypatch):
    _fake(tmp_path, monkeypatch, 'case "$*" in *driver_version*) echo 580.159.04;; esac\n')
    assert numerics._nvidia_driver() == "580.159.04"
