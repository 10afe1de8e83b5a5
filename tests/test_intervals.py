"""`trainer.intervals`: the Wilson score interval against its definition and against published values."""

import math

import pytest

from trainer.intervals import Z95, metric_intervals, wilson, with_interval


def _bisect(f, low, high, steps=200):
    """A root of ``f`` between ``low`` and ``high``, where ``f`` changes sign."""
    f_low = f(low)
    for _ in range(steps):
        mid = (low + high) / 2
        if (f(mid) > 0) == (f_low > 0):
            low, f_low = mid, f(mid)
        else:
            high = mid
    return (low + high) / 2


@pytest.mark.parametrize("successes,n", [(0, 20), (1, 29), (8, 10), (81, 263), (32, 32), (23, 64), (127, 128)])
def test_bounds_solve_the_score_equation(successes, n):
    # The interval is every p with |s - p| <= z sqrt(p (1 - p) / n): its ends are that equation's roots, on
    # either side of the observed share s (or 0 and 1 themselves when s is 0 or 1).
    s = successes / n
    low, high = wilson(s, n)
    gap = lambda p: (s - p) ** 2 - Z95**2 * p * (1 - p) / n  # noqa: E731
    expected_low = 0.0 if s == 0 else _bisect(gap, 0.0, s)
    expected_high = 1.0 if s == 1 else _bisect(gap, s, 1.0)
    assert low == pytest.approx(expected_low, abs=1e-12)
    assert high == pytest.approx(expected_high, abs=1e-12)


def test_published_values():
    # Newcombe (1998), Statistics in Medicine 17:857, Table I, method 3 (score, no continuity correction).
    for (successes, n), expected in (
        ((81, 263), (0.2553, 0.3662)),
        ((15, 148), (0.0624, 0.1605)),
        ((0, 20), (0.0, 0.1611)),
        ((1, 29), (0.0061, 0.1718)),
    ):
        low, high = wilson(successes / n, n)
        assert (round(low, 4), round(high, 4)) == expected


def test_more_problems_narrow_the_interval_and_it_holds_the_share():
    widths = []
    for n in (32, 64, 128, 1024):
        low, high = wilson(0.75, n)
        assert 0 <= low < 0.75 < high <= 1
        widths.append(high - low)
    assert widths == sorted(widths, reverse=True)
    # About 1 / sqrt(n): four times the problems, half the width.
    assert widths[2] / widths[0] == pytest.approx(0.5, rel=0.05)


def test_bad_counts_are_refused():
    with pytest.raises(ValueError, match="n must be a positive"):
        wilson(0.5, 0)
    with pytest.raises(ValueError, match="share must be in"):
        wilson(1.5, 10)


def test_every_metric_gets_its_interval_and_a_printed_form():
    intervals = metric_intervals({"accuracy": 0.75, "pass@4": 1.0}, 64)
    assert intervals["accuracy"] == list(wilson(0.75, 64))
    assert intervals["pass@4"][1] == 1.0 and intervals["pass@4"][0] < 1.0
    low, high = wilson(0.75, 64)
    assert with_interval(0.75, 64) == f"0.750 [{low:.2f}, {high:.2f}]"
    assert not math.isclose(low, high)
