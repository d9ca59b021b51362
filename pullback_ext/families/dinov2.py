"""Hugging Face DINOv2, with or without registers (``Dinov2Model``, ``...ForImageClassification``,
``Dinov2Backbone``, their ``Dinov2WithRegisters`` versions): CLS, registers, LayerScale."""

from pullback_ext.families.adapter import AttentionLayout, Branches, HFFamily, ProbeReadout

LOOPS = ("Dinov2Encoder", "Dinov2WithRegistersEncoder")
PROJECTIONS = ("q_proj", "k_proj", "v_proj")
ATTENTION = AttentionLayout("norm1", "attention", PROJECTIONS, "head_dim", "scaling")
SCALED_BRANCHES = Branches(("attention.o_proj", "layer_scale1"), "norm2", ("mlp", "layer_scale2"))  # LayerScale
ATTENTION_LINEARS = tuple(f"attention.{n}_proj" for n in "qkvo")
# a name a layer lacks is skipped: the SwiGLU MLP has weights_in / weights_out
LORA_TARGETS = ATTENTION_LINEARS + ("mlp.fc1", "mlp.fc2", "mlp.weights_in", "mlp.weights_out")

ADAPTER = HFFamily(
    name="dinov2", title="a Hugging Face DINOv2 model (Dinov2Encoder / Dinov2WithRegistersEncoder)", short_title="DINOv2",
    loops=LOOPS, attention=ATTENTION, branches=SCALED_BRANCHES, lora_targets=LORA_TARGETS,
    loads={"dinov2": ("Dinov2Model",), "dinov2_with_registers": ("Dinov2WithRegistersModel",)}, priority=20,
    dense=("Dinov2Backbone", "Dinov2WithRegistersBackbone"), captures=True,
    probe=ProbeReadout(("Dinov2Model", "Dinov2WithRegistersModel"), "dinov2", "encoder.layer", "layernorm"),
)
