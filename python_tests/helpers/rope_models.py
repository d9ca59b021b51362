"""The RoPE backbones (Hugging Face DINOv3, timm Eva) for the tests of the original methods: each
model with the halves that run its unpatched layers by hand, every current token rotated by the
rows of its original position, and how its patched run is read."""

from __future__ import annotations

from types import SimpleNamespace

import torch

import pullback_ext.patch as patch
from helpers.blocks import Halves
from helpers.prune import tiny_eva, tiny_hf

EVAS = {"eva02": ("eva02_tiny_patch14_224", 56), "rope_mixed": ("vit_small_patch16_rope_mixed_224", 64),
        "timm_dinov3": ("vit_small_patch16_dinov3", 64)}


def _softmax_probs(q, k, scale, log_sizes):
    logits = (q * scale) @ k.transpose(-2, -1)
    return (logits if log_sizes is None else logits + log_sizes).softmax(dim=-1)


def dinov3_halves(model, pe, p: int) -> Halves:
    """A ``DINOv3ViTLayer`` in two halves from its weights, on one image: the rotary rows of the
    given places, then the row of no rotation (cos 1, sin 0) for any token after them."""
    from transformers.models.dinov3_vit.modeling_dinov3_vit import apply_rotary_pos_emb

    cos, sin = pe

    def attend(layer, x, log_sizes, places):
        k_tokens, extra = x.shape[0], x.shape[0] - p - len(places)
        rows = [t - p for t in places]
        c = torch.cat([cos[rows], torch.ones(extra, cos.shape[-1], dtype=cos.dtype)])
        s = torch.cat([sin[rows], torch.zeros(extra, sin.shape[-1], dtype=sin.dtype)])
        attn, h = layer.attention, layer.norm1(x)
        q, k, v = (proj(h).view(k_tokens, -1, attn.head_dim).transpose(0, 1) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
        q, k = apply_rotary_pos_emb(q, k, c, s)
        probs = _softmax_probs(q, k, attn.scaling, log_sizes)
        out = attn.o_proj((probs @ v).transpose(0, 1).reshape(k_tokens, -1))
        return x + layer.layer_scale1(out), probs, k

    return Halves(attend, lambda layer, x: x + layer.layer_scale2(layer.mlp(layer.norm2(x))))


def eva_halves(model, rope_table) -> Halves:
    """An ``EvaBlock`` in two halves on one image: its own attention with the rotary rows of the
    given places (then sin 0, cos 1 for any token after them), its queries and keys caught at
    ``q_norm`` / ``k_norm`` and rotated by hand."""
    from timm.layers import apply_rot_embed_cat

    p = int(model.num_prefix_tokens)
    index = {id(block): i for i, block in enumerate(model.blocks)}

    def attend(block, x, log_sizes, places):
        table = rope_table[index[id(block)]] if model.rope_mixed else rope_table
        extra = x.shape[0] - p - len(places)
        still = torch.cat([torch.zeros(*table.shape[:-2], extra, table.shape[-1] // 2, dtype=table.dtype),
                           torch.ones(*table.shape[:-2], extra, table.shape[-1] // 2, dtype=table.dtype)], dim=-1)
        rows = torch.cat([table[..., [t - p for t in places], :], still], dim=-2)
        attn, seen = block.attn, {}
        hooks = [attn.q_norm.register_forward_hook(lambda m, a, out: seen.__setitem__("q", out)),
                 attn.k_norm.register_forward_hook(lambda m, a, out: seen.__setitem__("k", out))]
        try:
            mask = None if log_sizes is None else log_sizes[None, None, None, :]
            out = attn(block.norm1(x)[None], rope=rows, attn_mask=mask)[0]
        finally:
            for hook in hooks:
                hook.remove()
        q, k = (torch.cat([t[:, :, :p], apply_rot_embed_cat(t[:, :, p:], rows, half=attn.rotate_half)], dim=2)[0]
                for t in (seen["q"], seen["k"]))
        gamma = 1.0 if block.gamma_1 is None else block.gamma_1
        return x + gamma * out, _softmax_probs(q, k, attn.scale, log_sizes), k

    def feed(block, x):
        return x + (1.0 if block.gamma_2 is None else block.gamma_2) * block.mlp(block.norm2(x))

    return Halves(attend, feed)


class Rope(SimpleNamespace):
    """A RoPE model, its layer-0 input ``h``, the reference's stand-in (layers, prefix, final norm,
    identity embedding steps), its halves, and how to run it patched: ``run() -> (final, [after
    layer i])`` (final: normed), ``patch_fn``."""


def rope_model(name: str) -> Rope:
    identity = torch.nn.Identity()
    if name == "hf_dinov3":
        model = tiny_hf("dinov3", "sdpa").double()
        x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        layers, p = model.model.layer, 3
        halves = dinov3_halves(model, model.rope_embeddings(x), p)
        h = model(pixel_values=x, output_hidden_states=True).hidden_states[0]

        def run():
            out = model(pixel_values=x, output_hidden_states=True)
            return out.last_hidden_state, list(out.hidden_states[1:])

        patch_fn = patch.hf_dinov3
    else:
        model = tiny_eva(*EVAS[name])
        size = EVAS[name][1]
        x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        tokens, table = model._pos_embed(model.patch_embed(x))
        h, layers, p = model.norm_pre(tokens), model.blocks, int(model.num_prefix_tokens)
        halves = eva_halves(model, table)

        def run():
            final, inter = model.forward_intermediates(x, indices=list(range(len(layers))), output_fmt="NLC",
                                                       return_prefix_tokens=True)
            return final, [torch.cat([prefix, patches], dim=1) for patches, prefix in inter]

        patch_fn = patch.timm
    stand_in = SimpleNamespace(blocks=layers, num_prefix_tokens=p, norm=model.norm, norm_pre=identity,
                               patch_drop=identity, _pos_embed=identity, patch_embed=identity)
    return Rope(model=model, h=h, stand_in=stand_in, halves=halves, run=run, patch_fn=patch_fn, p=p)


def rope_matches(m: Rope, expected) -> bool:
    final, per_layer = m.run()
    return torch.allclose(final, expected[0], rtol=1e-9, atol=1e-9) and all(
        torch.allclose(got, want, rtol=1e-9, atol=1e-9) for got, want in zip(per_layer, expected[1]))
