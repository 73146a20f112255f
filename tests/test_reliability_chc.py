"""Hostile-but-realistic CHC inputs, built on the fly: repeated shard keys, images of every Pillow mode,
manifests naming FIFOs / devices / deeply nested JSON, images repaired in place, bad settings and CHC
outputs damaged after they were written.  Each case failed before the rule it tests existed."""

import io
import json
import os
import signal
import tarfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from helpers import tiny_chc_args
from helpers_chc import add_member, png_bytes, write_shard
from PIL import Image

from meta.chc.errors import InputError
from meta.chc.imaging import decode_image_why
from meta.chc.settings import read_chc_settings
from meta.chc.sources import KIND_FILE, PairIndex, build_index, scan_manifest, scan_tar

RED, BLUE, GREEN = (220, 20, 20), (20, 20, 220), (20, 200, 20)


@contextmanager
def deadline(seconds: int):
    """Fail (instead of hanging) when the body blocks, e.g. on opening a FIFO."""

    def _raise(signum, frame):
        raise TimeoutError(f"blocked for more than {seconds} s")

    old = signal.signal(signal.SIGALRM, _raise)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _colour_at(path, offset: int, size: int) -> tuple:
    with open(path, "rb") as fh:
        fh.seek(offset)
        img, why = decode_image_why(fh.read(size))
    assert why == ""
    return img.getpixel((0, 0))


# ---------------------------------------------------------------- 1. repeated keys in a shard
def test_repeated_key_keeps_the_first_complete_pair_and_counts_the_rest(tmp_path):
    path = tmp_path / "dup.tar"
    with tarfile.open(path, "w") as tar:
        for name, data in (
            ("dup.png", png_bytes(RED)),
            ("dup.txt", b"first red square"),
            ("dup.png", png_bytes(BLUE)),
            ("dup.txt", b"second blue square"),
            ("solo.png", png_bytes(GREEN)),
            ("solo.txt", b"a green square"),
        ):
            add_member(tar, name, data)
    counts, issues = {}, []
    records = scan_tar(str(path), counts, issues)
    by_key = {r[0]: r for r in records}
    assert sorted(by_key) == ["dup", "solo"]
    _, off, size, caption, _ = by_key["dup"]
    assert caption == "first red square" and _colour_at(path, off, size) == RED  # never a mixed pair
    assert counts["skipped_duplicate_key"] == 1 and counts["pairs_seen"] == 3
    assert issues == [
        {
            "source": str(path),
            "problem": "key repeated in the shard (the first complete pair kept, the other member groups skipped)",
            "rows": 1,
            "keys": ["dup"],
        }
    ]
    from meta.chc.report import _issue_line, skipped_input_rows

    rows = skipped_input_rows(counts, issues, {}, 500)
    assert [(r["reason"].split(":")[0], r["count"]) for r in rows] == [("key repeated in a shard", 1)]
    assert _issue_line(issues[0]).endswith("1 member group(s), key(s) dup")


def test_repeated_key_whose_first_group_has_no_caption_pairs_the_complete_one(tmp_path):
    path = tmp_path / "dup.tar"
    with tarfile.open(path, "w") as tar:  # an image without caption, then a complete pair
        for name, data in (
            ("k.png", png_bytes(RED)),
            ("k.png", png_bytes(BLUE)),
            ("k.txt", b"a blue square"),
            ("k.png", png_bytes(GREEN)),
        ):
            add_member(tar, name, data)
    counts = {}
    (record,) = scan_tar(str(path), counts)
    assert record[3] == "a blue square" and _colour_at(path, record[1], record[2]) == BLUE
    assert counts["skipped_duplicate_key"] == 2 and counts.get("skipped_empty_caption", 0) == 0


