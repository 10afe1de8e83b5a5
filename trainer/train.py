"""One GTPO (or GRPO) training run, top to bottom: ``python -m trainer`` or ``gtpo-train``.

    load model, data, rewards -> evaluate -> for each step:
        sample G completions for each of B prompts      (rollout)
        rewards -> group-relative advantages
        GTPO loss on the final hidden states, AdamW step (update)
        log, checkpoint, evaluate every k steps
    -> evaluate, save, plot, summary
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import torch
from tqdm.auto import tqdm

from gtpo_kernels import GTPOConfig, compute_advantages, fused_linear_gtpo_loss, gtpo_loss, token_logprobs_and_entropy
from gtpo_kernels.hf import grouped_completion_hidden_states

from .config import TrainConfig, parse_args
from .data import load_problems
from .model import load_model_and_tokenizer
from .plots import plot_run
from .rewards import (DEFAULT_REWARDS, EXAMPLE_ANSWER, EXAMPLE_QUESTION, SYSTEM_PROMPT, answers_match, extract_answer,
                      parse_number)


# ---------------------------------------------------------------------------------------------- rollouts

def chat(question: str, one_shot: bool) -> List[Dict[str, str]]:
    """The conversation a question is asked in: the system prompt, optionally one worked example."""
    example = [{"role": "user", "content": EXAMPLE_QUESTION},
               {"role": "assistant", "content": EXAMPLE_ANSWER}] if one_shot else []
    return [{"role": "system", "content": SYSTEM_PROMPT}, *example, {"role": "user", "content": question}]


def encode_prompts(tokenizer, questions: List[str], device, one_shot: bool = True) -> Dict[str, torch.Tensor]:
    texts = [tokenizer.apply_chat_template(chat(q, one_shot), tokenize=False, add_generation_prompt=True)
             for q in questions]
    return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)


@torch.no_grad()
def generate(model, tokenizer, questions: List[str], n: int, config: TrainConfig, device, greedy=False):
    """``n`` completions per question, rows of a question adjacent. Returns prompt ids/mask, completion
    ids/mask (the mask covers the completion up to and including its EOS) and the decoded texts."""
    enc = encode_prompts(tokenizer, questions, device, config.one_shot)
    kwargs = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=config.temperature, top_p=1.0,
                                                       top_k=0)
    out = model.generate(**enc, max_new_tokens=config.max_new_tokens, num_return_sequences=n,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, **kwargs)
    prompt_len = enc["input_ids"].shape[1]
    completion_ids = out[:, prompt_len:]
    is_eos = completion_ids == tokenizer.eos_token_id
    first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), completion_ids.shape[1])
    completion_mask = torch.arange(completion_ids.shape[1], device=device)[None] <= first_eos[:, None]
    texts = tokenizer.batch_decode(torch.where(completion_mask, completion_ids, tokenizer.pad_token_id),
                                   skip_special_tokens=True)
    return {
        "prompt_ids": enc["input_ids"].repeat_interleave(n, 0),
        "prompt_mask": enc["attention_mask"].repeat_interleave(n, 0),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "texts": texts,
    }


# ---------------------------------------------------------------------------------------------- the loss

def forward_inputs(batch):
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"].long()], dim=1)
    # Left-padded prompts: positions count real tokens only, as they did during generation.
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    return input_ids, attention_mask, position_ids


def completion_logits(model, batch, temperature: float) -> torch.Tensor:
    """``[N, L, V]`` logits of the distribution the completions were sampled from, softmax(logits / T):
    position ``t`` predicts ``completion_ids[:, t]``."""
    input_ids, attention_mask, position_ids = forward_inputs(batch)
    prompt_len = batch["prompt_ids"].shape[1]
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    logits = logits[:, prompt_len - 1:-1]
    return logits if temperature == 1.0 else logits / temperature


@torch.no_grad()
def token_stats(model, batch, temperature: float):
    """Per-token log-probs and entropies of the sampling policy (no grad): old log-probs and H_ini."""
    return token_logprobs_and_entropy(completion_logits(model, batch, temperature).float(), batch["completion_ids"],
                                      batch["completion_mask"])


def policy_loss(model, batch, rows: slice, advantages, loss_config: GTPOConfig, config: TrainConfig,
                old_logprobs, initial_entropy):
    """The GTPO loss of rows ``rows`` (whole prompt groups) of a rollout batch."""
    part = {k: v[rows] for k, v in batch.items() if isinstance(v, torch.Tensor)}
    common = dict(group_size=config.group_size, config=loss_config, initial_entropy=initial_entropy,
                  old_logprobs=None if old_logprobs is None else old_logprobs[rows])
    # The completions were sampled from softmax(logits / T): the loss's log-probs, ratio and entropy are
    # those of that distribution, so the update is on-policy whatever the temperature.
    t = config.temperature
    if config.fused_linear:  # never builds the [N, L, V] logits; (h W^T + b) / T = (h / T) W^T + b / T
        # Each prompt runs once for its group: its key/value cache is shared by the G completions.
        g = config.group_size
        hidden, weight, bias = grouped_completion_hidden_states(
            model, part["prompt_ids"][::g], part["prompt_mask"][::g], part["completion_ids"],
            part["completion_mask"], g)
        if t != 1.0:
            hidden, bias = hidden / t, None if bias is None else bias / t
        return fused_linear_gtpo_loss(hidden, weight, part["completion_ids"], part["completion_mask"],
                                      advantages[rows], lm_head_bias=bias, **common)
    return gtpo_loss(completion_logits(model, part, t), part["completion_ids"], part["completion_mask"],
                     advantages[rows], **common)


# ---------------------------------------------------------------------------------------------- evaluation

def evaluate(model, tokenizer, problems, config: TrainConfig, device, batch_size: int = 16) -> dict:
    """Greedy accuracy and format rate; with eval_k, pass@k and maj@k from k samples per problem."""
    model.eval()
    greedy_correct, formatted, pass_k, maj_k = [], [], [], []
    for start in range(0, len(problems), batch_size):
        chunk = problems[start:start + batch_size]
        out = generate(model, tokenizer, chunk["question"], 1, config, device, greedy=True)
        greedy_correct += [answers_match(extract_answer(t), a) for t, a in zip(out["texts"], chunk["answer"])]
        formatted += ["<answer>" in t and "</answer>" in t for t in out["texts"]]
        if config.eval_k:
            k = config.eval_k
            out = generate(model, tokenizer, chunk["question"], k, config, device)
            for i, gold in enumerate(chunk["answer"]):
                picks = [extract_answer(t) for t in out["texts"][i * k:(i + 1) * k]]
                pass_k.append(any(answers_match(p, gold) for p in picks))
                votes = Counter(parse_number(p) for p in picks if parse_number(p) is not None)
                maj_k.append(bool(votes) and answers_match(str(votes.most_common(1)[0][0]), gold))
    model.train()
    result = {"accuracy": float(np.mean(greedy_correct)), "format_rate": float(np.mean(formatted))}
    if config.eval_k:
        result[f"pass@{config.eval_k}"] = float(np.mean(pass_k))
        result[f"maj@{config.eval_k}"] = float(np.mean(maj_k))
    return result


# ---------------------------------------------------------------------------------------------- checkpoints

def save_checkpoint(path: Path, model, optimizer, scheduler, state: dict, config: TrainConfig) -> None:
    """Written to a temporary file, then renamed: a crash never leaves a half-written checkpoint."""
    payload = {
        "model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
        "state": state, "config": config.to_dict(),
        "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
    }
    tmp = path.with_name(path.name + ".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path, model, optimizer, scheduler) -> dict:
    if not path.exists():
        raise ValueError(f"--resume: no checkpoint at {path}; start without --resume")
    payload = torch.load(path, map_location="cpu", weights_only=False)
    model.load_state_dict(payload["model"])
    optimizer.load_state_dict(payload["optimizer"])
    scheduler.load_state_dict(payload["scheduler"])
    random.setstate(payload["rng"]["python"])
    np.random.set_state(payload["rng"]["numpy"])
    torch.set_rng_state(payload["rng"]["torch"])
    if payload["rng"]["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(payload["rng"]["cuda"])
    return payload["state"]


# ---------------------------------------------------------------------------------------------- the run

def warmup_cosine(warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return factor


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def run(config: TrainConfig) -> dict:
    run_started = time.time()  # wall clock of the whole run: loading, evaluations and saving included
    out_dir = Path(config.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics_path, checkpoint_path = out_dir / "metrics.jsonl", out_dir / "checkpoint.pt"
    device = torch.device("cuda" if config.device == "auto" and torch.cuda.is_available() else
                          "cpu" if config.device == "auto" else config.device)
    seed_everything(config.seed)
    model, tokenizer = load_model_and_tokenizer(config.model, device)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    train_set, eval_set = load_problems(config.dataset, config.seed, config.eval_size, config.difficulty)
    loss_config = GTPOConfig(preset=config.loss_preset)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, betas=(0.9, 0.99),
                                  weight_decay=config.weight_decay)
    total_updates = config.steps * config.num_iterations
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(config.warmup_steps, total_updates))
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")

    def log(row: dict) -> None:
        with open(metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    if config.resume:
        state = load_checkpoint(checkpoint_path, model, optimizer, scheduler)
        print(f"resumed from {checkpoint_path} at step {state['step']}")
    else:
        state = {"step": 0, "initial_entropy": None, "before": None}
        metrics_path.write_text("")
        (out_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=1))
        state["before"] = evaluate(model, tokenizer, eval_set, config, device)
        log({"kind": "eval", "step": 0, **state["before"]})
        print(f"before training: {state['before']}")

    model.train()
    started = time.time()
    stopped_early = False
    bar = tqdm(range(state["step"], config.steps), initial=state["step"], total=config.steps, desc=config.algo)
    try:
        for step in bar:
            if config.max_minutes is not None and time.time() - started > 60 * config.max_minutes:
                stopped_early = True
                break
            # Rollout: B prompts from a stream that depends only on the step (so resuming repeats nothing).
            t0 = time.time()
            first = step * config.prompts_per_step
            idx = [(first + j) % len(train_set) for j in range(config.prompts_per_step)]
            problems = train_set.select(idx)
            batch = generate(model, tokenizer, problems["question"], config.group_size, config, device)
            answers = [a for a in problems["answer"] for _ in range(config.group_size)]
            reward_parts = {f.__name__: torch.tensor(f(batch["texts"], answer=answers), dtype=torch.float32)
                            for f in DEFAULT_REWARDS}
            rewards = sum(reward_parts.values()).to(device)
            advantages = compute_advantages(rewards, config.group_size, normalize_std=loss_config.normalize_advantages_by_std)
            t1 = time.time()

            old_logprobs = None
            if state["initial_entropy"] is None or config.num_iterations > 1:
                logp, entropy = token_stats(model, batch, config.temperature)
                if state["initial_entropy"] is None:  # the policy's entropy before any update
                    mask = batch["completion_mask"]
                    state["initial_entropy"] = float((entropy * mask).sum() / mask.sum().clamp(min=1))
                old_logprobs = logp if config.num_iterations > 1 else None

            # Update: num_iterations optimiser steps on this batch, micro-batches of whole groups.
            n_rows = rewards.shape[0]
            rows_per_micro = n_rows // config.grad_accum_steps
            scale = 1.0 if loss_config.loss_reduction == "sum" else 1.0 / config.grad_accum_steps
            loss_time = opt_time = 0.0
            for _ in range(config.num_iterations):
                optimizer.zero_grad(set_to_none=True)
                losses, step_metrics = [], []
                for start in range(0, n_rows, rows_per_micro):
                    tl0 = time.time()
                    with autocast:
                        out = policy_loss(model, batch, slice(start, start + rows_per_micro), advantages,
                                          loss_config, config, old_logprobs, state["initial_entropy"])
                    (out.loss * scale).backward()
                    loss_time += time.time() - tl0
                    losses.append(float(out.loss.detach()))
                    step_metrics.append(out.metrics.to_dict())
                to0 = time.time()
                grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm))
                optimizer.step()
                scheduler.step()
                opt_time += time.time() - to0

            row = {"kind": "train", "step": step + 1, "loss": float(np.mean(losses)) * (config.grad_accum_steps * scale),
                   "reward": float(rewards.mean()),
                   **{k: float(v.mean()) for k, v in reward_parts.items()},
                   "accuracy": float((reward_parts["correctness_reward"] > 0).float().mean()),
                   "completion_length": float(batch["completion_mask"].sum(1).float().mean()),
                   **{k: float(np.mean([m[k] for m in step_metrics])) for k in step_metrics[0]},
                   "initial_entropy": state["initial_entropy"], "grad_norm": grad_norm,
                   "lr": scheduler.get_last_lr()[0], "time_generation": t1 - t0, "time_loss": loss_time,
                   "time_optimizer": opt_time, "time_step": time.time() - t0}
            log(row)
            state["step"] = step + 1
            bar.set_postfix(reward=f"{row['reward']:.2f}", acc=f"{row['accuracy']:.2f}", H=f"{row['entropy']:.2f}",
                            s_step=f"{row['time_step']:.1f}")
            if config.eval_every and state["step"] % config.eval_every == 0 and state["step"] < config.steps:
                log({"kind": "eval", "step": state["step"], **evaluate(model, tokenizer, eval_set, config, device)})
            if config.save_every and state["step"] % config.save_every == 0:
                save_checkpoint(checkpoint_path, model, optimizer, scheduler, state, config)
    except KeyboardInterrupt:
        bar.close()
        save_checkpoint(checkpoint_path, model, optimizer, scheduler, state, config)
        print(f"\ninterrupted at step {state['step']}: checkpoint saved to {checkpoint_path}; continue with --resume")
        return {"interrupted": True, "step": state["step"]}
    bar.close()

    after = evaluate(model, tokenizer, eval_set, config, device)
    log({"kind": "eval", "step": state["step"], **after})
    save_checkpoint(checkpoint_path, model, optimizer, scheduler, state, config)
    model.save_pretrained(out_dir / "final")
    tokenizer.save_pretrained(out_dir / "final")
    plot = plot_run(metrics_path, out_dir / "training.png", title=f"{config.algo} on {config.dataset}, seed {config.seed}")
    summary = {"algo": config.algo, "seed": config.seed, "steps": state["step"], "stopped_early": stopped_early,
               "minutes": (time.time() - started) / 60,
               "wall_minutes": (time.time() - run_started) / 60, "before": state["before"], "after": after}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print_summary(summary, metrics_path, plot)
    return summary


def print_summary(summary: dict, metrics_path: Path, plot: Optional[Path]) -> None:
    before, after = summary["before"] or {}, summary["after"]
    print(f"\n{'held-out metric':<16} {'before':>8} {'after':>8}")
    for key in after:
        b = before.get(key, float("nan"))
        print(f"{key:<16} {b:>8.3f} {after[key]:>8.3f}")
    train_rows = [json.loads(x) for x in metrics_path.read_text().splitlines() if '"train"' in x]
    if train_rows:
        mean = lambda k: np.mean([r[k] for r in train_rows])  # noqa: E731
        print(f"\n{len(train_rows)} steps this session, {summary['minutes']:.1f} min: mean reward {mean('reward'):.3f}, "
              f"entropy {mean('entropy'):.3f}, filtered {mean('filtered_fraction'):.3f}, step "
              f"{mean('time_step'):.1f} s (generation {mean('time_generation'):.1f}, loss {mean('time_loss'):.1f}, "
              f"optimiser {mean('time_optimizer'):.1f})")
    print(f"metrics: {metrics_path}" + (f"\nplot: {plot}" if plot else ""))


def main(argv=None) -> None:
    run(parse_args(argv))


if __name__ == "__main__":
    main()
