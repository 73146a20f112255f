"""CoCoOp as a prompt learner (Zhou et al., CVPR 2022, "Conditional Prompt Learning for Vision-Language Models";
public code KaiyangZhou/CoOp ``trainers/cocoop.py``): key ``cocoop``.

θ holds CoCoOp's two parts, every tensor one θ tensor (one R_φ each, in both task loops and in init files):

* ``ctx`` ``[M, d_t]``: the context vectors, from ``PromptSpec.ctx_init``'s words (CoCoOp's ``CTX_INIT`` "a photo
  of a", M = its token count) or N(0, init_std²) with M = ``n_ctx_text`` (CoCoOp's random init, σ 0.02);
* the meta-net π, CoCoOp's ``Linear(E, E // 16) -> ReLU -> Linear(E // 16, d_t)`` with E the CLIP embedding width
  (ViT-B/16: 512 -> 32 -> 512): ``meta_net_linear1_weight`` ``[h, E]``, ``meta_net_linear1_bias`` ``[h]``,
  ``meta_net_linear2_weight`` ``[d_t, h]``, ``meta_net_linear2_bias`` ``[d_t]`` (h = E // 16).  Module attributes
  cannot hold dots, so the names spell CoCoOp's state-dict keys (``meta_net.linear1.weight``, ...) with ``_``;
  :data:`STOCK_NAMES` maps them back (the stock-CoCoOp export).

The forward: image i's frozen feature f_i gives the bias π(f_i) ``[d_t]`` added to every context vector,
``ctx_i = ctx + π(f_i)``, so the text features are per image (``[n, C, E]``) and the logits ``s · f_i · w_k(ctx_i)``;
the image tower carries no prompts.  One task costs n·C text sequences.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence

import torch
from torch import nn

from meta.method.learners import PromptLearner, register_learner, text_only_structure
from meta.model.text_encoder import context_from_words

KEY = "cocoop"
# CoCoOp's meta-net narrows the image feature by this factor (trainers/cocoop.py: vis_dim // 16)
HIDDEN_DIVISOR = 16
# θ tensor name -> CoCoOp's PromptLearner state-dict key, in θ's parameter order (= the order of R_φ)
STOCK_NAMES: dict[str, str] = {
    "ctx": "ctx",
    "meta_net_linear1_weight": "meta_net.linear1.weight",
    "meta_net_linear1_bias": "meta_net.linear1.bias",
    "meta_net_linear2_weight": "meta_net.linear2.weight",
    "meta_net_linear2_bias": "meta_net.linear2.bias",
}
TENSORS = tuple(STOCK_NAMES)


def meta_hidden(embed_dim: int) -> int:
    """h = E // 16, the meta-net's hidden width; ValueError when the CLIP is too narrow for one unit."""
    hidden = int(embed_dim) // HIDDEN_DIVISOR
    if hidden < 1:
        raise ValueError(f"CoCoOp's meta-net needs an embedding width >= {HIDDEN_DIVISOR} (E // 16), got {embed_dim}")
    return hidden


