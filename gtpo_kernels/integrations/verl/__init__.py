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

The parts: `settings` (verl's config read as GTPO's), `estimator`, `policy_loss`, `v1_trainer` (the wrap of
verl's trainer) and `import_hook` (applying it when verl imports that trainer); this module registers them.
"""

from __future__ import annotations

try:
    from verl.trainer.ppo import core_algos
except ImportError as exc:  # pragma: no cover (the extra is not installed)
    raise ImportError(
        "gtpo_kernels.integrations.verl needs verl: pip install -e '.[verl]' (see README, 'Training with verl')"
    ) from exc

from .estimator import batch_fields, compute_gtpo_advantage, group_advantages_and_conflicts, reset_initial_entropy
from .import_hook import run_after_import
from .policy_loss import compute_policy_loss_gtpo, compute_policy_loss_gtpo_sum, gtpo_policy_loss
from .settings import (
    AGG_MODE_REDUCTION,
    ESTIMATOR,
    NOT_IN_VERL,
    POLICY_LOSS,
    POLICY_LOSS_SUM,
    VERL_OWNED,
    check_verl_config,
    gtpo_settings,
    verl_reduction,
)
from .v1_trainer import V1_TRAINER_MODULE, patch_v1_trainer

__all__ = [
    "AGG_MODE_REDUCTION",
    "ESTIMATOR",
    "NOT_IN_VERL",
    "POLICY_LOSS",
    "POLICY_LOSS_SUM",
    "V1_TRAINER_MODULE",
    "VERL_OWNED",
    "batch_fields",
    "check_verl_config",
    "compute_gtpo_advantage",
    "compute_policy_loss_gtpo",
    "compute_policy_loss_gtpo_sum",
    "group_advantages_and_conflicts",
    "gtpo_policy_loss",
    "gtpo_settings",
    "patch_v1_trainer",
    "register",
    "reset_initial_entropy",
    "run_after_import",
    "verl_reduction",
]


def register() -> None:
    """The estimator and the two policy losses in verl's registries (refusing a ``gtpo`` estimator of another)."""
    for name, fn in ((POLICY_LOSS, compute_policy_loss_gtpo), (POLICY_LOSS_SUM, compute_policy_loss_gtpo_sum)):
        core_algos.POLICY_LOSS_REGISTRY[name] = fn
    registered = core_algos.ADV_ESTIMATOR_REGISTRY.get(ESTIMATOR)
    if registered is not None and getattr(registered, "__module__", None) != compute_gtpo_advantage.__module__:
        raise ValueError(f"verl already has an advantage estimator named {ESTIMATOR!r} ({registered!r})")
    core_algos.ADV_ESTIMATOR_REGISTRY[ESTIMATOR] = compute_gtpo_advantage


register()
run_after_import(V1_TRAINER_MODULE, patch_v1_trainer)
