"""How `GTPOTrainer` treats every setting of TRL's ``GRPOConfig``: honoured, irrelevant to the loss, or refused.

`SETTINGS` classifies each field that ``GRPOConfig`` adds to ``transformers.TrainingArguments``; the fields of
``TrainingArguments`` itself (optimiser, schedule, precision, batch sizes, logging, checkpoints, distribution)
are the Trainer's, which ``GTPOTrainer`` does not touch. `check_settings` refuses, in one line naming the field
(and the GTPO knob it contradicts), every value the GTPO loss would otherwise ignore. ``tests/test_trl.py``
fails when the installed TRL has a field this table does not classify, so that a new TRL release cannot add
a silent one. ``python -m gtpo_kernels.integrations.trl_settings`` prints the table (docs/trl-settings.md).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Dict, NamedTuple, Optional

HONOURED, IRRELEVANT, REFUSED = "honoured", "irrelevant to the loss", "refused"

# TRL's loss_type -> (the GTPO reduction, the ratio function) that compute the same loss (None: not expressible).
LOSS_TYPES = {
    "grpo": ("sequence_mean", "clip"),
    "dapo": ("token_mean", "clip"),
    "dr_grpo": ("dr_grpo", "clip"),
    "cispo": ("token_mean", "cispo"),
    "sapo": ("sequence_mean", "sapo"),
    "bnpo": ("token_mean", "clip"),  # each micro-batch divided by its own tokens (GTPOTrainer passes them)
    "luspo": ("sequence_sum", "clip"),
    "vespo": ("token_mean", "vespo"),
}


class Setting(NamedTuple):
    status: str
    how: str
    # ``refuse(value, args, gtpo_config) -> reason or None`` (None: this value is fine): for refused settings, and
    # for honoured ones that reach the loss through the GTPO config, whose values must agree with it.
    refuse: Optional[Callable] = None


def _unless(expected, why: str):
    def refuse(value, args, config):
        same = value == expected or (
            isinstance(value, float) and isinstance(expected, float) and math.isclose(value, expected)
        )
        return None if same else f"{why}; leave it at {expected!r}"

    return refuse


def _clip_side(side: str):
    def refuse(value, args, config):
        default = 0.2 if side == "low" else None  # TRL's (epsilon_high None: epsilon's value)
        preset = config.clip_eps_low if side == "low" else config.clip_eps_high
        if value == default or value == preset:
            return None
        knob = "clip_eps_low" if side == "low" else "clip_eps_high"
        return (
            f"contradicts GTPOConfig({knob}={preset!r}) (preset {config.preset!r}), which sets the loss's clip "
            f"range: set GTPOConfig({knob}={value!r}) instead, or leave the TRL field at its default"
        )

    return refuse


def _loss_type(value, args, config):
    if value == "dapo":  # TRL's default: not a choice the user made
        return None
    mine = LOSS_TYPES.get(value)
    if mine is None:
        return f"{value!r} is not a GTPO reduction (the loss is GTPOConfig.loss_reduction={config.loss_reduction!r})"
    reduction, ratio_function = mine
    if (reduction, ratio_function) != (config.loss_reduction, config.ratio_function):
        return (
            f"contradicts GTPOConfig(loss_reduction={config.loss_reduction!r}, ratio_function="
            f"{config.ratio_function!r}) (preset {config.preset!r}): set GTPOConfig(loss_reduction={reduction!r}, "
            f"ratio_function={ratio_function!r}) for TRL's {value!r}"
        )
    return None


def entropy_bonus_knobs(args) -> dict:
    """TRL's static entropy bonus as `GTPOConfig` knobs (``{}`` without one; the adaptive one is refused)."""
    coef = float(getattr(args, "entropy_coef", 0.0) or 0.0)
    return {} if coef == 0 or getattr(args, "use_adaptive_entropy", False) else {"entropy_bonus": coef}


