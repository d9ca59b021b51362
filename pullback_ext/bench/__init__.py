"""``pullback bench``, the application: microbenchmarks of the fused ops (:mod:`.ops`) with their
timing helpers (:mod:`.timing`), eager baselines (:mod:`.baselines`), outputs (:mod:`.report`) and
the CUDA kernel breakdown (:mod:`.kernel_breakdown`). Nothing in the library imports this package."""
