"""``pullback bench``, the application: microbenchmarks of the fused ops (:mod:`.ops`) with their
timing helpers (:mod:`.timing`), eager baselines (:mod:`.baselines`), outputs (:mod:`.report`),
the CUDA kernel breakdown and launch counts (:mod:`.kernel_breakdown`), the operator counter
(:mod:`.dispatch`) and where a forward's time goes (:mod:`.forward_profile`). Nothing in the library imports this package."""
