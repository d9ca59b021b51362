"""``python -m pullback_ext ...`` (also what ``torchrun -m pullback_ext`` runs)."""

from pullback_ext.cli import console_main

console_main()
