"""Rollouts: prompts to completions (`generate`), and a step's batch scored by the task's rewards, with its
group-relative advantages and conflict weights (`rollout`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from gtpo_kernels import compute_advantages, conflict_weights
from gtpo_kernels.rows import LossRows

from .config import TrainConfig
from .sampling import StopStrings, sample
from .scoring import combine, score
from .task import Task


@dataclass
class Completions:
    """``n`` completions of each of ``P`` prompts, the rows of a prompt adjacent: what `generate` returns."""

    prompt_ids: torch.Tensor  # [P, Lp] left-padded
    prompt_mask: torch.Tensor  # [P, Lp]
    completion_ids: torch.Tensor  # [P * n, L]
    completion_mask: torch.Tensor  # [P * n, L] bool: up to and including the token that ended each; then padding
    texts: List[str]  # [P * n] decoded, special tokens skipped


@dataclass
class Rollout:
    """This process's share of a step's batch: ``P`` prompts' completions (``group_size`` each), what the task's
    rewards made of them, and the per-token inputs the update reads besides (`rows`)."""

    completions: Completions
    group_size: int
    advantages: torch.Tensor  # [P * G] group-relative
    scores: Optional[torch.Tensor] = None  # [P * G, R] each reward's values, NaN where a reward does not apply
    rewards: Optional[torch.Tensor] = None  # [P * G] their weighted sum
    conflict: Optional[Tuple[torch.Tensor, torch.Tensor]] = None  # (lambda [P * G, L], n_conflict [P * G]) of groups
    old_logprobs: Optional[torch.Tensor] = None  # [P * G, L] the sampling policy's (--num-iterations above 1)
    ref_logprobs: Optional[torch.Tensor] = None  # [P * G, L] the reference model's (--beta)

    @property
    def prompts(self) -> int:
        return self.completions.prompt_ids.shape[0]

    def completion_rows(self, groups: slice) -> slice:
        """The completions of prompt groups ``groups``."""
        return slice(groups.start * self.group_size, groups.stop * self.group_size)

    def rows(self, groups: slice, **call) -> LossRows:
        """The loss's rows for prompt groups ``groups`` (a micro-batch): their completions, advantages, conflict
        weights and log-probs; ``call``: the other row keywords (temperature, initial entropy, whole-batch counts)."""
        rows = self.completion_rows(groups)

        def pick(tensor):
            return None if tensor is None else tensor[rows]

        c = self.completions
        return LossRows(
            c.completion_ids[rows],
            c.completion_mask[rows],
            self.advantages[rows],
            conflict=None if self.conflict is None else (self.conflict[0][rows], self.conflict[1][rows]),
            old_logprobs=pick(self.old_logprobs),
            ref_logprobs=pick(self.ref_logprobs),
            **call,
        )


def encode_prompts(tokenizer, task: Task, prompts: list, device) -> Dict[str, torch.Tensor]:
    """Left-padded prompt ids and mask, one row per prompt. A chat template brings its own special tokens; plain
    text gets the tokenizer's (a base model's BOS)."""
    texts = [task.prompt_text(tokenizer, p) for p in prompts]
    return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=not task.chat_template).to(device)


def eos_ids(model, tokenizer) -> List[int]:
    """Every id that ends a completion: the tokenizer's EOS and each of the model's generation config (instruct
    models often list several, e.g. an end-of-turn and an end-of-text token)."""
    ids = [tokenizer.eos_token_id]
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids += configured if isinstance(configured, (list, tuple)) else [configured]
    return sorted({int(i) for i in ids if i is not None})


@torch.no_grad()
def generate(
    model,
    tokenizer,
    task: Task,
    prompts: list,
    n: int,
    config: TrainConfig,
    device,
    greedy=False,
    greedy_first=False,
    on_token=None,
) -> Completions:
    """``n`` completions per prompt, rows of a prompt adjacent, each prompt run once (`sampling.sample`), cut by
    ``--top-k/--top-p/--min-p`` and ended by any EOS id (`eos_ids`) or ``--stop`` string. Returns prompt ids/mask
    (one row per prompt), completion ids/mask (the mask covers the completion up to and including the token that
    ended it: the EOS, or the one that completed a stop string; what follows is padding the loss never sees) and
    the decoded texts."""
    enc = encode_prompts(tokenizer, task, prompts, device)
    completion_ids, lengths = sample(
        model,
        enc["input_ids"],
        enc["attention_mask"],
        n,
        config.max_new_tokens,
        temperature=config.temperature,
        top_k=config.top_k,
        top_p=config.top_p,
        min_p=config.min_p,
        greedy=greedy,
        greedy_first=greedy_first,
        eos_token_id=eos_ids(model, tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        stops=StopStrings(tokenizer, config.stop) if config.stop else None,
        on_token=on_token,
        with_lengths=True,
        own_cache=not config.fsdp,  # FSDP's hooks gather the weights around whole layers, which our step goes inside
        compile=compiles_decode(config, device),
    )
    completion_mask = torch.arange(completion_ids.shape[1], device=device)[None] < lengths[:, None]
    texts = tokenizer.batch_decode(
        torch.where(completion_mask, completion_ids, tokenizer.pad_token_id), skip_special_tokens=True
    )
    return Completions(enc["input_ids"], enc["attention_mask"], completion_ids, completion_mask, texts)


def compiles_decode(config: TrainConfig, device) -> bool:
    """Whether the sampler's step runs under torch.compile: ``--compile-decode on``. ``auto`` compiles where it was
    measured to pay, which is nowhere yet: on a CPU a cold compile took 47 s for a step 10 % faster, and the shape
    changes with each batch's prompt width (bench/results/sampler-cpu-fp32.md); on a GPU it has not been measured."""
    return config.compile_decode == "on"


