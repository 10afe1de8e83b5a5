"""gtpo_kernels: a fused, tested implementation of the GTPO loss for RL fine-tuning of LLMs."""

from .config import GTPOConfig
from .fused_linear import FusedLinearGTPOLoss, fused_linear_gtpo_loss
from .loss import GTPOLoss, gtpo_loss
from .token_stats import token_logprobs_and_entropy
from .reference import compute_advantages, conflict_weights
from .result import GTPOLossOutput, GTPOMetrics

__version__ = "0.1.0"

__all__ = [
    "FusedLinearGTPOLoss",
    "GTPOConfig",
    "GTPOLoss",
    "GTPOLossOutput",
    "GTPOMetrics",
    "compute_advantages",
    "conflict_weights",
    "fused_linear_gtpo_loss",
    "gtpo_loss",
    "token_logprobs_and_entropy",
]