def test_interleaved_members_of_different_keys_still_pair(tmp_path):
    path = tmp_path / "mixed.tar"
    with tarfile.open(path, "w") as tar:  # not contiguous, but no key repeats a kind: two pairs
        for name, data in (
            ("a.png", png_bytes(RED)),
            ("b.png", png_bytes(BLUE)),
            ("a.txt", b"red"),
            ("b.txt", b"blue"),
        ):
            add_member(tar, name, data)
    counts = {}
    recs = {r[0]: r for r in scan_tar(str(path), counts)}
    assert recs["a"][3] == "red" and _colour_at(path, *recs["a"][1:3]) == RED
    assert recs["b"][3] == "blue" and _colour_at(path, *recs["b"][1:3]) == BLUE
    assert counts.get("skipped_duplicate_key", 0) == 0


# ---------------------------------------------------------------- 2. decoding by mode
def _encode(img: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def _decoded(data: bytes) -> np.ndarray:
    img, why = decode_image_why(data)
    assert why == "", why
    assert img.mode == "RGB"
    return np.asarray(img).astype(np.int64)


def test_sixteen_bit_greyscale_png_keeps_its_ramp():
    ramp = np.linspace(0, 65535, 256).round().astype(np.uint16)[None].repeat(4, 0)  # [4, 256]
    data = _encode(Image.fromarray(ramp))
    assert Image.open(io.BytesIO(data)).mode == "I;16"
    px = _decoded(data)
    expected = (ramp.astype(np.int64) * 255 + 32767) // 65535
    assert np.array_equal(px[..., 0], expected) and np.array_equal(px[..., 1], px[..., 2])
    assert px[0, 0, 0] == 0 and px[0, -1, 0] == 255 and abs(px.mean() - 127.5) < 0.6  # was 254.99 (white)


@pytest.mark.parametrize("mode", ["I;16B", "I"])
def test_other_sixteen_bit_modes(mode):
    from meta.data.image_decode import to_rgb8

    values = np.array([[0, 257, 257 * 100, 65535]], dtype=np.int64)
    img = Image.new(mode, (4, 1))
    for x, v in enumerate(values[0]):
        img.putpixel((x, 0), int(v))
    assert np.asarray(to_rgb8(img))[0, :, 0].tolist() == [0, 1, 100, 255]


def test_float_image_in_unit_range_and_in_byte_range():
    from meta.data.image_decode import to_rgb8

    unit = Image.fromarray(np.array([[0.0, 0.25, 1.0, np.nan]], dtype=np.float32), mode="F")
    assert np.asarray(to_rgb8(unit))[0, :, 0].tolist() == [0, 64, 255, 0]  # was 0, 0, 1, 0
    byte = Image.fromarray(np.array([[0.0, 17.0, 200.0, 300.0]], dtype=np.float32), mode="F")
    assert np.asarray(to_rgb8(byte))[0, :, 0].tolist() == [0, 17, 200, 255]


def test_alpha_is_composited_over_white():
    rgba = np.zeros((1, 3, 4), dtype=np.uint8)
    rgba[0, 0] = (200, 10, 10, 255)  # opaque red
    rgba[0, 1] = (0, 0, 0, 0)  # fully transparent black: shown white
    rgba[0, 2] = (0, 0, 0, 128)  # half-transparent black: grey
    px = _decoded(_encode(Image.fromarray(rgba, "RGBA")))
    assert px[0, 0].tolist() == [200, 10, 10] and px[0, 1].tolist() == [255, 255, 255]
    assert np.all(np.abs(px[0, 2] - 127) <= 1)
    la = Image.fromarray(np.array([[[0, 0], [60, 255]]], dtype=np.uint8), "LA")
    assert _decoded(_encode(la))[0, :, 0].tolist() == [255, 60]


def test_palette_with_transparency_cmyk_and_one_bit():
    pal = Image.new("P", (2, 1))
    pal.putpalette([0, 0, 0, 10, 200, 30] + [0] * 762)
    pal.putpixel((0, 0), 0), pal.putpixel((1, 0), 1)
    assert _decoded(_encode(pal))[0].tolist() == [[0, 0, 0], [10, 200, 30]]
    assert _decoded(_encode(pal, transparency=0))[0].tolist() == [[255, 255, 255], [10, 200, 30]]
    cmyk = Image.new("CMYK", (2, 1), (255, 0, 0, 0))
    cmyk.putpixel((1, 0), (0, 0, 0, 255))
    assert _decoded(_encode(cmyk, "TIFF"))[0].tolist() == [[0, 255, 255], [0, 0, 0]]
    bits = Image.new("1", (2, 1), 0)
    bits.putpixel((1, 0), 1)
    assert _decoded(_encode(bits))[0].tolist() == [[0, 0, 0], [255, 255, 255]]


def test_evaluation_loader_decodes_by_mode_too(tmp_path):
    from meta.evaluation.images import ImageLoader

    ramp = np.linspace(0, 65535, 64).round().astype(np.uint16)[None].repeat(4, 0)  # 64 x 4: inside the aspect cap
    path = tmp_path / "ramp16.png"
    Image.fromarray(ramp).save(path)
    px = np.asarray(ImageLoader.decode(str(path))).astype(np.int64)
    assert px.shape == (4, 64, 3) and px[0, 0, 0] == 0 and px[0, -1, 0] == 255 and abs(px.mean() - 127.5) < 2


# ---------------------------------------------------------------- 3. manifests that could kill or hang a run
def test_deeply_nested_jsonl_line_is_an_invalid_row(tmp_path):
    (tmp_path / "a.png").write_bytes(png_bytes())
    deep = "[" * 200_000 + "]" * 200_000
    (tmp_path / "m.jsonl").write_text(
        json.dumps({"image": "a.png", "caption": "one red square"})
        + "\n"
        + deep
        + "\n"
        + json.dumps({"image": "a.png", "caption": "another red square"})
        + "\n"
    )
    counts, issues = {}, []
    recs = scan_manifest(str(tmp_path / "m.jsonl"), "image", "caption", "", counts, issues)
    assert [r[2] for r in recs] == ["one red square", "another red square"]
    assert counts["skipped_invalid_row"] == 1 and counts["pairs_seen"] == 3
    assert issues[0]["problem"] == "JSON nested too deep to read" and issues[0]["lines"] == [2]


def test_manifest_rows_naming_special_files_are_skipped_and_never_opened(tmp_path):
    (tmp_path / "a.png").write_bytes(png_bytes(RED))
    os.mkfifo(tmp_path / "fifo.png")
    (tmp_path / "folder.png").mkdir()
    os.symlink("/dev/zero", tmp_path / "zero.png")
    rows = [
        "image,caption",
        "a.png,a red square",
        "fifo.png,a pipe",
        "/dev/zero,endless zeros",
        "zero.png,a link to a device",
        "folder.png,a folder",
        "missing.png,no file yet",
    ]
    (tmp_path / "m.csv").write_text("\n".join(rows) + "\n")
    with deadline(20):
        index = build_index(manifest=str(tmp_path / "m.csv"), show_progress=False)
        reasons: list = []
        blobs = index.read_image_bytes(range(len(index)), reasons)
    assert index.captions == ["a red square", "no file yet"]
    assert index.counts["skipped_not_regular_file"] == 4
    problems = {i["problem"]: i["lines"] for i in index.issues}
    assert problems["image is not a regular file (FIFO; never opened)"] == [3]
    assert problems["image is not a regular file (character device; never opened)"] == [4, 5]
    assert problems["image is not a regular file (folder; never opened)"] == [6]
    assert blobs[0] == png_bytes(RED) and blobs[1] is None and reasons == ["", "FileNotFoundError"]
    assert len(index.special_files) == 4


def test_reading_a_path_replaced_by_a_fifo_or_device_after_indexing(tmp_path):
    """The index said regular file; by the time the images are read it is a FIFO or a device."""
    os.mkfifo(tmp_path / "fifo.png")
    paths = [str(tmp_path / "fifo.png"), "/dev/zero"]
    index = PairIndex(
        sources=["m.csv"],
        source_kind=np.array([KIND_FILE], dtype=np.int8),
        item_source=np.zeros(2, dtype=np.int32),
        item_offset=np.full(2, -1, dtype=np.int64),
        item_size=np.full(2, -1, dtype=np.int64),
        item_key=["0", "1"],
        item_path=paths,
        captions=["x", "y"],
        meta_json=["", ""],
    )
    reasons: list = []
    with deadline(20):
        assert index.read_image_bytes([0, 1], reasons) == [None, None]
    assert reasons == ["not a regular file", "not a regular file"]


def test_shards_naming_special_files_are_skipped_and_never_opened(tmp_path):
    """A shard glob that matches a FIFO, a link to /dev/zero or /dev/urandom, or a folder: each is counted and listed,
    never opened (tarfile.open blocked on the FIFO and read the devices for ever), and the regular shard is indexed."""
    from meta.chc.report import _issue_line, skipped_input_rows

    write_shard(tmp_path / "s-0.tar", ["a red square", "a blue square"], [png_bytes(RED), png_bytes(BLUE)])
    os.mkfifo(tmp_path / "s-1.tar")
    os.symlink("/dev/zero", tmp_path / "s-2.tar")
    os.symlink("/dev/urandom", tmp_path / "s-3.tar")
    (tmp_path / "s-4.tar").mkdir()
    with deadline(20):
        index = build_index(shards=[str(tmp_path / "s-*.tar")], show_progress=False)
    assert index.captions == ["a red square", "a blue square"]
    assert index.counts["shards_not_regular_file"] == 4 and index.counts["corrupt_shards"] == 0
    problems = {os.path.basename(i["source"]): i["problem"] for i in index.issues}
    assert problems == {
        "s-1.tar": "shard is not a regular file (FIFO; never opened)",
        "s-2.tar": "shard is not a regular file (character device; never opened)",
        "s-3.tar": "shard is not a regular file (character device; never opened)",
        "s-4.tar": "shard is not a regular file (folder; never opened)",
    }
    rows = skipped_input_rows(index.counts, index.issues, {}, 500)
    row = next(r for r in rows if r["action"] == "shard skipped (never opened)")
    assert row["count"] == 4 and "FIFO" in row["reason"]
    fifo = next(i for i in index.issues if i["source"].endswith("s-1.tar"))
    assert _issue_line(fifo) == f"- {tmp_path / 's-1.tar'}: shard is not a regular file (FIFO; never opened)"


def test_a_shard_replaced_by_a_fifo_after_indexing_makes_its_images_unreadable_not_a_hang(tmp_path):
    write_shard(tmp_path / "s-0.tar", ["a red square", "a blue square"], [png_bytes(RED), png_bytes(BLUE)])
    index = build_index(shards=[str(tmp_path / "s-*.tar")], show_progress=False)
    (tmp_path / "s-0.tar").unlink()
    os.mkfifo(tmp_path / "s-0.tar")
    reasons: list = []
    with deadline(20):
        assert index.read_image_bytes([0, 1], reasons) == [None, None]
    assert reasons == ["not a regular file", "not a regular file"]


def test_manifest_that_is_not_a_regular_file_is_one_line(tmp_path):
    os.mkfifo(tmp_path / "m.csv")
    with deadline(20), pytest.raises(FileNotFoundError, match=r"^CHC.INPUT.MANIFEST: not a regular file \(FIFO\)"):
        build_index(manifest=str(tmp_path / "m.csv"), show_progress=False)


# ---------------------------------------------------------------- 4. repaired inputs are read again
def _cfg(tmp_path, **chc):
    from meta.config import get_meta_cfg_default

    cfg = get_meta_cfg_default()
    cfg.MODEL.BACKBONE, cfg.MODEL.DEVICE = "GRAM-Test-Tiny", "cpu"
    cfg.CHC.OUTPUT_DIR = str(tmp_path / "out")
    for key, value in chc.items():
        node, name = cfg.CHC, key.split(".")
        for part in name[:-1]:
            node = node[part]
        node[name[-1]] = value
    return cfg


def _features(cfg):
    from meta.chc.pipeline import ChcRun

    run = ChcRun(read_chc_settings(cfg), show_progress=False)
    run.out.mkdir(parents=True, exist_ok=True)
    index, index_fp = run.stage_index()
    run.stage_image_features(index, index_fp)
    return index_fp, np.load(run.out / "image_features" / "image_ok.npy")


def test_images_repaired_in_place_are_read_again(tmp_path):
    img = tmp_path / "img"
    img.mkdir()
    for i in range(12):
        (img / f"{i}.png").write_bytes(png_bytes((i * 20, 60, 90)))
    for i in (3, 7):
        (img / f"{i}.png").write_bytes(b"not a png")  # corrupt
    (tmp_path / "m.csv").write_text("image,caption\n" + "".join(f"img/{i}.png,square {i}\n" for i in range(12)))
    cfg = _cfg(tmp_path, **{"INPUT.MANIFEST": str(tmp_path / "m.csv")})
    fp1, ok = _features(cfg)
    assert np.flatnonzero(~ok).tolist() == [3, 7]
    fp_again, ok_again = _features(cfg)  # nothing changed: cached
    assert fp_again == fp1 and np.array_equal(ok_again, ok)
    for i in (3, 7):
        (img / f"{i}.png").write_bytes(png_bytes((i * 20, 60, 90)))  # repaired in place
    fp2, ok = _features(cfg)
    assert fp2 != fp1 and ok.all()
    os.remove(img / "5.png")  # and a file that goes away
    fp3, ok = _features(cfg)
    assert fp3 != fp2 and np.flatnonzero(~ok).tolist() == [5]


def test_special_file_replaced_by_an_image_is_indexed_again(tmp_path):
    from meta.chc.pipeline import ChcRun

    for i in range(3):
        (tmp_path / f"{i}.png").write_bytes(png_bytes((i * 50, 0, 0)))
    os.mkfifo(tmp_path / "3.png")
    (tmp_path / "m.csv").write_text("image,caption\n" + "".join(f"{i}.png,square {i}\n" for i in range(4)))
    cfg = _cfg(tmp_path, **{"INPUT.MANIFEST": str(tmp_path / "m.csv")})
    run = ChcRun(read_chc_settings(cfg), show_progress=False)
    run.out.mkdir(parents=True)
    assert len(run.stage_index()[0]) == 3
    os.remove(tmp_path / "3.png")
    (tmp_path / "3.png").write_bytes(png_bytes((0, 0, 150)))
    assert len(ChcRun(read_chc_settings(cfg), show_progress=False).stage_index()[0]) == 4


def test_shard_only_index_fingerprint_is_unchanged(tmp_path):
    """Shards carry no per-file stamps: the fingerprint cached runs were made with still holds."""
    from meta.chc.pipeline import ChcRun, index_settings
    from meta.chc.stages import fingerprint

    shard = write_shard(tmp_path / "s.tar", ["a red square", "a blue square"])
    cfg = _cfg(tmp_path, **{"INPUT.SHARDS": [str(shard)]})
    run = ChcRun(read_chc_settings(cfg), show_progress=False)
    run.out.mkdir(parents=True)
    _, fp = run.stage_index()
    st = os.stat(shard)
    assert fp == fingerprint("index", index_settings(cfg.CHC.INPUT), [[str(shard), st.st_size, int(st.st_mtime)]])


# ---------------------------------------------------------------- 6. settings checked before any work
def _cli(tmp_path, *opts):
    from meta.chc.cli import main

    return main(tiny_chc_args(tmp_path / "out", *opts))


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("CHC.IMAGES.BATCH_SIZE", "0", "expected an integer >= 1, got 0"),  # was: range() arg 3 ...
        ("CHC.TEXT.CHUNK_SIZE", "-5", "expected an integer >= 1, got -5"),  # was: negative dimensions
        ("CHC.TOPICS.MIN_CLUSTER_SIZE", "1", "expected an integer >= 2, got 1"),  # was: hdbscan, after 34 s
        ("CHC.OUTPUT_DIR", "", "expected a folder path, got '' (an empty path would write into the current folder)"),
        ("CHC.INPUT.MAX_UNREADABLE_FRACTION", "1.5", "expected a finite number in [0.0, 1.0], got 1.5"),
        ("CHC.FILTER.MODE", "'median'", "expected one of none|threshold|quantile, got 'median'"),
        ("CHC.FILTER.TEMPLATE", "'a photo'", "expected text with one '{}' for the caption, got 'a photo'"),
        ("CHC.TOPICS.FIT_SAMPLE", "10", "expected >= CHC.TOPICS.MIN_CLUSTER_SIZE (20), got 10"),
        ("CHC.DOMAINS.NUM", "0", "expected an integer >= 1, got 0"),
    ],
)
def test_bad_setting_is_one_line_naming_the_key_before_any_work(tmp_path, capsys, monkeypatch, key, value, message):
    (tmp_path / "m.csv").write_text("image,caption\na.png,a red square\n")
    monkeypatch.chdir(tmp_path)  # where CHC.OUTPUT_DIR '' used to write
    code = _cli(tmp_path, "CHC.INPUT.MANIFEST", str(tmp_path / "m.csv"), key, value)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"error: {key}: {message}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.csv"]  # nothing written


