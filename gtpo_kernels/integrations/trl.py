"""`GTPOTrainer`: TRL's ``GRPOTrainer`` with the GTPO loss, for users who keep accelerate, DeepSpeed, FSDP,
vLLM and many nodes. ``pip install -e ".[trl]"`` (``trl>=1.16``).

What it changes in ``GRPOTrainer`` (everything else, generation included, is TRL's):

- Scoring: after TRL has scored the completions and gathered the rewards across processes, the conflict
  weights are computed on whole prompt groups (the completions are gathered too) and kept in the batch as
  ``gtpo_lambda`` / ``gtpo_n_conflict``, so they travel with their rows through TRL's shuffling and
  splitting into ``steps_per_generation`` slices.
- The loss: `fused_linear_gtpo_loss` on the policy's final hidden states (no ``[B, L, V]`` logits), at TRL's
  sampling temperature, inside the model's forward (so DDP, FSDP and DeepSpeed see it as one forward),
  with the exact normalisers of the optimiser step it belongs to: when TRL splits a generation batch into
  ``steps_per_generation`` slices, each row is given the token count of its optimisation window (the
  ``gradient_accumulation_steps`` slices one optimiser step covers, summed over processes), so the slices of
  one step add up to that step's whole loss (``token_mean``), whatever the completion lengths; DDP averages
  the processes.
- Tool masks: TRL's ``tool_mask`` (0 on a tool's output inside a completion) masks those tokens out of the
  loss, the entropy means and the token counts; the conflict weights are computed on the completions as
  generated (docs/method.md, "Inputs").
- Old and reference log-probs come from `fused_linear_token_logprobs_and_entropy` (the same kernels); the
  initial entropy is measured on the first training batch, for the entropy gate.
- Metrics: ``gtpo/entropy``, ``gtpo/filtered_fraction``, ``gtpo/signal_fraction``, ``gtpo/amplified_fraction``,
  ``gtpo/skipped_fraction``, ``gtpo/clip_fraction``, ``gtpo/kl`` through TRL's own metrics. Each loss call
  adds its metric sums on the device; they are all-reduced and read once, when TRL logs (no host sync per
  micro-batch).

Advantages follow ``gtpo_config.normalize_advantages_by_std`` (TRL's ``scale_rewards`` is set to "group" or
"none" to match, or kept at "batch" when the config normalises); the loss follows ``gtpo_config``
(``from_grpo_config(args)`` makes the one that computes what ``GRPOTrainer`` would; ``beta`` must equal
``gtpo_config.kl_beta`` so that TRL loads the reference model when one is needed).
"""

from __future__ import annotations

import logging
import math
import sys
import types
import warnings
from contextlib import nullcontext
from typing import Optional

import torch

from ..config import GTPOConfig
from ..conflict import conflict_weights
from ..fused_linear import fused_linear_gtpo_loss, fused_linear_token_logprobs_and_entropy
from ..hf import decoder_of, head_logit_transform
from ..hf.model_config import linear_head, unwrap
from ..result import GTPOMetrics
from .trl_settings import check_settings, with_trl_loss_terms

try:
    from trl import GRPOTrainer
except ImportError as exc:  # pragma: no cover (the extra is not installed)
    raise ImportError("gtpo_kernels.integrations.trl needs TRL: pip install -e '.[trl]' (trl>=1.16)") from exc

logger = logging.getLogger(__name__)

METRIC_NAMES = (
    "entropy",
    "filtered_fraction",
    "signal_fraction",
    "amplified_fraction",
    "skipped_fraction",
    "clip_fraction",
    "kl",
)


def _lm_head(model):
    """The output embedding's weight and bias, whole: FSDP2 shards them (DTensor), DeepSpeed ZeRO-3
    partitions them (gathered for the duration of the ``with``)."""
    head = linear_head(unwrap(model))
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


