"""GTPO in verl: a registered ``gtpo`` advantage estimator and ``gtpo`` / ``gtpo_sum`` policy losses.
``pip install -e ".[verl]"`` (see README, "Training with verl", for how CI installs verl without its pins).

Importing this module (verl does it in every process through the ``verl.plugins`` entry point this package
declares) registers:

- ``algorithm.adv_estimator=gtpo`` (`compute_gtpo_advantage`): on the whole rollout batch, grouped by ``uid``
  (rows in any order, groups of any size), the group-relative advantages, the conflict weights and counts of
  each group (the package's kernels), and the completion entropy filter and shift. All of it is folded into
  verl's per-token ``advantages`` (`objective.token_advantages`), so it travels with each row through verl's
  shuffling and its mini-/micro-batches, and the policy loss needs nothing from other rows.
- ``actor.policy_loss.loss_mode=gtpo`` (`compute_policy_loss_gtpo`): the package's objective
  (`objective.loss_from_token_stats`) on verl's per-token ``log_prob`` and ``old_log_prob``, reduced as
  ``actor.loss_agg_mode`` says (``seq-mean-token-mean``: the paper's ``sequence_mean``; ``token-mean``:
  ``token_mean``; ``seq-mean-token-sum-norm``: ``dr_grpo`` with ``actor.loss_scale_factor`` the generation
  cap), with verl's whole-mini-batch counts (``global_batch_info``), so the micro-batches of one optimiser
  step add up to that step's loss. ``loss_mode=gtpo_sum``: the ``official`` preset's ``sum`` of
  per-completion means (verl has no such ``loss_agg_mode``; set ``seq-mean-token-mean`` beside it).

Where each knob comes from: the GTPO knobs from an ``algorithm.gtpo`` section (``preset`` and any
`GTPOConfig` field verl has no field for: the entropy threshold, gate and coefficient, the conflict weights,
``normalize_advantages_by_std``; verl's ``norm_adv_by_std_in_grpo`` is GRPO's and is not read), clipping from
``actor.clip_ratio_low/high``, the reduction from ``actor.loss_agg_mode`` / ``loss_mode``, the KL from verl's
own ``use_kl_loss`` (applied by verl beside the policy loss). `check_verl_config` refuses combinations that
contradict the preset, in one line naming both settings.

The completion entropy. verl's policy loss is not handed the current entropy, so the filter and the shift
use the **old policy's** per-token entropies, which verl computes with the old log-probs (``entropy`` in its
batch) at the rollout temperature. They equal the current policy's on the first mini-batch of an on-policy
step (the paper's setting: one mini-batch, ``ppo_epochs=1``); on later mini-batches of the same rollout the
paper would use the updated policy's entropy, this integration the rollout's. verl's registered estimators
are given neither the completion ids nor these entropies, so this module also wraps verl's V1 trainer's
``_compute_advantage`` (the one change to verl, made when that module is imported) to read ``responses`` and
``entropy`` from its batch for the ``gtpo`` estimator; `batch_fields` hands them over in any other caller.
"""

from __future__ import annotations

import contextvars
import functools
import importlib.abc
import importlib.util
import math
import sys
from contextlib import contextmanager
from dataclasses import fields
from typing import Optional

import numpy as np
import torch

from ..advantages import compute_advantages
from ..config import GTPOConfig
from ..conflict import conflict_weights
from ..objective import loss_from_token_stats, token_advantages
from ..rows import LossRows

try:
    from verl.trainer.ppo import core_algos
except ImportError as exc:  # pragma: no cover (the extra is not installed)
    raise ImportError(
        "gtpo_kernels.integrations.verl needs verl: pip install -e '.[verl]' (see README, 'Training with verl')"
    ) from exc

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
_NOT_READ = ("max_chunk_bytes", "inplace_backward", "validate_inputs", "warn_no_signal", "_origin")


# --------------------------------------------------------------------------------------------- configuration
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
    if loss_mode not in (POLICY_LOSS, POLICY_LOSS_SUM):
        raise ValueError(
            f"algorithm.adv_estimator={ESTIMATOR} folds the conflict weights and the entropy filter "
            f"into the advantages, which only the GTPO policy loss reduces as GTPO does: set "
            f"actor_rollout_ref.actor.policy_loss.loss_mode={POLICY_LOSS} (got {loss_mode!r})"
        )
    reduction = verl_reduction(loss_mode, _get(actor, "loss_agg_mode"))
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


