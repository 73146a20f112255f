"""Export θ*_T for *stock* CoOp / CoCoOp trainers: ``python -m trainers.gram.export SOURCE [DEST]``.

SOURCE is a GRAM init file (``.safetensors`` from ``meta.finetune.init_io.export_gram_init``), a GRAM
trainer's output folder, or one of its checkpoint files.  DEST (default: ``coop_ctx_nctx<M>.pth``
beside SOURCE) receives ``{"state_dict": {"ctx": [M, d_t]}, "epoch": 0, "n_ctx": M}``
(``meta.finetune.init_io.export_coop_context``), which a fork's ``CoOp``/``CoCoOp`` trainer loads with
``MODEL.INIT_WEIGHTS DEST``: Dassl's ``load_pretrained_weights`` copies every key whose name and
shape match (torchtools.py L267-314), and ``ctx`` is ``[n_ctx, 512]`` in both trainers for ViT-B/16.

Their ``N_CTX`` must be M (default 16) and ``CTX_INIT`` empty.  Stock Dassl only *warns* when the
shape differs and trains a random context, so the file name carries ``nctx<M>`` (a DEST without it
gets it added), the tool prints the options to pass, and ``trainers.gram.dassl_compat`` turns the
mismatch into an error.  The file holds plain tensors, so ``weights_only=True`` loading works.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

from meta.finetune.init_io import coop_context_name, coop_context_usage, export_coop_context, load_gram_init

from .dassl_checkpoint import checkpoint_file, load_checkpoint


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


def context_destination(source: Union[str, Path], destination: Optional[Union[str, Path]], n_ctx: int) -> Path:
    """DEST with ``nctx<n_ctx>`` in its name; default ``coop_ctx_nctx<n_ctx>.pth`` beside (or inside) SOURCE."""
    tag = f"nctx{int(n_ctx)}"
    if destination is None:
        source = Path(source)
        return (source if source.is_dir() else source.parent) / coop_context_name(n_ctx)
    destination = Path(destination)
    if tag in destination.name:
        return destination
    return destination.with_name(f"{destination.stem}_{tag}{destination.suffix or '.pth'}")


def export_for_coop(
    source: Union[str, Path], destination: Optional[Union[str, Path]] = None, epoch: Optional[int] = None
) -> Path:
    """Write ``source``'s text context where stock CoOp/CoCoOp's ``MODEL.INIT_WEIGHTS`` can read it; returns the
    path."""
    ctx = text_context_of(source, epoch)
    return export_coop_context(context_destination(source, destination, ctx.shape[0]), ctx)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainers.gram.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="GRAM init .safetensors, GRAM output folder, or checkpoint file")
    parser.add_argument(
        "destination",
        nargs="?",
        default=None,
        help="file to write (default coop_ctx_nctx<M>.pth beside SOURCE; nctx<M> is added if missing)",
    )
    parser.add_argument("--epoch", type=int, default=None, help="checkpoint epoch when SOURCE is a folder")
    args = parser.parse_args(argv)
    try:
        path = export_for_coop(args.source, args.destination, args.epoch)
    except (OSError, ValueError, RuntimeError) as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    n_ctx = int(torch.load(path, weights_only=True)["n_ctx"])
    print(f"wrote {path} ({n_ctx} context vectors); pass these options to the fork's train.py:")
    print(coop_context_usage(path, n_ctx))
    return 0


if __name__ == "__main__":
    sys.exit(main())
