"""Hugging Face ``SiglipVisionModel``: no CLS token; the pooled output comes from an
attention-pooling head on the full-length last hidden state."""

from torch import Tensor

from pullback_ext.families import clip
from pullback_ext.families.adapter import HFFamily, ProbeReadout


def _pool(base, h: Tensor) -> Tensor:
    """The attention-pooling head's output ``[B, D]`` on the last hidden state ``h [B, N, D]``."""
    return base.head(h)


ADAPTER = HFFamily(
    name="siglip", title="a Hugging Face SiglipVisionModel", short_title="SigLIP", loops=("SiglipEncoder",),
    parents=("SiglipVisionModel",), attention=clip.ATTENTION, branches=clip.BRANCHES, lora_targets=clip.LORA_TARGETS,
    loads={"siglip_vision_model": ("SiglipVisionModel",)}, priority=50, layer_attr="layers", cls_token=False,
    probe=ProbeReadout(("SiglipVisionModel",), "vision_model", "encoder.layers", "post_layernorm", _pool, "head"),
)