def test_every_numeric_chc_key_has_a_range():
    from meta.chc.settings import INT_RANGES, REAL_RANGES, check_chc_cfg
    from meta.config import get_meta_cfg_default

    cfg = get_meta_cfg_default()
    numeric = []

    def walk(node, prefix):
        for k, v in node.items():
            if hasattr(v, "items"):
                walk(v, f"{prefix}{k}.")
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                numeric.append(f"{prefix}{k}")

    walk(cfg.CHC, "")
    assert numeric and sorted(numeric) == sorted([*INT_RANGES, *REAL_RANGES])
    check_chc_cfg(cfg)  # the defaults pass
    cfg.CHC.IMAGES.CACHE_MAX_GB = float("nan")
    with pytest.raises(ValueError, match=r"^CHC.IMAGES.CACHE_MAX_GB: expected a finite number >= 0.0, got nan"):
        check_chc_cfg(cfg)
    cfg.CHC.IMAGES.CACHE_MAX_GB = 2.0
    cfg.CHC.IMAGES.DECODER = "nvjpeg"  # the device decides nvJPEG; the key names the library
    with pytest.raises(ValueError, match=r"^CHC.IMAGES.DECODER: expected one of pil\|torchvision, got 'nvjpeg'$"):
        check_chc_cfg(cfg)


