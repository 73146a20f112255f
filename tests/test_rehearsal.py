"""gram_tools.rehearsal: the user's whole path as subprocesses, checked on the CPU with the tiny CLIP."""

import importlib.util
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from gram_tools import rehearsal
from gram_tools.synthetic import write_synthetic_dtd, write_synthetic_shards

REPO = Path(__file__).resolve().parents[1]


def test_epoch_seconds_reads_the_last_epochs_mean_batch_time():
    log = (
        "epoch [1/2] batch [20/40] time 0.500 (0.600) data 0.01 (0.02) loss 1.0\n"
        "epoch [1/2] batch [40/40] time 0.400 (0.550) data 0.01 (0.02) loss 0.9\n"
        "epoch [2/2] batch [20/40] time 0.300 (0.250) data 0.01 (0.02) loss 0.8\n"
        "epoch [2/2] batch [40/40] time 0.200 (0.225) data 0.01 (0.02) loss 0.7\nElapsed: 0:00:31\n"
    )
    assert rehearsal.epoch_seconds(log) == {"epoch_s": 9.0, "batch_s": 0.225, "batches": 40}
    assert rehearsal.epoch_seconds("no batch lines") is None


def test_synthetic_slices_and_dtd_layout(tmp_path):
    """Shard slices written apart continue each other's keys; the DTD-layout dataset has its split file."""
    write_synthetic_shards(tmp_path, n_pairs=6, n_shards=1, seed=1, size=(64, 64), first_shard=0)
    write_synthetic_shards(tmp_path, n_pairs=5, n_shards=1, seed=2, size=(64, 64), first_shard=1, first_key=6)
    keys = []
    for shard in sorted(tmp_path.glob("shard-*.tar")):
        with tarfile.open(shard) as tar:
            keys += sorted({Path(m.name).stem for m in tar.getmembers()})
    assert [p.name for p in sorted(tmp_path.glob("shard-*.tar"))] == ["shard-00000.tar", "shard-00001.tar"]
    assert keys == [f"{i:08d}" for i in range(11)]
    split = write_synthetic_dtd(tmp_path / "data", 3, {"train": 2, "test": 1}, size=(40, 40))
    on_disk = json.loads((tmp_path / "data/dtd/split_zhou_DescribableTextures.json").read_text())
    assert on_disk == split and len(split["train"]) == 6 and {r[1] for r in split["test"]} == {0, 1, 2}
    from PIL import Image

    assert Image.open(tmp_path / "data/dtd/images" / split["train"][0][0]).size == (40, 40)


