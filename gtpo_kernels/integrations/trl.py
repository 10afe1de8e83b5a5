"""`GTPOTrainer`: TRL's ``GRPOTrainer`` with the GTPO loss, for users who keep accelerate, DeepSpeed, FSDP,
vLLM and many nodes. ``pip install -e ".[trl]"`` (``trl>=1.16``).

What it changes in ``GRPOTrainer`` (everything else, generation included, is TRL's):

- Scoring: after TRL has scored the completions and gathered the rewards across processes, the conflict
  weights are computed on whole prompt groups (the completions are gathered too) and kept in the batch as
  ``gtpo_lambda`` / ``gtpo_n_conflict``, so they travel with their rows through TRL's shuffling and
  splitting into ``steps_per_generation`` slices.
- The loss: `fused_linear_gtpo_loss` on the policy's final hidden states (no ``[B, L, V]`` logits), at TRL's
  sampling temperature, inside the model's forward (so DDP, FSDP and DeepSpeed see it as one forward),
  with the whole batch's normalisers in TRL's conventions: a loss call's rows are its share of the
  accumulation window of this process, and DDP averages the processes.
- Old and reference log-probs come from `fused_linear_token_logprobs_and_entropy` (the same kernels); the
  initial entropy is measured on the first training batch, for the entropy gate.
- Metrics: ``gtpo/entropy``, ``gtpo/filtered_fraction``, ``gtpo/signal_fraction``, ``gtpo/amplified_fraction``,
  ``gtpo/skipped_fraction``, ``gtpo/clip_fraction``, ``gtpo/kl`` through TRL's own metrics.

Advantages follow ``gtpo_config.normalize_advantages_by_std`` (TRL's ``scale_rewards`` is set to "group" or
"none" to match); the loss follows ``gtpo_config`` (TRL's ``loss_type``, ``epsilon`` and ``beta`` do not drive
it; ``beta`` must equal ``gtpo_config.kl_beta`` so that TRL loads the reference model when one is needed).
"""

from __future__ import annotations

import types
import warnings
from contextlib import nullcontext
from typing import Optional

import torch

from ..config import GTPOConfig
from ..conflict import conflict_weights
from ..fused_linear import fused_linear_gtpo_loss, fused_linear_token_logprobs_and_entropy
from ..hf import check_hidden_states_supported
from ..result import GTPOMetrics

try:
    from trl import GRPOTrainer
except ImportError as exc:  # pragma: no cover (the extra is not installed)
    raise ImportError("gtpo_kernels.integrations.trl needs TRL: pip install -e '.[trl]' (trl>=1.16)") from exc

METRIC_NAMES = ("entropy", "filtered_fraction", "signal_fraction", "amplified_fraction", "skipped_fraction",
                "clip_fraction", "kl")


def _lm_head(model):
    """The output embedding's weight and bias, whole: FSDP2 shards them (DTensor), DeepSpeed ZeRO-3
    partitions them (gathered for the duration of the ``with``)."""
    head = model.get_output_embeddings()
    weight, bias = head.weight, head.bias
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        DTensor = ()
    if isinstance(weight, DTensor):
        weight = weight.full_tensor()
        bias = None if bias is None else bias.full_tensor()
    gather = nullcontext()
    if hasattr(head.weight, "ds_id"):  # DeepSpeed ZeRO-3 (untested here: no DeepSpeed on the CPU)
        import deepspeed

        gather = deepspeed.zero.GatheredParameters([p for p in (head.weight, head.bias) if p is not None])
    return weight, bias, gather


