"""Matched-cost comparison of token-reduction methods: run reduced models, measure what they cost
and how far their outputs move, and report it.

- ``backbones``: the models ``pullback evaluate`` loads (a ``Backbone``: features, a reduced
  forward under a ``Reduction``, its output head)
- ``tasks``: the tasks compared on (cls, depth, segmentation): their outputs, metrics and modes
- ``quality``: the output metrics (cosine ×100, kNN top-1, SILog ×100, per-pixel KL ×100, mIoU) and
  the Wilcoxon test
- ``cost``: FLOPs of a forward and interleaved wall-clock timing
- ``evaluation``: strategy × ratio tables of quality and cost (``pullback evaluate``)
- ``pareto``: quality against measured speed-up over method grids, the frontier and matched errors
  (``pullback evaluate --pareto``)
- ``report``, ``pareto_report``: their JSON, markdown and figures

Layering: this package builds on :mod:`pullback_ext.prune` (the reduction itself); ``prune``
never imports it.
"""
