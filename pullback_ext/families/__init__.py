"""Model families: one adapter per family (timm ViT, timm Eva, Hugging Face ViT, CLIP, SigLIP,
DINOv2, DINOv3, DPT, Depth Anything), each holding everything about that family that the patches,
probes, model sources and TAP training need, and :func:`detect`, which says which family a model
is of. A low-level package: it imports torch, the errors and (lazily) timm and transformers only.
"""

from pullback_ext.families.adapter import AttentionLayout, Branches, HFFamily, ProbeReadout, TimmFamily
from pullback_ext.families.registry import detect, family, supported, table
from pullback_ext.families.versions import CHECKED_TRANSFORMERS, check_transformers

__all__ = ["AttentionLayout", "Branches", "CHECKED_TRANSFORMERS", "HFFamily", "ProbeReadout", "TimmFamily",
           "check_transformers", "detect", "family", "supported", "table"]
