"""One GTPO (or GRPO) training run, top to bottom: ``gtpo-train`` (``python -m gtpo_train``; ``python -m trainer``
in a checkout), or under ``torchrun --nproc_per_node K -m gtpo_train`` for K processes.

    load model, data, rewards -> evaluate -> for each step:
        sample G completions for each of this process's prompts          (rollout)
        rewards -> group-relative advantages -> conflict weights of the (whole, local) groups
        old log-probs and the initial entropy from hidden states          (no [N, L, V] logits)
        GTPO loss on hidden states over micro-batches, with the whole batch's counts across processes;
        no optimiser step when no completion carries signal
        log (process 0), evaluate every k steps, checkpoint every k steps
    -> evaluate, save, plot, summary

``--prompts-per-step`` is the global batch: each of the K processes samples its share of the prompts, so
prompt groups and their conflict weights stay within a process, and the loss divides by the whole
batch's counts (all-reduced), which makes K processes update exactly as one would (tested).
"""

from __future__ import annotations

import gc
import json
import math
import re
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from gtpo_kernels import (
    GTPOConfig,
    GTPOMetrics,
    compute_advantages,
    conflict_weights,
    fused_linear_gtpo_loss,
    fused_linear_token_logprobs_and_entropy,
    gtpo_loss,
)
from gtpo_kernels.hf import check_hidden_states_supported, grouped_completion_hidden_states

from .checkpoint import RunState, load_checkpoint, require_checkpoint, save_checkpoint
from .config import ConfigError, TrainConfig, parse_args
from .data import load_problems
from .distributed import Distributed, full_parameters, full_state, load_full_state, no_sync, wrap
from .intervals import metric_intervals, with_interval
from .metrics_log import MetricsLog
from .model import check_model_source, load_model_and_tokenizer, use_grouped_query_attention_on_cpu
from .plots import plot_run
from .rewards import DEFAULT_REWARDS, SYSTEM_PROMPT, WORKED_EXAMPLES, answers_match, extract_answer, parse_number
from .sampling import sample
from .seeding import step_seed
from .stopping import Interrupted, Stopped, StopReason, StopRequests

# Steps in a row without any learning signal before the run warns (it keeps going).
NO_SIGNAL_WARNING_AFTER = 3


# ---------------------------------------------------------------------------------------------- rollouts


def chat(question: str, worked_examples: int) -> List[Dict[str, str]]:
    """The conversation a question is asked in: the system prompt, the first ``worked_examples`` worked
    examples as earlier turns, the question."""
    if not 0 <= worked_examples <= len(WORKED_EXAMPLES):
        raise ValueError(f"worked_examples must be between 0 and {len(WORKED_EXAMPLES)} (got {worked_examples})")
    turns = [
        {"role": role, "content": text}
        for q, a in WORKED_EXAMPLES[:worked_examples]
        for role, text in (("user", q), ("assistant", a))
    ]
    return [{"role": "system", "content": SYSTEM_PROMPT}, *turns, {"role": "user", "content": question}]


def encode_prompts(tokenizer, questions: List[str], device, worked_examples: int) -> Dict[str, torch.Tensor]:
    texts = [
        tokenizer.apply_chat_template(chat(q, worked_examples), tokenize=False, add_generation_prompt=True)
        for q in questions
    ]
    return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)


@torch.no_grad()
def generate(
    model,
    tokenizer,
    questions: List[str],
    n: int,
    config: TrainConfig,
    device,
    greedy=False,
    greedy_first=False,
    on_token=None,
):
    """``n`` completions per question, rows of a question adjacent, each prompt run once (`sampling.sample`).
    Returns prompt ids/mask (one row per question), completion ids/mask (the mask covers the completion up
    to and including its EOS) and the decoded texts."""
    enc = encode_prompts(tokenizer, questions, device, config.worked_examples)
    completion_ids = sample(
        model,
        enc["input_ids"],
        enc["attention_mask"],
        n,
        config.max_new_tokens,
        temperature=config.temperature,
        greedy=greedy,
        greedy_first=greedy_first,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        on_token=on_token,
    )
    is_eos = completion_ids == tokenizer.eos_token_id
    first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), completion_ids.shape[1])
    completion_mask = torch.arange(completion_ids.shape[1], device=device)[None] <= first_eos[:, None]
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


