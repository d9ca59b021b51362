"""Token merging and pruning with the learned geometry, and the methods users already have.

- ``methods``: the registry of token-reduction methods, one module each (``single_stage``: the
  staged criteria of ``strategies``; ``tome``, ``pitome``, ``evit``, ``expedite``, ``asap``, ``tap``:
  the methods as their authors define them); ``methods.base``: what a method is
- ``reduction_options``: the validated options of a reduction (common fields, and the method's own)
- ``pipeline``: the block loop every patched backbone runs; ``timm_vit``, ``timm_eva``,
  ``hf_encoders``, ``hf_split``, ``hf_vit``: the block adapters of the model families
- ``tokens``, ``merged_tokens``: the running token state (prune / merge / re-insert through the
  kernels); ``split_block``: a block run as attention, then MLP; ``folded_attention``, ``rope``
- ``strategies``: the single-stage keep scores; ``oracle``: the imp* scorer; ``matching``: where
  merged tokens go (pullback distance or cosine); ``recovery``; ``redundancy``
- ``eta``: the η a setting produces; ``schedules``: ViT-B stage schedules scaled to other depths

The patch API itself is :mod:`pullback_ext.patch`; the evaluation of reduced models (quality,
cost, Pareto fronts, reports) is :mod:`pullback_ext.comparison`.
"""
