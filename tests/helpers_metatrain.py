"""A tiny meta-training world shared by test files (import it from here, never from a test file): coloured 32 px
images whose topic is the colour and whose domain is the style, their CHC hierarchy under the tiny test CLIP, and
the ``KEY VALUE`` options of a short meta-training run on it."""

import warnings

import numpy as np
import torch
from helpers import tiny_meta_opts, tiny_task_opts

from meta.chc.hierarchy import Hierarchy
from meta.chc.imaging import CLIP_MEAN, CLIP_STD, normalize_uint8
from meta.model.backbone import load_clip

MODEL = "GRAM-Test-Tiny"
N_TOPICS, N_DOMAINS, PER_DOMAIN = 8, 3, 6
NAMES = ["apple", "bridge", "cactus", "drum", "eagle", "fern", "glove", "harbor"]


def colour_pixels(n_topics=N_TOPICS, seed=0):
    """uint8 [N, 32, 32, 3]: topic = colour, domain = style (flat / stripes / noise); labels."""
    rng = np.random.default_rng(seed)
    images, topic, domain = [], [], []
    for t in range(n_topics):
        colour = np.array([(37 * t) % 256, (91 * t + 60) % 256, (151 * t + 120) % 256], dtype=np.float64)
        for u in range(N_DOMAINS):
            for _ in range(PER_DOMAIN):
                img = np.tile(colour, (32, 32, 1))
                if u == 1:
                    img[::4] = 255 - img[::4]
                elif u == 2:
                    img = img + rng.normal(0, 60, img.shape)
                img = img + rng.normal(0, 8, img.shape)
                images.append(np.clip(img, 0, 255).astype(np.uint8))
                topic.append(t), domain.append(u)
    return np.stack(images), np.array(topic), np.array(domain)


def seeded_clip(seed=0):
    """The tiny test CLIP with random weights drawn after ``torch.manual_seed(seed)``, as the trainer draws them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(seed)  # what the trainer does for random weights with SEED = seed
        return load_clip(MODEL, None)


def colour_hierarchy(clip_seed=0, backbone=MODEL):
    """A CHC hierarchy of :func:`colour_pixels`: topics, domains and the tiny CLIP's unit image features."""
    pixels, topic, domain = colour_pixels()
    clip, _ = seeded_clip(clip_seed)
    with torch.no_grad():
        feats = torch.nn.functional.normalize(clip.encode_image(normalize_uint8(pixels)), dim=-1).numpy()
    meta = {
        "backbone": backbone,
        "pretrained": None,
        "weights_sha256": None,
        "image_size": 32,
        "mean": list(CLIP_MEAN),
        "std": list(CLIP_STD),
    }
    return Hierarchy(
        topic_names=NAMES[:N_TOPICS],
        item_topic=topic,
        item_domain=domain,
        image_features=feats,
        meta=meta,
        image_loader=lambda idx: pixels[np.asarray(idx)],
    )


BASE = [
    *tiny_meta_opts(),
    "META.TENSORBOARD",  # written here: tests read the event files
    "True",
    "META.STEPS",
    "6",
    "META.CHECKPOINT_EVERY",
    "2",
    *tiny_task_opts(),
    "META.VAL_EVERY",
    "3",
    "META.VAL_TASKS",
    "2",
    "META.LOG_DETAIL_EVERY",
    "2",
    "META.FEATURE_CHECK",
    "4",
    "META.INNER_LR",
    "0.5",
]
