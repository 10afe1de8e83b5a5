"""Held-out evaluation of any task: decode (a greedy completion and ``eval_k`` samples per prompt), then score
them with the task's rewards.

Reported: each reward's mean over the greedy completions (``rewards/NAME``) and their weighted sum (``reward``);
where the accuracy reward's values are 0 or 1, greedy ``accuracy``, ``pass@k`` (some sample scores 1) and
``maj@k`` (the answer most samples give, by the task's ``answer_key``, scores 1); the task's ``greedy_rates``.
The shares have 95 % intervals (`intervals.metric_intervals`); the reward means are not shares and have none.
"""

from __future__ import annotations

from collections import Counter
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
        (out["texts"][i * (k + 1) : (i + 1) * (k + 1)], scores[i * (k + 1) : (i + 1) * (k + 1)])
        for i in range(len(rows[task.prompt_column]))
    ]


def tally(task: Task, decoded: list, k: int) -> torch.Tensor:
    """The sums `evaluate` adds over batches and processes, in `_layout`'s order."""
    acc = task.reward_names.index(task.accuracy_reward)
    rewards = len(task.rewards)
    sums = torch.zeros(_size(task), dtype=torch.float64)
    weights = torch.tensor(task.weights, dtype=torch.float32)
    for texts, scores in decoded:
        right = scores[:, acc] == 1
        sums[0] += 1
        sums[1] += right[0]
        values = scores[:, acc]  # NaN (the reward does not apply): not right, and no reason to doubt it is 0/1
        sums[4] += bool((~values.isnan() & (values != 0) & (values != 1)).any())
        if k:
            sums[2] += bool(right[1:].any())
            keys = [task.answer_key(t) for t in texts[1:]]
            votes = Counter(key for key in keys if key is not None)
            if votes:
                sums[3] += bool(right[1 + keys.index(votes.most_common(1)[0][0])])
        greedy = scores[0]
        sums[5] += float((greedy * weights).nansum())
        applies = ~greedy.isnan()
        sums[6 : 6 + rewards] += torch.where(applies, greedy, 0).double()
        sums[6 + rewards : 6 + 2 * rewards] += applies.double()
        for j, rate in enumerate(task.greedy_rates.values()):
            sums[6 + 2 * rewards + j] += bool(rate(texts[0]))
    return sums


def _size(task: Task) -> int:
    # rows, greedy right, pass@k, maj@k, non-binary rows, weighted reward, reward sums, reward counts, greedy rates
    return 6 + 2 * len(task.rewards) + len(task.greedy_rates)


def metrics(task: Task, sums: torch.Tensor, k: int) -> dict:
    """The held-out figures from `tally`'s sums, over all processes."""
    n, rewards = float(sums[0]), len(task.rewards)
    result = {}
    if not sums[4]:  # the accuracy reward was 0 or 1 on every completion
        result["accuracy"] = float(sums[1]) / n
    for j, name in enumerate(task.greedy_rates):
        result[name] = float(sums[6 + 2 * rewards + j]) / n
    if not sums[4] and k:
        result[f"pass@{k}"] = float(sums[2]) / n
        result[f"maj@{k}"] = float(sums[3]) / n
    result["reward"] = float(sums[5]) / n
    for j, name in enumerate(task.reward_names):
        count = float(sums[6 + rewards + j])
        result[f"rewards/{name}"] = float(sums[6 + j]) / count if count else float("nan")
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
    sums = torch.zeros(_size(task), dtype=torch.float64)
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
        sums += tally(task, decoded, config.eval_k)
        bar.update(len(decoded))
    bar.close()
    model.train()
    stop_together(dist, failed)
    if dist.any(stopped):
        return None
    return metrics(task, dist.all_sum(sums.to(dist.device)).cpu(), config.eval_k)
