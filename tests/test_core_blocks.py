"""meta.model.blocks: our batch-first block forward equals open_clip's own block, rows and all."""

import pytest
import torch

from meta.model.blocks import block_forward, is_plain_block, transformer_forward


def _tokens(width: int, n: int = 3, length: int = 7, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, length, width, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("tower", ["text", "visual"])
def test_block_forward_equals_open_clip_block(tiny_clip, tower):
    clip, _ = tiny_clip
    transformer = clip.transformer if tower == "text" else clip.visual.transformer
    block = transformer.resblocks[0]
    assert is_plain_block(block)
    x = _tokens(block.ln_1.normalized_shape[0])
    mask = clip.attn_mask[:7, :7] if tower == "text" else None
    with torch.no_grad():
        ours = block_forward(block, x, attn_mask=mask)
        theirs = block(x, attn_mask=mask)
    assert ours.shape == theirs.shape == x.shape
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_selected_rows_equal_the_full_output_at_those_rows(tiny_clip):
    clip, _ = tiny_clip
    block = clip.transformer.resblocks[-1]
    x = _tokens(block.ln_1.normalized_shape[0])
    mask = clip.attn_mask[:7, :7]
    rows = torch.tensor([6, 2, 4])
    with torch.no_grad():
        full = block(x, attn_mask=mask)
        picked = block_forward(block, x, attn_mask=mask, rows=rows)
    assert picked.shape == (3, 1, x.shape[-1])
    torch.testing.assert_close(picked[:, 0], full[torch.arange(3), rows], rtol=1e-5, atol=1e-5)
    # a row before the last position must not see later tokens (causal mask applied per row)
    changed = x.clone()
    changed[1, 3:] += 1.0
    with torch.no_grad():
        again = block_forward(block, changed, attn_mask=mask, rows=rows)
    torch.testing.assert_close(again[1], picked[1])
    changed[1, 1] += 1.0  # an earlier token does reach it
    with torch.no_grad():
        again = block_forward(block, changed, attn_mask=mask, rows=rows)
    assert not torch.allclose(again[1], picked[1])


def test_transformer_forward_gradient_matches_open_clip(tiny_clip):
    clip, _ = tiny_clip
    width = clip.transformer.resblocks[0].ln_1.normalized_shape[0]
    mask = clip.attn_mask[:7, :7]
    rows = torch.tensor([6, 5, 3])
    grads = []
    for ours in (True, False):
        x = _tokens(width, seed=1).requires_grad_(True)
        if ours:
            out = transformer_forward(clip.transformer, x, attn_mask=mask, last_rows=rows)[:, 0]
        else:
            out = clip.transformer(x, attn_mask=mask)[torch.arange(3), rows]
        grads.append(torch.autograd.grad(out.square().sum(), x)[0])
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)


def test_unrecognised_block_falls_back_to_its_own_forward():
    class Doubler(torch.nn.Module):
        def forward(self, x, attn_mask=None):
            return 2 * x

    x = _tokens(8)
    assert not is_plain_block(Doubler())
    torch.testing.assert_close(block_forward(Doubler(), x), 2 * x)
    torch.testing.assert_close(
        block_forward(Doubler(), x, rows=torch.tensor([0, 1, 2])),
        2 * x[torch.arange(3), torch.tensor([0, 1, 2])].unsqueeze(1),
    )
