"""Hostile inputs: no image counted twice or seen sideways, no input that eats the machine, and every
bad input to an entry point one ``error:`` line with exit status 2.

Each hostile input is built small in ``tmp_path``: a symbolic link back to the image-folder root,
photos with an EXIF Orientation tag, a 60000x1 PNG, a tall 1-pixel-wide PNG, a PNG header claiming
60 M pixels, a sparse 60 MiB ``.jpg``, a file over a byte cap set by its key, a 9-level YAML alias bomb
(for every reader of a config: ``meta``, ``train.py``, the planner, a checkpoint's saved config), a CHC
config given to the planner, init files holding NaN or int32, out-of-range image-cap keys.  Kinds that
other modules already cover through the command line are covered here through the function (numeric
flags: ``test_one_line_errors.py``).
"""

import io
import json
import os
import struct
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import one_error_line, resave_tensors, tiny_chc_args
from helpers_chc import png_bytes
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from meta.chc.imaging import DECODE_RULE, MAX_PIXELS, decode_batch, decode_image_why, to_clip_uint8
from meta.chc.settings import read_chc_settings
from meta.chc.sources import MAX_IMAGE_BYTES, build_index, read_regular_file
from meta.config import get_meta_cfg_default, load_meta_cfg
from meta.infra.cli_errors import UserError, run_cli

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- 1. image-folder symbolic links
def _folder_with_links(tmp_path):
    """data/{apple,bridge}/ with 4 images each, and five symbolic links (3 back inside, 2 outside)."""
    data = tmp_path / "data"
    for c, name in enumerate(("apple", "bridge")):
        (data / name).mkdir(parents=True)
        for k in range(4):
            (data / name / f"{k}.png").write_bytes(png_bytes((40 * k, 200 * c, 90)))
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "far.png").write_bytes(png_bytes((1, 2, 3)))
    (data / "zz_all").symlink_to(data, target_is_directory=True)  # class-level link back to the root
    (data / "apple" / "nested").symlink_to(data / "bridge", target_is_directory=True)
    (data / "bridge" / "dup.png").symlink_to(data / "apple" / "0.png")
    (data / "outside").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (data / "apple" / "far.png").symlink_to(tmp_path / "elsewhere" / "far.png")
    return data


def test_image_folder_symlinks_are_skipped_and_every_image_has_one_label(tiny_clip, tmp_path):
    from meta.chc.image_folder import build_image_folder_hierarchy

    clip, _ = tiny_clip
    data = _folder_with_links(tmp_path)
    h = build_image_folder_hierarchy(data, clip, num_domains=1, min_per_domain=1, seed=0, show_progress=False)
    assert h.topic_names == ["apple", "bridge"]
    paths = h.image_loader.paths
    real = [os.path.realpath(p) for p in paths]
    assert len(paths) == 8 and len(set(real)) == 8  # no image under two labels (or twice under one)
    assert h.meta["counts"]["images"] == 8 and h.meta["counts"]["classes"] == 2
    assert h.meta["counts"]["symlinks_skipped_inside_root"] == 3
    assert h.meta["counts"]["symlinks_skipped_outside_root"] == 2
    assert (h.item_topic >= 0).sum() == 8


# ---------------------------------------------------------------- 2. EXIF orientation
# A 64x32 picture of four flat 32x16 quadrants (8-aligned: JPEG keeps them nearly exact); any turn or flip
# moves a colour to another quadrant.
QUADRANTS = ((220, 30, 30), (30, 200, 40), (40, 40, 210), (240, 240, 240))
# EXIF orientation -> the transpose that makes the stored pixels from the upright picture (the inverse of
# what a viewer applies: 3 = 180 degrees, 6 = stored turned 90 degrees left, 8 = stored turned 90 degrees right)
STORED = {3: Image.Transpose.ROTATE_180, 6: Image.Transpose.ROTATE_90, 8: Image.Transpose.ROTATE_270}


def _upright_picture() -> np.ndarray:
    """uint8 [32, 64, 3]: the picture as a viewer shows it."""
    arr = np.zeros((32, 64, 3), dtype=np.uint8)
    arr[:16, :32], arr[:16, 32:], arr[16:, :32], arr[16:, 32:] = QUADRANTS
    return arr