def test_image_folder_hierarchy_checks_the_chc_keys_it_uses(tiny_clip, tmp_path):
    from meta.chc.image_folder import build_image_folder_hierarchy

    (tmp_path / "d" / "apple").mkdir(parents=True)
    (tmp_path / "d" / "apple" / "0.png").write_bytes(png_bytes())
    with pytest.raises(ValueError, match=r"^CHC.IMAGES.BATCH_SIZE: expected an integer >= 1, got 0$"):
        build_image_folder_hierarchy(tmp_path / "d", tiny_clip[0], batch_size=0, show_progress=False)
    with pytest.raises(ValueError, match=r"^CHC.DOMAINS.NUM: expected an integer >= 1, got 0$"):
        build_image_folder_hierarchy(tmp_path / "d", tiny_clip[0], num_domains=0, show_progress=False)


def test_shipped_chc_configs_pass_the_checks():
    from pathlib import Path

    from meta.chc.settings import check_chc_cfg
    from meta.config import load_meta_cfg

    for path in sorted(Path(__file__).resolve().parents[1].glob("configs/meta/chc_*.yaml")):
        check_chc_cfg(load_meta_cfg(str(path)))


# ---------------------------------------------------------------- 6. damaged CHC outputs
@pytest.fixture
def finished_output(tmp_path):
    """A CHC output folder as `meta cluster` leaves it (3 pairs, 1 topic), written by hand."""
    shard = write_shard(tmp_path / "s.tar", ["a red square", "a blue square", "a green square"])
    out = tmp_path / "out"
    build_index([str(shard)], show_progress=False).save(out / "index")
    (out / "image_features").mkdir(parents=True)
    np.save(out / "image_features" / "image_features.npy", np.eye(3, 8, dtype=np.float32))
    np.save(out / "item_topic.npy", np.zeros(3, dtype=np.int64))
    np.save(out / "item_domain.npy", np.zeros(3, dtype=np.int64))
    (out / "hierarchy.json").write_text(json.dumps({"topic_names": ["square"], "meta": {"image_size": 16}}))
    return out


