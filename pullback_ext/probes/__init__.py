"""Probe maps ψ_ℓ: features of one ViT layer -> task outputs, for timm, Hugging Face and custom models."""

from pullback_ext.probes.modes import jvp_friendly
from pullback_ext.probes.base import Probe
from pullback_ext.probes.callable_probe import CallableProbe, from_callable
from pullback_ext.probes.features import Features, as_features, image_map
from pullback_ext.probes.hf_dinov2 import HFDinov2Probe, from_hf_dinov2
from pullback_ext.probes.hf_dpt import HFDepthProbe, from_hf_dpt
from pullback_ext.probes.hf_vision import HFVisionProbe, from_hf_vision
from pullback_ext.probes.linear import LinearTokenProbe, linear_probe
from pullback_ext.probes.timm_vit import TimmViTProbe, from_timm

__all__ = [
    "CallableProbe",
    "Features",
    "HFDepthProbe",
    "HFDinov2Probe",
    "HFVisionProbe",
    "LinearTokenProbe",
    "Probe",
    "TimmViTProbe",
    "as_features",
    "from_callable",
    "from_hf_dinov2",
    "from_hf_dpt",
    "from_hf_vision",
    "from_timm",
    "image_map",
    "jvp_friendly",
    "linear_probe",
]
