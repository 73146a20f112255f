"""Hostile inputs: no image counted twice or seen sideways, no input that eats the machine.

Each hostile input is built small in ``tmp_path``: a symbolic link back to the image-folder root,
photos with an EXIF Orientation tag, a 60000x1 PNG, a PNG header claiming 60 M pixels, a sparse
60 MiB ``.jpg``, a 9-level YAML alias bomb.
"""

import io
import os
import struct
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from helpers_chc import png_bytes
from PIL import Image

from meta.chc.imaging import MAX_PIXELS, decode_batch, decode_image_why, to_clip_uint8
from meta.chc.sources import MAX_IMAGE_BYTES, build_index, read_regular_file
from meta.cli_errors import UserError
from meta.config import load_meta_cfg


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


@pytest.mark.parametrize(
    "name", sorted(p.name for p in (Path(__file__).parents[1] / "configs" / "meta").glob("*.yaml"))
)
def test_the_shipped_meta_configs_still_load(name):
    load_meta_cfg(str(Path(__file__).parents[1] / "configs" / "meta" / name))
