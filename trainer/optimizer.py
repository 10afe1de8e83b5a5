"""The run's optimiser: AdamW over the trainable parameters (all of them, or LoRA's adapters), with float32 master
copies when the weights are bfloat16 (``--model-dtype bf16``, unless ``--no-master-weights``)."""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import nn

from .config import ConfigError, TrainConfig


class PolicyOptimizer:
    """AdamW on ``params`` (those that require a gradient). With ``master``, AdamW updates float32 copies of
    low-precision parameters, into which each step's gradients are read and from which the parameters are rounded
    back after the step: a bf16 weight cannot take an update below 2**-8 of itself, which the float32 copy keeps.
    ``self.adamw`` is the torch optimiser (the schedule drives it)."""

    def __init__(self, params, config: TrainConfig, device: torch.device, master: bool) -> None:
        self.params: List[nn.Parameter] = [p for p in params if p.requires_grad]
        self.master: Optional[List[torch.Tensor]] = None
        if master and any(p.dtype != torch.float32 for p in self.params):
            self.master = [p.detach().float().clone() for p in self.params]
        # fused: one kernel over all parameters, not the loop over parameters torch picks on a CPU (the same
        # update, summed in another order; the step's time: docs/training.md, "Where a step goes").
        self.adamw = torch.optim.AdamW(
            self.master or self.params,
            lr=config.learning_rate,
            betas=(0.9, 0.99),
            weight_decay=config.weight_decay,
            fused=device.type in ("cpu", "cuda") or None,
        )

    def zero_grad(self) -> None:
        for p in self.params + (self.master or []):
            p.grad = None

    def clip_and_step(self, max_norm: float) -> float:
        """Clips the gradients' global norm to ``max_norm`` (in float32 on the master copies), steps; returns the
        norm before clipping."""
        targets = self.params
        if self.master is not None:
            for copy, p in zip(self.master, self.params):
                copy.grad = None if p.grad is None else p.grad.float()
            targets = self.master
        norm = float(torch.nn.utils.clip_grad_norm_(targets, max_norm))
        self.adamw.step()
        if self.master is not None:
            with torch.no_grad():
                for copy, p in zip(self.master, self.params):
                    p.copy_(copy)
        return norm

    def state_dict(self) -> dict:
        state = self.adamw.state_dict()
        if self.master is not None:  # the float32 weights: the bf16 ones in the checkpoint are rounded
            state = {**state, "master": {i: m.detach().cpu() for i, m in enumerate(self.master)}}
        return state

    def load_state_dict(self, state: dict) -> None:
        master = state.get("master")
        if (master is None) != (self.master is None):
            raise ConfigError(
                "--resume: the checkpoint's optimiser "
                + ("has" if master is not None else "has no")
                + " float32 master weights and this run "
                + ("has none" if self.master is None else "has them")
                + ": resume with the run's --model-dtype and --master-weights"
            )
        self.adamw.load_state_dict({k: v for k, v in state.items() if k != "master"})
        if master is not None:
            with torch.no_grad():
                for i, m in enumerate(self.master):
                    m.copy_(master[i])


def check_master_weights(config: TrainConfig, world: int) -> None:
    """float32 master copies are kept by one process here (the checkpoint gathers a torchrun run's optimiser by the
    parameters' names, which the copies do not have)."""
    if config.model_dtype == "bf16" and config.master_weights and world > 1:
        raise ConfigError(
            "--model-dtype bf16 keeps float32 master weights in one process only; under torchrun pass "
            "--no-master-weights (plain bf16 AdamW) or --model-dtype fp32"
        )