# ------------------------------------------------------------------------------------ advantage estimator
_BATCH_FIELDS: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar("gtpo_verl_batch_fields", default=None)
_MEASURED_INITIAL_ENTROPY: dict = {}


@contextmanager
def batch_fields(responses: torch.Tensor, entropy: Optional[torch.Tensor]):
    """Hands the batch's ``responses`` ``[bs, L]`` and old-policy ``entropy`` ``[bs, L]`` (rows in the order of
    the advantage call's) to `compute_gtpo_advantage` when verl calls it without them."""
    token = _BATCH_FIELDS.set({"responses": responses, "entropy": entropy})
    try:
        yield
    finally:
        _BATCH_FIELDS.reset(token)


def reset_initial_entropy() -> None:
    """Forgets the entropy measured on the first batch (for the gate): a new run in the same process."""
    _MEASURED_INITIAL_ENTROPY.clear()


def _groups(index, n_rows: int):
    """``(order, sizes)``: rows sorted by group (stable), and each group's size in that order."""
    if index is None:
        raise ValueError("the gtpo advantage estimator needs index (verl's uid of each row's prompt)")
    index = np.asarray(index, dtype=object)
    if index.shape != (n_rows,):
        raise ValueError(f"index must hold one uid per row ({n_rows}), got shape {index.shape}")
    _, inverse, sizes = np.unique(index.astype(str), return_inverse=True, return_counts=True)
    order = np.argsort(inverse, kind="stable")
    return torch.from_numpy(order), sizes[inverse[order]]


def group_advantages_and_conflicts(rewards, responses, valid, index, config: GTPOConfig):
    """``(A [bs], lambda_ [bs, L] or None, n_conflict [bs] or None)`` on whole groups found by ``index``: the
    rows may come in any order and groups may differ in size (each size is computed in one kernel call)."""
    n_rows = rewards.shape[0]
    order, row_sizes = _groups(index, n_rows)
    device = rewards.device
    advantages = torch.zeros(n_rows, dtype=rewards.dtype, device=device)
    lambda_ = n_conflict = None
    if config.use_conflict_weights:
        lambda_ = torch.ones(valid.shape, dtype=rewards.dtype, device=device)
        n_conflict = torch.zeros(n_rows, dtype=torch.int64, device=device)
    for size in np.unique(row_sizes):
        rows = order[torch.from_numpy(row_sizes == size)].to(device)  # whole groups, each contiguous
        group_rewards = rewards[rows]
        a = compute_advantages(group_rewards, int(size), normalize_std=config.normalize_advantages_by_std)
        advantages[rows] = a
        if lambda_ is not None:
            lam, n = conflict_weights(responses[rows], valid[rows], a, int(size), config.conflict_weight)
            lambda_[rows] = lam.to(lambda_.dtype)
            n_conflict[rows] = n
    return advantages, lambda_, n_conflict


