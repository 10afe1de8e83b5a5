"""verl's config, read as GTPO's: the names this package registers, the `GTPOConfig` of an ``algorithm.gtpo``
section (`gtpo_settings`), the reduction an actor's ``loss_agg_mode`` gives (`verl_reduction`), and the refusal of
combinations that contradict the preset (`check_verl_config`)."""

from __future__ import annotations

from dataclasses import fields
from typing import Optional

from ...config import GTPOConfig

ESTIMATOR = "gtpo"


POLICY_LOSS = "gtpo"


POLICY_LOSS_SUM = "gtpo_sum"


# verl's loss_agg_mode -> the GTPO reduction it computes (per completion token mean, then mean over the
# mini-batch's completions, etc.). The others (token-sum, seq-mean-token-sum) are none of GTPO's.
AGG_MODE_REDUCTION = {
    "seq-mean-token-mean": "sequence_mean",
    "token-mean": "token_mean",
    "seq-mean-token-sum-norm": "dr_grpo",
}


# GTPOConfig knobs that verl's own config holds: refused in algorithm.gtpo, with the field to set instead.
VERL_OWNED = {
    "clip_eps_low": "actor_rollout_ref.actor.clip_ratio_low",
    "clip_eps_high": "actor_rollout_ref.actor.clip_ratio_high",
    "kl_beta": "actor_rollout_ref.actor.use_kl_loss / kl_loss_coef (verl adds the KL beside the policy loss)",
    "max_completion_length": "actor_rollout_ref.actor.loss_scale_factor (dr_grpo's cap)",
}


# GTPOConfig knobs of the loss itself that the policy loss cannot be given (it sees verl's actor config only,
# which has no field for them): refused in algorithm.gtpo rather than accepted and ignored.
NOT_IN_VERL = ("ratio_cap", "kl_ratio_weighted")


_NOT_READ = ("max_chunk_bytes", "inplace_backward", "validate_inputs", "warn_no_signal")


def _plain(section) -> dict:
    if section is None:
        return {}
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(section, DictConfig):
            return OmegaConf.to_container(section, resolve=True)
    except ImportError:  # pragma: no cover (omegaconf comes with verl)
        pass
    return dict(section)


def _get(config, key: str, default=None):
    if config is None:
        return default
    if isinstance(config, dict):
        return config.get(key, default)
    getter = getattr(config, "get", None)
    return getter(key, default) if getter is not None else getattr(config, key, default)


def gtpo_settings(algorithm) -> tuple[GTPOConfig, Optional[float]]:
    """``(GTPOConfig, initial_entropy)`` from verl's ``algorithm`` config and its ``gtpo`` section.

    The section holds ``preset`` and any `GTPOConfig` knob that verl has no field for, plus
    ``initial_entropy`` (the entropy gate's reference; default: measured on the first batch this process
    sees, so set it when resuming). ``loss_reduction`` may be given to state the reduction that the actor's
    ``loss_agg_mode`` must give (`check_verl_config`).
    """
    section = _plain(_get(algorithm, "gtpo"))
    initial_entropy = section.pop("initial_entropy", None)
    known = {f.name for f in fields(GTPOConfig)} - set(_NOT_READ)
    for name in section:
        if name in VERL_OWNED:
            raise ValueError(f"algorithm.gtpo.{name}: verl holds this setting; set {VERL_OWNED[name]} instead")
        if name in NOT_IN_VERL:
            raise ValueError(
                f"algorithm.gtpo.{name} acts in the policy loss, which verl gives only its actor config "
                f"(no field for it): not available with verl"
            )
        if name not in known:
            raise ValueError(
                f"algorithm.gtpo.{name} is not a GTPO setting; known: "
                f"{sorted(known - set(VERL_OWNED) - set(NOT_IN_VERL)) + ['initial_entropy']}"
            )
    config = GTPOConfig(**section, warn_no_signal=False)
    if config.entropy_mode == "penalty" and config.entropy_coef > 0:
        raise ValueError(
            "algorithm.gtpo.entropy_mode='penalty' needs the current entropy with its gradient, which "
            "verl's policy loss is not given: use 'advantage_shift' (the presets' mode)"
        )
    if initial_entropy is not None and not (isinstance(initial_entropy, (int, float)) and initial_entropy >= 0):
        raise ValueError(f"algorithm.gtpo.initial_entropy must be a number >= 0, got {initial_entropy!r}")
    return config, initial_entropy


# verl's own policy losses that take per-token advantages and reduce by loss_agg_mode: with the gtpo estimator,
# which folds the conflict weights, the entropy filter and the shift into the advantages, each is GTPO with that
# ratio function (docs/verl.md): PPO's clip (vanilla, with verl's dual clip), GSPO, CISPO and SAPO as verl defines
# them.
VERL_RATIO_LOSSES = ("vanilla", "gspo", "cispo", "sapo")
# Those that reduce as they please whatever loss_agg_mode says (verl's SAPO: always the per-completion mean).
VERL_FIXED_AGG_MODE = {"sapo": "seq-mean-token-mean"}


