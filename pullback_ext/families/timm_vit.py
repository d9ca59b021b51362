"""timm ``VisionTransformer`` (ViT, DeiT, DeiT-III, DINOv2 ports; CLS and register tokens, LayerScale)."""

from pullback_ext.families.adapter import TimmFamily

LORA_TARGETS = ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")


def _classes() -> tuple:
    from timm.models.vision_transformer import VisionTransformer

    return (VisionTransformer,)


ADAPTER = TimmFamily(
    name="timm_vit", title="a timm VisionTransformer", listing="a timm VisionTransformer or Eva", classes=_classes,
    lora_targets=LORA_TARGETS, priority=1,
)