def _entropy_bonus(value, args, config):
    wanted = entropy_bonus_knobs(args).get("entropy_bonus", 0.0)
    if wanted and config.entropy_bonus not in (0.0, wanted):
        return (
            f"contradicts GTPOConfig(entropy_bonus={config.entropy_bonus!r}), TRL's entropy bonus in the GTPO loss: "
            f"set the same in both, or leave entropy_bonus 0 to take TRL's"
        )
    return None


def _off_policy_mask(value, args, config):
    mine = config.off_policy_mask_threshold
    if value is not None and mine is not None and not math.isclose(value, mine):
        return f"contradicts GTPOConfig(off_policy_mask_threshold={mine!r}): set the same in both, or leave it None"
    return None


def _top_entropy(value, args, config):
    mine = config.top_entropy_quantile
    if value < 1 and mine < 1 and not math.isclose(value, mine):
        return f"contradicts GTPOConfig(top_entropy_quantile={mine!r}): set the same in both, or leave it 1.0"
    return None


def _adaptive_entropy(value, args, config):
    if value and config.entropy_bonus != 0:
        return (
            f"TRL's adaptive controller sets the entropy bonus, and GTPOConfig(entropy_bonus={config.entropy_bonus!r}) "
            f"sets one too: leave entropy_bonus 0"
        )
    return None


def _vespo_knob(name: str):
    def refuse(value, args, config):
        mine = getattr(config, name)
        if config.ratio_function != "vespo" or math.isclose(value, mine):
            return None
        return f"contradicts GTPOConfig({name}={mine!r}): set the same in both"

    return refuse


def _sapo_temperature(side: str):
    def refuse(value, args, config):
        mine = getattr(config, f"sapo_temperature_{side}")
        if config.ratio_function != "sapo" or math.isclose(value, mine):
            return None
        return f"contradicts GTPOConfig(sapo_temperature_{side}={mine!r}): set the same in both"

    return refuse


def _scale_mode(value) -> str:
    """TRL's scale_rewards, whose booleans are older spellings of 'group' and 'none'."""
    return {True: "group", False: "none"}.get(value, value)


def _scale_rewards(value, args, config):
    value = _scale_mode(value)
    if value == "group":  # TRL's default
        return None
    wanted = ("group", "batch") if config.normalize_advantages_by_std else ("none",)
    if value not in wanted:
        return (
            f"contradicts GTPOConfig(normalize_advantages_by_std={config.normalize_advantages_by_std}) "
            f"(preset {config.preset!r}), which sets the advantages ({' or '.join(map(repr, wanted))})"
        )
    return None


def _bias_correction(value, args, config):
    if float(args.beta) != 0.0 and bool(value) != config.kl_ratio_weighted:
        return (
            f"contradicts GTPOConfig(kl_ratio_weighted={config.kl_ratio_weighted}), which decides whether the KL "
            f"is weighted by the importance ratio: set both the same (TRL's default is True)"
        )
    return None


def _delta(value, args, config):
    if config.ratio_function != "clip" and getattr(args, "loss_type", None) in ("cispo", "sapo", "vespo"):
        return None  # TRL applies delta to its clip losses only; so does the config (ratio_cap is refused there)
    if value != config.ratio_cap:
        return (
            f"contradicts GTPOConfig(ratio_cap={config.ratio_cap!r}), the loss's two-sided clipping: set "
            f"GTPOConfig(ratio_cap={value!r})" + ("" if value is not None else " or leave ratio_cap None")
        )
    return None


def vllm_sampling_knobs(args) -> dict:
    """The `GTPOConfig` knobs of TRL's vLLM importance-sampling correction under ``args`` (``{}`` when it is off:
    without vLLM, or with ``vllm_importance_sampling_correction=False``)."""
    if not (getattr(args, "use_vllm", False) and getattr(args, "vllm_importance_sampling_correction", False)):
        return {}
    return dict(
        sampling_correction=args.vllm_importance_sampling_mode,
        sampling_ratio_min=args.vllm_importance_sampling_clip_min,
        sampling_ratio_max=args.vllm_importance_sampling_clip_max,
    )


