"""Training DTEM's decoupled embeddings (above the reduction floor: it runs the patched models).

- ``relaxed``: the authors' continuous relaxation of ToMe's merge (soft grouping, soft merging)
- ``training``: the embedding learned on the frozen demo, timm or Hugging Face model, and the
  held-out report of the deployed (hard) merge

See docs/prune.md (DTEM).
"""
