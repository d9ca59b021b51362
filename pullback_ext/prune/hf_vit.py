"""``ViTModel.forward`` of transformers 5 with token reduction.

Since transformers 5 a ``ViTModel`` has no encoder module: its forward runs the embedding, the
layers (``ViTModel.layers``), the final LayerNorm and the pooler itself. The patched forward is that
method line by line with the layer loop replaced by ``run_layers``; it is installed wrapped in the
same ``merge_with_config_defaults`` and ``capture_outputs`` decorators, so hidden states are
recorded by the same hooks on the (full-length returning) layers. A hash of the upstream source is
recorded in :data:`pullback_ext.families.versions.MIRRORS`; a test fails when it changes.
"""

from __future__ import annotations

from typing import Callable

import torch

from pullback_ext.errors import PullbackError


def refuse_attention_mask(attention_mask) -> None:
    """A token-reducing layer loop takes no attention mask: its token set changes between layers."""
    if attention_mask is not None:
        raise PullbackError(f"attention_mask: a token-reducing encoder takes none (its token set changes between "
                            f"layers); got a tensor of shape {list(attention_mask.shape)}")


def model_forward(model, run_layers: Callable, pixel_values: torch.Tensor | None = None, bool_masked_pos=None,
                  interpolate_pos_encoding: bool | None = None, attention_mask=None, **kwargs):
    """``ViTModel.forward`` on ``pixel_values [B, C, H, W]`` with ``run_layers(embeddings [B, N, D])
    -> [B, N, D]`` (full-length) as its layer loop; returns ``BaseModelOutputWithPooling``."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    expected_dtype = model.embeddings.patch_embeddings.projection.weight.dtype
    if pixel_values.dtype != expected_dtype:
        pixel_values = pixel_values.to(expected_dtype)
    embedding_output = model.embeddings(
        pixel_values, bool_masked_pos=bool_masked_pos, interpolate_pos_encoding=interpolate_pos_encoding
    )
    refuse_attention_mask(attention_mask)  # upstream turns it into a bidirectional mask over all N tokens
    sequence_output = model.layernorm(run_layers(embedding_output))
    pooled_output = model.pooler(sequence_output) if model.pooler is not None else None
    return BaseModelOutputWithPooling(last_hidden_state=sequence_output, pooler_output=pooled_output)
