"""Hugging Face Depth Anything (``DepthAnythingForDepthEstimation``): a DINOv2 backbone (its layers
are DINOv2's) whose hidden states feed a DPT-style depth neck."""

from pullback_ext.families import dinov2
from pullback_ext.families.adapter import HFFamily

ADAPTER = HFFamily(
    name="depth_anything", title="a Hugging Face Depth Anything model (DepthAnythingForDepthEstimation)",
    loops=dinov2.LOOPS, anchors=("DepthAnythingForDepthEstimation",), attention=dinov2.ATTENTION,
    branches=dinov2.SCALED_BRANCHES, lora_targets=dinov2.LORA_TARGETS,
    loads={"depth_anything": ("DepthAnythingForDepthEstimation",)}, depth=True, priority=15,
    dense=("Dinov2Backbone", "Dinov2WithRegistersBackbone"), captures=True,
)