def _jpeg_with_orientation(upright: np.ndarray, orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    stored = Image.fromarray(upright).transpose(STORED[orientation])
    stored.save(buf, "JPEG", quality=95, subsampling=0, exif=exif.tobytes())
    return buf.getvalue()


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_exif_orientation_is_applied_before_clustering(orientation):
    upright = _upright_picture()
    data = _jpeg_with_orientation(upright, orientation)
    img, why = decode_image_why(data)
    assert why == "" and img.size == (64, 32)
    assert np.abs(np.asarray(img, dtype=np.int16) - upright).max() <= 12  # JPEG noise; a wrong turn is >= 150
    pixels, ok = decode_batch([data], 16)  # what CLIP encodes and the decoded-image cache keeps
    expected = to_clip_uint8(Image.fromarray(upright), 16)
    assert ok[0] and np.abs(pixels[0].astype(np.int16) - expected).max() <= 12


# ---------------------------------------------------------------- 3. pixel and aspect caps
def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)


def _png_header_only(width: int, height: int) -> bytes:
    """A grey 8-bit PNG declaring ``width x height`` with one tiny IDAT (a few hundred bytes in all)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    idat = zlib.compress(b"\0" * (width + 1))  # one row: a decoder would go on to allocate all of them
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", idat) + _png_chunk(b"IEND", b"")


def test_a_60000x1_png_is_skipped_and_counted_before_any_resize():
    buf = io.BytesIO()
    Image.new("L", (60000, 1), 128).save(buf, "PNG", optimize=True)
    line = buf.getvalue()
    assert len(line) < 1000
    reasons: list = []
    t0 = time.perf_counter()
    pixels, ok = decode_batch([line, png_bytes()], 8, reasons=reasons)
    assert time.perf_counter() - t0 < 1.0
    assert ok.tolist() == [False, True] and reasons == ["aspect ratio above 20", ""]
    assert not pixels[0].any()
    buf = io.BytesIO()
    Image.new("L", (80, 4), 128).save(buf, "PNG")  # 20:1 exactly is still an image
    assert decode_batch([buf.getvalue()], 8)[1].tolist() == [True]


def test_a_png_declaring_more_pixels_than_the_cap_is_never_decoded():
    bomb = _png_header_only(10_000, 6_000)  # 60 M pixels declared, ~300 bytes of file
    assert 10_000 * 6_000 > MAX_PIXELS
    reasons: list = []
    _, ok = decode_batch([bomb], 8, reasons=reasons)
    assert not ok[0] and reasons == [f"more than {MAX_PIXELS} pixels"]
    small = np.full((4, 80, 3), 7, dtype=np.uint8)  # 20:1 is allowed, 320 pixels
    buf = io.BytesIO()
    Image.fromarray(small).save(buf, "PNG")
    reasons = []
    _, ok = decode_batch([buf.getvalue()], 8, reasons=reasons, max_pixels=300)
    assert not ok[0] and reasons == ["more than 300 pixels"]


# ---------------------------------------------------------------- 4. byte cap before reading
def test_a_sparse_60_mib_jpg_in_a_manifest_is_not_read(tmp_path):
    big = tmp_path / "huge.jpg"
    with open(big, "wb") as fh:
        fh.truncate(60 * 2**20)  # sparse: no 60 MiB written
    (tmp_path / "ok.png").write_bytes(png_bytes())
    (tmp_path / "m.csv").write_text("image,caption\nhuge.jpg,a huge file\nok.png,a red square\n")
    index = build_index(manifest=str(tmp_path / "m.csv"), show_progress=False)
    reasons: list = []
    blobs = index.read_image_bytes(range(len(index)), reasons)
    assert blobs[0] is None and blobs[1] == png_bytes()
    assert reasons == [f"file larger than {MAX_IMAGE_BYTES} bytes", ""]
    _, ok = decode_batch(blobs, 8)  # counted as unreadable like a damaged image
    assert ok.tolist() == [False, True]
    with pytest.raises(OSError, match="huge.jpg: expected an image file of at most"):
        read_regular_file(str(big))


# ---------------------------------------------------------------- 5. YAML alias bomb
def _alias_bomb(levels: int = 9) -> str:
    """``levels`` nested mappings of 9 aliases each: ~1 KB of YAML, 9**levels leaves once yacs copies them."""
    keys = [f"k{j}" for j in range(9)]
    lines = ["a0: &a0 {" + ", ".join(f"{k}: lol" for k in keys) + "}"]
    for n in range(1, levels):
        lines.append(f"a{n}: &a{n} {{" + ", ".join(f"{k}: *a{n - 1}" for k in keys) + "}")
    return "\n".join(lines) + "\n"


def test_a_yaml_alias_bomb_fails_fast_naming_the_file(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(_alias_bomb(9))
    assert path.stat().st_size < 1200
    t0 = time.perf_counter()
    with pytest.raises(UserError) as err:
        load_meta_cfg(str(path))
    assert time.perf_counter() - t0 < 1.0
    message = str(err.value)
    assert message.startswith(f"{path}: ") and "alias" in message and "\n" not in message


def test_config_files_without_aliases_still_load(tmp_path):
    path = tmp_path / "plain.yaml"
    path.write_text("CHC:\n  IMAGES:\n    BATCH_SIZE: &b 32\n  TEXT:\n    BATCH_SIZE: 16\n")  # an anchor alone is fine
    cfg = load_meta_cfg(str(path))
    assert cfg.CHC.IMAGES.BATCH_SIZE == 32 and cfg.CHC.TEXT.BATCH_SIZE == 16


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "configs" / "meta").glob("*.yaml")))
def test_the_shipped_meta_configs_still_load(name):
    load_meta_cfg(str(REPO / "configs" / "meta" / name))


@pytest.mark.dassl
def test_train_py_refuses_a_yaml_alias_bomb_before_yacs_builds_it(tmp_path, capsys):
    """``train.py`` merges Dassl config files with yacs: the same scan runs first (in-process: ``run_cli``)."""
    pytest.importorskip("dassl", reason="Dassl is not installed (scripts/setup.sh --with-dassl)")
    import train

    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(_alias_bomb(9))
    for flag in ("--config-file", "--dataset-config-file"):
        t0 = time.perf_counter()
        code = run_cli(train.cli, ["--trainer", "GRAM_CoOp", flag, str(bomb), "--output-dir", str(tmp_path / "o")])
        assert time.perf_counter() - t0 < 5.0
        line = one_error_line(capsys, str(bomb), "YAML alias *a0")
        assert code == 2 and line.startswith(f"error: {bomb}: ")
    assert not (tmp_path / "o").exists()


def test_a_checkpoint_whose_saved_config_holds_aliases_is_refused():
    from meta.metatrain.checkpoint import CheckpointError
    from meta.metatrain.export import saved_cfg

    with pytest.raises(UserError, match=r"^checkpoint config_yaml: YAML alias \*a0 at line 2"):
        saved_cfg({"config_yaml": _alias_bomb(9)})
    with pytest.raises(CheckpointError, match="config_yaml: expected the run's config as YAML text, got NoneType"):
        saved_cfg({})
    default = get_meta_cfg_default()
    cfg = saved_cfg({"config_yaml": default.dump()})  # what the trainer writes loads as before
    assert cfg.META.STEPS == default.META.STEPS and cfg.CHC.INPUT == default.CHC.INPUT


# ---------------------------------------------------------------- 6. the planner and the kind of its config
def test_the_planner_refuses_a_chc_config_naming_the_file(capsys):
    from gram_tools.plan import config_kind_problem, main

    chc = str(REPO / "configs" / "meta" / "chc_cc3m.yaml")
    code = main(["--config-file", chc])
    captured = capsys.readouterr()
    line = one_error_line(captured.err, chc, "sets no META keys", "python -m meta cluster")
    assert code == 2 and captured.out == "" and line.startswith(f"error: {chc}: ")
    for name in (p.name for p in (REPO / "configs" / "meta").glob("train_*.yaml")):
        assert config_kind_problem(str(REPO / "configs" / "meta" / name)) == "", name


def test_the_planner_refuses_a_yaml_alias_bomb(tmp_path, capsys):
    from gram_tools.plan import main

    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(_alias_bomb(9))
    assert main(["--config-file", str(bomb)]) == 2
    one_error_line(capsys, str(bomb), "YAML alias")


# ---------------------------------------------------------------- 7. the caps are config keys, one default each
CAPS = {"MAX_IMAGE_BYTES": 50 * 2**20, "MAX_IMAGE_PIXELS": 50_000_000, "MAX_IMAGE_ASPECT": 20.0}


def test_the_caps_are_keys_whose_defaults_are_the_module_constants():
    from meta.chc import imaging, sources
    from meta.data import input_limits

    inp = get_meta_cfg_default().CHC.INPUT
    assert {k: inp[k] for k in CAPS} == CAPS
    assert (sources.MAX_IMAGE_BYTES, imaging.MAX_PIXELS, imaging.MAX_ASPECT) == tuple(CAPS.values())
    assert (
        input_limits.image_caps(inp)
        == input_limits.image_caps({})
        == {
            "max_bytes": CAPS["MAX_IMAGE_BYTES"],
            "max_pixels": CAPS["MAX_IMAGE_PIXELS"],
            "max_aspect": CAPS["MAX_IMAGE_ASPECT"],
        }
    )
    # image features cached before the caps were keys keep their fingerprint at the defaults
    assert DECODE_RULE == "rgb8,exif-upright,max_pixels=50000000,max_aspect=20"
    assert input_limits.caps_away_from_defaults(input_limits.image_caps(inp)) == []
    assert input_limits.caps_away_from_defaults(input_limits.image_caps({"MAX_IMAGE_ASPECT": 50.0})) == [
        "max_aspect=50.0"
    ]


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("CHC.INPUT.MAX_IMAGE_BYTES", "0", "expected an integer >= 1, got 0"),
        ("CHC.INPUT.MAX_IMAGE_PIXELS", "-1", "expected an integer >= 1, got -1"),
        ("CHC.INPUT.MAX_IMAGE_ASPECT", "0.5", "expected a finite number >= 1.0, got 0.5"),
        ("CHC.INPUT.MAX_IMAGE_ASPECT", "1e400", "expected a finite number >= 1.0, got inf"),
    ],
)
def test_a_cap_out_of_range_is_one_line_naming_the_key_before_any_work(tmp_path, capsys, key, value, message):
    from meta.chc.cli import main

    (tmp_path / "m.csv").write_text("image,caption\na.png,a red square\n")
    code = main(tiny_chc_args(tmp_path / "out", "CHC.INPUT.MANIFEST", str(tmp_path / "m.csv"), key, value))
    assert code == 2 and one_error_line(capsys, key) == f"error: {key}: {message}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.csv"]  # nothing written


def _noise_png(size=(40, 40)) -> bytes:
    """An RGB PNG of random pixels: several KB (noise does not compress)."""
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (*size[::-1], 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def test_cluster_reads_the_caps_from_its_keys(tmp_path):
    """CHC's image stage: a tall 1-pixel-wide PNG over the aspect cap and a file over a byte cap set by its
    key are skipped and counted by reason; raising the aspect cap encodes the tall image (a new fingerprint)."""
    from meta.chc.pipeline import ChcRun

    rows = ["image,caption"]
    for i in range(4):
        (tmp_path / f"{i}.png").write_bytes(png_bytes((50 * i, 90, 200)))
        rows.append(f"{i}.png,a picture of thing {i}")
    (tmp_path / "tall.png").write_bytes(png_bytes(size=(1, 40)))  # 40:1, a few dozen bytes
    (tmp_path / "big.png").write_bytes(_noise_png())
    assert len((tmp_path / "big.png").read_bytes()) > 2000 > len((tmp_path / "tall.png").read_bytes())
    rows += ["tall.png,a tall thin line", "big.png,a noisy square"]
    (tmp_path / "m.csv").write_text("\n".join(rows) + "\n")

    def image_stage(*opts: str) -> tuple[str, dict]:
        argv = tiny_chc_args(tmp_path / "out", "CHC.INPUT.MANIFEST", str(tmp_path / "m.csv"), *opts)[1:]
        run = ChcRun(read_chc_settings(load_meta_cfg("", argv)), show_progress=False)
        index, index_fp = run.stage_index()
        fp = run.stage_image_features(index, index_fp)
        return fp, json.loads((tmp_path / "out" / "image_features" / "unreadable.json").read_text())

    fp, unreadable = image_stage("CHC.INPUT.MAX_IMAGE_BYTES", "2000")
    assert unreadable == {"file larger than 2000 bytes": 1, "aspect ratio above 20": 1}
    wider, unreadable = image_stage("CHC.INPUT.MAX_IMAGE_BYTES", "2000", "CHC.INPUT.MAX_IMAGE_ASPECT", "50.0")
    assert unreadable == {"file larger than 2000 bytes": 1} and wider != fp


def test_image_folder_source_reads_the_caps_from_its_keys(tiny_clip, tmp_path):
    """Meta-training on a labelled folder (``TASKS.SOURCE image_folder``): the same keys, the same counts, and
    the hierarchy's lazy loader keeps them (an over-cap image is never decoded later either)."""
    from meta.metatrain.data import load_task_hierarchy
    from meta.metatrain.settings import hierarchy_source

    for c, name in enumerate(("apple", "bridge")):
        (tmp_path / "data" / name).mkdir(parents=True)
        for k in range(3):
            (tmp_path / "data" / name / f"{k}.png").write_bytes(png_bytes((60 * k, 200 * c, 90)))
    (tmp_path / "data" / "apple" / "tall.png").write_bytes(png_bytes(size=(1, 40)))
    (tmp_path / "data" / "bridge" / "big.png").write_bytes(_noise_png())
    opts = ["TASKS.SOURCE", "image_folder", "TASKS.IMAGE_FOLDER", str(tmp_path / "data"), "META.PROGRESS", "False"]
    opts += ["MODEL.BACKBONE", "GRAM-Test-Tiny", "CHC.DOMAINS.NUM", "1", "CHC.DOMAINS.MIN_PER_DOMAIN", "1"]
    cfg = load_meta_cfg("", [*opts, "CHC.INPUT.MAX_IMAGE_BYTES", "2000"])
    h = load_task_hierarchy(hierarchy_source(cfg), *tiny_clip)
    assert h.meta["unreadable_by_reason"] == {"file larger than 2000 bytes": 1, "aspect ratio above 20": 1}
    assert h.meta["counts"]["images"] == 8 and h.meta["counts"]["unreadable_images"] == 2
    tall = [i for i, p in enumerate(h.image_loader.paths) if p.endswith("tall.png")]
    assert not h.images(tall).any() and h.images([0]).any()
    with pytest.raises(UserError, match=r"^CHC.INPUT.MAX_IMAGE_BYTES: expected an integer >= 1, got 0$"):
        load_task_hierarchy(hierarchy_source(load_meta_cfg("", [*opts, "CHC.INPUT.MAX_IMAGE_BYTES", "0"])), *tiny_clip)


