"""Prompt learners over open_clip: truncation, VPT shapes/gradients, no frozen-weight cloning."""

import pytest
import torch

from meta.infra.profiling import bytes_copied
from meta.method.gram import GRAMMetaLearner, MetaSpec
from meta.method.prompts import PromptedCLIP, PromptParams, PromptSpec, classification_loss
from meta.model.text_encoder import ClassTokenCache, context_from_words, encode_text_with_context
from meta.model.visual_encoder import encode_image_with_prompts

NAMES = ["red circle", "square", "a very long class name with many words", "x"]


def test_truncated_text_features_equal_full_77_token_features(tiny_clip):
    clip, dims = tiny_clip
    ctx = torch.randn(4, dims.text_width, generator=torch.Generator().manual_seed(0)) * 0.02
    short = ClassTokenCache(clip, 4, truncate=True).tokens(NAMES)
    full = ClassTokenCache(clip, 4, truncate=False).tokens(NAMES)
    assert full.length == dims.context_length
    assert short.length == int(short.eot_index.max()) + 1 < full.length
    expected = encode_text_with_context(clip, full, ctx)
    # float32 rounding only: over 200 seeds the largest difference was 6.7e-7 x max|feature|
    # (different matmul blocking for 20 vs 77 rows); attending to padding would differ by ~1e-1
    torch.testing.assert_close(
        encode_text_with_context(clip, short, ctx), expected, rtol=0, atol=2e-6 * float(expected.abs().max())
    )


def test_context_from_words_reproduces_clip_text_encoding(tiny_clip):
    """ctx initialised from "a photo of a" + class tokens == open_clip's encode_text of the full sentence."""
    import open_clip

    clip, dims = tiny_clip
    ctx = context_from_words(clip, "a photo of a")
    assert ctx.shape == (4, dims.text_width)
    tokens = ClassTokenCache(clip, 4).tokens(["dog", "traffic light"])
    ours = encode_text_with_context(clip, tokens, ctx)
    ref = clip.encode_text(open_clip.get_tokenizer("ViT-B-16")(["a photo of a dog.", "a photo of a traffic light."]))
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_image_encoder_without_prompts_equals_open_clip(tiny_clip):
    clip, dims = tiny_clip
    images = torch.randn(3, 3, dims.image_size, dims.image_size)
    empty = torch.zeros(1, 0, dims.vision_width)
    torch.testing.assert_close(encode_image_with_prompts(clip, images, empty), clip.encode_image(images))


@pytest.mark.parametrize("depth", [1, 2])
def test_vpt_shapes_and_only_prompts_get_gradients(tiny_clip, depth):
    clip, dims = tiny_clip
    spec = PromptSpec(n_ctx_text=0, n_ctx_vision=3, vision_depth=depth)
    prompts = PromptParams.from_spec(spec, clip, dims)
    assert prompts.ctx is None and prompts.vpt.shape == (depth, 3, dims.vision_width)
    images = torch.randn(2, 3, dims.image_size, dims.image_size)
    feats = encode_image_with_prompts(clip, images, prompts.vpt)
    assert feats.shape == (2, dims.embed_dim)
    assert not torch.allclose(feats, clip.encode_image(images))  # prompts change the features
    pclip = PromptedCLIP(clip, dims, 0)
    loss, logits = classification_loss(pclip)(
        prompts, {"classnames": NAMES[:2], "images": images, "label": torch.tensor([0, 1])}
    )
    assert logits.shape == (2, 2)
    loss.backward()
    assert prompts.vpt.grad is not None and prompts.vpt.grad.abs().sum() > 0
    if depth == 2:  # the deep layer's prompts matter too
        assert prompts.vpt.grad[1].abs().sum() > 0
    assert all(p.grad is None for p in clip.parameters()), "frozen CLIP received gradients"
    assert not any(p.requires_grad for p in clip.parameters())


def test_deep_prompts_replace_previous_layer_outputs(tiny_clip):
    """Changing layer-1 prompts must not matter when depth is 1 (they are never used)."""
    clip, dims = tiny_clip
    images = torch.randn(2, 3, dims.image_size, dims.image_size)
    vpt = torch.randn(2, 2, dims.vision_width) * 0.02
    a = encode_image_with_prompts(clip, images, vpt[:1])
    b = encode_image_with_prompts(clip, images, vpt)
    c = encode_image_with_prompts(clip, images, torch.stack([vpt[0], vpt[1] * 5]))
    assert not torch.allclose(a, b) and not torch.allclose(b, c)


def test_gbml_clone_copies_only_prompts_and_regulators(tiny_clip):
    clip, dims = tiny_clip
    prompts = PromptParams.from_spec(PromptSpec(n_ctx_text=2, n_ctx_vision=2), clip, dims)
    ml = GRAMMetaLearner(prompts, MetaSpec())
    theta_phi = sum(p.numel() * p.element_size() for p in ml.gbml.parameters())
    clip_bytes = sum(p.numel() * p.element_size() for p in clip.parameters())
    _, copied = bytes_copied(lambda: ml.gbml.clone())
    assert copied == theta_phi, (copied, theta_phi)
    assert copied < clip_bytes / 100


