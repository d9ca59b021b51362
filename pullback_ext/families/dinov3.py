"""Hugging Face DINOv3 ViT (``DINOv3ViTModel``, ``DINOv3ViTBackbone``): CLS, registers, LayerScale,
a gated MLP, and rotary position embeddings passed to every layer."""

from pullback_ext.families.adapter import HFFamily, ProbeReadout
from pullback_ext.families.dinov2 import ATTENTION, ATTENTION_LINEARS, SCALED_BRANCHES


def _rotate(q, k, position_embeddings):
    """Queries and keys ``[B, H, K, d]`` rotated by the ``(cos, sin)`` rows of their patch tokens
    (the leading prefix tokens are left as they are)."""
    from transformers.models.dinov3_vit.modeling_dinov3_vit import apply_rotary_pos_emb

    return apply_rotary_pos_emb(q, k, *position_embeddings)


ADAPTER = HFFamily(
    name="dinov3", title="a Hugging Face DINOv3 ViT (DINOv3ViTModel / DINOv3ViTBackbone)", short_title="DINOv3",
    loops=("DINOv3ViTEncoder",), attention=ATTENTION, branches=SCALED_BRANCHES,
    lora_targets=ATTENTION_LINEARS + ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
    loads={"dinov3_vit": ("DINOv3ViTModel",)}, priority=60, dense=("DINOv3ViTBackbone",), captures=True,
    rotate=_rotate, probe=ProbeReadout(("DINOv3ViTModel",), None, "model.layer", "norm", rotary=True),
)