def _one_line_error(fn) -> list:
    import contextlib
    import io as _io

    from meta.infra.cli_errors import run_cli

    buf = _io.StringIO()
    with contextlib.redirect_stderr(buf):
        code = run_cli(lambda argv: fn(), [])
    assert code == 2
    return buf.getvalue().strip().splitlines()


def test_garbled_or_cut_outputs_name_the_file_and_what_was_expected(finished_output):
    from meta.chc import load_hierarchy

    out = finished_output
    h = load_hierarchy(out)
    assert h.topic_names == ["square"] and h.image_features.shape == (3, 8) and h.images([0]).shape == (1, 16, 16, 3)
    feats = out / "image_features" / "image_features.npy"
    good = feats.read_bytes()
    feats.write_bytes(good[:-40])  # cut short
    (line,) = _one_line_error(lambda: load_hierarchy(out))
    assert line.startswith(f"error: {feats}: truncated or not a .npy array (")
    assert f"expected float32 [3, D] CLIP image features; delete {out / 'image_features.done.json'} and rerun" in line
    np.save(feats, np.zeros((2, 8), dtype=np.float32))  # wrong shape
    (line,) = _one_line_error(lambda: load_hierarchy(out))
    assert line.startswith(f"error: {feats}: holds shape (2, 8), 2 rows, not 3; expected float32 [3, D]")
    feats.write_bytes(good)
    head = out / "hierarchy.json"
    head.write_text('{"topic_names": ["square"], "meta": ')  # garbled
    (line,) = _one_line_error(lambda: load_hierarchy(out))
    assert line.startswith(
        f"error: {head}: not valid JSON (Expecting value: line 1 column 37); expected a JSON object with 'topic_names'"
    )
    head.write_text(json.dumps(["square"]))  # valid JSON, wrong content
    (line,) = _one_line_error(lambda: load_hierarchy(out))
    assert line.startswith(f"error: {head}: does not hold a JSON object with 'topic_names'")
    head.write_text(json.dumps({"topic_names": ["square"], "meta": {"image_size": 16}}))
    (out / "index" / "items.jsonl").write_text('["0000", "", "a red square", ""]\n')  # 1 pair, not 3
    (line,) = _one_line_error(lambda: load_hierarchy(out))
    assert line.startswith(f"error: {out / 'index'}: items.jsonl holds 1 pairs, items.npz 3")


