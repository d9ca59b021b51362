"""TAP: task-adaptive pruning with one learned task register per task (a reconstruction).

- ``register``: the register token, its read-out (scores, budget shares, recovery scale α) and
  TAP-J's LoRA adapters; ``budget``: the exact keep count and the largest-remainder split;
  ``tokens``: the register's place in the sequence
- ``checkpoint``: loading a register (the checkpoint kinds of the metric format with TAP's added)

The deployed block loop is the TAP method of the registry (:mod:`pullback_ext.prune.methods.tap`);
training is :mod:`pullback_ext.tap_training`. See docs/tap.md.
"""
