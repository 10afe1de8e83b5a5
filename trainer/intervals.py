"""95 % intervals for held-out rates: what a before/after figure of a few dozen problems can and cannot tell.

A held-out metric is a share of ``n`` problems (right greedy answer, right answer among k samples, ...). Its
Wilson score interval is the set of true rates ``p`` for which the observed share ``s`` is within ``z``
standard errors, ``|s - p| <= z sqrt(p (1 - p) / n)``; unlike ``s +- z sqrt(s (1 - s) / n)`` it stays inside
[0, 1] and does not shrink to a point at 0 or 1 (an 8-problem run that got every answer right is not proof
of a perfect policy).
"""

from __future__ import annotations

import math
from typing import Dict, List, Tuple

Z95 = 1.959963984540054  # the normal distribution's 97.5 % quantile: a two-sided 95 % interval


def wilson(share: float, n: int, z: float = Z95) -> Tuple[float, float]:
    """The Wilson score interval ``(low, high)`` of a rate observed as ``share`` of ``n`` trials."""
    if n < 1:
        raise ValueError(f"n must be a positive number of problems (got {n})")
    if not 0 <= share <= 1:
        raise ValueError(f"share must be in [0, 1] (got {share})")
    z2n = z * z / n
    centre = (share + z2n / 2) / (1 + z2n)
    half = z / (1 + z2n) * math.sqrt(share * (1 - share) / n + z2n / (4 * n))
    # The interval always contains the observed share; clamp only the rounding at 0 and 1.
    return max(0.0, min(share, centre - half)), min(1.0, max(share, centre + half))


# Held-out figures that are counts or means, not shares of the problems (`trainer.evaluation`).
NOT_SHARES = frozenset({"reward", "distinct_answers", "mean_completion_tokens", "mean_reasoning_words"})


def is_share(metric: str) -> bool:
    """Whether a held-out metric is a share of the problems (accuracy, a rate, pass@k, maj@k, the top answer's
    share), which has an interval; a reward's mean (``reward``, ``rewards/NAME``), the number of distinct answers
    and the mean lengths are not. (pass@k below k = eval_k and the reasoning share are means over the problems of
    shares in [0, 1], not counts of problems: a variable in [0, 1] varies no more than a 0/1 one of the same mean, so
    their Wilson interval is, if anything, too wide.)"""
    return not (metric in NOT_SHARES or metric.startswith("rewards/"))


def metric_intervals(metrics: Dict[str, float], n: int) -> Dict[str, List[float]]:
    """``{metric: [low, high]}``: each held-out share's 95 % interval over ``n`` problems (`is_share`)."""
    return {name: list(wilson(value, n)) for name, value in metrics.items() if is_share(name)}


def with_interval(share: float, n: int) -> str:
    """``0.719 [0.60, 0.81]``: a rate and its 95 % interval, as the run's summary and compare print it."""
    low, high = wilson(share, n)
    return f"{share:.3f} [{low:.2f}, {high:.2f}]"


# Student's t distribution's 97.5 % quantiles by degrees of freedom (1-30): a mean of a few seeds has a wider
# two-sided 95 % interval than the normal's +-1.96 standard errors (4 seeds: +-3.18).
T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def t_interval(values: List[float]) -> Tuple[float, float]:
    """The 95 % Student's t interval of the mean of ``values`` (independent runs: seeds, or paired differences of
    seeds); ``(nan, nan)`` for fewer than two. Beyond 31 values the normal quantile (a slightly narrower interval)."""
    n = len(values)
    if n < 2:
        return (float("nan"), float("nan"))
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = (T975[n - 2] if n - 1 <= len(T975) else Z95) * sd / math.sqrt(n)
    return mean - half, mean + half
