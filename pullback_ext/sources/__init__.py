"""Where models and images come from, from local files only.

Models (:mod:`pullback_ext.sources.models`) are named by one grammar, ``demo | timm:NAME |
hf:DIR``, plus an optional weights file:

- ``demo``: the embedded demo model (:mod:`pullback_ext.embedded`);
- ``timm:NAME``: ``timm.create_model(NAME, pretrained=False)`` and a local weights file;
- ``hf:DIR``: a transformers model from a local folder holding ``config.json`` (and weights): a
  DINOv2 model, or a DPT / Depth Anything depth model.

:mod:`pullback_ext.sources.probe_setup` turns a model and a decoder name into a probe map and the
preprocessing its images need.

Images (:mod:`pullback_ext.sources.images`) come from an :class:`~pullback_ext.sources.image_sets.ImageSource`:
a folder (a plain path is always a folder) or a built-in set ``builtin:NAME`` (``builtin:scenes``:
rendered demo scenes; ``builtin:photos``: crops of the photographs bundled with scikit-image and
scikit-learn). Every source hands out the same :class:`~pullback_ext.sources.image_sets.ImageSet`
(indexed, model-ready images), prepared by :mod:`pullback_ext.sources.preprocess`.
"""
