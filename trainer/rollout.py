"""Rollouts: prompts to completions (`generate`), and a step's batch scored by the task's rewards, with its
group-relative advantages and conflict weights (`rollout`)."""

from __future__ import annotations

from typing import Dict, List

import torch

from gtpo_kernels import GTPOConfig, compute_advantages, conflict_weights

from .config import TrainConfig
from .sampling import StopStrings, sample
from .scoring import combine, score
from .task import Task


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
):
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
    return {
        "prompt_ids": enc["input_ids"],
        "prompt_mask": enc["attention_mask"],
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "texts": texts,
    }


def compiles_decode(config: TrainConfig, device) -> bool:
    """Whether the sampler's step runs under torch.compile: ``--compile-decode on``. ``auto`` compiles where it was
    measured to pay, which is nowhere yet: on a CPU a cold compile took 47 s for a step 10 % faster, and the shape
    changes with each batch's prompt width (bench/results/sampler-cpu-fp32.md); on a GPU it has not been measured."""
    return config.compile_decode == "on"


def score_completions(task: Task, rows: Dict[str, list], batch: dict, n: int) -> torch.Tensor:
    """``[len(prompts) * n, R]``: the task's rewards for ``batch``'s completions (``n`` per row of ``rows``), with
    TRL's arguments: each row's prompt and columns repeated for each of its completions, the completions in the
    prompt's format, the completion ids up to and including EOS."""
    repeat = lambda values: [v for v in values for _ in range(n)]  # noqa: E731
    ids, mask = batch["completion_ids"], batch["completion_mask"]
    return score(
        task.rewards,
        prompts=repeat(rows[task.prompt_column]),
        completions=[task.completion(t) for t in batch["texts"]],
        completion_ids=[row[keep].tolist() for row, keep in zip(ids, mask)],
        columns={k: repeat(v) for k, v in rows.items() if k != task.prompt_column},
    )


def rollout(
    model,
    tokenizer,
    task: Task,
    rows: Dict[str, List],
    config: TrainConfig,
    loss_config: GTPOConfig,
    device,
    on_token=None,
):
    """This process's share of a step's batch (``rows``: its prompts' dataset rows): completions, each reward's
    values (``scores``, NaN where a reward returned None), their weighted sum, advantages and the conflict weights
    of its whole prompt groups. ``on_token(t)`` is called after each decoded token."""
    batch = generate(
        model, tokenizer, task, rows[task.prompt_column], config.group_size, config, device, on_token=on_token
    )
    batch["scores"] = score_completions(task, rows, batch, config.group_size)
    batch["rewards"] = combine(batch["scores"], task.weights).to(device)
    batch["advantages"] = compute_advantages(
        batch["rewards"], config.group_size, normalize_std=loss_config.normalize_advantages_by_std
    )
    if loss_config.use_conflict_weights:
        batch["conflict"] = conflict_weights(
            batch["completion_ids"],
            batch["completion_mask"],
            batch["advantages"],
            config.group_size,
            loss_config.conflict_weight,
        )
    return batch