def trl_loss_terms(args) -> dict:
    """The `GTPOConfig` knobs of the loss terms ``args`` turns on that stand beside any preset: vLLM's
    importance-sampling correction, the static entropy bonus, GSPO's sequence-level ratio, off-policy masking, the
    top-entropy token mask."""
    knobs = {**vllm_sampling_knobs(args), **entropy_bonus_knobs(args)}
    if getattr(args, "importance_sampling_level", "token") == "sequence":
        knobs["importance_sampling_level"] = "sequence"
    if getattr(args, "off_policy_mask_threshold", None) is not None:
        knobs["off_policy_mask_threshold"] = args.off_policy_mask_threshold
    if getattr(args, "top_entropy_quantile", 1.0) < 1:
        knobs["top_entropy_quantile"] = args.top_entropy_quantile
    return knobs


def with_trl_loss_terms(config, args):
    """``config`` with each of `trl_loss_terms` that it leaves at its default (one it sets itself must agree with
    TRL's: `check_settings` refuses it otherwise)."""
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    taken = {name: value for name, value in trl_loss_terms(args).items() if getattr(config, name) == defaults[name]}
    return config.replace(**taken) if taken else config


def _vllm_is(value, args, config):
    wanted = vllm_sampling_knobs(args)
    if not wanted:
        if config.sampling_correction is not None:
            return (
                f"GTPOConfig(sampling_correction={config.sampling_correction!r}) needs the sampler's log-probs, "
                f"which TRL has only with use_vllm=True and vllm_importance_sampling_correction=True: set both, or "
                f"sampling_correction=None"
            )
        return None
    if config.sampling_correction is None:  # GTPOTrainer applies TRL's correction
        return None
    differ = [(knob, getattr(config, knob), value) for knob, value in wanted.items() if getattr(config, knob) != value]
    if differ:
        knob, mine, trls = differ[0]
        return (
            f"with use_vllm=True TRL's correction is {knob}={trls!r} and GTPOConfig({knob}={mine!r}) contradicts it: "
            f"set the same in both, or leave GTPOConfig.sampling_correction None to take TRL's"
        )
    return None


def _sampling(name):
    return Setting(IRRELEVANT, f"sampling ({name}); the loss scores under softmax(logits / temperature), as TRL does")


