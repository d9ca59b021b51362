"""``python -m pullback_ext ...`` (also what ``torchrun -m pullback_ext`` runs)."""

import sys

from pullback_ext.cli import main

sys.exit(main())
