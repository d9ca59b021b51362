"""TAP: task-adaptive pruning with one learned task register per task (a reconstruction).

- ``register``: the register token, its read-out (scores, budget shares, recovery scale α) and
  TAP-J's LoRA adapters; ``budget``: the exact keep count and the largest-remainder split
- ``run``: the deployed block loop (``patch.timm(model, strategy="tap", head=DIR, ratio=η)``);
  ``relaxed``: the training forward with a straight-through top-k
- ``training``: TAP-F / TAP-J training on the demo model; ``checkpoint``: loading a register
  (and the checkpoint kinds of the metric format with TAP's 'tap' added)

See docs/tap.md.
"""
