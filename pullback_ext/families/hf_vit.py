"""Hugging Face ``ViTModel`` (also inside ``ViTForImageClassification``): transformers 5 runs the
layers in ``ViTModel.forward`` itself, so a patch mirrors that forward."""

from pullback_ext.families.adapter import AttentionLayout, Branches, HFFamily, ProbeReadout
from pullback_ext.families.dinov2 import ATTENTION_LINEARS, PROJECTIONS

ADAPTER = HFFamily(
    name="vit", title="a Hugging Face ViTModel / ViTForImageClassification", short_title="ViT", loops=("ViTModel",),
    attention=AttentionLayout("layernorm_before", "attention", PROJECTIONS, "head_dim", "scaling"),
    branches=Branches(("attention.o_proj",), "layernorm_after", ("mlp",)),
    lora_targets=ATTENTION_LINEARS + ("mlp.fc1", "mlp.fc2"),
    loads={"vit": ("ViTModel", "ViTForImageClassification")}, priority=30, layer_attr="layers", captures=True,
    mirrored=True, probe=ProbeReadout(("ViTModel",), "vit", "layers", "layernorm", pooler=False),
)
