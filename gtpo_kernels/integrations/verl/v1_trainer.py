"""The one change to verl: its V1 trainer's ``_compute_advantage`` hands the batch's ``responses`` and
``entropy`` to the ``gtpo`` estimator, which verl's estimator interface does not pass."""

from __future__ import annotations

import functools

from .estimator import batch_fields
from .settings import ESTIMATOR, check_verl_config

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