_TRL = "TRL's, unchanged"
SETTINGS: Dict[str, Setting] = {
    # the model
    "model_init_kwargs": Setting(HONOURED, _TRL + " (loading the model)"),
    "trust_remote_code": Setting(HONOURED, _TRL + " (loading the model)"),
    "disable_dropout": Setting(HONOURED, _TRL + " (dropout off in the policy and reference)"),
    "router_aux_loss_coef": Setting(
        HONOURED,
        "a Mixture-of-Experts model's router load-balancing loss, from the decoder pass's router logits, added as "
        "TRL adds it",
    ),
    "cast_lm_head_to_fp32": Setting(
        HONOURED, "the fused loss's head GEMMs and statistics in float32 (TRL casts the head's weights)"
    ),
    # generation and groups
    "num_generations": Setting(HONOURED, "G: the group of the advantages and of the conflict weights"),
    "num_generations_eval": Setting(HONOURED, _TRL + " (evaluation)"),
    "max_completion_length": Setting(HONOURED, "the generation cap; dr_grpo's divisor"),
    "ds3_gather_for_generation": Setting(IRRELEVANT, "generation under DeepSpeed ZeRO-3"),
    "shuffle_dataset": Setting(IRRELEVANT, "data order"),
    "pad_to_multiple_of": Setting(IRRELEVANT, "padding (masked out of the loss)"),
    "generation_batch_size": Setting(
        HONOURED,
        "the generation batch, split into steps_per_generation slices; the grpo preset's token means take "
        "TRL's average window, GTPO's presets each optimiser step's exact count (TRL's when a step spans "
        "generation batches)",
    ),
    "steps_per_generation": Setting(HONOURED, "as generation_batch_size"),
    "temperature": Setting(HONOURED, "the loss's statistics are those of softmax(logits / temperature)"),
    "top_p": _sampling("top_p"),
    "top_k": _sampling("top_k"),
    "min_p": _sampling("min_p"),
    "repetition_penalty": _sampling("repetition_penalty"),
    "generation_kwargs": _sampling("generation_kwargs"),
    "chat_template_kwargs": Setting(IRRELEVANT, "prompt formatting"),
    "cache_implementation": Setting(IRRELEVANT, "generation"),
    "use_transformers_continuous_batching": Setting(IRRELEVANT, "generation"),
    "transformers_continuous_batching_config": Setting(IRRELEVANT, "generation"),
    "use_transformers_paged": Setting(IRRELEVANT, "generation"),
    "max_tool_calling_iterations": Setting(
        HONOURED, "tools; a tool's output is masked out of the loss (tool_mask) and kept in the conflict runs"
    ),
    # vLLM
    "use_vllm": Setting(IRRELEVANT, "generation with vLLM"),
    **{
        name: Setting(IRRELEVANT, "generation with vLLM")
        for name in (
            "vllm_mode",
            "vllm_model_impl",
            "vllm_enable_sleep_mode",
            "vllm_structured_outputs_regex",
            "vllm_server_base_url",
            "vllm_server_host",
            "vllm_server_port",
            "vllm_server_timeout",
            "vllm_group_port",
            "vllm_gpu_memory_utilization",
            "vllm_max_model_length",
            "vllm_tensor_parallel_size",
        )
    },
    "vllm_importance_sampling_correction": Setting(
        HONOURED,
        "with use_vllm, GTPOConfig.sampling_correction: each token's policy term weighted by TRL's ratio of the "
        "trainer's to vLLM's probability (set from the fields below unless the GTPO config sets its own, which "
        "must agree)",
        _vllm_is,
    ),
    **{
        name: Setting(HONOURED, "the mode and bounds of GTPOConfig.sampling_correction (sampling_ratio_min/max)")
        for name in (
            "vllm_importance_sampling_mode",
            "vllm_importance_sampling_clip_max",
            "vllm_importance_sampling_clip_min",
            "vllm_importance_sampling_cap",
        )
    },
    # rewards and advantages
    "reward_weights": Setting(HONOURED, _TRL + " (the reward)"),
    "multi_objective_aggregation": Setting(HONOURED, _TRL + " (the reward)"),
    "scale_rewards": Setting(
        HONOURED,
        "GTPOConfig.normalize_advantages_by_std: 'group' (TRL's default) or 'batch' (the batch's std, TRL's) when "
        "it normalises, 'none' when it does not; a value that contradicts it is refused",
        _scale_rewards,
    ),
    "mask_truncated_completions": Setting(HONOURED, "TRL zeroes a truncated completion's mask before the loss"),
    # the loss
    "loss_type": Setting(
        HONOURED,
        "GTPOConfig.loss_reduction and ratio_function; a value given is refused unless the config computes the "
        "same ('grpo': sequence_mean, 'dapo': token_mean, 'dr_grpo', 'luspo': sequence_sum, each with the clip; "
        "'bnpo': token_mean over each micro-batch's own tokens; 'cispo': token_mean with ratio_function='cispo'; "
        "'sapo': sequence_mean with 'sapo'; 'vespo': token_mean with 'vespo')",
        _loss_type,
    ),
    "epsilon": Setting(
        HONOURED,
        "through GTPOConfig.clip_eps_low/high (from_grpo_config sets them); a value given "
        "is refused unless it equals the config's",
        _clip_side("low"),
    ),
    "epsilon_high": Setting(HONOURED, "as epsilon", _clip_side("high")),
    "delta": Setting(
        HONOURED, "two-sided clipping is GTPOConfig.ratio_cap; a value other than the config's is refused", _delta
    ),
    "beta": Setting(HONOURED, "must equal GTPOConfig.kl_beta (TRL loads the reference model when beta > 0)"),
    "use_bias_correction_kl": Setting(
        HONOURED,
        "the ratio-weighted KL is GTPOConfig.kl_ratio_weighted; with beta > 0 "
        "a value other than the config's is refused (TRL's default is True)",
        _bias_correction,
    ),
    "num_iterations": Setting(HONOURED, "TRL keeps the old log-probs; the loss takes the ratio against them"),
    "importance_sampling_level": Setting(
        HONOURED,
        "GTPOConfig.importance_sampling_level ('sequence': GSPO; taken from here unless the GTPO config sets "
        "'sequence' itself)",
    ),
    "off_policy_mask_threshold": Setting(
        HONOURED,
        "GTPOConfig.off_policy_mask_threshold (taken from here unless the GTPO config sets its own, which must "
        "agree), against vLLM's log-probs with vLLM, else the old ones",
        _off_policy_mask,
    ),
    "top_entropy_quantile": Setting(
        HONOURED,
        "GTPOConfig.top_entropy_quantile (taken from here unless the GTPO config sets its own, which must agree): "
        "the policy term on the tokens at or above the quantile of every process's tokens of the micro-batch, as "
        "TRL's; the fused loss walks the micro-batch twice (statistics, then gradients: 8 T H V FLOPs instead of 6)",
        _top_entropy,
    ),
    "entropy_coef": Setting(
        HONOURED,
        "TRL's entropy bonus is GTPOConfig.entropy_bonus (taken from here unless the GTPO config sets its own, "
        "which must agree; not GTPO's own entropy_coef): the optimiser step's token mean, where TRL takes each "
        "micro-batch's (the same when they hold as many tokens)",
        _entropy_bonus,
    ),
    "use_adaptive_entropy": Setting(
        HONOURED,
        "TRL's controller drives GTPOConfig.entropy_bonus call by call (its state is TRL's, in TRL's checkpoints); "
        "a GTPO config with a bonus of its own is refused beside it",
        _adaptive_entropy,
    ),
    **{
        name: Setting(HONOURED, "the adaptive entropy controller's, as TRL uses them")
        for name in ("entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target")
    },
    "sapo_temperature_pos": Setting(
        HONOURED, "with loss_type='sapo', GTPOConfig.sapo_temperature_pos (must agree)", _sapo_temperature("pos")
    ),
    "sapo_temperature_neg": Setting(
        HONOURED, "with loss_type='sapo', GTPOConfig.sapo_temperature_neg (must agree)", _sapo_temperature("neg")
    ),
    **{
        name: Setting(HONOURED, f"with loss_type='vespo', GTPOConfig.{name} (must agree)", _vespo_knob(name))
        for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")
    },
    # the reference model
    "sync_ref_model": Setting(HONOURED, _TRL + " (reference model updates)"),
    "ref_model_mixup_alpha": Setting(HONOURED, _TRL + " (reference model updates)"),
    "ref_model_sync_steps": Setting(HONOURED, _TRL + " (reference model updates)"),
    # logging
    **{
        name: Setting(IRRELEVANT, "logging")
        for name in (
            "log_completions",
            "log_multimodal",
            "num_completions_to_print",
            "log_unique_prompts",
            "log_completions_hub_repo",
        )
    },
}