def router_load_balancing_loss(model, decoded, attention_mask) -> torch.Tensor:
    """A Mixture-of-Experts causal LM's router load-balancing loss from its decoder's router logits, by the
    architecture's own ``load_balancing_loss_func`` (what its forward adds with ``output_router_logits``)."""
    module = sys.modules[type(model).__module__]
    balance = getattr(module, "load_balancing_loss_func", None)
    if balance is None or getattr(decoded, "router_logits", None) is None:
        raise ValueError(
            f"GTPOTrainer: {type(model).__name__} has no router load-balancing loss this trainer can compute (no "
            f"load_balancing_loss_func or router logits): set GRPOConfig(router_aux_loss_coef=0.0)"
        )
    config = getattr(model.config, "get_text_config", lambda: model.config)()
    experts = getattr(model, "num_experts", None) or config.num_experts
    top_k = getattr(model, "num_experts_per_tok", None) or config.num_experts_per_tok
    return balance(decoded.router_logits, experts, top_k, attention_mask)


def add_gtpo_head(model, trainer: GTPOTrainer) -> None:
    """Adds two modes to ``model.forward`` (whatever TRL's own patches do otherwise):

    ``model(input_ids, attention_mask, gtpo_stats=L)``: per-token log-probs and entropies of the last ``L``
    tokens (no grad), as ``(logp [B, L], H [B, L])``;
    ``model(input_ids, attention_mask, gtpo_loss=dict(...))``: ``(GTPOLossOutput of the last L tokens, the router
    load-balancing loss of a Mixture-of-Experts model when TRL adds one, else None)``.
    Both run the decoder, then the fused kernels on its final hidden states; never the logits. A model that
    soft-caps or scales its logits (Gemma 2/3, Cohere, Granite, ...) hands its transform to the fused kernels
    (``logit_scale``, ``logit_softcap``), which apply it to each chunk's logits."""
    transform = head_logit_transform(model)
    head_transform = {}
    if transform is not None:
        head_transform = dict(logit_scale=transform[1].scale, logit_softcap=transform[1].softcap)
        logger.info(
            "GTPOTrainer: %s %s: the fused hidden @ lm_head kernels apply it to each chunk's logits",
            type(model).__name__,
            transform[0],
        )
    previous_forward = model.forward

    def forward(
        self,
        *args,
        gtpo_stats: Optional[int] = None,
        gtpo_loss: Optional[dict] = None,
        gtpo_temperature: Optional[torch.Tensor] = None,
        **kwargs,
    ):
        if gtpo_stats is None and gtpo_loss is None:
            return previous_forward(*args, **kwargs)
        kwargs["use_cache"] = False
        router_loss = gtpo_loss is not None and trainer.aux_loss_enabled
        if router_loss:
            kwargs["output_router_logits"] = True  # the decoder returns them; the load-balancing loss is below
        decoded = decoder_of(self)(*args, **kwargs)
        hidden_all = decoded.last_hidden_state
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        length = gtpo_stats if gtpo_stats is not None else gtpo_loss["completion_ids"].shape[1]
        hidden = hidden_all[:, -length - 1 : -1]
        weight, bias, gather = _lm_head(self)
        head_precision = nullcontext()
        if trainer.args.cast_lm_head_to_fp32:
            # TRL's float32 head (its weights are float32 already): the GEMMs and the softmax in float32 whatever
            # the autocast, the hidden states cast on the way in (their gradient flows back in their dtype).
            hidden, weight = hidden.float(), weight.float()
            bias = None if bias is None else bias.float()
            head_precision = torch.autocast(hidden.device.type, enabled=False)
        temperature = trainer.temperature if gtpo_temperature is None else gtpo_temperature
        with gather, head_precision:
            if gtpo_stats is not None:
                completion_ids = input_ids[:, -length:]
                mask = kwargs["attention_mask"][:, -length:] if kwargs.get("attention_mask") is not None else None
                return fused_linear_token_logprobs_and_entropy(
                    hidden,
                    weight,
                    completion_ids,
                    mask,
                    lm_head_bias=bias,
                    temperature=temperature,
                    max_chunk_bytes=trainer.gtpo_config.max_chunk_bytes,
                    **head_transform,
                )
            inputs = dict(gtpo_loss)
            ids, mask, advantages = (
                inputs.pop("completion_ids"),
                inputs.pop("completion_mask"),
                inputs.pop("advantages"),
            )
            out = fused_linear_gtpo_loss(
                hidden, weight, ids, mask, advantages, lm_head_bias=bias, **head_transform, **inputs
            )
        aux = router_load_balancing_loss(self, decoded, kwargs.get("attention_mask")) if router_loss else None
        return out, aux

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
            raise ValueError(
                f"GRPOConfig(beta={self.beta}) and GTPOConfig(kl_beta={config.kl_beta}) disagree: the loss "
                f"uses kl_beta, and TRL loads the reference model only when beta > 0; set both to the same "
                f"value"
            )
        check_settings(self.args, config)  # every GRPOConfig field the GTPO loss would ignore (trl_settings.py)
        # TRL's loss terms that stand beside any preset (vLLM's correction, on by default with vLLM, since its
        # probabilities differ from the trainer's; the entropy bonus; GSPO; off-policy masking) apply to the GTPO
        # loss unless the GTPO config sets them itself.
        config = with_trl_loss_terms(config, self.args)
        # Advantages as the GTPO config defines them (mean-centred for the paper and official presets).
        batch_std = str(self.args.scale_rewards) == "batch"  # TRL's batch-std scaling, when the config normalises
        self.scale_rewards = ("batch" if batch_std else "group") if config.normalize_advantages_by_std else "none"
        # TRL's 'bnpo' divides each micro-batch by its own tokens (a local normaliser, by its definition not
        # exact across micro-batches); every other token mean by its optimiser step's.
        self._gtpo_local_tokens = self.args.loss_type == "bnpo"
        # A token mean divides by its optimiser step's tokens, exactly, when the step's micro-batches come from one
        # generation batch. TRL's 'dapo', 'cispo' and 'vespo' divide instead by the generation batch's tokens times
        # gradient_accumulation_steps / steps_per_generation (an average window): the grpo preset (TRL's loss, what
        # from_grpo_config gives) keeps TRL's count, to train as GRPOTrainer does; GTPO's presets keep the exact
        # one. Any config takes TRL's count when a step spans generation batches (steps_per_generation not a
        # multiple of the accumulation steps: the exact count is not known in time).
        self._gtpo_trl_token_average = (
            config.preset == "grpo"
            and config.loss_reduction == "token_mean"
            and self.args.loss_type in ("dapo", "cispo", "vespo")
        )
        self.gtpo_config = config
        self._gtpo_initial_entropy: Optional[float] = None
        # mode -> (metric sums, clip extremes) of the loss calls since the last log, on the device
        self._gtpo_pending = {}
        self._gtpo_pending_policy = {}  # mode -> [sum of the calls' policy_loss, calls], on the device
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
            lambda_, n_conflict = conflict_weights(
                all_ids, all_mask.bool(), all_adv.float(), self.num_generations, self.gtpo_config.conflict_weight
            )
            rows = slice(
                self.accelerator.process_index * ids.shape[0], (self.accelerator.process_index + 1) * ids.shape[0]
            )
            output["gtpo_lambda"] = lambda_[rows, : ids.shape[1]]
            output["gtpo_n_conflict"] = n_conflict[rows]
        if self._gtpo_initial_entropy is None and self.model.training:
            # The policy's mean token entropy before any update, over every process: the entropy gate's H_ini.
            _, entropy, _ = self._get_per_token_logps_and_entropies(
                self.model,
                torch.cat([output["prompt_ids"], ids], dim=1),
                torch.cat([output["prompt_mask"], mask], dim=1),
                ids.shape[1],
                compute_entropy=True,
            )
            sums = torch.stack([(entropy * mask).sum(), mask.sum()]).double()
            sums = self.accelerator.reduce(sums, reduction="sum")
            self._gtpo_initial_entropy = float(sums[0] / sums[1].clamp(min=1))
        return output

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        pixel_values=None,
        gtpo_temperature=None,
        **kwargs,
    ):
        """Old and reference log-probs (and entropies) from the hidden states, in chunks of ``batch_size`` rows;
        ``gtpo_temperature [B]``: each completion's sampling temperature (default: ``args.temperature``), for a
        rollout that samples at mixed temperatures (it passes them here and as the batch's ``gtpo_temperature``)."""
        if pixel_values is not None or compute_aux_loss:
            raise ValueError("GTPOTrainer supports text-only models without MoE auxiliary losses")
        batch_size = batch_size or input_ids.size(0)
        logps, entropies = [], []
        with torch.no_grad():
            for start in range(0, input_ids.size(0), batch_size):
                rows = slice(start, start + batch_size)
                with self.accelerator.autocast():
                    logp, entropy = model(
                        input_ids=input_ids[rows],
                        attention_mask=attention_mask[rows],
                        gtpo_stats=logits_to_keep,
                        gtpo_temperature=None if gtpo_temperature is None else gtpo_temperature[rows],
                    )
                logps.append(logp)
                entropies.append(entropy)
        return torch.cat(logps), torch.cat(entropies) if compute_entropy else None, None

    def _prepare_inputs(self, generation_batch):
        buffered = self._buffered_inputs
        inputs = super()._prepare_inputs(generation_batch)
        if self.model.training and self._buffered_inputs is not buffered:
            # TRL has just split a new generation batch into steps_per_generation slices.
            self.attach_window_counts(self._buffered_inputs)
        return inputs

    def attach_window_counts(self, slices) -> None:
        """Gives every row of ``slices`` (one generation batch, in the order TRL feeds them to the loss) the
        token count of its optimisation window, ``gtpo_window_tokens [rows]``: the loss tokens of the
        ``gradient_accumulation_steps`` consecutive slices that one optimiser step covers, summed over
        processes and divided by their number (DDP averages the processes' gradients). One all-reduce of a
        few numbers per generation batch, no host sync."""
        accumulation = self.args.gradient_accumulation_steps
        if len(slices) % accumulation or self._gtpo_trl_token_average:
            return  # windows span generation batches, or TRL's average window: `whole_batch_counts`
        tokens = torch.stack([_loss_mask(part).sum() for part in slices]).to(torch.float64)
        windows = self.accelerator.reduce(tokens.view(-1, accumulation).sum(dim=1), reduction="sum")
        # A window whose completions are all masked (mask_truncated_completions, every one truncated) trains nothing:
        # its count is 1, as GRPOTrainer clamps it, so the step is a zero step instead of an error.
        windows = windows.clamp(min=1.0) / self.accelerator.num_processes
        for k, part in enumerate(slices):
            rows = part["completion_ids"].shape[0]
            part["gtpo_window_tokens"] = windows[k // accumulation].expand(rows).clone()

    # ------------------------------------------------------------------------------------------ the loss

    def whole_batch_counts(self, inputs: dict, mode: str):
        """``(num_sequences, num_tokens)`` of the optimisation step a loss call belongs to, per process (DDP
        averages the processes): the rows of ``current_gradient_accumulation_steps`` slices like this one, and
        the window's tokens that `attach_window_counts` gave every row (for TRL's 'bnpo', the call's own tokens).
        In evaluation, the call's own batch."""
        rows = inputs["completion_ids"].shape[0]
        if self._gtpo_local_tokens:  # BNPO: this call's tokens (at least 1, as TRL), times the accumulation steps
            steps = self.current_gradient_accumulation_steps if mode == "train" else 1
            return rows * steps, _loss_mask(inputs).sum().to(torch.float64).clamp(min=1.0) * steps
        if mode == "train":
            num_sequences = rows * self.current_gradient_accumulation_steps
            if "gtpo_window_tokens" in inputs:
                return num_sequences, inputs["gtpo_window_tokens"][0]
            # TRL's own average window (from_grpo_config's token means; a step spanning generation batches; a batch
            # that did not come through _prepare_inputs, e.g. a test's).
            tokens = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            return num_sequences, tokens * self.current_gradient_accumulation_steps / self.args.steps_per_generation
        return rows, inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes

    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        completion_ids = inputs["completion_ids"]
        mask = _loss_mask(inputs)  # holes at a tool's output: out of the loss, still in the conflict runs
        num_sequences, num_tokens = self.whole_batch_counts(inputs, mode)
        conflict = None
        if self.gtpo_config.use_conflict_weights:
            conflict = (inputs["gtpo_lambda"], inputs["gtpo_n_conflict"])
        config = self.gtpo_config
        if self.use_adaptive_entropy:
            # TRL's controller (its state, self.entropy_coef and self._last_world_entropy, is TRL's, saved in its
            # checkpoints): the coefficient and gate of the end of the previous optimiser step.
            applied = self.entropy_coef if self._last_world_entropy <= self.args.entropy_target else 0.0
            config = config.replace(entropy_bonus=float(applied))
        loss_inputs = dict(
            completion_ids=completion_ids,
            completion_mask=mask,
            advantages=inputs["advantages"].reshape(-1),
            config=config,
            conflict=conflict,
            old_logprobs=inputs.get("old_per_token_logps"),
            ref_logprobs=inputs.get("ref_per_token_logps"),
            sampling_logprobs=inputs.get("sampling_per_token_logps") if _reads_sampler(self.gtpo_config) else None,
            initial_entropy=self._gtpo_initial_entropy,
            num_sequences=num_sequences,
            num_tokens=num_tokens,
            # Each completion's own temperature where the rollout sampled at several (the batch's gtpo_temperature).
            temperature=inputs.get("gtpo_temperature", self.temperature),
        )
        if config.top_entropy_quantile < 1 and self.accelerator.num_processes > 1:
            loss_inputs["entropy_quantile_group"] = torch.distributed.group.WORLD  # TRL's: every process's tokens
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        with self.accelerator.autocast():
            out, router_loss = model(input_ids=input_ids, attention_mask=attention_mask, gtpo_loss=loss_inputs)
        loss = out.loss
        if self.gtpo_config.loss_reduction == "sum":
            loss = loss * self.accelerator.num_processes  # DDP averages the processes; a sum is over all of them
        if router_loss is not None:  # as TRL adds it: per call, scaled for gradient accumulation
            steps = self.current_gradient_accumulation_steps if mode == "train" else 1.0
            loss = loss + self.router_aux_loss_coef * router_loss / steps
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(router_loss).mean().item())
        self._log_gtpo_metrics(out.metrics, mode)
        if getattr(self, "_entropy_bonus_enabled", False) or config.entropy_bonus > 0:
            self._log_policy_loss(out, config, num_tokens, mode)
        if self.use_adaptive_entropy and mode == "train":
            self._update_entropy_controller(out.metrics)
        elif config.entropy_bonus and mode == "train" and self.accelerator.sync_gradients:
            self._metrics["train"]["entropy_coef"].append(config.entropy_bonus)  # as TRL logs its static one
        return loss

    def _log_policy_loss(self, out, config: GTPOConfig, num_tokens, mode: str) -> None:
        """TRL's ``policy_loss`` beside an entropy bonus: the call's loss without the bonus, on TRL's scale (a token
        mean's share of its window as it is; the other reductions' micro-batch mean, before TRL divides it by the
        accumulation steps). Kept on the device with the other metrics, read at the log."""
        metrics = out.metrics
        if config.top_entropy_quantile < 1:
            return  # the bonus then averages the kept tokens only, whose entropies the metrics do not hold
        tokens = torch.as_tensor(num_tokens, dtype=torch.float64, device=metrics.entropy.device).clamp(min=1.0)
        bonus = config.entropy_bonus * metrics.entropy.detach().double() * metrics.num_tokens / tokens
        policy = out.loss.detach().double() + bonus
        # TRL divides every policy loss but a token mean over its window by the accumulation steps after logging it.
        window_share = config.loss_reduction == "token_mean" and not self._gtpo_local_tokens
        if mode == "train" and not window_share:
            policy = policy * self.current_gradient_accumulation_steps
        pending = self._gtpo_pending_policy.get(mode)
        entry = torch.stack([policy, torch.ones_like(policy)])
        self._gtpo_pending_policy[mode] = entry if pending is None else pending + entry

    def _update_entropy_controller(self, metrics: GTPOMetrics) -> None:
        """TRL's adaptive entropy bonus: the window's token-weighted entropy (this call's sums added to the
        window's), and at the optimiser step's boundary, over every process, the coefficient moved by
        ``entropy_coef_delta`` towards keeping the entropy above ``entropy_target``."""
        stats = torch.stack([metrics.entropy.detach().double() * metrics.num_tokens, metrics.num_tokens.double()])
        stats = stats.to(self.accelerator.device)
        self._entropy_window_stats = stats if self._entropy_window_stats is None else self._entropy_window_stats + stats
        if not self.accelerator.sync_gradients:
            return
        window = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
        world_entropy = float(window[0] / window[1].clamp(min=1.0))
        args = self.args
        if world_entropy <= args.entropy_target:
            self.entropy_coef = min(self.entropy_coef + args.entropy_coef_delta, args.entropy_coef_max)
        else:
            self.entropy_coef = max(self.entropy_coef - args.entropy_coef_delta, args.entropy_coef_min)
        self._last_world_entropy = world_entropy
        self._entropy_window_stats = None
        self._metrics["train"]["entropy_coef"].append(self.entropy_coef)

    def _log_gtpo_metrics(self, metrics: GTPOMetrics, mode: str) -> None:
        """Adds this call's metric sums to the mode's pending ones, on the device (read in `log`)."""
        sums = metrics.to_sums()

        def row_sum(row):  # over completions, an empty one (NaN) counting 0, as TRL's one-ratio-per-completion mean
            return sums.new_zeros(()) if row is None else torch.nan_to_num(row.detach().to(torch.float64)).sum()

        rows = metrics.num_sequences.to(torch.float64)[None]
        sums = torch.cat(
            [sums, torch.stack([row_sum(metrics.completion_clip_low), row_sum(metrics.completion_clip_high)]), rows]
        )

        def smallest(row):  # over completions; empty ones (NaN) skipped, +inf when none is left
            if row is None:  # no clipping (or on-policy): every completion's fraction is 0
                return sums.new_zeros(())
            row = torch.nan_to_num(row.detach().to(torch.float64), nan=math.inf)
            return row.amin() if row.numel() else sums.new_full((), math.inf)

        # TRL's clip_ratio/low_min and /high_max, kept as [low_min, -high_max]: one running minimum holds both.
        extremes = torch.stack(
            [
                smallest(metrics.completion_clip_low),
                smallest(None if metrics.completion_clip_high is None else -metrics.completion_clip_high),
            ]
        )
        pending = self._gtpo_pending.get(mode)
        if pending is None:
            self._gtpo_pending[mode] = (sums, extremes)
        else:
            self._gtpo_pending[mode] = (pending[0] + sums, torch.minimum(pending[1], extremes))

    def _flush_gtpo_metrics(self, mode: str) -> None:
        """One gather and one host read for every loss call since the last log: the ``gtpo/*`` metrics, and
        TRL's own ``entropy``, ``kl`` and ``clip_ratio/*`` (so that dashboards built for ``GRPOTrainer`` keep
        working; ``clip_ratio/low_min`` and ``/high_max`` are the extremes over the completions of every loss
        call since the last log, where TRL logs them per call and averages at the log; with one ratio per completion,
        GSPO's, the ``*_mean`` ones are over completions, as TRL's; TRL's ``cispo_clip_ratio`` and
        ``vespo/phi_seq_mean`` with CISPO and VESPO)."""
        pending = self._gtpo_pending.pop(mode, None)
        if pending is None:
            return
        policy = self._gtpo_pending_policy.pop(mode, None)
        policy = pending[0].new_zeros(2) if policy is None else policy.to(pending[0])
        per_process = self.accelerator.gather(torch.cat([*pending, policy])[None])  # [processes, sums, 2 extremes, 2]
        policy = per_process[:, -2:].sum(0)  # TRL: each call's mean over processes, then the mean over calls
        per_process = per_process[:, :-2]
        extremes = per_process[:, -2:].amin(dim=0)
        extremes = torch.where(torch.isinf(extremes), torch.full_like(extremes, math.nan), extremes)
        totals = per_process[:, :-2].sum(0)
        # [clip low, clip high, completions] summed over completions: TRL's means when each completion has one ratio.
        per_completion = totals[-3:-1] / totals[-1].clamp(min=1)
        # TRL computes reference log-probs (hence a KL) exactly when beta != 0.
        has_kl = float(self.beta) != 0.0
        vespo = self.gtpo_config.ratio_function == "vespo"
        merged = GTPOMetrics.from_sums(totals[:-3], has_kl=has_kl, has_vespo=vespo)
        low_mean, high_mean = merged.clip_low_fraction, merged.clip_high_fraction
        if self.gtpo_config.importance_sampling_level == "sequence":
            low_mean, high_mean = per_completion[0], per_completion[1]
        values = {f"gtpo/{name}": getattr(merged, name) for name in METRIC_NAMES if getattr(merged, name) is not None}
        values.update(
            {
                "entropy": merged.entropy,
                "clip_ratio/low_mean": low_mean,
                "clip_ratio/high_mean": high_mean,
                "clip_ratio/region_mean": low_mean + high_mean,
                "clip_ratio/low_min": extremes[0],
                "clip_ratio/high_max": -extremes[1],
            }
        )
        if has_kl:
            values["kl"] = merged.kl
        if self.gtpo_config.ratio_function == "cispo":  # TRL's name for CISPO's capped share
            values["cispo_clip_ratio"] = merged.clip_high_fraction
        if vespo:
            values["vespo/phi_seq_mean"] = merged.vespo_weight_mean
        values["policy_loss"] = policy[0] / policy[1].clamp(min=1)
        read = torch.stack([v.to(torch.float64) for v in values.values()] + [policy[1], merged.num_tokens])
        *read, calls, tokens = read.tolist()  # the one host read
        if not calls:
            values.pop("policy_loss")
        for name, value in zip(values, read):
            self._metrics[mode][name].append(value)
        if mode == "train" and not tokens:
            warnings.warn(
                "GTPOTrainer: every completion since the last log was masked out of the loss (with "
                "mask_truncated_completions, every one reached max_completion_length): those optimiser steps "
                "trained nothing; raise max_completion_length, or let the model learn to stop",
                RuntimeWarning,
                stacklevel=2,
            )

    def log(self, logs, *args, **kwargs):
        self._flush_gtpo_metrics("train" if self.model.training else "eval")  # the mode TRL's log reports
        return super().log(logs, *args, **kwargs)


def _reads_sampler(config: GTPOConfig) -> bool:
    """Whether the loss reads the sampler's log-probs (vLLM's), which TRL's batch has with vLLM."""
    return config.sampling_correction is not None or config.off_policy_mask_threshold is not None


def _loss_mask(inputs: dict) -> torch.Tensor:
    """The tokens the loss trains: ``completion_mask``, less a tool's output (TRL's ``tool_mask``) inside it."""
    mask = inputs["completion_mask"]
    return mask * inputs["tool_mask"] if "tool_mask" in inputs else mask
