"""Supervised meta-learning source: a labelled image folder -> Hierarchy (paper Table 4 row 4)."""

import numpy as np
import pytest

from gram_tools.synthetic import write_synthetic_image_folder
from meta.chc.image_folder import build_image_folder_hierarchy
from meta.metatrain.tasks import TaskSampler


def test_image_folder_hierarchy_classes_domains_and_tasks(tiny_clip, tmp_path):
    from sklearn.metrics import adjusted_rand_score

    clip, dims = tiny_clip
    classes = ["apple", "bridge", "clock", "drum"]
    styles = write_synthetic_image_folder(tmp_path / "data", classes, per_class=30, seed=0)
    (tmp_path / "data" / "clock" / "broken.png").write_bytes(b"\x89PNG garbage")
    h = build_image_folder_hierarchy(
        tmp_path / "data",
        clip,
        num_domains=3,
        min_per_domain=4,
        seed=0,
        model_name="GRAM-Test-Tiny",
        show_progress=False,
    )
    assert h.topic_names == classes
    assert h.meta["counts"]["unreadable_images"] == 1 and h.meta["counts"]["images"] == 121
    assert (h.item_topic >= 0).sum() == 120 and h.image_features.shape == (121, dims.embed_dim)
    np.testing.assert_allclose(np.linalg.norm(h.image_features[h.item_topic >= 0], axis=1), 1.0, atol=1e-5)
    # domains: k-means on CLIP features finds the drawing styles well above chance (ARI ~ 0)
    style = np.array([styles.get(p, -1) for p in h.image_loader.paths])  # item order = sorted paths
    assert (style[h.item_topic < 0] == -1).all()
    ok = h.item_topic >= 0
    aris = [
        adjusted_rand_score(style[ok][h.item_topic[ok] == c], h.item_domain[ok][h.item_topic[ok] == c])
        for c in range(len(classes))
    ]
    assert np.mean(aris) > 0.5, aris
    imgs = h.images(np.flatnonzero(ok)[:3])
    assert imgs.shape == (3, dims.image_size, dims.image_size, 3) and imgs.dtype == np.uint8
    task = TaskSampler(h, k_way=3, n_support=2, n_query=3, seed=0).sample()
    assert len(set(task.classnames)) == 3 and set(task.classnames) <= set(classes)
    with pytest.raises(FileNotFoundError, match="TASKS.IMAGE_FOLDER"):
        build_image_folder_hierarchy(tmp_path / "nope", clip)


def test_image_folder_records_its_weights_and_a_mismatch_hint_fits_the_source(tiny_clip, tmp_path):
    import torch

    from meta.infra.hashing import file_sha256
    from meta.metatrain.data import FeatureMismatchError, check_cached_features

    clip, dims = tiny_clip
    write_synthetic_image_folder(tmp_path / "data", ["apple", "bridge"], per_class=12, seed=0)
    weights, other = tmp_path / "clip.pt", tmp_path / "other.pt"
    torch.save(clip.state_dict(), weights)
    other.write_bytes(b"other weights")
    h = build_image_folder_hierarchy(
        tmp_path / "data",
        clip,
        num_domains=2,
        min_per_domain=3,
        seed=0,
        model_name="GRAM-Test-Tiny",
        pretrained=str(weights),
        show_progress=False,
    )
    assert h.meta["weights_sha256"] == file_sha256(weights)  # as CHC records it; None made the check fail
    assert check_cached_features(h, clip, dims, "GRAM-Test-Tiny", str(weights), n_check=2)["metadata"]
    with pytest.raises(FeatureMismatchError) as err:
        check_cached_features(h, clip, dims, "GRAM-Test-Tiny", str(other), n_check=0)
    assert "rebuild the image-folder hierarchy" in str(err.value) and "meta cluster" not in str(err.value)
