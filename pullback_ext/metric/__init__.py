"""Learned task metrics (docs/formulas.md §3): the Spectral Pullback Network, the distilled importance head and
the VAE bottleneck, with their RandNLA / exact-SVD targets, training loop and checkpoints."""

from pullback_ext.metric.checkpoint import load_model, save_model
from pullback_ext.metric.evaluation import spearman_per_image
from pullback_ext.metric.head import ImportanceHead, parameter_count
from pullback_ext.metric.schedule import load_schedule
from pullback_ext.metric.spn import SPN, LowRankMetric
from pullback_ext.metric.targets import TargetCache, TargetConfig, compute_targets
from pullback_ext.metric.training import TrainConfig, fit
from pullback_ext.metric.vae import FeatureVAE, LatentProbe

__all__ = [
    "FeatureVAE",
    "ImportanceHead",
    "LatentProbe",
    "LowRankMetric",
    "SPN",
    "TargetCache",
    "TargetConfig",
    "TrainConfig",
    "compute_targets",
    "fit",
    "load_model",
    "load_schedule",
    "parameter_count",
    "save_model",
    "spearman_per_image",
]