def test_caption_and_metadata_members_over_the_field_cap_are_never_read(tmp_path):
    """A 300 MiB caption member took 5 GiB of memory to index; now a member over CHC.INPUT.MAX_FIELD_CHARS bytes is
    not read: a caption skips its pair, a metadata member is dropped from a pair that is kept; both counted and
    listed.  Members at the cap are read as before."""
    from meta.chc.report import skipped_input_rows

    cap = 64
    path = tmp_path / "s-0.tar"
    with tarfile.open(path, "w") as tar:
        for key, caption, meta in [
            ("a", b"a red square", b"{}"),
            ("b", b"word " * 13, b"{}"),  # 65 bytes: over
            ("c", b"x" * cap, b'{"k": "' + b"v" * cap + b'"}'),  # caption at the cap; metadata over
            ("d", b"a blue square", b"{}"),
        ]:
            add_member(tar, f"{key}.png", png_bytes(RED))
            add_member(tar, f"{key}.txt", caption)
            add_member(tar, f"{key}.json", meta)
    counts: dict = {}
    issues: list = []
    records = scan_tar(str(path), counts, issues, max_text_bytes=cap)
    assert [(r[0], r[3], r[4]) for r in records] == [
        ("a", "a red square", "{}"),
        ("c", "x" * cap, ""),
        ("d", "a blue square", "{}"),
    ]
    assert counts["skipped_caption_too_long"] == 1 and counts["metadata_too_long_dropped"] == 1
    problems = {i["problem"]: i["keys"] for i in issues}
    assert problems == {
        f"caption member larger than CHC.INPUT.MAX_FIELD_CHARS={cap} bytes (never read)": ["b"],
        f"metadata member larger than CHC.INPUT.MAX_FIELD_CHARS={cap} bytes (never read)": ["c"],
    }
    reasons = {r["reason"]: r["count"] for r in skipped_input_rows(counts, issues, {}, 500)}
    assert reasons["shard caption member over CHC.INPUT.MAX_FIELD_CHARS bytes"] == 1
    # build_index passes the key's value: the default reads all four
    index = build_index(shards=[str(path)], show_progress=False)
    assert len(index) == 4 and "skipped_caption_too_long" not in index.counts
    index = build_index(shards=[str(path)], show_progress=False, max_field_chars=cap)
    assert index.item_key == ["a", "c", "d"]