def test_a_clustered_hierarchy_decodes_lazily_under_the_caps_it_recorded(tmp_path):
    from meta.chc.hierarchy import PairIndexImages
    from meta.data.input_limits import image_caps

    (tmp_path / "a.png").write_bytes(png_bytes(size=(20, 12)))  # 240 pixels
    (tmp_path / "m.csv").write_text("image,caption\na.png,a red square\n")
    index = build_index(manifest=str(tmp_path / "m.csv"), show_progress=False)
    assert PairIndexImages(index, 8)([0]).any()
    recorded = {"MAX_IMAGE_PIXELS": 200}  # hierarchy.json's meta.settings.CHC.INPUT of a run with a lower cap
    assert not PairIndexImages(index, 8, image_caps(recorded))([0]).any()


# ---------------------------------------------------------------- 8. init files: NaN, int32
def _with_nan(src: Path, dst: Path) -> Path:
    with safe_open(str(src), framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(str(src))
    tensors["prompt.ctx"][0, 0] = float("nan")
    save_file(tensors, str(dst), metadata=metadata)
    return dst


@pytest.mark.parametrize("bad", ["nan", "int32"])
def test_a_bad_init_file_is_one_line_naming_file_and_tensor(init_file, tmp_path, capsys, bad):  # noqa: F811
    """``python -m trainers.gram.export`` (its ``main``): NaN or an integer dtype -> one line, exit 2, no output."""
    from trainers.gram.export import main

    path = tmp_path / f"{bad}.safetensors"
    if bad == "nan":
        _with_nan(init_file, path)
        names = (str(path), "tensor prompt.ctx", "holds NaN or infinite values")
    else:
        resave_tensors(init_file, path, torch.int32, only="prompt.ctx")
        names = (str(path), "tensor prompt.ctx", "dtype int32 is not accepted", "expected float32")
    code = main([str(path), str(tmp_path / "out.pth")])
    one_error_line(capsys, *names)
    assert code == 2 and sorted(p.name for p in tmp_path.iterdir()) == [path.name]


# ---------------------------------------------------------------- 9. counts below their range (gram_tools)
@pytest.mark.parametrize(
    "tool, argv, flag, low, got",
    [
        ("bench", ["--way", "0"], "--way", 1, "0"),  # was: a traceback after ~30 s of building tasks
        ("bench", ["--repeats", "0"], "--repeats", 1, "0"),  # was: StatisticsError after the warm-up
        ("bench", ["--support-shots", "-1"], "--support-shots", 1, "-1"),
        ("bench_eval", ["--dataset", "unused", "--epochs", "-1"], "--epochs", 0, "-1"),
        ("bench_eval", ["--dataset", "unused", "--batch-size", "0"], "--batch-size", 1, "0"),
        ("chc_measure", ["--pairs", "0"], "--pairs", 1, "0"),
        ("chc_measure", ["--min-cluster-size", "1"], "--min-cluster-size", 2, "1"),
        ("chc_growth", ["--pairs", "10000", "0"], "--pairs", 1, "0"),  # was: `--one 0` ran the default sizes
        ("realsize", ["--repeats", "-1"], "--repeats", 1, "-1"),  # was: TypeError after the first learner
        ("profile_gpu", ["--steps", "0"], "--steps", 1, "0"),  # was: argparse's usage text, then the error
        ("profile_gpu", ["--top", "-3"], "--top", 1, "-3"),
        ("profile_gpu", ["--decode-images", "-1"], "--decode-images", 0, "-1"),
    ],
)
def test_a_count_out_of_range_is_one_line_before_any_work(tmp_path, monkeypatch, capsys, tool, argv, flag, low, got):
    import importlib

    monkeypatch.chdir(tmp_path)  # nothing may be written, not even a default output folder
    code = importlib.import_module(f"gram_tools.{tool}").main(argv)
    assert one_error_line(capsys, flag) == f"error: {flag}: expected an integer >= {low}, got {got}"
    assert code == 2 and list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- 10. the evaluator's numeric flags
@pytest.mark.parametrize(
    "argv, line",
    [
        # was: `error: TrainSpec.epochs must be >= 0, got -1`, the dataclass field instead of the flag
        (["--epochs", "-1"], "error: --epochs: expected an integer >= 0, got -1"),
        (["--batch-size", "0"], "error: --batch-size: expected an integer >= 1, got 0"),
        (["--aug-views", "0"], "error: --aug-views: expected an integer >= 1, got 0"),
        (["--vision-depth", "-1"], "error: --vision-depth: expected an integer >= 0, got -1"),
        (["--lr", "-0.1"], "error: --lr: expected a number >= 0, got -0.1"),
        (["--rrcrop-scale", "0.5", "0.2"], "error: --rrcrop-scale: expected LO HI with 0 < LO <= HI <= 1, got 0.5 0.2"),
    ],
)
def test_an_evaluator_flag_out_of_range_is_one_line_naming_the_flag(tmp_path, monkeypatch, capsys, argv, line):
    from meta.evaluation.cli import main

    monkeypatch.chdir(tmp_path)
    output = tmp_path / "out" / "runs.jsonl"
    code = main(["base2new", "--dataset", str(tmp_path / "unused"), "--output", str(output), *argv])
    assert one_error_line(capsys, argv[0]) == line
    assert code == 2 and list(tmp_path.iterdir()) == []  # refused before any dataset, model or output folder