def test_cluster_stage_takes_the_caption_model_folder_given(tmp_path):
    """--text-model reaches CHC as CHC.TEXT.MODEL (offline machines carry the model folder), and the
    cluster stage's options load as a config: every key exists and the value lands where CHC reads it."""
    from meta.config import load_meta_cfg

    size = dict(rehearsal.SIZES["cpu_smoke"], text_model=str(tmp_path / "minilm"))
    args = rehearsal.cluster_args(size, tmp_path / "corpus", tmp_path / "chc")
    config, opts = args[args.index("--config-file") + 1], args[args.index("--config-file") + 2 :]
    cfg = load_meta_cfg(str(REPO / config), opts)
    assert cfg.CHC.TEXT.MODEL == str(tmp_path / "minilm")
    assert cfg.CHC.IMAGES.DECODE_WORKERS == size["workers"]  # decoding threads as many as the loaders' workers
    default = rehearsal.cluster_args(rehearsal.SIZES["gpu"], tmp_path / "corpus", tmp_path / "chc")
    cfg = load_meta_cfg(str(REPO / config), default[default.index("--config-file") + 2 :])
    assert cfg.CHC.TEXT.MODEL == ""
    assert cfg.CHC.IMAGES.DECODER == "torchvision"  # on the GPU: nvJPEG batches (meta.chc.tensor_decode)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_without_cuda_the_real_size_rehearsal_stops_with_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "gram_tools.rehearsal", "--out", str(tmp_path / "r")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: gram_tools.rehearsal: CUDA is not available on this machine (use --cpu-smoke for the CPU "
        "plumbing check)"
    ]
    assert not (tmp_path / "r").exists()
    script = subprocess.run(
        ["bash", str(REPO / "scripts/gpu_rehearsal.sh"), str(tmp_path / "s")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert script.returncode == 2 and len(script.stderr.strip().splitlines()) == 1
    assert "CUDA is not available" in script.stderr


@pytest.mark.slow
@pytest.mark.dassl
@pytest.mark.skipif(importlib.util.find_spec("dassl") is None, reason="Dassl is not installed (train.py needs it)")
def test_cpu_smoke_rehearsal_runs_every_stage(tmp_path):
    """--cpu-smoke: corpus -> cluster -> train x2 -> export x2 -> base2new x4 -> parse, one JSON of it all."""
    out = tmp_path / "rehearsal"
    proc = subprocess.run(
        [sys.executable, "-m", "gram_tools.rehearsal", "--cpu-smoke", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads((out / "rehearsal.json").read_text())
    stages = [
        "data",
        "cluster",
        "train_coop",
        "train_unigram",
        "export_coop",
        "export_unigram",
        "fewshot_coop",
        "fewshot_gram_coop",
        "fewshot_joint",
        "fewshot_unigram",
        "parse",
    ]
    assert list(result["stages"]) == stages and result["settings"]["side_by_side"] is True
    for name, stage in result["stages"].items():
        assert stage["wall_s"] > 0 and stage["peak_gpu_mib"] is None, name
        if name != "data":
            assert stage["peak_rss_mib"] > 50, name  # a Python process with torch loaded
    # the groups ran side by side: each pair names the other, and the whole took at least its groups' longest stages
    groups = [("data",)] + [tuple(group) for group in rehearsal.SCHEDULE]
    assert [name for group in groups for name in group] == stages
    for group in groups:
        for name in group:
            assert result["stages"][name].get("ran_with", []) == [other for other in group if other != name]
    assert result["total_s"] >= sum(max(result["stages"][n]["wall_s"] for n in group) for group in groups) - 1.0
    assert {("fewshot_" + den, "fewshot_" + num) for num, den in rehearsal.RATIOS.values()} <= set(groups)
    # every line of a stage's log starts with the seconds since the stage started, in order
    lines = (out / "logs/train_coop.log").read_text().splitlines()
    stamps = [float(line[1:].split(" s]", 1)[0]) for line in lines]
    assert (
        len(lines) > 3
        and stamps == sorted(stamps)
        and 0 <= stamps[0] <= stamps[-1] <= result["stages"]["train_coop"]["wall_s"]
    )
    for method in rehearsal.FEWSHOT:
        epoch = result["fewshot_epoch"][method]
        assert epoch["batches"] >= 1 and epoch["epoch_s"] > 0, method
    for key, (num, den) in rehearsal.RATIOS.items():
        expected = result["fewshot_epoch"][num]["epoch_s"] / result["fewshot_epoch"][den]["epoch_s"]
        assert result["epoch_time_ratio"][key] == pytest.approx(expected, rel=1e-2), key
    assert (out / "meta/coop/gram_init.safetensors").is_file() and (
        out / "meta/unigram/gram_init.safetensors"
    ).is_file()
    assert any(name.endswith(".csv") for name in result["tables"])
    # `python -m meta train` records what computed the run (META.FINGERPRINT on: the golden run's digest) and the
    # export carries it into the init file's provenance
    record = json.loads((out / "meta/coop/run.json").read_text())["computed_by"]
    assert len(record["fingerprint"]) == 64 and isinstance(record["golden"], bool) and record["numerics"]["cpu_model"]
    info = json.loads((out / "meta/unigram/run.json").read_text())  # META.FINGERPRINT False: numerics and commit only
    assert "computed_by" not in info and info["numerics"]["cpu_model"] and info["commit"]
    # the GRAM rows started from the exports (run_methods passes INIT as TRAINER.GRAM.INIT)
    log = (out / "output/base2new/train_base/dtd/shots_2/gram_coop/seed1/log.txt").read_text()
    assert str(out / "meta/coop/gram_init.safetensors") in log


def test_a_group_runs_side_by_side_and_a_failing_stage_is_named_with_its_log(tmp_path):
    """run_group starts its stages at once (two 2 s sleeps end before 4 s: one after the other they could not),
    stamps each log line with the seconds since its stage started, and after all have ended raises for a failing
    one, naming it and its log."""
    import os
    import time

    env = dict(os.environ)
    sleeper = "import time; print('start', flush=True); time.sleep(2.0); print('end', flush=True)"
    jobs = [(name, [sys.executable, "-c", sleeper], env) for name in ("a", "b")]
    start = time.perf_counter()
    out = rehearsal.run_group(jobs, tmp_path, gpu=False)
    assert time.perf_counter() - start < 3.9
    assert [out["a"]["ran_with"], out["b"]["ran_with"]] == [["b"], ["a"]]
    assert all(out[n]["wall_s"] >= 2.0 for n in "ab") and out["a"]["peak_gpu_mib"] is None
    lines = (tmp_path / "a.log").read_text().splitlines()
    (t0, first), (t1, last) = ((float(line[1:].split(" s]")[0]), line.split("] ", 1)[1]) for line in lines)
    # the stamps have one decimal: their difference may exceed the wall time by up to 0.1 s of rounding
    assert (first, last) == ("start", "end") and 1.9 <= t1 - t0 <= out["a"]["wall_s"] + 0.1
    alone = rehearsal.run_group([("c", [sys.executable, "-c", "print(1)"], env)], tmp_path, gpu=False)
    assert "ran_with" not in alone["c"]
    failing = [("ok", [sys.executable, "-c", "print('fine')"], env)]
    failing.append(("bad", [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"], env))
    with pytest.raises(RuntimeError, match=r"stage bad failed \(exit 3\); log .*bad\.log: .*boom"):
        rehearsal.run_group(failing, tmp_path, gpu=False)
    assert (tmp_path / "ok.log").read_text().endswith("fine\n")  # the other stage ran to its end


def _fake_nvidia_smi(folder: Path, listed: bool) -> dict:
    """An ``nvidia-smi`` on PATH: the device's memory in use 5,000 MiB at the first query and 6,000 after; per process
    (``listed``) 1,000 MiB for each process whose command line holds MARK_A and 3,000 for MARK_B, else no process."""
    import os

    folder.mkdir()
    apps = (
        'for p in $(pgrep -f MARK_A); do echo "$p, 1000"; done; for p in $(pgrep -f MARK_B); do echo "$p, 3000"; done'
    )
    script = folder / "nvidia-smi"
    script.write_text(
        "#!/bin/bash\n"
        'case "$*" in\n'
        f"  *query-gpu*) if [ -f {folder}/seen ]; then echo 6000; else touch {folder}/seen; echo 5000; fi;;\n"
        f"  *query-compute-apps*) {apps if listed else 'true'};;\n"
        "esac\n"
    )
    script.chmod(0o755)
    return {**os.environ, "PATH": f"{folder}{os.pathsep}{os.environ['PATH']}"}


@pytest.mark.parametrize("listed", [True, False], ids=["per_process", "device_wide"])
def test_each_stage_gets_its_own_processes_device_memory_where_nvidia_smi_lists_them(tmp_path, monkeypatch, listed):
    """Side by side, a stage's peak device memory is its own processes' (``gpu_mib_of: processes``); where
    ``nvidia-smi`` lists none of them (another PID namespace), the group's device-wide peak (``device``)."""
    env = _fake_nvidia_smi(tmp_path / "bin", listed)
    monkeypatch.setenv("PATH", env["PATH"])
    jobs = [(n, [sys.executable, "-c", f"import time; time.sleep(1.5)  # MARK_{n.upper()}"], env) for n in "ab"]
    out = rehearsal.run_group(jobs, tmp_path, gpu=True)
    if listed:
        assert [out[n]["peak_gpu_mib"] for n in "ab"] == [1000.0, 3000.0]
        assert {out[n]["gpu_mib_of"] for n in "ab"} == {"processes"}
    else:
        assert [out[n]["peak_gpu_mib"] for n in "ab"] == [1000.0, 1000.0]  # 6,000 in use, 5,000 at the start
        assert {out[n]["gpu_mib_of"] for n in "ab"} == {"device"}


@pytest.mark.parametrize("side_by_side", [True, False])
def test_the_schedule_runs_as_groups_or_one_stage_at_a_time(tmp_path, monkeypatch, side_by_side):
    """``rehearse`` hands run_group the SCHEDULE's groups, or (``--one-at-a-time``) each stage alone in that order."""
    calls: list = []

    def fake_group(jobs, log_dir, gpu):
        calls.append([name for name, _, _ in jobs])
        return {name: {"wall_s": 1.0} for name, _, _ in jobs}

    monkeypatch.setattr(rehearsal, "run_group", fake_group)
    monkeypatch.setattr(rehearsal, "write_data", lambda *args: None)
    size = dict(rehearsal.SIZES["cpu_smoke"])
    result = rehearsal.rehearse(tmp_path / "r", size, side_by_side=side_by_side)
    order = [name for group in rehearsal.SCHEDULE for name in group]
    assert calls == ([list(g) for g in rehearsal.SCHEDULE] if side_by_side else [[name] for name in order])
    assert list(result["stages"]) == ["data", *order] and result["settings"]["side_by_side"] is side_by_side


def test_one_at_a_time_flag_reaches_rehearse(tmp_path, monkeypatch):
    seen: list = []
    fake = {"total_s": 1.0, "epoch_time_ratio": {}}
    monkeypatch.setattr(rehearsal, "rehearse", lambda out, size, side_by_side=True: seen.append(side_by_side) or fake)
    for argv in (["--cpu-smoke", "--out", str(tmp_path)], ["--cpu-smoke", "--one-at-a-time", "--out", str(tmp_path)]):
        assert rehearsal.main(argv) == 0
    assert seen == [True, False]