def score_completions(task: Task, rows: Dict[str, list], completions: Completions, n: int) -> torch.Tensor:
    """``[len(prompts) * n, R]``: the task's rewards for the ``completions`` (``n`` per row of ``rows``), with
    TRL's arguments: each row's prompt and columns repeated for each of its completions, the completions in the
    prompt's format, the completion ids up to and including EOS."""
    repeat = lambda values: [v for v in values for _ in range(n)]  # noqa: E731
    ids, mask = completions.completion_ids, completions.completion_mask
    return score(
        task.rewards,
        prompts=repeat(rows[task.prompt_column]),
        completions=[task.completion(t) for t in completions.texts],
        completion_ids=[row[keep].tolist() for row, keep in zip(ids, mask)],
        columns={k: repeat(v) for k, v in rows.items() if k != task.prompt_column},
    )


def rollout(
    model,
    tokenizer,
    task: Task,
    rows: Dict[str, List],
    config: TrainConfig,
    device,
    on_token=None,
) -> Rollout:
    """This process's share of a step's batch (``rows``: its prompts' dataset rows): completions, each reward's
    values (``scores``, NaN where a reward returned None), their weighted sum, advantages and the conflict weights
    of its whole prompt groups. ``on_token(t)`` is called after each decoded token."""
    completions = generate(
        model, tokenizer, task, rows[task.prompt_column], config.group_size, config, device, on_token=on_token
    )
    scores = score_completions(task, rows, completions, config.group_size)
    rewards = combine(scores, task.weights).to(device)
    loss_config = config.loss_config()
    advantages = compute_advantages(rewards, config.group_size, normalize_std=loss_config.normalize_advantages_by_std)
    conflict = None
    if loss_config.use_conflict_weights:
        conflict = conflict_weights(
            completions.completion_ids,
            completions.completion_mask,
            advantages,
            config.group_size,
            loss_config.conflict_weight,
        )
    return Rollout(completions, config.group_size, advantages, scores=scores, rewards=rewards, conflict=conflict)