def from_grpo_config(args, **overrides):
    """The `GTPOConfig` of the ``grpo`` preset that computes what TRL's ``GRPOTrainer`` computes with ``args``:
    ``GTPOTrainer(..., args=args, gtpo_config=from_grpo_config(args))`` trains as ``GRPOTrainer`` does (tested
    against it). Every ``loss_type`` (its reduction and ratio function), ``epsilon``/``epsilon_high``, ``delta``,
    ``beta``, ``use_bias_correction_kl``, the SAPO and VESPO knobs, ``importance_sampling_level``,
    ``off_policy_mask_threshold``, ``top_entropy_quantile``, ``scale_rewards``, TRL's static entropy bonus
    (``entropy_coef``) and, with vLLM, its importance-sampling correction drive it. ``overrides`` are further
    `GTPOConfig` knobs."""
    from ..config import GTPOConfig

    if LOSS_TYPES.get(args.loss_type) is None:
        known = sorted(k for k, v in LOSS_TYPES.items() if v is not None)
        raise ValueError(f"GRPOConfig(loss_type={args.loss_type!r}) has no GTPO counterpart; these do: {known}")
    reduction, ratio_function = LOSS_TYPES[args.loss_type]
    scale = _scale_mode(args.scale_rewards)
    if scale not in ("group", "batch", "none"):
        raise ValueError(
            f"GRPOConfig(scale_rewards={args.scale_rewards!r}) has no GTPO counterpart: the advantages are "
            f"scaled by the group's std ('group'), the batch's ('batch') or not at all ('none')"
        )
    high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    knobs = dict(
        preset="grpo",
        loss_reduction=reduction,
        clip_eps_low=args.epsilon,
        clip_eps_high=high,
        ratio_cap=args.delta if ratio_function == "clip" else None,  # TRL applies delta to the clip losses only
        kl_beta=float(args.beta),
        kl_ratio_weighted=bool(args.use_bias_correction_kl),
        normalize_advantages_by_std=scale != "none",
        ratio_function=ratio_function,
        cispo_ratio_max=high,  # TRL's CISPO caps the detached ratio at its epsilon_high
        sapo_temperature_pos=args.sapo_temperature_pos,
        sapo_temperature_neg=args.sapo_temperature_neg,
        **{
            name: getattr(args, name) for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")
        },
        max_completion_length=args.max_completion_length if reduction == "dr_grpo" else None,
        **trl_loss_terms(args),
    )
    knobs.update(overrides)
    return GTPOConfig(**knobs)