def test_prompt_module_holds_no_clip_weights(tiny_clip):
    clip, dims = tiny_clip
    prompts = PromptParams.from_spec(PromptSpec(n_ctx_text=4, n_ctx_vision=2), clip, dims)
    assert {n for n, _ in prompts.named_parameters()} == {"ctx", "vpt"}
    assert sum(p.numel() for p in prompts.parameters()) == 4 * dims.text_width + 2 * dims.vision_width


def test_cached_features_refused_with_visual_prompts(tiny_clip):
    clip, dims = tiny_clip
    prompts = PromptParams.from_spec(PromptSpec(n_ctx_text=0, n_ctx_vision=2), clip, dims)
    with pytest.raises(ValueError, match="visual prompts"):
        PromptedCLIP(clip, dims, 0).logits(prompts, ["a"], image_features=torch.randn(1, dims.embed_dim))


def test_class_specific_context_shapes_and_per_class_independence(tiny_clip):
    """CSC ``[C, M, d_t]`` -> ``[C, E]``; identical rows reproduce the shared ``[M, d_t]`` context,
    and class j's context reaches class j's feature only (values and gradients)."""
    clip, dims = tiny_clip
    gen = torch.Generator().manual_seed(4)
    tokens = ClassTokenCache(clip, 4).tokens(NAMES)
    shared = torch.randn(4, dims.text_width, generator=gen) * 0.02
    csc = shared.expand(len(NAMES), -1, -1).clone().requires_grad_(True)
    out = encode_text_with_context(clip, tokens, csc)
    assert csc.shape == (len(NAMES), 4, dims.text_width) and out.shape == (len(NAMES), dims.embed_dim)
    expected = encode_text_with_context(clip, tokens, shared)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6 * float(expected.abs().max()))

    grad = torch.autograd.grad(out[2].sum(), csc)[0]
    assert grad[2].abs().sum() > 0
    assert torch.equal(grad[[0, 1, 3]], torch.zeros_like(grad[[0, 1, 3]]))

    moved = csc.detach().clone()
    moved[1] += 0.5 * torch.randn(4, dims.text_width, generator=gen)
    new = encode_text_with_context(clip, tokens, moved)
    assert not torch.allclose(new[1], out[1].detach())
    torch.testing.assert_close(new[[0, 2, 3]], out[[0, 2, 3]].detach(), rtol=0, atol=1e-6 * float(expected.abs().max()))


def test_class_names_too_long_error_names_the_class_and_the_limit(tiny_clip):
    """``[SOT] X*M <name> . [EOT]`` must fit the text context: the longest name that fits passes,
    one word more is refused with an error naming the class, the token limit and M."""
    clip, dims = tiny_clip
    n_ctx, limit = 4, dims.context_length
    fits = " ".join(["cat"] * (limit - n_ctx - 4))  # SOT + M + words + "." + EOT = limit - 1 tokens
    too_long = fits + " dog"
    assert ClassTokenCache(clip, n_ctx).tokens([fits, "x"]).eot_index.tolist()[0] == limit - 2
    with pytest.raises(ValueError) as err:
        ClassTokenCache(clip, n_ctx).tokens(["x", too_long])
    message = str(err.value)
    assert "class names too long" in message and repr(too_long) in message
    assert f"{limit} text tokens" in message and f"{n_ctx} context tokens" in message
    assert "'x'" not in message  # only the offending class is listed


def test_class_token_cache_keeps_tokens_in_the_blocks_dtype_and_stacks_once():
    """open_clip's fp16 weights keep token / position embeddings fp32: the cache holds them in the blocks' dtype
    (the cast happens once, not every step), returns the same stacked tokens for the same class list, and the
    text features equal those of the per-step cast (the former path: fp32 tokens, no positional given)."""
    import warnings

    from meta.model.backbone import load_clip
    from meta.model.text_encoder import ClassTokens

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        clip, dims = load_clip("GRAM-Test-Tiny", None, device="cpu", precision="fp16")
    assert clip.token_embedding.weight.dtype == torch.float32
    cache = ClassTokenCache(clip, 4)
    tokens = cache.tokens(NAMES)
    assert tokens.prefix.dtype == tokens.suffix.dtype == tokens.positional.dtype == torch.float16
    assert cache.tokens(NAMES) is tokens and cache.tokens(NAMES[::-1]) is not tokens
    with torch.no_grad():
        ids = cache.tokenizer([f"X X X X {NAMES[0]}."], context_length=clip.positional_embedding.shape[0])
        assert torch.equal(tokens.prefix[0, 0], clip.token_embedding(ids)[0, 0].half())
    fp32 = ClassTokens(prefix=tokens.prefix.float(), suffix=tokens.suffix.float(), eot_index=tokens.eot_index, n_ctx=4)
    ctx = torch.randn(4, dims.text_width, generator=torch.Generator().manual_seed(2)) * 0.02
    assert torch.equal(encode_text_with_context(clip, tokens, ctx), encode_text_with_context(clip, fp32, ctx))
