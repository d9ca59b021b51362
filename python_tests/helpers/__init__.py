"""Shared test helpers: tiny random-weight models, dense-Jacobian oracles and reference blocks
(import as ``from helpers.prune import ...``; fixtures live in ``conftest.py``)."""