def verl_reduction(loss_mode: str, loss_agg_mode: str) -> str:
    """The GTPO reduction the ``gtpo`` / ``gtpo_sum`` policy loss computes under this ``loss_agg_mode``."""
    if loss_mode == POLICY_LOSS_SUM:
        if loss_agg_mode != "seq-mean-token-mean":
            raise ValueError(
                f"actor.policy_loss.loss_mode={POLICY_LOSS_SUM} sums per-completion token means; set "
                f"actor.loss_agg_mode=seq-mean-token-mean (got {loss_agg_mode!r}) so that verl's own "
                f"KL and entropy terms also take per-completion means"
            )
        return "sum"
    if loss_agg_mode not in AGG_MODE_REDUCTION:
        raise ValueError(
            f"actor.loss_agg_mode={loss_agg_mode!r} is none of GTPO's reductions; with "
            f"loss_mode={POLICY_LOSS} use one of {sorted(AGG_MODE_REDUCTION)} (or "
            f"loss_mode={POLICY_LOSS_SUM} for the official preset's sum)"
        )
    return AGG_MODE_REDUCTION[loss_agg_mode]


def check_verl_config(config) -> None:
    """Refuses a verl config (the whole Hydra config) whose settings contradict the GTPO preset, in one line
    naming both settings. Called by the trainer before the first ``gtpo`` advantages; callable by hand."""
    algorithm = config.algorithm
    if str(_get(algorithm, "adv_estimator")) != ESTIMATOR:
        return
    gtpo, _ = gtpo_settings(algorithm)
    actor = config.actor_rollout_ref.actor
    loss_mode = _get(_get(actor, "policy_loss"), "loss_mode", "vanilla")
    if loss_mode not in (POLICY_LOSS, POLICY_LOSS_SUM, *VERL_RATIO_LOSSES):
        raise ValueError(
            f"algorithm.adv_estimator={ESTIMATOR} folds the conflict weights and the entropy filter into the "
            f"advantages, which loss_mode={loss_mode!r} does not take as per-token advantages reduced by "
            f"loss_agg_mode: set actor_rollout_ref.actor.policy_loss.loss_mode to {POLICY_LOSS} or one of "
            f"{list(VERL_RATIO_LOSSES)}"
        )
    if loss_mode in VERL_RATIO_LOSSES and gtpo.loss_reduction == "sum":
        raise ValueError(
            f"algorithm.gtpo (preset {gtpo.preset!r}) sums per-completion means, which no loss_agg_mode of verl's "
            f"loss_mode={loss_mode!r} gives: use loss_mode={POLICY_LOSS_SUM}, or algorithm.gtpo.loss_reduction="
            f"sequence_mean"
        )
    reduction = verl_reduction(loss_mode, VERL_FIXED_AGG_MODE.get(loss_mode, _get(actor, "loss_agg_mode")))
    if reduction != gtpo.loss_reduction:
        wanted = {v: k for k, v in AGG_MODE_REDUCTION.items()}.get(gtpo.loss_reduction)
        fix = (
            f"actor_rollout_ref.actor.policy_loss.loss_mode={POLICY_LOSS_SUM} with loss_agg_mode=seq-mean-token-mean"
            if gtpo.loss_reduction == "sum"
            else f"actor_rollout_ref.actor.loss_agg_mode={wanted} with loss_mode={POLICY_LOSS}"
        )
        raise ValueError(
            f"algorithm.gtpo (preset {gtpo.preset!r}) reduces by {gtpo.loss_reduction}, but "
            f"actor.loss_agg_mode={_get(actor, 'loss_agg_mode')!r} with loss_mode={loss_mode!r} gives "
            f"{reduction}: set {fix} (or algorithm.gtpo.loss_reduction={reduction})"
        )
    if reduction == "dr_grpo" and _get(actor, "loss_scale_factor") is None:
        raise ValueError(
            "actor.loss_agg_mode=seq-mean-token-sum-norm (dr_grpo) without actor.loss_scale_factor "
            "divides each micro-batch by its own padded length: set loss_scale_factor to the "
            "generation cap (data.max_response_length)"
        )
    if _get(algorithm, "use_kl_in_reward", False):
        raise ValueError(
            "algorithm.use_kl_in_reward=True puts a per-token KL into the rewards, which GTPO sums "
            "into one reward per completion: use actor_rollout_ref.actor.use_kl_loss instead"
        )
    needs_entropy = gtpo.entropy_coef > 0 or gtpo.entropy_filter
    bypass = _get(_get(algorithm, "rollout_correction"), "bypass_mode", False)
    if needs_entropy and bypass:
        raise ValueError(
            "algorithm.rollout_correction.bypass_mode=True skips the old-policy pass that gives the "
            "completion entropies GTPO's filter and shift use: turn it off, or set "
            "algorithm.gtpo.entropy_threshold=null and entropy_coef=0"
        )