def test_manifest_lines_over_the_line_cap_are_skipped_unread_in_jsonl_and_one_line_in_csv(tmp_path, monkeypatch):
    """A JSON array on one line (a 300 MB one took 1.9 GB to read and parse) is not read: a JSONL line longer than
    4 x CHC.INPUT.MAX_FIELD_CHARS + 64 KiB bytes is a skipped row, the lines after it are read; in a CSV it is a
    one-line error naming file and line.  Nothing longer than the cap is ever held whole."""
    from meta.chc import sources

    (tmp_path / "a.png").write_bytes(png_bytes(RED))
    (tmp_path / "b.png").write_bytes(png_bytes(BLUE))
    cap_chars = 10
    limit = sources.max_line_bytes(cap_chars)
    huge = json.dumps([{"image": "a.png", "caption": "x" * 50}] * 40_000)  # 3 MB on one line
    assert len(huge) > 2 * (1 << 20) > limit
    rows = [json.dumps({"image": "a.png", "caption": "red"}), huge, json.dumps({"image": "b.png", "caption": "blue"})]
    (tmp_path / "m.jsonl").write_text("\n".join(rows) + "\n")
    longest: list = []

    class Recording(io.BytesIO):  # the manifest's bytes, recording how much each read returns
        def readline(self, size=-1):
            line = super().readline(size)
            longest.append(len(line))
            return line

        def __iter__(self):
            raise AssertionError("a manifest is read with readline(limit), not line by line whole")

    monkeypatch.setattr(sources, "open", lambda path, mode: Recording(Path(path).read_bytes()), raising=False)
    index = build_index(manifest=str(tmp_path / "m.jsonl"), show_progress=False, max_field_chars=cap_chars)
    monkeypatch.undo()
    assert index.captions == ["red", "blue"] and index.counts["skipped_invalid_row"] == 1
    assert max(longest) <= 1 << 20 and limit + 1 in longest  # the long line was read in pieces, never whole
    problems = {i["problem"]: i["lines"] for i in index.issues}
    assert problems == {f"line longer than {limit} bytes, not read (one JSON object per line?)": [2]}
    (tmp_path / "m.csv").write_text("image,caption\na.png,red\nb.png," + "y" * (limit + 5) + "\n")
    with pytest.raises(InputError, match=rf"^{tmp_path}/m.csv:3: a line longer than {limit} bytes, not read"):
        build_index(manifest=str(tmp_path / "m.csv"), show_progress=False, max_field_chars=cap_chars)
