"""The learner × backbone table of ``docs/learners.md``, from what the code accepts.

``python -m gram_tools.backbone_table`` prints it; ``--write docs/learners.md`` replaces the block between its
markers.  Each cell asks the code about the learner's θ at full size (its reference method row,
``meta/method/methods.yaml``) on the real open_clip architecture: first the check the Dassl trainers make before
any work (:func:`meta.model.backbone.check_visual_prompts`), then the learner's own structure and shape rules on
the dimensions read from the built model (:func:`meta.model.backbone.clip_dims`; the rules init files are checked
against): the cell gives θ's parameter count, or says the learner is refused there.  The CLIPs are made on
PyTorch's ``meta`` device: every module and shape as open_clip builds them, no weights, no memory, no download
(the five take well under a second; ``tests/test_backbones.py`` runs the learners on tiny CLIPs of both towers).
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import warnings
from pathlib import Path
from typing import Optional, Sequence

# CoOp's backbone configs (KaiyangZhou/CoOp configs/trainers/CoOp: rn50, rn101, vit_b32, vit_b16), then ViT-L/14
BACKBONES = ("RN50", "RN101", "ViT-B-32", "ViT-B-16", "ViT-L-14")
BEGIN = "<!-- backbones:begin (python -m gram_tools.backbone_table --write docs/learners.md) -->"
END = "<!-- backbones:end -->"


def shape_only_clip(model_name: str):
    """``(clip, dims)`` of open_clip's ``model_name`` on the ``meta`` device (shapes without weights)."""
    import torch

    from meta.model.backbone import load_clip

    logging.disable(logging.WARNING)  # open_clip's "no pretrained weights": there are none by design
    try:
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")
            return load_clip(model_name, pretrained=None, device="meta")
    finally:
        logging.disable(logging.NOTSET)


def cell(trainer: str, model_name: str, clip, dims) -> str:
    """What the code does with learner ``trainer`` (a Dassl trainer of the learner table) on ``model_name``:
    ``"θ N"`` (N prompt parameters of its full-size reference shape) or ``"refused"``."""
    from meta.method import methods
    from meta.method.learners import get_learner
    from meta.method.prompts import PromptSpec
    from meta.model.backbone import check_visual_prompts

    spec = PromptSpec(**methods.learners()[trainer].prompt_fields("full"))
    learner = get_learner(spec.learner)
    if learner.spec_prompts_vision(spec):
        try:
            check_visual_prompts(model_name, "backbone", trainer, ())
        except ValueError:
            return "refused"
    shapes = learner.shapes_of(learner.structure_of(spec, dims), dims.as_dict())  # the rule init files meet
    return f"θ {sum(math.prod(shape) for shape, _ in shapes.values()):,}"


def table(backbones: Sequence[str] = BACKBONES) -> str:
    """The markdown table: one row per learner of ``meta/method/methods.yaml``, one column per backbone."""
    from meta.method import methods
    from meta.model.backbone import image_tower

    built = {name: shape_only_clip(name) for name in backbones}
    head = "| learner (Dassl trainer) | " + " | ".join(f"{b} ({image_tower(b)})" for b in backbones) + " |"
    rows = [head, "| --- |" + " --- |" * len(backbones)]
    for trainer in methods.learners():
        rows.append(f"| `{trainer}` | " + " | ".join(cell(trainer, b, *built[b]) for b in backbones) + " |")
    return "\n".join(rows)


def replace_block(text: str, block: str, where: str) -> str:
    """``text`` with the lines between :data:`BEGIN` and :data:`END` replaced by ``block``; ValueError naming
    ``where`` without both markers."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"{where}: expected the markers {BEGIN} and {END}")
    return text[: start + len(BEGIN)] + "\n" + block + "\n" + text[end:]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", metavar="MARKDOWN", help="replace the table block of this file (docs/learners.md)")
    args = parser.parse_args(argv)
    block = table()
    if not args.write:
        print(block)
        return 0
    path = Path(args.write)
    path.write_text(replace_block(path.read_text(encoding="utf-8"), block, str(path)), encoding="utf-8")
    print(f"wrote the learner x backbone table to {path}")
    return 0


if __name__ == "__main__":
    from meta.infra.cli_errors import run_cli

    sys.exit(run_cli(main, sys.argv[1:]))
