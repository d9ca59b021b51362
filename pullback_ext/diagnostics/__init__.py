"""The tractability diagnostic: spectrum, captured energy, spatial concentration and regime of a
probe map at given feature maps (docs/formulas.md §2).

``diagnose(probe, F, DiagnoseConfig(...))`` returns a ``Diagnosis``: one ``ImageDiagnosis`` per
feature map and an aggregate (mean ± std over images) with the regime of the mean.

- ``config``: ``DiagnoseConfig`` (every setting, validated once) and the regime ``Thresholds``;
- ``regimes``: the five regimes and ``classify``;
- ``image``: ``diagnose_one`` (method choice, spectrum, statistics of one feature map);
- ``batch``: ``diagnose`` over a batch; ``results``: the result types and ``aggregate``.
"""

from pullback_ext.diagnostics.batch import RankCappedWarning, diagnose
from pullback_ext.diagnostics.config import DiagnoseConfig, Thresholds
from pullback_ext.diagnostics.image import diagnose_one
from pullback_ext.diagnostics.regimes import REDUCTION, REGIMES, classify
from pullback_ext.diagnostics.results import AGGREGATED, Diagnosis, ImageDiagnosis, aggregate, r90_note, recorded_settings

__all__ = [
    "AGGREGATED",
    "DiagnoseConfig",
    "Diagnosis",
    "ImageDiagnosis",
    "REDUCTION",
    "REGIMES",
    "RankCappedWarning",
    "Thresholds",
    "aggregate",
    "classify",
    "diagnose",
    "diagnose_one",
    "r90_note",
    "recorded_settings",
]