def linear_default_init(
    d_out: int, d_in: int, generator: Optional[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.nn.Linear(d_in, d_out)``'s default start, drawn from ``generator``: ``(weight [d_out, d_in],
    bias [d_out])``, both U(-1/√d_in, 1/√d_in) (Kaiming-uniform with a = √5 gives the weight that bound), weight
    first as ``reset_parameters`` draws them."""
    bound = 1.0 / math.sqrt(d_in)
    return tuple((torch.rand(*shape, generator=generator) * 2.0 - 1.0) * bound for shape in ((d_out, d_in), (d_out,)))


def meta_net(prompts: Any, image: torch.Tensor) -> torch.Tensor:
    """π(f) = W₂ relu(W₁ f + b₁) + b₂: ``image [..., n, E]`` -> ``[..., n, d_t]``.

    θ's tensors may lead with a task dimension (``[B, h, E]`` etc.) matching ``image [B, n, E]``."""
    w1, b1 = prompts.meta_net_linear1_weight, prompts.meta_net_linear1_bias
    w2, b2 = prompts.meta_net_linear2_weight, prompts.meta_net_linear2_bias
    hidden = torch.relu(torch.matmul(image, w1.transpose(-1, -2)) + b1.unsqueeze(-2))  # [..., n, h]
    return torch.matmul(hidden, w2.transpose(-1, -2)) + b2.unsqueeze(-2)  # [..., n, d_t]


class CoCoOp(PromptLearner):
    """CoCoOp's conditional context: ``ctx [M, d_t]`` shifted per image by the meta-net of its feature (module
    docstring); the text side is per image."""

    key = KEY
    tensor_names = TENSORS
    per_image_text = True

    # ------------------------------------------------------------------ structure, shapes, start, checks
    def structure_of(self, spec: Any, dims: Any) -> dict:
        """M = ``spec.n_ctx_text`` (as for the built-in learner, a ``ctx_init`` of other length is refused where θ
        is built), E and h = E // 16 from the CLIP's widths."""
        return text_only_structure(
            spec.n_ctx_text, meta_input=int(dims.embed_dim), meta_hidden=meta_hidden(dims.embed_dim)
        )

    def shapes_of(self, structure: Mapping[str, Any], backbone: Mapping[str, Any]) -> dict[str, tuple[list, str]]:
        m, e, h = structure["n_ctx_text"], structure["meta_input"], structure["meta_hidden"]
        d = backbone["text_width"]
        return {
            "ctx": ([m, d], "[prompt.n_ctx_text, backbone.text_width]"),
            "meta_net_linear1_weight": ([h, e], "[prompt.meta_hidden, prompt.meta_input]"),
            "meta_net_linear1_bias": ([h], "[prompt.meta_hidden]"),
            "meta_net_linear2_weight": ([d, h], "[backbone.text_width, prompt.meta_hidden]"),
            "meta_net_linear2_bias": ([d], "[backbone.text_width]"),
        }

    def init(self, spec: Any, clip: nn.Module, dims: Any, generator: Optional[torch.Generator]) -> dict:
        """CoCoOp's start: ``ctx`` from ``spec.ctx_init``'s token embeddings or N(0, init_std²) (drawn first), then
        the two linear layers by ``nn.Linear``'s default rule, all from ``generator`` (float32, CPU)."""
        if spec.ctx_init:
            ctx = context_from_words(clip, spec.ctx_init).float().cpu()
        else:
            if int(spec.n_ctx_text) < 1:
                raise ValueError(f"CoCoOp needs n_ctx_text >= 1 or ctx_init, got {spec.n_ctx_text}")
            ctx = torch.randn(int(spec.n_ctx_text), dims.text_width, generator=generator) * spec.init_std
        hidden = meta_hidden(dims.embed_dim)
        w1, b1 = linear_default_init(hidden, dims.embed_dim, generator)
        w2, b2 = linear_default_init(dims.text_width, hidden, generator)
        return dict(zip(TENSORS, (ctx, w1, b1, w2, b2)))

    def check(self, tensors: Mapping[str, Optional[torch.Tensor]]) -> None:
        super().check(tensors)
        missing = [n for n in TENSORS if tensors.get(n) is None]
        if missing:
            raise ValueError(f"prompt learner {KEY!r} needs {', '.join(TENSORS)}; missing {', '.join(missing)}")
        ctx, w1, b1, w2, b2 = (tensors[n] for n in TENSORS)
        if ctx.dim() != 2 or w1.dim() != 2 or b1.dim() != 1 or w2.dim() != 2 or b2.dim() != 1:
            raise ValueError(
                f"prompt learner {KEY!r}: expected ctx [M, d_t], meta_net_linear1_weight [h, E], "
                f"meta_net_linear1_bias [h], meta_net_linear2_weight [d_t, h], meta_net_linear2_bias [d_t]; got "
                + ", ".join(str(tuple(t.shape)) for t in (ctx, w1, b1, w2, b2))
            )
        d, h = ctx.shape[1], w1.shape[0]
        if b1.shape[0] != h or tuple(w2.shape) != (d, h) or b2.shape[0] != d:
            raise ValueError(
                f"prompt learner {KEY!r}: meta-net shapes do not chain with ctx [M, d_t={d}]: linear1 "
                f"{tuple(w1.shape)} + {tuple(b1.shape)}, linear2 {tuple(w2.shape)} + {tuple(b2.shape)} "
                f"(expected [h, E] + [h], [d_t, h] + [d_t])"
            )

    def structure(self, prompts: Any) -> dict:
        h, e = prompts.meta_net_linear1_weight.shape[-2:]
        return text_only_structure(prompts.ctx.shape[-2], meta_input=int(e), meta_hidden=int(h))

    def text_prompts(self, prompts: Any) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``(ctx, None)``: the context before any image's bias (the per-image text is :meth:`features`')."""
        return prompts.ctx, None

    def visual_prompts(self, prompts: Any) -> Optional[torch.Tensor]:
        return None

    def spec_prompts_vision(self, spec: Any) -> bool:
        return False

    def has_visual_prompts(self, prompts: Any) -> bool:
        return False

    # ------------------------------------------------------------------ the forward
    def conditioned_text(
        self, pclip: Any, prompts: Any, image: torch.Tensor, names_per_row: Sequence[Sequence[str]]
    ) -> torch.Tensor:
        """Text features ``[..., n, K, E]`` (L2-normalised): row r of the images ``image [..., n, E]`` (flattened
        in order) runs the K names ``names_per_row[r]`` through the text tower with its context ``ctx + π(f_r)``.

        θ's tensors carry the same leading dimensions as ``image`` minus its ``n`` (none, or a task dimension)."""
        ctx = prompts.ctx.unsqueeze(-3) + meta_net(prompts, image).unsqueeze(-2)  # [..., n, M, d_t]
        contexts = ctx.reshape(-1, *ctx.shape[-2:])  # [R, M, d_t], R = rows
        if len(names_per_row) != contexts.shape[0]:
            raise ValueError(f"{contexts.shape[0]} images but {len(names_per_row)} lists of class names")
        n_cls = len(names_per_row[0])
        if any(len(names) != n_cls for names in names_per_row):
            raise ValueError("every image needs the same number of class names")
        flat = [name for names in names_per_row for name in names]
        text = pclip.encode_text(contexts.repeat_interleave(n_cls, dim=0), None, flat)  # [R·K, E]
        return text.view(*ctx.shape[:-2], n_cls, text.shape[-1])

    def features(
        self,
        pclip: Any,
        prompts: Any,
        classnames: Sequence[str],
        images: Optional[torch.Tensor] = None,
        image_features: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(image [n, E], text [n, C, E])``: the frozen image features (or the cached ``image_features``) and
        each image's class embeddings under its own context."""
        image = self.image_side(pclip, prompts, images, image_features)
        return image, self.conditioned_text(pclip, prompts, image, [list(classnames)] * image.shape[0])

    def stacked_features(
        self,
        pclip: Any,
        prompts: Any,
        classnames: Sequence[Sequence[str]],
        images: Optional[torch.Tensor] = None,
        image_features: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """B tasks in one pass: ``(image [B, n, E], text [B, n, K, E])``; ``prompts`` stacked ``[B, ...]``,
        ``images`` ``[B·n, 3, H, W]`` task-major or ``image_features`` ``[B, n, E]``; B·n·K text sequences."""
        image = self.image_side(pclip, prompts, images, image_features, len(classnames))
        rows = [list(names) for names in classnames for _ in range(image.shape[1])]
        return image, self.conditioned_text(pclip, prompts, image, rows)


register_learner(CoCoOp())
