"""Hugging Face CLIP vision models (``CLIPVisionModel``, ``...WithProjection``): the ``CLIPEncoder``
of the vision model (the text model has the same class); the pre-LayerNorm runs before it and the
pooled output is the post-LayerNorm CLS token, both outside the loop."""

from torch import Tensor

from pullback_ext.families.adapter import AttentionLayout, Branches, HFFamily, ProbeReadout
from pullback_ext.families.dinov2 import PROJECTIONS

ATTENTION = AttentionLayout("layer_norm1", "self_attn", PROJECTIONS, "head_dim", "scale")
BRANCHES = Branches(("self_attn.out_proj",), "layer_norm2", ("mlp",))
LORA_TARGETS = tuple(f"self_attn.{n}_proj" for n in "qkv") + ("self_attn.out_proj", "mlp.fc1", "mlp.fc2")


def _pool(base, h: Tensor) -> Tensor:
    """The post-LayerNorm CLS row ``[B, D]`` of the last hidden state ``h [B, N, D]``."""
    return base.post_layernorm(h[:, 0])


ADAPTER = HFFamily(
    name="clip", title="a Hugging Face CLIP vision model (CLIPVisionModel / CLIPVisionModelWithProjection)",
    short_title="CLIP", loops=("CLIPEncoder",), parents=("CLIPVisionModel",), attention=ATTENTION, branches=BRANCHES,
    lora_targets=LORA_TARGETS, loads={"clip_vision_model": ("CLIPVisionModel", "CLIPVisionModelWithProjection")},
    priority=40, layer_attr="layers",
    probe=ProbeReadout(("CLIPVisionModel",), "vision_model", "encoder.layers", None, _pool, projection="visual_projection"),
)
