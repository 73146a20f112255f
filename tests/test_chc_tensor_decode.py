"""CHC.IMAGES.DECODER torchvision (meta/chc/tensor_decode.py) against the reference decoder (Pillow,
meta.chc.imaging.decode_batch): the same images decode, with the same reasons for the others; pixels within a level
or two; EXIF orientation turned as Pillow turns it; image features at cosine >= 0.999.  On CPU (libjpeg-turbo) here;
the ``gpu`` test repeats the comparison with nvJPEG batches on CUDA."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from meta.chc.imaging import decode_batch, encode_images
from meta.chc.tensor_decode import decode_batch_tensor, orient
from meta.data.image_decode import EXIF_ORIENTATION, UPRIGHT


def _jpeg(w: int, h: int, seed: int = 0, mode: str = "RGB", orientation: int = 0, **save) -> bytes:
    """A photo-like JPEG: low-frequency colour noise upsampled to ``w x h`` (quality 90 unless ``save`` says)."""
    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (h // 16 + 2, w // 16 + 2, 3), dtype=np.uint8))
    img = img.resize((w, h), Image.BICUBIC).convert(mode)
    if orientation:
        exif = Image.Exif()
        exif[EXIF_ORIENTATION] = orientation
        save["exif"] = exif.tobytes()
    buf = io.BytesIO()
    img.save(buf, "JPEG", **{"quality": 90, **save})
    return buf.getvalue()


def _png(w: int, h: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((h, w, 3), 90, dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _both(blobs, size=64, device="cpu", **caps):
    why_ref, why_new = [], []
    ref, ok_ref = decode_batch(blobs, size, 0, why_ref, **caps)
    new, ok_new = decode_batch_tensor(blobs, size, device, 2, why_new, **caps)
    return ref, ok_ref, why_ref, new.cpu().numpy(), ok_new, why_new


def test_the_same_images_decode_with_the_same_reasons_and_nearly_the_same_pixels():
    good = _jpeg(500, 375)  # CC3M's typical size
    blobs = [
        good,
        good[: len(good) // 2],  # cut in the middle of the scan
        good[:200],  # header only
        b"",
        None,
        b"not an image at all",
        _jpeg(300, 200, mode="L"),  # greyscale JPEG: batched
        _jpeg(300, 200, mode="CMYK"),  # CMYK JPEG: the reference decodes it
        _jpeg(380, 290, seed=1, progressive=True),
        _png(60, 50),  # not a JPEG: the reference
        _jpeg(2000, 100),  # aspect 20: at the cap, decoded
        _jpeg(2100, 100),  # aspect 21: refused from the header
        _jpeg(64, 64, seed=2),  # already the target size: cropped only
    ]
    ref, ok_ref, why_ref, new, ok_new, why_new = _both(blobs, max_pixels=2_000_000, max_aspect=20.0)
    assert ok_new.tolist() == ok_ref.tolist() == [1, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 0, 1]
    assert (
        why_new == why_ref and why_ref[11] == "aspect ratio above 20" and why_ref[3] == why_ref[4] == "no image bytes"
    )
    diff = np.abs(ref.astype(int) - new.astype(int))
    assert diff[~ok_ref].max() == 0 and new[~ok_new].max() == 0  # zeros where unreadable
    assert diff.max() <= 2
    assert diff[ok_ref].mean() < 0.3
    assert np.array_equal(new[12], ref[12])  # no resize: the decoders agree to the bit here
    # the pixel cap is read from the header, before any decode
    _, ok_ref, why_ref, _, ok_new, why_new = _both([good], max_pixels=500 * 375 - 1)
    assert not ok_new[0] and why_new == why_ref == [f"more than {500 * 375 - 1} pixels"]


@pytest.mark.parametrize("orientation", sorted(UPRIGHT))
def test_exif_orientation_turns_the_image_as_pillow_does(orientation):
    blob = _jpeg(120, 72, seed=orientation, orientation=orientation)  # not square: a transpose changes the shape
    ref, ok_ref, _, new, ok_new, _ = _both([blob], size=48)
    assert ok_ref[0] and ok_new[0]
    assert np.abs(ref.astype(int) - new.astype(int)).max() <= 2
    # the tensor operation alone equals Pillow's transpose, to the bit
    arr = np.random.default_rng(orientation).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    turned = orient(torch.from_numpy(arr).permute(2, 0, 1), orientation).permute(1, 2, 0).numpy()
    assert np.array_equal(turned, np.asarray(Image.fromarray(arr).transpose(UPRIGHT[orientation])))


def _features_agree(tiny_clip, device):
    clip, dims = tiny_clip
    size = dims.image_size
    blobs = [_jpeg(500, 375, seed=s, orientation=(s % 8) + 1) for s in range(12)]
    ref, ok = decode_batch(blobs, size)
    new, ok_new = decode_batch_tensor(blobs, size, device)
    assert ok.all() and ok_new.all()
    model = clip.to(device)
    try:
        a = encode_images(model, ref, (0.48, 0.46, 0.41), (0.27, 0.26, 0.28), device=device)
        b = encode_images(model, new, (0.48, 0.46, 0.41), (0.27, 0.26, 0.28), device=device)
    finally:
        clip.to("cpu")
    cos = (a * b).sum(axis=1)
    assert cos.min() >= 0.999, cos


def test_image_features_of_both_decoders_agree(tiny_clip):
    _features_agree(tiny_clip, "cpu")


@pytest.mark.gpu
def test_nvjpeg_batches_give_the_references_images_and_features(tiny_clip):
    if not torch.cuda.is_available():
        pytest.skip("CUDA not available")
    blobs = [_jpeg(500, 375, seed=s) for s in range(8)] + [b"broken", _png(40, 30), _jpeg(300, 200, mode="CMYK")]
    ref, ok_ref, why_ref, new, ok_new, why_new = _both(blobs, size=224, device="cuda")
    assert ok_new.tolist() == ok_ref.tolist() and why_new == why_ref
    assert np.abs(ref.astype(int) - new.astype(int)).mean() < 1.0  # nvJPEG's IDCT differs a little from libjpeg's
    _features_agree(tiny_clip, "cuda")


def test_the_gpu_profilers_chc_probe_runs_the_stages_decoder_and_tower_on_cpu():
    from gram_tools.profile_gpu import chc_rates, synthetic_jpegs

    for decoder in ("torchvision", "pil"):  # the stage's own encode_rank, end to end
        rates = chc_rates(
            synthetic_jpegs(4, 120, 90), batch=2, device="cpu", model="GRAM-Test-Tiny", autocast="none", decoder=decoder
        )
        assert rates["image_size"] == 32 and rates["model"] == "GRAM-Test-Tiny" and rates["decoder"] == decoder
        assert rates["chc_decoder_batch2_img_s"] > 0 and rates["chc_end_to_end_batch2_img_s"] > 0


def test_large_photos_are_decoded_in_runs_of_bounded_pixels(monkeypatch):
    import meta.chc.tensor_decode as td

    assert td.pixel_batches([3, 5, 8, 9], [40, 70, 30, 10], 100) == [[3], [5, 8], [9]]
    assert td.pixel_batches([1, 2], [500, 10], 100) == [[1], [2]]  # one image above the budget: alone
    seen = []
    real = td._decode_jpegs
    monkeypatch.setattr(td, "_decode_jpegs", lambda blobs, device: seen.append(len(blobs)) or real(blobs, device))
    monkeypatch.setattr(td, "DECODE_BATCH_PIXELS", 2 * 200 * 150)
    blobs = [_jpeg(200, 150, seed=s) for s in range(5)]
    ref, ok_ref, _, new, ok_new, _ = _both(blobs, size=32)
    assert seen == [2, 2, 1] and ok_new.all() and np.abs(ref.astype(int) - new.astype(int)).max() <= 2


@pytest.mark.parametrize("decoder", ["pil", "torchvision"])
def test_the_next_chunk_is_decoded_while_this_one_is_encoded(tiny_clip, tmp_path, monkeypatch, decoder):
    """CHC's image stage decodes chunk k+1 in its background thread while chunk k is encoded: the encoder of each
    chunk waits until the next chunk's decode has run (a run that decoded on the encoder's path would time out), and
    the features equal those of one chunk."""
    import threading

    from gram_tools.profile_gpu import InMemoryImages
    from meta.chc import image_features
    from meta.chc.imaging import clip_norm_stats

    clip, _ = tiny_clip
    mean, std = clip_norm_stats(clip)
    index = InMemoryImages([_jpeg(48 + 8 * i, 40, seed=i) for i in range(6)])
    name = "decode_batch_tensor" if decoder == "torchvision" else "decode_batch"
    real_decode, real_encode = getattr(image_features, name), image_features.encode_images
    on_main: list = []
    decoded = [threading.Event() for _ in range(3)]
    encoded: list = []

    def decode(*args, **kwargs):
        out = real_decode(*args, **kwargs)
        on_main.append(threading.current_thread() is threading.main_thread())
        decoded[len(on_main) - 1].set()
        return out

    def encode(*args, **kwargs):
        chunk = len(encoded)
        if chunk + 1 < len(decoded):
            assert decoded[chunk + 1].wait(timeout=60), f"chunk {chunk + 1} was not decoded ahead"
        encoded.append(chunk)
        return real_encode(*args, **kwargs)

    monkeypatch.setattr(image_features, name, decode)
    monkeypatch.setattr(image_features, "encode_images", encode)
    kwargs = dict(show_progress=False, decoder=decoder)
    image_features.encode_rank(index, clip, 0, 1, tmp_path / "a", "fp", 32, mean, std, chunk_size=2, **kwargs)
    assert on_main == [True, False, False] and encoded == [0, 1, 2]
    monkeypatch.setattr(image_features, "encode_images", real_encode)
    monkeypatch.setattr(image_features, name, real_decode)
    image_features.encode_rank(index, clip, 0, 1, tmp_path / "b", "fp", 32, mean, std, chunk_size=6, **kwargs)
    chunked, whole = (np.load(tmp_path / part / "feats.rank0.npy") for part in ("a", "b"))
    assert chunked[:, -1].all() and np.allclose(chunked, whole, atol=1e-6)
