"""Hugging Face DPT with a ViT encoder (``DPTViTEncoder``): a depth model whose neck reads the
encoder's hidden states; its attention takes no mask (a patched layer adds the bias itself)."""

from pullback_ext.families.adapter import AttentionLayout, Branches, HFFamily

ADAPTER = HFFamily(
    name="dpt", title="a Hugging Face DPT with a ViT encoder (DPTViTEncoder)", loops=("DPTViTEncoder",),
    attention=AttentionLayout("layernorm_before", "attention.attention", ("query", "key", "value"),
                              "attention_head_size", "scaling"),
    branches=Branches(("attention.output.dense",), "layernorm_after", ("intermediate", "output.dense")),
    lora_targets=("attention.attention.query", "attention.attention.key", "attention.attention.value",
                  "attention.output.dense", "intermediate.dense", "output.dense"),
    loads={"dpt": ("DPTForDepthEstimation",)}, depth=True, priority=10, dense=("DPTModel",), takes_mask=False,
    checked=False,
)
