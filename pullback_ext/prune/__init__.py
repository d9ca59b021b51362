"""Token merging and pruning with the learned geometry, and the baselines.

- ``tokens``: the running token state (prune / merge / re-insert through the kernels)
- ``strategies``: which tokens go (importance, oracle, random, tome_score, evit_score, norm, cls_sim,
  asap_score); ``oracle``: the imp* scorer; ``matching``: where merged tokens go (pullback distance or cosine)
- ``tome``, ``evit``: ToMe and EViT as their authors run them, reducing inside the blocks
  (``merged_tokens``: their token state; ``split_block``: a block run as attention, then MLP)
- ``asap``: ASAP reconstructed from its abstract (sink-anchored, pools or prunes in one shot)
- ``reduction_options``: the validated options of a reduction; ``pipeline``: the reducing block
  loop; ``timm_vit`` / ``hf_encoders`` adapters; ``eta``: the η a setting produces
- ``schedules``: ViT-B stage schedules scaled to other depths

The patch API itself is :mod:`pullback_ext.patch`; the evaluation of reduced models (quality,
cost, Pareto fronts, reports) is :mod:`pullback_ext.comparison`.
"""

