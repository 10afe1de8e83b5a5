"""Held-out evaluation of any task: decode (a greedy completion and ``eval_k`` samples per prompt), then score
them with the task's rewards.

Reported: each reward's mean over the greedy completions (``rewards/NAME``) and their weighted sum (``reward``);
where the accuracy reward's values are 0 or 1, greedy ``accuracy``, ``pass@k`` (some sample scores 1) and
``maj@k`` (the answer most samples give, by the task's ``answer_key``, scores 1); the task's ``greedy_rates``.
The shares have 95 % intervals (`intervals.metric_intervals`); the reward means are not shares and have none.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional

import torch
from tqdm.auto import tqdm

from .config import TrainConfig
from .distributed import Distributed
from .precision import autocast
from .rollout import generate, score_completions
from .scoring import RewardError, stop_together
from .seeding import step_seed
from .stopping import Interrupted, StopRequests
from .task import Task
from .totals import Totals


def decode(model, tokenizer, task: Task, rows: dict, config: TrainConfig, dist: Distributed, on_token) -> list:
    """``eval_k + 1`` completions per row (greedy first) and their scores: ``[(texts, scores [k + 1, R]), ...]``."""
    k = config.eval_k
    with autocast(config, dist.device):
        out = generate(
            model,
            tokenizer,
            task,
            rows[task.prompt_column],
            k + 1,
            config,
            dist.device,
            greedy=not k,
            greedy_first=True,
            on_token=on_token,
        )
    scores = score_completions(task, rows, out, k + 1)
    return [
        (out.texts[i * (k + 1) : (i + 1) * (k + 1)], scores[i * (k + 1) : (i + 1) * (k + 1)])
        for i in range(len(rows[task.prompt_column]))
    ]


@dataclass
class HeldOutTotals(Totals):
    """The sums `evaluate` adds over batches and processes (`Totals`), each over the held-out problems."""

    problems: float = 0.0
    greedy_right: float = 0.0  # the greedy completion scored 1 on the accuracy reward
    pass_at_k: float = 0.0  # some sample scored 1
    maj_at_k: float = 0.0  # the samples' most common answer scored 1
    not_binary: float = 0.0  # problems on which some accuracy reward was neither 0 nor 1 (then no accuracy)
    reward: float = 0.0  # the greedy completion's weighted reward
    per_reward: Optional[torch.Tensor] = None  # [R] each reward's greedy values where it applies
    applies: Optional[torch.Tensor] = None  # [R] how many greedy completions each reward applies to
    greedy_rates: Optional[torch.Tensor] = None  # [Q] greedy completions passing each of the task's rate checks

    @classmethod
    def zeros(cls, task: Task) -> HeldOutTotals:
        rewards, rates = len(task.rewards), len(task.greedy_rates)
        zeros = lambda n: torch.zeros(n, dtype=torch.float64)  # noqa: E731
        return cls(per_reward=zeros(rewards), applies=zeros(rewards), greedy_rates=zeros(rates))

    @classmethod
    def read(cls, task: Task, sums: torch.Tensor) -> HeldOutTotals:
        rewards, rates = len(task.rewards), len(task.greedy_rates)
        return cls.from_sums(sums, per_reward=rewards, applies=rewards, greedy_rates=rates)


def tally(task: Task, decoded: list, k: int) -> HeldOutTotals:
    """The held-out sums of ``decoded`` (`decode`'s problems)."""
    acc = task.reward_names.index(task.accuracy_reward)
    totals = HeldOutTotals.zeros(task)
    weights = torch.tensor(task.weights, dtype=torch.float32)
    for texts, scores in decoded:
        right = scores[:, acc] == 1
        totals.problems += 1
        totals.greedy_right += bool(right[0])
        values = scores[:, acc]  # NaN (the reward does not apply): not right, and no reason to doubt it is 0/1
        totals.not_binary += bool((~values.isnan() & (values != 0) & (values != 1)).any())
        if k:
            totals.pass_at_k += bool(right[1:].any())
            keys = [task.answer_key(t) for t in texts[1:]]
            votes = Counter(key for key in keys if key is not None)
            if votes:
                totals.maj_at_k += bool(right[1 + keys.index(votes.most_common(1)[0][0])])
        greedy = scores[0]
        totals.reward += float((greedy * weights).nansum())
        applies = ~greedy.isnan()
        totals.per_reward += torch.where(applies, greedy, 0).double()
        totals.applies += applies.double()
        for j, rate in enumerate(task.greedy_rates.values()):
            totals.greedy_rates[j] += bool(rate(texts[0]))
    return totals


def metrics(task: Task, totals: HeldOutTotals, k: int) -> dict:
    """The held-out figures from the sums over all processes."""
    n = float(totals.problems)
    result = {}
    if not totals.not_binary:  # the accuracy reward was 0 or 1 on every completion
        result["accuracy"] = float(totals.greedy_right) / n
    for name, passed in zip(task.greedy_rates, totals.greedy_rates.tolist()):
        result[name] = passed / n
    if not totals.not_binary and k:
        result[f"pass@{k}"] = float(totals.pass_at_k) / n
        result[f"maj@{k}"] = float(totals.maj_at_k) / n
    result["reward"] = float(totals.reward) / n
    for name, value, count in zip(task.reward_names, totals.per_reward.tolist(), totals.applies.tolist()):
        result[f"rewards/{name}"] = value / count if count else float("nan")
    return result


def evaluate(
    model,
    tokenizer,
    task: Task,
    config: TrainConfig,
    dist: Distributed,
    seed: int,
    stop: Optional[StopRequests] = None,
    desc: str = "eval",
    greedy_answers: Optional[list] = None,
) -> Optional[dict]:
    """The held-out figures (module docstring); each process takes every K-th row, the sums are added. Returns None
    if a stop was requested meanwhile. ``greedy_answers``, a list, gets this process's rows, each with its greedy
    completion, whether the accuracy reward scored it 1 and how many of its samples it scored 1
    (``row | {"completion": ..., "correct": ..., "samples_right": ...}``)."""
    model.eval()
    torch.manual_seed(step_seed(config.seed, "eval", seed, dist.rank))
    mine = task.held_out.select(range(dist.rank, len(task.held_out), dist.world))
    sums = HeldOutTotals.zeros(task).to_sums()
    acc = task.reward_names.index(task.accuracy_reward)
    # Progress on stderr, in a terminal only: rows done, and the token the current batch is at.
    bar = tqdm(total=len(mine), desc=desc, unit="problem", leave=False, disable=None if dist.is_main else True)

    def on_token(t: int) -> None:
        bar.set_postfix_str(f"token {t}/{config.max_new_tokens}", refresh=t % 4 == 0)
        if stop is not None and dist.world == 1:  # one process stops within a token of a request
            stop.check()

    stopped, failed = False, None
    for start in range(0, len(mine), config.eval_batch_size):
        if stop is not None and stop.requested:
            stopped = True
            break
        rows = mine.select(range(start, min(len(mine), start + config.eval_batch_size))).to_dict()
        try:
            decoded = decode(model, tokenizer, task, rows, config, dist, on_token)
        except Interrupted:  # one process, a stop request: the layers' hooks cut the batch short
            stopped = True
            break
        except RewardError as exc:  # raised below on every process together
            failed = exc
            break
        if greedy_answers is not None:
            for i, (texts, scores) in enumerate(decoded):
                row = {column: values[i] for column, values in rows.items()}
                greedy_answers.append(
                    {
                        **row,
                        "completion": texts[0],
                        "correct": bool(scores[0, acc] == 1),
                        "samples_right": int((scores[1:, acc] == 1).sum()),
                    }
                )
        sums += tally(task, decoded, config.eval_k).to_sums()
        bar.update(len(decoded))
    bar.close()
    model.train()
    stop_together(dist, failed)
    if dist.any(stopped):
        return None
    return metrics(task, HeldOutTotals.read(task, dist.all_sum(sums.to(dist.device)).cpu()), config.eval_k)
