"""Training TAP registers (above the reduction floor: it runs the patched models).

- ``relaxed``: the training forward with a straight-through top-k
- ``training``: TAP-F / TAP-J training on the demo model, a timm or a Hugging Face model
- ``evaluation``: the held-out report of a trained register

See docs/tap.md.
"""