def rollout(model, tokenizer, problems, config: TrainConfig, loss_config: GTPOConfig, device) -> dict:
    """This process's share of a step's batch: completions, rewards, advantages and the conflict weights of
    its whole prompt groups."""
    batch = generate(model, tokenizer, problems["question"], config.group_size, config, device)
    answers = [a for a in problems["answer"] for _ in range(config.group_size)]
    batch["reward_parts"] = {
        f.__name__: torch.tensor(
            f(batch["texts"], answer=answers, answer_in_block=config.answer_in_block), dtype=torch.float32
        )
        for f in DEFAULT_REWARDS
    }
    batch["rewards"] = sum(batch["reward_parts"].values()).to(device)
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


# ---------------------------------------------------------------------------------------------- the loss


def completion_hidden_states(model, batch, groups: slice, group_size: int):
    """``(hidden [n, L, H], lm_head weight, bias)`` of the completions of prompt groups ``groups``: position
    ``t`` predicts ``completion_ids[:, t]``. Each prompt runs once and shares its cache with its group."""
    rows = slice(groups.start * group_size, groups.stop * group_size)
    return grouped_completion_hidden_states(
        model,
        batch["prompt_ids"][groups],
        batch["prompt_mask"][groups],
        batch["completion_ids"][rows],
        batch["completion_mask"][rows],
        group_size,
    )


def completion_logits(model, batch, groups: slice, group_size: int) -> torch.Tensor:
    """``[n, L, V]`` logits of the completions of prompt groups ``groups`` (the --no-fused-linear path)."""
    rows = slice(groups.start * group_size, groups.stop * group_size)
    prompt_ids = batch["prompt_ids"][groups].repeat_interleave(group_size, 0)
    prompt_mask = batch["prompt_mask"][groups].repeat_interleave(group_size, 0)
    input_ids = torch.cat([prompt_ids, batch["completion_ids"][rows]], dim=1)
    attention_mask = torch.cat([prompt_mask, batch["completion_mask"][rows].long()], dim=1)
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)  # left-padded prompts: real tokens only
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    return logits[:, prompt_ids.shape[1] - 1 : -1]


