"""The transformers versions the Hugging Face families were checked against, stated once.

:data:`CHECKED_TRANSFORMERS` is the range of transformers whose code the families' patched layer
loops mirror (pyproject.toml's ``models`` extra states the same range; a test compares them);
:func:`check_transformers` refuses other versions for the families that mirror code.
:data:`MIRRORS` records a hash of the upstream code the patched loops mirror or rely on (a test
compares it with the installed source).
"""

from __future__ import annotations

from pullback_ext.errors import PullbackError

CHECKED_TRANSFORMERS = ("5.24", "6")  # [lowest, first excluded) versions the mirrors were checked against
REQUIREMENT = f"transformers>={CHECKED_TRANSFORMERS[0]},<{CHECKED_TRANSFORMERS[1]}"

# The upstream code the adapters mirror or rely on, as of transformers 5.24.0: "module:qualified name"
# -> (sha256 of its inspect.getsource, what here depends on it). When a hash changes, re-read the new
# source against that code (and the versions in CHECKED_TRANSFORMERS), then record the new hash.
MIRRORS = {
    "transformers.models.vit.modeling_vit:ViTModel.forward": (
        "212d5a8f612d34b1cf6037a24a633b6d05535521e540c85b9a43b7edb4155aba", "hf_vit.model_forward (mirrored line by line)"),
    "transformers.models.dpt.modeling_dpt:DPTViTEncoder.forward": (
        "ac35e3e6f0a29c8fda1d900aefe81bddecdd85121814d180ca0ce93ca27816c1", "hf_encoders.encoder_forward (its layer loop)"),
    "transformers.models.dpt.modeling_dpt:DPTViTLayer.forward": (
        "0936d66774596f7aed1c1b3dbfe415470d0fb4f12a0762d96a546e22b8137ff2", "hf_encoders.biased_layer_forward"),
    "transformers.models.dinov2.modeling_dinov2:Dinov2Encoder.forward": (
        "a0a46fc79ac37bb4d29cf5b9da6f695b60ff0c6342575e9a32b6a207d9891fbb", "hf_encoders.encoder_forward (its layer loop)"),
    "transformers.models.dinov2_with_registers.modeling_dinov2_with_registers:Dinov2WithRegistersEncoder.forward": (
        "a0a46fc79ac37bb4d29cf5b9da6f695b60ff0c6342575e9a32b6a207d9891fbb", "hf_encoders.encoder_forward (its layer loop)"),
    "transformers.models.clip.modeling_clip:CLIPEncoder.forward": (
        "1004cb628fc6685f8316486c8fe5e84692ecf7add0fbbc6f91cb397ab768ca50", "hf_encoders.encoder_forward (its layer loop)"),
    "transformers.models.siglip.modeling_siglip:SiglipEncoder.forward": (
        "d91ba546ba6bcc0710927bffa70189e0c09563e897a682a969b8f8b8456f6963", "hf_encoders.encoder_forward (its layer loop)"),
    "transformers.models.dinov3_vit.modeling_dinov3_vit:DINOv3ViTEncoder.forward": (
        "b982b7cb5ae25c8d31c51bbd98019bb70dade90b7d7ca9cae5cf825f71cf3d7c", "hf_encoders.encoder_forward (its layer loop)"),
    "transformers.models.dinov3_vit.modeling_dinov3_vit:apply_rotary_pos_emb": (
        "8403a7e3d9db2c5e111f7a7795108985120a7d66ce5f1500590ea0a0116cebd3",
        "rope.RotaryRows (prefix tokens = all tokens but one per table row)"),
}


def check_transformers(family) -> None:
    """Raise unless the installed transformers is one the mirror of ``family`` (an
    :class:`~pullback_ext.families.adapter.HFFamily`) was checked against."""
    if not family.checked:
        return
    import transformers
    from packaging.version import Version

    low, high = CHECKED_TRANSFORMERS
    installed = Version(transformers.__version__)
    if not Version(low) <= installed < Version(high):
        raise PullbackError(f"token reduction for {family.title} mirrors transformers {low} up to (not including) "
                            f"{high}, whose layer loop it replaces; transformers {transformers.__version__} is installed "
                            f"(install {REQUIREMENT})")
