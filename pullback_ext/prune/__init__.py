"""Token merging and pruning with the learned geometry, baselines and their evaluation.

- ``tokens``: the running token state (prune / merge / re-insert through the kernels)
- ``strategies``: which tokens go (importance, oracle, random, tome, evit, norm, cls_sim, asap);
  ``oracle``: the imp* scorer; ``matching``: where merged tokens go (pullback distance or cosine)
- ``pipeline``: validated plans and the reducing block loop; ``timm_vit`` / ``hf_encoders`` adapters
- ``schedules``: ViT-B stage schedules scaled to other depths
- ``quality``, ``cost``, ``evaluation``, ``report``: metrics, FLOPs / wall-clock, strategy × ratio
  tables, JSON and plots; ``backbones``: the models ``pullback evaluate`` loads
- ``subspace``: Geosubprobe-style subspace interventions

The patch API itself is :mod:`pullback_ext.patch`.
"""

