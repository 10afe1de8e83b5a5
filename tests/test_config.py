"""`GTPOConfig`: presets fill only what the user did not set, the config cannot drift or mix presets, and
every knob is validated with an error that names it."""

import dataclasses
import math

import pytest

from gtpo_kernels import GTPOConfig


def test_presets_fill_knobs():
    paper, official, grpo = (GTPOConfig(preset=p) for p in ("paper", "official", "grpo"))
    assert paper.entropy_threshold == pytest.approx(math.log(2)) and paper.entropy_gate
    assert official.entropy_threshold == 0.7 and not official.entropy_gate
    assert official.divide_by_conflict_count and official.loss_reduction == "sum"
    assert grpo.entropy_threshold is None and not grpo.use_conflict_weights
    assert grpo.clip_eps_low == grpo.clip_eps_high == 0.2 and grpo.normalize_advantages_by_std
    assert not paper.clipping and grpo.clipping


def test_overrides_win_over_the_preset():
    c = GTPOConfig(preset="official", entropy_threshold=0.5, loss_reduction="token_mean")
    assert c.entropy_threshold == 0.5 and c.loss_reduction == "token_mean"
    assert c.divide_by_conflict_count  # the rest still from the preset
    assert GTPOConfig.from_dict(c.to_dict()) == c


def test_clipping_can_be_switched_off_in_every_preset():
    for preset in ("paper", "official", "grpo"):
        c = GTPOConfig(preset=preset, clip_eps_low=None, clip_eps_high=None)
        assert not c.clipping and c.clip_eps_low is None and c.clip_eps_high is None


def test_one_clip_side():
    # A preset that clips keeps its other side (DAPO's clip-higher on top of GRPO).
    c = GTPOConfig(preset="grpo", clip_eps_high=0.28)
    assert (c.clip_eps_low, c.clip_eps_high) == (0.2, 0.28)
    # A preset without clipping: one side given clips symmetrically.
    c = GTPOConfig(preset="paper", clip_eps_low=0.2)
    assert (c.clip_eps_low, c.clip_eps_high) == (0.2, 0.2)
    # An infinite side is open: clip_eps_high=inf clips only below.
    c = GTPOConfig(preset="grpo", clip_eps_high=math.inf)
    assert c.clipping and c.clip_bounds == (0.8, math.inf)
    c = GTPOConfig(preset="grpo", clip_eps_low=math.inf)
    assert c.clip_bounds == (-math.inf, 1.2)


def test_errors_name_the_right_clip_field():
    with pytest.raises(ValueError, match="clip_eps_high must be a number >= 0"):
        GTPOConfig(preset="grpo", clip_eps_high=-0.1)
    with pytest.raises(ValueError, match=r"clip_eps_low must be a number in \[0, 1\)"):
        GTPOConfig(preset="grpo", clip_eps_low=1.5)
    with pytest.raises(ValueError, match="clip_eps_high"):
        GTPOConfig(preset="grpo", clip_eps_high=float("nan"))


def test_replace_re_resolves_the_preset():
    base = GTPOConfig(entropy_coef=0.05)  # paper, one knob set by the user
    grpo = base.replace(preset="grpo")
    # The user's knob survives; every other knob follows the new preset (no paper leftovers).
    assert grpo.entropy_coef == 0.05
    assert grpo == GTPOConfig(preset="grpo", entropy_coef=0.05)
    assert GTPOConfig().replace(preset="grpo") == GTPOConfig(preset="grpo")


def test_replace_keeps_an_explicit_value_and_depends_on_the_fields_only():
    """An explicit change is never thrown away, even when it equals what the old preset filled in; configs with
    equal fields replace alike (no state beyond the fields)."""
    for replaced in (
        dataclasses.replace(GTPOConfig(preset="paper"), preset="grpo", entropy_threshold=math.log(2)),
        GTPOConfig(preset="paper").replace(preset="grpo", entropy_threshold=math.log(2)),
    ):
        assert replaced.entropy_threshold == math.log(2)
    filled, given = GTPOConfig(preset="paper"), GTPOConfig(preset="paper", entropy_threshold=math.log(2))
    assert filled == given
    assert filled.replace(preset="grpo") == given.replace(preset="grpo")
    assert dataclasses.replace(filled, kl_beta=0.1) == dataclasses.replace(given, kl_beta=0.1)
    # dataclasses.replace copies every field: a new preset fills nothing in a copy (it relabels).
    copied = dataclasses.replace(filled, preset="grpo")
    assert copied.entropy_threshold == math.log(2) and copied.preset == "grpo"
    assert [f.name for f in dataclasses.fields(GTPOConfig)] == list(GTPOConfig().to_dict())  # nothing private