def compute_gtpo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index=None,
    config=None,
    responses: Optional[torch.Tensor] = None,
    entropy: Optional[torch.Tensor] = None,
    **unused,
):
    """verl's ``gtpo`` advantage estimator.

    Args:
        token_level_rewards: ``[bs, L]``; a completion's reward is its row's sum.
        response_mask: ``[bs, L]``, 1 on the tokens trained (holes for tool outputs allowed).
        index: ``[bs]`` uids: rows with the same uid are one group (any order, any sizes).
        config: verl's ``algorithm`` config (its ``gtpo`` section, `gtpo_settings`).
        responses: ``[bs, L]`` completion ids (for the conflict weights); entropy: ``[bs, L]`` old-policy
            per-token entropies (for the filter and shift). verl's trainer does not pass them: they come from
            `batch_fields`, which the wrapped trainer sets.

    Returns:
        ``(advantages, returns)``, both the per-token GTPO advantage ``lambda delta (A - gamma Hbar) / n``
        (`objective.token_advantages`), 0 on masked positions.
    """
    gtpo, initial_entropy = gtpo_settings(config)
    supplied = _BATCH_FIELDS.get() or {}
    responses = responses if responses is not None else supplied.get("responses")
    entropy = entropy if entropy is not None else supplied.get("entropy")
    valid = response_mask.bool()
    n_rows, length = valid.shape
    if gtpo.use_conflict_weights and responses is None:
        raise ValueError(
            "the gtpo advantage estimator needs the completion ids for the conflict weights, which "
            "verl does not pass to estimators: run verl's V1 trainer with gtpo_kernels installed "
            "(it supplies them), or wrap the call in gtpo_kernels.integrations.verl.batch_fields"
        )
    needs_entropy = gtpo.entropy_coef > 0 or gtpo.entropy_filter
    if needs_entropy and entropy is None:
        raise ValueError(
            "the gtpo advantage estimator needs the old policy's per-token entropies (verl's "
            "'entropy' field) for the entropy filter and shift; or set algorithm.gtpo."
            "entropy_threshold=null and entropy_coef=0"
        )
    for name, tensor in (("responses", responses), ("entropy", entropy)):
        if tensor is not None and tuple(tensor.shape) != (n_rows, length):
            raise ValueError(
                f"{name} must be [bs, L] = {(n_rows, length)} like response_mask, got {tuple(tensor.shape)}"
            )
    dtype = token_level_rewards.dtype if token_level_rewards.is_floating_point() else torch.float32
    rewards = token_level_rewards.to(dtype).sum(dim=-1)
    advantages, lambda_, n_conflict = group_advantages_and_conflicts(rewards, responses, valid, index, gtpo)
    if entropy is None:
        entropy = torch.zeros(valid.shape, dtype=dtype, device=valid.device)
    if gtpo.entropy_gate and gtpo.entropy_filter and initial_entropy is None:
        if "value" not in _MEASURED_INITIAL_ENTROPY:
            mask = valid.to(entropy.dtype)
            _MEASURED_INITIAL_ENTROPY["value"] = float((entropy * mask).sum() / mask.sum().clamp(min=1))
        initial_entropy = _MEASURED_INITIAL_ENTROPY["value"]
    rows = LossRows(responses, valid, advantages, conflict=(lambda_, n_conflict), initial_entropy=initial_entropy)
    _, _, token_advantage = token_advantages(entropy.to(dtype), rows, gtpo)
    return token_advantage, token_advantage


# ------------------------------------------------------------------------------------------- policy loss
def _clip(config) -> tuple[Optional[float], Optional[float]]:
    clip = _get(config, "clip_ratio")
    low = _get(config, "clip_ratio_low")
    high = _get(config, "clip_ratio_high")
    low = clip if low is None else low
    high = clip if high is None else high
    return (
        None if low is None or math.isinf(low) else float(low),
        None if high is None or math.isinf(high) else float(high),
    )


def gtpo_policy_loss(
    old_log_prob, log_prob, advantages, response_mask, reduction: str, config=None, rollout_is_weights=None
):
    """The package's objective on verl's per-token statistics and GTPO's per-token advantages (see the module
    docstring). Returns ``(loss, metrics)`` as verl's policy losses do."""
    info = dict(_get(config, "global_batch_info", None) or {})
    dp_size = info.get("dp_size") or 1
    scale = _get(config, "loss_scale_factor")
    if reduction == "dr_grpo" and scale is None:
        raise ValueError(
            "loss_agg_mode=seq-mean-token-sum-norm (dr_grpo) needs actor.loss_scale_factor, the "
            "generation cap: without it each micro-batch would divide by its own padded length"
        )
    low, high = _clip(config)
    loss_config = GTPOConfig(
        preset="grpo",
        normalize_advantages_by_std=False,
        entropy_threshold=None,
        entropy_coef=0.0,
        use_conflict_weights=True,
        divide_by_conflict_count=False,
        loss_reduction=reduction,
        clip_eps_low=low,
        clip_eps_high=high,
        max_completion_length=int(scale) if reduction == "dr_grpo" else None,
        warn_no_signal=False,
    )
    valid = response_mask.bool()
    weights = advantages if rollout_is_weights is None else advantages * rollout_is_weights  # IS weights >= 0
    ones = torch.ones(valid.shape[0], dtype=log_prob.dtype, device=log_prob.device)
    # The per-token advantages ride as the conflict weights of unit advantages: lambda * A = the given a.
    rows = LossRows(
        None,
        valid,
        ones,
        conflict=(weights, None),
        old_logprobs=old_log_prob,
        num_sequences=info.get("global_batch_size") if reduction in ("sequence_mean", "dr_grpo") else None,
        num_tokens=info.get("batch_num_tokens") if reduction == "token_mean" else None,
    )
    out = loss_from_token_stats(log_prob, torch.zeros_like(log_prob), rows, loss_config)
    mask = valid.to(log_prob.dtype)
    ppo_kl = ((old_log_prob - log_prob).detach() * mask).sum() / mask.sum().clamp(min=1)
    metrics = {
        "actor/pg_clipfrac": float(out.metrics.clip_fraction),
        "actor/ppo_kl": float(ppo_kl),
        "actor/gtpo_ratio_mean": float(out.metrics.ratio_mean),
    }
    return out.loss * dp_size, metrics