def grpo_fields() -> Dict[str, object]:
    """The installed TRL's ``GRPOConfig`` fields beyond ``TrainingArguments``, with their defaults."""
    from transformers import TrainingArguments
    from trl import GRPOConfig

    inherited = {f.name for f in dataclasses.fields(TrainingArguments)}
    out = {}
    for f in dataclasses.fields(GRPOConfig):
        if f.name in inherited:
            continue
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            out[f.name] = f.default_factory()  # type: ignore[misc]
        else:
            out[f.name] = None
    return out


def unclassified() -> list:
    """Fields of the installed ``GRPOConfig`` that `SETTINGS` does not classify (should be empty)."""
    return sorted(set(grpo_fields()) - set(SETTINGS))


def check_settings(args, config) -> None:
    """Raises ``ValueError`` naming the first ``GRPOConfig`` field whose value the GTPO loss would ignore or
    contradict (`SETTINGS`)."""
    for name, setting in SETTINGS.items():
        if setting.refuse is None or not hasattr(args, name):
            continue
        value = getattr(args, name)
        reason = setting.refuse(value, args, config)
        if reason:
            raise ValueError(f"GTPOTrainer: GRPOConfig({name}={value!r}): {reason}")


def markdown() -> str:
    fields = grpo_fields()
    lines = [
        "# GRPOConfig settings under GTPOTrainer",
        "",
        "Generated by `python -m gtpo_kernels.integrations.trl_settings` from the installed TRL's `GRPOConfig` "
        "(the fields it adds to `transformers.TrainingArguments`; those of `TrainingArguments` itself are the "
        "Trainer's and are honoured as they are). A refused value stops `GTPOTrainer(...)` with one line naming "
        "the field.",
        "",
        "| field | default | status | how |",
        "|---|---|---|---|",
    ]
    for name in fields:
        setting = SETTINGS.get(name, Setting("NOT CLASSIFIED", ""))
        lines.append(f"| `{name}` | `{fields[name]!r}` | {setting.status} | {setting.how} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
