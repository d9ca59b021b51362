"""Layer studies: one measurement swept over the depth of a model (``pullback study KIND``).

- ``layers``: the ``--layers all|LIST`` rule (0-based blocks of the model at hand, checked);
- ``engine``: the sweep engine (one atomically written JSON unit per finished layer, resume,
  progress, images sharded over torchrun ranks);
- ``diagnose_study``: the tractability diagnostic per layer and decoder;
- ``subspace``: Geosubprobe-style subspace interventions on a linear probe of token features
  (the probe fits, the projections, the demo's depth probe);
- ``subspace_study``: Geosubprobe interventions on a per-token linear probe per layer;
- ``criteria_study``: training-free pruning criteria at one layer at a time, and the dense
  recovery endpoints;
- ``models``: the study's model names (``demo:random``, the demo architecture untrained);
- ``figures``: the plots.
"""
