"""A prompt learner that exists only in the tests: the text context as a product of two factors,

    ctx = ctx_factor [M, r] @ ctx_basis [r, d_t]

two tensors of names and shapes no built-in learner has.  It is one class and one registration, which is all
:mod:`meta.method.learners` asks of a new learner; the tests then run it through meta-training (both task loops), init
files, the evaluator and the Dassl trainer.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from meta.method.learners import PromptLearner, register_learner, text_only_structure, unregister_learner

KEY = "test_low_rank_context"
RANK = 3


class LowRankContext(PromptLearner):
    """CoOp's text context of rank r: ``ctx_factor @ ctx_basis`` (leading task dims ride along in ``matmul``)."""

    key = KEY
    tensor_names = ("ctx_factor", "ctx_basis")

    def structure_of(self, spec, dims) -> dict:
        return text_only_structure(spec.n_ctx_text, rank=RANK)

    def shapes_of(self, structure, backbone) -> dict:
        return {
            "ctx_factor": ([structure["n_ctx_text"], structure["rank"]], "[prompt.n_ctx_text, prompt.rank]"),
            "ctx_basis": ([structure["rank"], backbone["text_width"]], "[prompt.rank, backbone.text_width]"),
        }

    def init(self, spec, clip, dims, generator) -> dict:
        factor = torch.randn(spec.n_ctx_text, RANK, generator=generator)
        basis = torch.randn(RANK, dims.text_width, generator=generator) * spec.init_std
        return {"ctx_factor": factor, "ctx_basis": basis}

    def check(self, tensors) -> None:
        super().check(tensors)
        factor, basis = tensors.get("ctx_factor"), tensors.get("ctx_basis")
        if factor is None or basis is None or factor.dim() != 2 or basis.dim() != 2:
            raise ValueError("the low-rank context needs ctx_factor [M, r] and ctx_basis [r, d_t]")
        if factor.shape[1] != basis.shape[0]:
            raise ValueError(f"ranks differ: ctx_factor {tuple(factor.shape)}, ctx_basis {tuple(basis.shape)}")

    def structure(self, prompts) -> dict:
        m, r = prompts.ctx_factor.shape[-2:]
        return text_only_structure(m, rank=r)

    def text_prompts(self, prompts):
        return torch.matmul(prompts.ctx_factor, prompts.ctx_basis), None

    def visual_prompts(self, prompts):
        return None

    def spec_prompts_vision(self, spec) -> bool:
        return False


@contextlib.contextmanager
def low_rank_learner() -> Iterator[str]:
    """The toy learner registered for the block (removed after it); yields its key."""
    register_learner(LowRankContext())
    try:
        yield KEY
    finally:
        unregister_learner(KEY)