def test_configs_saved_by_earlier_versions_load():
    """`to_dict` of an earlier version (every knob resolved, the fields in their old order) loads as an equal config;
    a field this version does not know is refused in one line."""
    saved = {
        "preset": "grpo",
        "normalize_advantages_by_std": True,
        "entropy_threshold": None,
        "entropy_gate": False,
        "entropy_coef": 0.0,
        "entropy_mode": "advantage_shift",
        "use_conflict_weights": False,
        "conflict_weight": 2.0,
        "divide_by_conflict_count": False,
        "loss_reduction": "sequence_mean",
        "clip_eps_low": 0.2,
        "clip_eps_high": 0.28,
        "kl_beta": 0.05,
    }
    assert GTPOConfig.from_dict(saved) == GTPOConfig(preset="grpo", clip_eps_high=0.28, kl_beta=0.05)
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['_origin'\]"):
        GTPOConfig.from_dict({**saved, "_origin": None})


def test_replace_validates():
    with pytest.raises(ValueError, match="kl_beta must be"):
        dataclasses.replace(GTPOConfig(), kl_beta=-1.0)
    with pytest.raises(ValueError, match="unknown field"):
        GTPOConfig().replace(beta=0.1)


def test_config_is_frozen():
    c = GTPOConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.kl_beta = -1.0  # would skip validation


def test_infinite_threshold_and_none_switch_the_filter_off():
    assert not GTPOConfig(entropy_threshold=math.inf).entropy_filter
    assert not GTPOConfig(entropy_threshold=None).entropy_filter
    assert GTPOConfig().entropy_filter


def test_one_chunk_budget_knob():
    assert GTPOConfig(max_chunk_bytes=4 * 2**20).max_chunk_bytes == 4 * 2**20
    with pytest.raises(TypeError):
        GTPOConfig(chunk_size=3)  # replaced by max_chunk_bytes (bytes of float32 logits)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(preset="ppo"), "preset must be one of"),
        (dict(entropy_threshold=-1.0), "entropy_threshold must be a positive number"),
        (dict(entropy_coef=-0.1), "entropy_coef must be a finite number >= 0"),
        (dict(entropy_mode="bonus"), "entropy_mode must be one of"),
        (dict(conflict_weight=0.0), "conflict_weight must be"),
        (dict(loss_reduction="mean"), "loss_reduction must be one of"),
        (dict(kl_beta=-1.0), "kl_beta must be"),
        (dict(max_chunk_bytes=0), "max_chunk_bytes must be a positive int"),
        (dict(max_completion_length=2.5), "max_completion_length must be a positive int"),
        (dict(entropy_gate="yes"), "entropy_gate must be True or False"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GTPOConfig(**kwargs)


def test_config_from_dict_rejects_unknown_fields():
    with pytest.raises(ValueError, match="unknown field"):
        GTPOConfig.from_dict({"preset": "paper", "beta": 0.1})


def test_the_entropy_shift_scope_is_checked():
    assert GTPOConfig().entropy_shift_scope == "all"
    with pytest.raises(ValueError, match="entropy_shift_scope"):
        GTPOConfig(entropy_shift_scope="tied")
    with pytest.raises(ValueError, match="entropy_shift_scope.*needs entropy_mode='advantage_shift'"):
        GTPOConfig(entropy_shift_scope="nonzero_advantage", entropy_mode="penalty")


def test_clip_cov_and_kl_cov_settings_are_checked():
    """cov_mode's knobs: a mode of the two, a share in (0, 1] (the mode's default without one), a band low < high,
    a coefficient >= 0; the per-token advantages of verl's path cannot carry a pick made inside the loss."""
    import torch

    from gtpo_kernels.objective import token_advantages
    from gtpo_kernels.rows import LossRows

    assert GTPOConfig().cov_share == 0 and GTPOConfig(cov_mode="clip_cov").cov_share == 2e-4
    assert GTPOConfig(cov_mode="kl_cov").cov_share == 2e-3
    assert GTPOConfig(cov_mode="kl_cov", cov_ratio=0.3).cov_share == 0.3
    for bad in (
        dict(cov_mode="cov"),
        dict(cov_ratio=0.0),
        dict(cov_ratio=1.5),
        dict(clip_cov_low=5.0),
        dict(clip_cov_high=float("inf")),
        dict(kl_cov_coef=-1.0),
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            GTPOConfig(**bad)
    rows = LossRows(
        ids=torch.zeros(2, 3, dtype=torch.long), valid=torch.ones(2, 3, dtype=torch.bool), advantages=torch.ones(2)
    )
    with pytest.raises(ValueError, match="cov_mode='clip_cov' picks tokens"):
        token_advantages(torch.rand(2, 3), rows, GTPOConfig(cov_mode="clip_cov"))
