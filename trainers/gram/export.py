"""Export θ*_T for *stock* CoOp / CoCoOp trainers: ``python -m trainers.gram.export SOURCE DEST``.

SOURCE is a GRAM init file (``.safetensors`` from ``meta.init_io.export_gram_init``), a GRAM
trainer's output folder, or one of its checkpoint files.  DEST receives
``{"state_dict": {"ctx": [n_ctx, d_t]}, "epoch": 0}`` (``meta.init_io.export_coop_context``), which
a fork's ``CoOp``/``CoCoOp`` trainer loads with ``MODEL.INIT_WEIGHTS DEST``: Dassl's
``load_pretrained_weights`` copies every key whose name and shape match (torchtools.py L267-314),
and ``ctx`` is ``[n_ctx, 512]`` in both trainers for ViT-B/16.  Set their ``N_CTX`` to n_ctx and
leave ``CTX_INIT`` empty.  The file holds plain tensors, so ``weights_only=True`` loading works.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

from meta.init_io import export_coop_context, load_gram_init

from .checkpoint import checkpoint_file, load_checkpoint


def text_context_of(source: Union[str, Path], epoch: Optional[int] = None) -> torch.Tensor:
    """``ctx`` ``[n_ctx, d_t]`` from a GRAM init file, a GRAM output folder or a checkpoint file."""
    source = Path(source)
    if source.is_dir():
        ckpt = load_checkpoint(checkpoint_file(source, "prompt_learner", epoch))
        ctx = ckpt["state_dict"].get("ctx")
    elif source.suffix == ".safetensors":
        ctx = load_gram_init(source, config_key="SOURCE").prompt.get("ctx")
    else:
        ctx = load_checkpoint(source)["state_dict"].get("ctx")
    if ctx is None:
        raise ValueError(f"{source} holds no text context 'ctx' (visual prompts only?); nothing to export for CoOp")
    return ctx


def export_for_coop(source: Union[str, Path], destination: Union[str, Path], epoch: Optional[int] = None) -> Path:
    """Write ``source``'s text context where stock CoOp/CoCoOp's ``MODEL.INIT_WEIGHTS`` can read it."""
    return export_coop_context(destination, text_context_of(source, epoch))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainers.gram.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="GRAM init .safetensors, GRAM output folder, or checkpoint file")
    parser.add_argument("destination", help="file to write (e.g. gram_ctx.pth)")
    parser.add_argument("--epoch", type=int, default=None, help="checkpoint epoch when SOURCE is a folder")
    args = parser.parse_args(argv)
    try:
        path = export_for_coop(args.source, args.destination, args.epoch)
    except (OSError, ValueError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    n_ctx = text_context_of(args.source, args.epoch).shape[0]
    print(f"wrote {path}: use MODEL.INIT_WEIGHTS {path} with TRAINER.COOP.N_CTX {n_ctx} (or TRAINER.COCOOP.N_CTX)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