def compute_policy_loss_gtpo(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights=None,
):
    """verl's ``gtpo`` policy loss: the reduction named by ``loss_agg_mode`` (`AGG_MODE_REDUCTION`)."""
    return gtpo_policy_loss(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        verl_reduction(POLICY_LOSS, loss_agg_mode),
        config,
        rollout_is_weights,
    )


def compute_policy_loss_gtpo_sum(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode: str = "seq-mean-token-mean",
    config=None,
    rollout_is_weights=None,
):
    """verl's ``gtpo_sum`` policy loss: the ``official`` preset's sum of per-completion token means."""
    return gtpo_policy_loss(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        verl_reduction(POLICY_LOSS_SUM, loss_agg_mode),
        config,
        rollout_is_weights,
    )


# ---------------------------------------------------------------------------------------- registration
def _register() -> None:
    for name, fn in ((POLICY_LOSS, compute_policy_loss_gtpo), (POLICY_LOSS_SUM, compute_policy_loss_gtpo_sum)):
        core_algos.POLICY_LOSS_REGISTRY[name] = fn
    registered = core_algos.ADV_ESTIMATOR_REGISTRY.get(ESTIMATOR)
    if registered is not None and getattr(registered, "__module__", None) != __name__:
        raise ValueError(f"verl already has an advantage estimator named {ESTIMATOR!r} ({registered!r})")
    core_algos.ADV_ESTIMATOR_REGISTRY[ESTIMATOR] = compute_gtpo_advantage


V1_TRAINER_MODULE = "verl.trainer.ppo.v1.trainer_base"


def patch_v1_trainer(module) -> None:
    """Wraps ``PPOTrainer._compute_advantage`` of verl's V1 trainer so that, for ``adv_estimator=gtpo``, the
    config is checked (`check_verl_config`) and the batch's ``responses`` and ``entropy`` reach the
    estimator (`batch_fields`). Other estimators run verl's method unchanged."""
    trainer = module.PPOTrainer
    original = trainer._compute_advantage
    if getattr(original, "_gtpo_wrapped", False):
        return

    @functools.wraps(original)
    def _compute_advantage(self, batch, metrics):
        if str(self.config.algorithm.adv_estimator) != ESTIMATOR:
            return original(self, batch, metrics)
        check_verl_config(self.config)
        names = ["responses", "response_mask", "entropy"]
        data = module.tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=names)
        padded = data.to_padded_tensor()
        with batch_fields(padded["responses"], padded["entropy"]):
            return original(self, batch, metrics)

    _compute_advantage._gtpo_wrapped = True
    trainer._compute_advantage = _compute_advantage


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs ``hook(module)`` right after the module ``name`` is first imported (verl imports its trainer after
    its plugins, which import this module)."""

    def __init__(self, name: str, hook) -> None:
        self.name, self.hook, self.spec = name, hook, None

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name or self.spec is not None:
            return None
        sys.meta_path.remove(self)  # find the real module's spec, then stand in for its loader
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return None
        self.spec = spec
        wrapped = importlib.util.spec_from_loader(
            fullname, self, origin=spec.origin, is_package=spec.submodule_search_locations is not None
        )
        wrapped.submodule_search_locations = spec.submodule_search_locations
        wrapped.has_location = spec.has_location
        return wrapped

    def create_module(self, spec):
        return self.spec.loader.create_module(self.spec)

    def exec_module(self, module):
        module.__spec__ = self.spec
        module.__loader__ = self.spec.loader
        self.spec.loader.exec_module(module)
        self.hook(module)


def run_after_import(name: str, hook) -> None:
    """``hook(module)`` now if ``name`` is imported, else right after its first import."""
    if name in sys.modules:
        hook(sys.modules[name])
    elif not any(isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, hook))


_register()
run_after_import(V1_TRAINER_MODULE, patch_v1_trainer)