def add_gtpo_head(model, trainer: "GTPOTrainer") -> None:
    """Adds two modes to ``model.forward`` (whatever TRL's own patches do otherwise):

    ``model(input_ids, attention_mask, gtpo_stats=L)``: per-token log-probs and entropies of the last ``L``
    tokens (no grad), as ``(logp [B, L], H [B, L])``;
    ``model(input_ids, attention_mask, gtpo_loss=dict(...))``: the `GTPOLossOutput` of the last ``L`` tokens.
    Both run the decoder, then the fused kernels on its final hidden states; never the logits."""
    check_hidden_states_supported(model)
    previous_forward = model.forward

    def forward(self, *args, gtpo_stats: Optional[int] = None, gtpo_loss: Optional[dict] = None, **kwargs):
        if gtpo_stats is None and gtpo_loss is None:
            return previous_forward(*args, **kwargs)
        kwargs["use_cache"] = False
        hidden_all = self.get_decoder()(*args, **kwargs).last_hidden_state
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        length = gtpo_stats if gtpo_stats is not None else gtpo_loss["completion_ids"].shape[1]
        hidden = hidden_all[:, -length - 1:-1]
        weight, bias, gather = _lm_head(self)
        with gather:
            if gtpo_stats is not None:
                completion_ids = input_ids[:, -length:]
                mask = kwargs["attention_mask"][:, -length:] if kwargs.get("attention_mask") is not None else None
                return fused_linear_token_logprobs_and_entropy(hidden, weight, completion_ids, mask, lm_head_bias=bias,
                                                               temperature=trainer.temperature)
            inputs = dict(gtpo_loss)
            return fused_linear_gtpo_loss(hidden, weight, inputs.pop("completion_ids"), inputs.pop("completion_mask"),
                                          inputs.pop("advantages"), lm_head_bias=bias, **inputs)

    model.forward = types.MethodType(forward, model)


class GTPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` with the GTPO loss. Takes every ``GRPOTrainer`` argument, plus ``gtpo_config`` (default:
    ``GTPOConfig()``, the paper preset).

    Example::

        trainer = GTPOTrainer(model="HuggingFaceTB/SmolLM2-135M-Instruct", reward_funcs=[correctness],
                              args=GRPOConfig(output_dir="out", num_generations=8, temperature=0.7),
                              train_dataset=dataset, gtpo_config=GTPOConfig(preset="paper"))
        trainer.train()
    """

    _tag_names = ["trl", "gtpo", "gtpo_kernels"]
    _name = "GTPO"

    def __init__(self, *args, gtpo_config: Optional[GTPOConfig] = None, **kwargs):
        super().__init__(*args, **kwargs)
        config = gtpo_config or GTPOConfig()
        if not isinstance(config, GTPOConfig):
            raise TypeError(f"gtpo_config must be a gtpo_kernels.GTPOConfig, got {type(config).__name__}")
        if config.loss_reduction == "dr_grpo":
            config = config.replace(max_completion_length=self.max_completion_length)
        if abs(float(self.beta) - config.kl_beta) > 0:
            raise ValueError(f"GRPOConfig(beta={self.beta}) and GTPOConfig(kl_beta={config.kl_beta}) disagree: the loss "
                             f"uses kl_beta, and TRL loads the reference model only when beta > 0; set both to the same "
                             f"value")
        unsupported = {"top_entropy_quantile": (self.top_entropy_quantile, 1.0),
                       "off_policy_mask_threshold": (self.off_policy_mask_threshold, None),
                       "importance_sampling_level": (self.importance_sampling_level, "token")}
        for name, (value, default) in unsupported.items():
            if value != default:
                raise ValueError(f"GTPOTrainer does not support GRPOConfig({name}={value!r}); leave it at {default!r}")
        if getattr(self, "vllm_importance_sampling_correction", False) and self.use_vllm:
            warnings.warn("GTPOTrainer: the vLLM importance-sampling correction (TRL's "
                          "vllm_importance_sampling_correction) is not applied to the GTPO loss", stacklevel=2)
        # Advantages as the GTPO config defines them (mean-centred for the paper and official presets).
        self.scale_rewards = "group" if config.normalize_advantages_by_std else "none"
        self.gtpo_config = config
        self._gtpo_initial_entropy: Optional[float] = None
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        add_gtpo_head(base, self)
        if self.ref_model is not None:
            add_gtpo_head(self.ref_model, self)

    # ------------------------------------------------------------------------------------------ scoring

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        ids, mask, advantages = output["completion_ids"], output["completion_mask"], output["advantages"]
        if self.gtpo_config.use_conflict_weights:
            # Groups may span processes: compare whole groups, then keep this process's rows.
            pad = self.processing_class.pad_token_id if hasattr(self.processing_class, "pad_token_id") else 0
            all_ids = self.accelerator.gather(self.accelerator.pad_across_processes(ids, dim=1, pad_index=pad or 0))
            all_mask = self.accelerator.gather(self.accelerator.pad_across_processes(mask, dim=1, pad_index=0))
            all_adv = self.accelerator.gather(advantages)
            lambda_, n_conflict = conflict_weights(all_ids, all_mask.bool(), all_adv.float(), self.num_generations,
                                                   self.gtpo_config.conflict_weight)
            rows = slice(self.accelerator.process_index * ids.shape[0], (self.accelerator.process_index + 1) * ids.shape[0])
            output["gtpo_lambda"] = lambda_[rows, :ids.shape[1]]
            output["gtpo_n_conflict"] = n_conflict[rows]
        if self._gtpo_initial_entropy is None and self.model.training:
            # The policy's mean token entropy before any update, over every process: the entropy gate's H_ini.
            _, entropy, _ = self._get_per_token_logps_and_entropies(
                self.model, torch.cat([output["prompt_ids"], ids], dim=1),
                torch.cat([output["prompt_mask"], mask], dim=1), ids.shape[1], compute_entropy=True)
            sums = torch.stack([(entropy * mask).sum(), mask.sum()]).double()
            sums = self.accelerator.reduce(sums, reduction="sum")
            self._gtpo_initial_entropy = float(sums[0] / sums[1].clamp(min=1))
        return output

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, pixel_values=None,
                                           **kwargs):
        """Old and reference log-probs (and entropies) from the hidden states, in chunks of ``batch_size`` rows."""
        if pixel_values is not None or compute_aux_loss:
            raise ValueError("GTPOTrainer supports text-only models without MoE auxiliary losses")
        batch_size = batch_size or input_ids.size(0)
        logps, entropies = [], []
        with torch.no_grad():
            for start in range(0, input_ids.size(0), batch_size):
                rows = slice(start, start + batch_size)
                with self.accelerator.autocast():
                    logp, entropy = model(input_ids=input_ids[rows], attention_mask=attention_mask[rows],
                                          gtpo_stats=logits_to_keep)
                logps.append(logp)
                entropies.append(entropy)
        return torch.cat(logps), torch.cat(entropies) if compute_entropy else None, None

    # ------------------------------------------------------------------------------------------ the loss

    def whole_batch_counts(self, inputs: dict, mode: str):
        """``(num_sequences, num_tokens)`` of a loss call's accumulation window on this process, as TRL normalises:
        its ``grpo``/``dr_grpo`` losses divide each slice's mean by the accumulation steps, its ``dapo`` loss by
        the generation batch's tokens per process and slice."""
        rows = inputs["completion_ids"].shape[0]
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        num_sequences = rows * accumulation
        tokens = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
        if mode == "train":
            tokens = tokens * self.current_gradient_accumulation_steps / self.args.steps_per_generation
        return num_sequences, tokens

    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        completion_ids, mask = inputs["completion_ids"], inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        num_sequences, num_tokens = self.whole_batch_counts(inputs, mode)
        conflict = None
        if self.gtpo_config.use_conflict_weights:
            conflict = (inputs["gtpo_lambda"], inputs["gtpo_n_conflict"])
        loss_inputs = dict(
            completion_ids=completion_ids, completion_mask=mask, advantages=inputs["advantages"].reshape(-1),
            config=self.gtpo_config, conflict=conflict, old_logprobs=inputs.get("old_per_token_logps"),
            ref_logprobs=inputs.get("ref_per_token_logps"), initial_entropy=self._gtpo_initial_entropy,
            num_sequences=num_sequences, num_tokens=num_tokens, temperature=self.temperature)
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        with self.accelerator.autocast():
            out = model(input_ids=input_ids, attention_mask=attention_mask, gtpo_loss=loss_inputs)
        loss = out.loss
        if self.gtpo_config.loss_reduction == "sum":
            loss = loss * self.accelerator.num_processes  # DDP averages the processes; a sum is over all of them
        self._log_gtpo_metrics(out.metrics, mode)
        return loss

    def _log_gtpo_metrics(self, metrics: GTPOMetrics, mode: str) -> None:
        sums = self.accelerator.reduce(metrics.to_sums(), reduction="sum")
        merged = GTPOMetrics.from_sums(sums, parts=self.accelerator.num_processes).to_dict()
        for name in METRIC_NAMES:
            if name in merged:
                self._metrics[mode][f"gtpo/{name}"].append(merged[name])
