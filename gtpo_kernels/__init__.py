"""gtpo_kernels: a fused, tested implementation of the GTPO loss for RL fine-tuning of LLMs."""

from . import custom_ops  # noqa: F401 (registers the gtpo_kernels:: operators)
from ._version import __version__
from .advantages import compute_advantages
from .config import GTPOConfig
from .conflict import conflict_weights
from .fused_linear import FusedLinearGTPOLoss, fused_linear_gtpo_loss, fused_linear_token_logprobs_and_entropy
from .loss import GTPOLoss, gtpo_loss
from .result import GTPOLossOutput, GTPOMetrics
from .token_stats import token_logprobs_and_entropy

__all__ = [
    "__version__",
    "FusedLinearGTPOLoss",
    "GTPOConfig",
    "GTPOLoss",
    "GTPOLossOutput",
    "GTPOMetrics",
    "compute_advantages",
    "conflict_weights",
    "fused_linear_gtpo_loss",
    "fused_linear_token_logprobs_and_entropy",
    "gtpo_loss",
    "token_logprobs_and_entropy",
]