class PolicyLoss(nn.Module):
    """The policy's GTPO loss on prompt groups ``groups`` of a rollout batch, as a module: DDP and FSDP see
    the whole computation (decoder, loss, lm_head) as its forward."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        batch: dict,
        groups: slice,
        loss_config: GTPOConfig,
        config: TrainConfig,
        *,
        old_logprobs,
        initial_entropy,
        num_sequences,
        num_tokens,
    ):
        g = config.group_size
        rows = slice(groups.start * g, groups.stop * g)
        conflict = batch.get("conflict")
        common = dict(
            config=loss_config,
            initial_entropy=initial_entropy,
            temperature=config.temperature,
            conflict=None if conflict is None else (conflict[0][rows], conflict[1][rows]),
            old_logprobs=None if old_logprobs is None else old_logprobs[rows],
            num_sequences=num_sequences,
            num_tokens=num_tokens,
        )
        ids, mask, advantages = batch["completion_ids"][rows], batch["completion_mask"][rows], batch["advantages"][rows]
        if config.fused_linear:  # never builds the [n, L, V] logits
            hidden, weight, bias = completion_hidden_states(self.model, batch, groups, g)
            return fused_linear_gtpo_loss(hidden, weight, ids, mask, advantages, lm_head_bias=bias, **common)
        return gtpo_loss(completion_logits(self.model, batch, groups, g), ids, mask, advantages, **common)


@torch.no_grad()
def token_stats(model, batch, config: TrainConfig):
    """Per-token log-probs and entropies of the sampling policy, ``softmax(logits / T)`` (no grad, no logits):
    old log-probs and the initial entropy."""
    hidden, weight, bias = completion_hidden_states(
        model, batch, slice(0, batch["prompt_ids"].shape[0]), config.group_size
    )
    budget = None if config.loss_chunk_mib is None else config.loss_chunk_mib * 2**20
    return fused_linear_token_logprobs_and_entropy(
        hidden,
        weight,
        batch["completion_ids"],
        batch["completion_mask"],
        lm_head_bias=bias,
        temperature=config.temperature,
        max_chunk_bytes=budget,
    )


def update(
    policy: nn.Module,
    optimizer,
    batch: dict,
    loss_config: GTPOConfig,
    config: TrainConfig,
    dist: Distributed,
    old_logprobs,
    initial_entropy,
) -> dict:
    """One optimiser update from this process's rollout rows: micro-batches of whole prompt groups, the loss of
    each divided by the whole batch's counts (all processes), gradients summed; no step without signal.
    Returns the step's loss (the whole batch's), metrics (merged over micro-batches and processes) and
    whether the optimiser stepped."""
    mask = batch["completion_mask"]
    counts = dist.all_sum(torch.tensor([mask.shape[0], mask.sum()], dtype=torch.float64, device=dist.device))
    num_sequences, num_tokens = counts[0], counts[1]
    n_groups = batch["prompt_ids"].shape[0]
    if n_groups % config.grad_accum_steps:  # check_process_shares refuses this at start
        raise ValueError(f"{n_groups} prompt groups cannot be split into {config.grad_accum_steps} equal micro-batches")
    per_micro = n_groups // config.grad_accum_steps
    optimizer.zero_grad(set_to_none=True)
    loss_sum = torch.zeros((), dtype=torch.float64, device=dist.device)
    metrics = []
    for k in range(config.grad_accum_steps):
        groups = slice(k * per_micro, (k + 1) * per_micro)
        with no_sync(policy, last=k == config.grad_accum_steps - 1):
            with autocast(config, dist.device):
                out = policy(
                    batch,
                    groups,
                    loss_config,
                    config,
                    old_logprobs=old_logprobs,
                    initial_entropy=initial_entropy,
                    num_sequences=num_sequences,
                    num_tokens=num_tokens,
                )
            # Each call's loss is its share of the whole batch's; DDP and FSDP average the processes'
            # gradients, hence the factor: the sum over processes is the whole batch's gradient.
            (out.loss * dist.world).backward()
        loss_sum += out.loss.detach().double()
        metrics.append(out.metrics)
    merged = GTPOMetrics.from_sums(dist.all_sum(GTPOMetrics.merge(metrics).to_sums().to(dist.device)), parts=dist.world)
    signal = float(merged.signal_fraction) > 0
    grad_norm = float("nan")
    if signal:  # with no signal every gradient is 0, but Adam's momentum would still move the weights
        grad_norm = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), config.max_grad_norm))
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"loss": float(dist.all_sum(loss_sum)), "metrics": merged, "stepped": signal, "grad_norm": grad_norm}


def advance_schedule(scheduler) -> None:
    """One step of the learning-rate schedule, which follows the training steps, those without an optimiser
    step too (PyTorch warns when the schedule moves before the optimiser ever stepped: here that is meant)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()` before"))
        scheduler.step()


def no_signal_cause(metrics: GTPOMetrics, loss_config: GTPOConfig) -> str:
    if float(metrics.filtered_fraction) >= 1:
        return (
            f"every completion was dropped by the entropy filter (threshold {loss_config.entropy_threshold:.3g} "
            f"nats, preset {loss_config.preset!r}): raise --entropy-threshold, or use --preset paper, whose "
            f"gate switches the filter off when the initial entropy is above the threshold"
        )
    return (
        "every prompt group's rewards tied (all right or all wrong), so every advantage is 0: make the "
        "problems easier or harder (--difficulty), sample more (--group-size) or at a higher --temperature"
    )


# ---------------------------------------------------------------------------------------------- evaluation


def evaluate(
    model,
    tokenizer,
    problems,
    config: TrainConfig,
    dist: Distributed,
    seed: int,
    stop: Optional[StopRequests] = None,
    desc: str = "eval",
    greedy_answers: Optional[list] = None,
) -> Optional[dict]:
    """Greedy accuracy and format rate; with eval_k, pass@k and maj@k from k samples per problem. Each process
    takes every K-th problem; the counts are summed. Returns None if a stop was requested meanwhile.
    ``greedy_answers``, a list, gets this process's ``(question, reference answer, greedy completion)``."""
    model.eval()
    torch.manual_seed(step_seed(config.seed, "eval", seed, dist.rank))
    mine = problems.select(range(dist.rank, len(problems), dist.world))
    sums = torch.zeros(5, dtype=torch.float64, device=dist.device)  # greedy, format, pass@k, maj@k, problems
    size = config.eval_batch_size
    # Progress on stderr, in a terminal only: problems done, and the token the current batch is at.
    bar = tqdm(total=len(mine), desc=desc, unit="problem", leave=False, disable=None if dist.is_main else True)
    stopped = False
    for start in range(0, len(mine), size):
        if stop is not None and stop.requested:
            stopped = True
            break
        chunk = mine.select(range(start, min(len(mine), start + size)))
        # One prompt pass per problem: its greedy answer first, then eval_k samples.
        k = config.eval_k
        try:
            with autocast(config, dist.device):
                out = generate(
                    model,
                    tokenizer,
                    chunk["question"],
                    k + 1,
                    config,
                    dist.device,
                    greedy=not k,
                    greedy_first=True,
                    on_token=lambda t: bar.set_postfix_str(f"token {t}/{config.max_new_tokens}", refresh=t % 4 == 0),
                )
        except Interrupted:  # one process, a stop request: the layers' hooks cut the batch short
            stopped = True
            break
        texts = [out["texts"][i * (k + 1) : (i + 1) * (k + 1)] for i in range(len(chunk))]
        if greedy_answers is not None:
            greedy_answers.extend(zip(chunk["question"], chunk["answer"], (t[0] for t in texts)))
        sums[0] += sum(
            answers_match(extract_answer(t[0], config.answer_in_block), a) for t, a in zip(texts, chunk["answer"])
        )
        sums[1] += sum("<answer>" in t[0] and "</answer>" in t[0] for t in texts)
        if k:
            for samples, gold in zip(texts, chunk["answer"]):
                picks = [extract_answer(t, config.answer_in_block) for t in samples[1:]]
                sums[2] += any(answers_match(p, gold) for p in picks)
                votes = Counter(parse_number(p) for p in picks if parse_number(p) is not None)
                sums[3] += bool(votes) and answers_match(str(votes.most_common(1)[0][0]), gold)
        sums[4] += len(chunk)
        bar.update(len(chunk))
    bar.close()
    model.train()
    if dist.any(stopped):
        return None
    dist.all_sum(sums)
    n = float(sums[4])
    result = {"accuracy": float(sums[0]) / n, "format_rate": float(sums[1]) / n}
    if config.eval_k:
        result[f"pass@{config.eval_k}"] = float(sums[2]) / n
        result[f"maj@{config.eval_k}"] = float(sums[3]) / n
    return result


# ---------------------------------------------------------------------------------------------- the run


def uses_bf16(config: TrainConfig, device: torch.device) -> bool:
    """Whether the run takes bf16 autocast: ``--precision bf16``, or ``auto`` on a GPU and on CPUs whose oneDNN
    has native bf16 matmuls."""
    if config.precision == "fp32":
        return False
    if config.precision == "bf16":
        return True
    return device.type == "cuda" or (device.type == "cpu" and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def autocast(config: TrainConfig, device: torch.device):
    """bf16 autocast for the matrix products (the loss kernels accumulate in float32 whatever the dtype) where
    `uses_bf16` (measured on a CPU with bf16 units: the update 14.5 s -> 8.6 s)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=uses_bf16(config, device))


def warmup_cosine(warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def check_process_shares(config: TrainConfig, world: int) -> None:
    """At start, before anything is loaded or written: each of the ``world`` processes samples whole prompt
    groups, and splits its own groups into ``grad_accum_steps`` equal micro-batches (a split that dropped the
    remainder would train on part of the batch while the dropped rows still counted in the denominators)."""
    if config.prompts_per_step % world:
        raise ConfigError(
            f"--prompts-per-step ({config.prompts_per_step}) must be a multiple of the number of "
            f"processes ({world}): each process samples whole prompt groups"
        )
    share = config.prompts_per_step // world
    if share % config.grad_accum_steps:
        raise ConfigError(
            f"--grad-accum-steps ({config.grad_accum_steps}) must divide each process's prompt groups "
            f"(--prompts-per-step {config.prompts_per_step} over {world} processes = {share}): every "
            f"micro-batch holds whole groups, none is left out"
        )


def step_problems(train_set, step: int, config: TrainConfig, dist: Distributed):
    """This process's prompts of a step: a fixed stream that depends only on the step (resuming repeats
    nothing), cut into one contiguous share per process."""
    share = config.prompts_per_step // dist.world
    first = step * config.prompts_per_step + dist.rank * share
    return train_set.select([(first + j) % len(train_set) for j in range(share)])


@dataclass
class Session:
    """What every step of a run works with, fixed once the run is loaded: the trainer's and the loss's settings,
    the processes, the model, its loss as a (wrapped) module and its optimiser, the data, the stop requests."""

    config: TrainConfig
    loss_config: GTPOConfig
    dist: Distributed
    model: nn.Module
    tokenizer: Any
    policy: nn.Module  # PolicyLoss(model), wrapped for DDP / FSDP
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    train_set: Any
    eval_set: Any
    checkpoint_path: Path
    stop: StopRequests

    def evaluate(self, seed: int, desc: str = "eval") -> Optional[dict]:
        with full_parameters(self.policy):
            return evaluate(
                self.model, self.tokenizer, self.eval_set, self.config, self.dist, seed=seed, stop=self.stop, desc=desc
            )

    def checkpoint(self, state: RunState) -> None:
        model_state, optimizer_state = full_state(self.policy, self.optimizer)  # every process takes part
        if self.dist.is_main:
            save_checkpoint(
                self.checkpoint_path,
                model_state,
                optimizer_state,
                self.scheduler.state_dict(),
                state,
                self.config.to_dict(),
            )
        self.dist.barrier()


def load_session(config: TrainConfig, dist: Distributed, train_set, eval_set) -> Session:
    """The model (seeded by ``config.seed``), its loss module wrapped for the processes, the optimiser and
    the schedule: what a run's steps work with (``python -m bench trainer`` times steps of it)."""
    checkpoint_path = Path(config.output_dir) / "checkpoint.pt"
    torch.manual_seed(config.seed)
    model, tokenizer = load_model_and_tokenizer(config.model, dist.device)
    if dist.device.type == "cpu" and not uses_bf16(config, dist.device):
        use_grouped_query_attention_on_cpu()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    if config.gradient_checkpointing:  # transformers >= 5.2x renamed it
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    check_hidden_states_supported(model)  # before wrapping: its check runs the model once on a few tokens
    policy = wrap(PolicyLoss(model), model.get_decoder().layers, dist, config.fsdp)
    # fused: one kernel over all parameters; on 2 CPU cores 0.07 s a step for SmolLM2-135M against 0.39 s for
    # the loop over parameters torch picks on a CPU (the same update, summed in another order).
    optimizer = torch.optim.AdamW(
        policy.parameters(),
        lr=config.learning_rate,
        betas=(0.9, 0.99),
        weight_decay=config.weight_decay,
        fused=dist.device.type in ("cpu", "cuda") or None,
    )
    total_updates = config.steps * config.num_iterations
    return Session(
        config=config,
        loss_config=config.loss_config(max_completion_length=config.max_new_tokens),
        dist=dist,
        model=model,
        tokenizer=tokenizer,
        policy=policy,
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(config.warmup_steps, total_updates)),
        train_set=train_set,
        eval_set=eval_set,
        checkpoint_path=checkpoint_path,
        stop=StopRequests(),
    )


def run(config: TrainConfig, dist: Optional[Distributed] = None) -> dict:
    """The whole run; returns its summary. Under torchrun the process group it starts (``dist`` not given) is
    closed when the run ends (not after an error: a peer may be gone)."""
    run_started = time.time()  # wall clock of the whole run: loading, evaluations and saving included
    started_here = dist is None
    dist = dist or Distributed.start(config.device)
    result = run_in(config, dist, run_started)
    if started_here:
        dist.close()
    return result


def run_in(config: TrainConfig, dist: Distributed, run_started: float) -> dict:
    """`run` in the processes of ``dist``, started at ``run_started``."""
    out_dir = Path(config.output_dir)
    checkpoint_path = out_dir / "checkpoint.pt"
    # Everything that can be checked without the model is, before anything is loaded or written: a bad setting
    # costs a second and leaves no empty output folder behind.
    check_process_shares(config, dist.world)
    check_model_source(config.model)
    if config.resume:
        require_checkpoint(checkpoint_path)
    train_set, eval_set = load_problems(config.dataset, config.seed, config.eval_size, config.difficulty)
    if dist.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    log = MetricsLog(out_dir / "metrics.jsonl", enabled=dist.is_main)
    session = load_session(config, dist, train_set, eval_set)
    model, tokenizer, policy, optimizer = session.model, session.tokenizer, session.policy, session.optimizer

    if config.resume:
        payload = load_checkpoint(checkpoint_path)
        load_full_state(policy, optimizer, payload["model"], payload["optimizer"])
        session.scheduler.load_state_dict(payload["scheduler"])
        state = RunState.from_dict(payload["state"])
        dropped = log.cut_back(state.step, state.eval_step)
        if dist.is_main:
            print(
                f"resumed from {checkpoint_path} at step {state.step}"
                + (f" ({dropped} log rows after it dropped: those steps run again)" if dropped else "")
            )
    else:
        state = RunState()
        log.start()
        if dist.is_main:
            (out_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=1))

    started = time.time()
    stopped: Optional[Stopped] = None
    with session.stop as stop:
        if dist.world == 1:  # one process stops mid-phase; several must agree, at step and batch boundaries
            stop.interrupt_layers(model.get_decoder().layers)
        if state.eval_step < 0:  # the evaluation before training
            before = session.evaluate(seed=0, desc="eval before")
            if before is None:
                stopped = stop.stopped("during the first evaluation")
            else:
                state.before, state.eval_step = before, 0
                log.append({"kind": "eval", "step": 0, **before})
                if dist.is_main:
                    print(f"before training: {before}")

        def evaluate_if_due() -> None:
            """The evaluation every --eval-every steps, unless done (a resume may find it still owed)."""
            due = config.eval_every and state.step % config.eval_every == 0 and 0 < state.step < config.steps
            if due and state.eval_step < state.step:
                result = session.evaluate(seed=state.step)
                if result is not None:
                    log.append({"kind": "eval", "step": state.step, **result})
                    state.eval_step = state.step

        if stopped is None:
            evaluate_if_due()
        bar = tqdm(
            range(state.step, config.steps),
            initial=state.step,
            total=config.steps,
            desc=config.algo,
            disable=not dist.is_main,
        )
        for step in bar if stopped is None else []:
            if dist.any(stop.requested is not None):
                stopped = stop.stopped()
                break
            if config.max_minutes is not None and time.time() - started > 60 * config.max_minutes:
                cap = f"the --max-minutes cap ({config.max_minutes:g} min) was reached"
                stopped = Stopped(StopReason.TIME_CAP, cap)
                break
            try:
                row = train_step(session, state, step)
            except Interrupted:  # nothing of this step was applied: the run is at the previous one
                optimizer.zero_grad(set_to_none=True)
                stopped = stop.stopped()
                break
            log.append(row)
            state.step = step + 1
            bar.set_postfix(
                reward=f"{row['reward']:.2f}",
                acc=f"{row['accuracy']:.2f}",
                H=f"{row['entropy']:.2f}",
                s_step=f"{row['time_step']:.1f}",
            )
            evaluate_if_due()
            if config.save_every and state.step % config.save_every == 0:
                session.checkpoint(state)
        bar.close()
        if stopped is None and dist.any(stop.requested is not None):
            stopped = stop.stopped()
        if stopped is not None and stopped.finishes and dist.is_main:
            print(
                f"stopping early at step {state.step} of {config.steps}: {stopped.message}; evaluating and saving",
                flush=True,
            )
        after = None
        if stopped is None or stopped.finishes:
            after = session.evaluate(seed=config.steps, desc="eval after")
            if after is None:
                stopped = stop.stopped("during the final evaluation")
        if after is None:  # stopped by a signal: save the last completed step, say how to go on, exit non-zero
            session.checkpoint(state)
            if dist.is_main:
                print(
                    f"stopped at step {state.step} of {config.steps} ({stopped.message}); checkpoint saved; resume "
                    f"with: gtpo-train --config {out_dir / 'config.json'} --resume",
                    file=sys.stderr,
                    flush=True,
                )
            return {"interrupted": True, "step": state.step, "reason": stopped.message, "exit_status": stop.exit_status}

    log.append({"kind": "eval", "step": state.step, **after})
    state.eval_step = state.step
    session.checkpoint(state)
    summary = None
    if dist.is_main:
        save_final(model, tokenizer, policy, out_dir / "final")
        plot = plot_run(
            log.path,
            out_dir / "training.png",
            title=f"{config.algo} ({config.loss_preset}) on {config.dataset}, seed {config.seed}",
        )
        summary = {
            "algo": config.algo,
            "preset": config.loss_preset,
            "seed": config.seed,
            "steps": state.step,
            "stopped_early": None if stopped is None else stopped.message,
            "processes": dist.world,
            "minutes": (time.time() - started) / 60,
            "wall_minutes": (time.time() - run_started) / 60,
            "before": state.before,
            "after": after,
            # Each figure is a share of these problems: its 95 % interval (Wilson) says what it can tell.
            "eval_problems": len(eval_set),
            "intervals_95": {
                "before": metric_intervals(state.before, len(eval_set)) if state.before else None,
                "after": metric_intervals(after, len(eval_set)),
            },
        }
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        print_summary(summary, log, plot)
    else:
        full_state(policy, None)  # take part in save_final's gather
    dist.barrier()
    return summary or {"steps": state.step}


def train_step(session: Session, state: RunState, step: int) -> dict:
    """Rollout, old log-probs, num_iterations updates; returns the step's log row and advances ``state``'s
    initial entropy and no-signal streak. A stop request may cut it short (`Interrupted`) until its first
    optimiser step; after that the step completes."""
    config, loss_config, dist, stop = session.config, session.loss_config, session.dist, session.stop
    model, policy = session.model, session.policy
    t0 = time.time()
    # Every random draw of this step comes from (seed, step, rank): a replayed step draws the same.
    torch.manual_seed(step_seed(config.seed, "rollout", step, dist.rank))
    with full_parameters(policy), autocast(config, dist.device):
        problems = step_problems(session.train_set, step, config, dist)
        batch = rollout(model, session.tokenizer, problems, config, loss_config, dist.device)
    t1 = time.time()
    old_logprobs = None
    if state.initial_entropy is None or config.num_iterations > 1:
        with full_parameters(policy), autocast(config, dist.device):
            logp, entropy = token_stats(model, batch, config)
        if state.initial_entropy is None:  # the policy's entropy before any update, over all processes
            mask = batch["completion_mask"]
            sums = dist.all_sum(torch.stack([(entropy * mask).sum().double(), mask.sum().double()]))
            state.initial_entropy = float(sums[0] / sums[1].clamp(min=1))
        old_logprobs = logp if config.num_iterations > 1 else None
    t2 = time.time()
    stepped, losses, grad_norms = 0, [], []
    for iteration in range(config.num_iterations):
        if iteration == 1:
            stop.paused = True  # the first update is applied: finish the step, so the checkpoint stays exact
        result = update(
            policy, session.optimizer, batch, loss_config, config, dist, old_logprobs, state.initial_entropy
        )
        advance_schedule(session.scheduler)
        stepped += result["stepped"]
        losses.append(result["loss"])
        grad_norms.append(result["grad_norm"])
    t3 = time.time()
    stop.paused = False
    metrics = result["metrics"].to_dict()
    state.no_signal_streak = 0 if stepped else state.no_signal_streak + 1
    if state.no_signal_streak == NO_SIGNAL_WARNING_AFTER and dist.is_main:
        tqdm.write(
            f"warning: {NO_SIGNAL_WARNING_AFTER} steps in a row without any learning signal, so the weights "
            f"did not move: {no_signal_cause(result['metrics'], loss_config)}",
            file=sys.stderr,
        )
    parts = {
        k: float(dist.all_sum(v.sum().double().to(dist.device)) / config.prompts_per_step / config.group_size)
        for k, v in batch["reward_parts"].items()
    }
    correct = batch["reward_parts"]["correctness_reward"] > 0
    totals = dist.all_sum(
        torch.tensor(
            [float(batch["rewards"].sum()), float(correct.sum()), float(batch["completion_mask"].sum())],
            dtype=torch.float64,
            device=dist.device,
        )
    )
    n = config.prompts_per_step * config.group_size
    return {
        "kind": "train",
        "step": step + 1,
        "loss": float(np.mean(losses)),
        "reward": float(totals[0]) / n,
        **parts,
        "accuracy": float(totals[1]) / n,
        "completion_length": float(totals[2]) / n,
        **{k: v for k, v in metrics.items() if not k.startswith("num_")},
        "updates": stepped,
        "initial_entropy": state.initial_entropy,
        "grad_norm": float(np.nanmean(grad_norms)) if stepped else None,
        "lr": session.scheduler.get_last_lr()[0],
        "time_generation": t1 - t0,
        "time_old_logprobs": t2 - t1,
        "time_update": t3 - t2,
        "time_step": time.time() - t0,
    }


def save_final(model, tokenizer, policy, folder: Path) -> None:
    """``save_pretrained`` of the trained model, its parameters gathered whole on process 0."""
    model_state, _ = full_state(policy, None)
    prefix = "model."
    model.save_pretrained(
        folder, state_dict={k[len(prefix) :] if k.startswith(prefix) else k: v for k, v in model_state.items()}
    )
    tokenizer.save_pretrained(folder)


def print_summary(summary: dict, log: MetricsLog, plot: Optional[Path]) -> None:
    before, after, n = summary["before"] or {}, summary["after"], summary["eval_problems"]
    # A gain counts when the after figure's interval lies wholly above the before figure's: a stricter test
    # than needed (the same problems are scored twice), so "within noise" may still hide a small gain.
    print(f"\nheld-out metric on {n} problems, with 95 % intervals (Wilson)")
    print(f"{'metric':<12} {'before':>20} {'after':>20}  verdict")
    for key in after:
        b, verdict = "-", "-"
        if key in before:
            b = with_interval(before[key], n)
            (b_low, b_high), (a_low, a_high) = (summary["intervals_95"][w][key] for w in ("before", "after"))
            verdict = "up" if a_low > b_high else "down" if a_high < b_low else "within noise"
        print(f"{key:<12} {b:>20} {with_interval(after[key], n):>20}  {verdict}")
    train_rows = log.rows("train")
    if train_rows:
        mean = lambda k: np.mean([r[k] for r in train_rows])
        print(
            f"\n{len(train_rows)} steps, {summary['minutes']:.1f} min of training "
            f"({summary['wall_minutes']:.1f} min in all): mean reward {mean('reward'):.3f}, "
            f"entropy {mean('entropy'):.3f}, filtered "
            f"{mean('filtered_fraction'):.3f}, with signal {mean('signal_fraction'):.3f}, "
            f"step {mean('time_step'):.1f} s "
            f"(generation {mean('time_generation'):.1f}, update {mean('time_update'):.1f})"
        )
    print(f"metrics: {log.path}" + (f"\nplot: {plot}" if plot else ""))


def main(argv=None) -> None:
    config = parse_args(argv)
    try:
        result = run(config)
        # FSDP2's modules sit in reference cycles that hold the process group: freed now, while the interpreter is
        # whole, not at its exit, where tearing down gloo's threads can abort a finished process (exit status -6,
        # seen in the two-process FSDP2 update test).
        gc.collect()
    except ConfigError as exc:  # a setting, model or dataset that cannot be used: one line, not a traceback
        print(f"gtpo-train: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # a second Ctrl-C, or one before training started: stop at once
        print("gtpo-train: interrupted (the last saved checkpoint, if any, resumes with --resume)", file=sys.stderr)
        sys.exit(130)
    if result.get("interrupted"):  # a script or scheduler can tell a stopped run from a finished one
        sys.exit(result["exit_status"])


if __name__ == "__main__":
    main()
