"""Token merging and pruning with the learned geometry, and the methods users already have.

- ``methods``: the registry of token-reduction methods (:func:`pullback_ext.prune.methods.all_methods`;
  one module per method family, which documents its options; ``single_stage`` runs the criteria
  of ``strategies``); ``methods.base``: what a method is
- ``reduction_options``: the validated options of a reduction (common fields, and the method's own);
  ``option_checks``: the checks they share
- ``pipeline``: the block loop every patched backbone runs; ``timm_vit``, ``timm_eva`` (with
  ``timm_blocks``, what the two share), ``hf_encoders``, ``hf_split``, ``hf_vit``: the block
  adapters of the model families
- ``tokens``, ``merged_tokens``: the running token state (prune / merge / re-insert through the
  kernels); ``stages``: the token counts of a staged reduction; ``split_block``: a block run as
  attention, then MLP; ``folded_attention``, ``rope``
- ``strategies``: the single-stage keep scores; ``oracle``: the imp* scorer; ``attention_sink``: the
  lazy walk over the attention and its sink (ASAP's); ``matching``: where merged tokens go
  (pullback distance or cosine); ``recovery``; ``redundancy``
- ``eta``: the η a setting produces; ``schedules``: ViT-B stage schedules scaled to other depths;
  ``row_rules``: a comparison row's label

The patch API itself is :mod:`pullback_ext.patch`; the evaluation of reduced models (quality,
cost, Pareto fronts, reports) is :mod:`pullback_ext.comparison`.
"""
