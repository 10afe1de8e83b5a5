"""Held-out evaluation of any task: decode (a greedy completion and ``eval_k`` samples per prompt), then score
them with the task's rewards.

Reported: each reward's mean over the greedy completions (``rewards/NAME``) and their weighted sum (``reward``);
where the accuracy reward's values are 0 or 1, greedy ``accuracy``, ``pass@k`` for k = 1, 2, 4, ... up to
``eval_k`` (`pass_ks`; the chance that k of the ``eval_k`` samples drawn without replacement hold a right one, the
unbiased estimator `pass_at`; at k = ``eval_k``, some sample scores 1) and ``maj@k`` (the answer most samples
give, by the task's ``answer_key``, scores 1); the task's ``greedy_rates``.
Whether the model answers one thing to every problem (one-answer collapse): ``distinct_answers``, how many different
greedy answers it gave, ``top_answer_share``, the share of problems given the most common one (a warning is printed
where it passes half). Whether it reasons: ``mean_completion_tokens`` over every completion decoded,
``reasoning_share``, the share of them with at least `REASONING_MIN_WORDS` words outside their answer (the task's
``reasoning_of``), and ``mean_reasoning_words``.
The shares have 95 % intervals (`intervals.metric_intervals`); the reward means and the counts have none.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from tqdm.auto import tqdm

from .allocator import release_freed_memory
from .config import TrainConfig
from .distributed import Distributed
from .precision import autocast
from .rollout import generate, score_completions
from .scoring import RewardError, stop_together
from .seeding import step_seed
from .stopping import Interrupted, StopRequests
from .task import Task
from .totals import Totals


@dataclass
class Decoded:
    """One held-out problem's ``k + 1`` completions (the greedy one first): their texts, ``scores [k + 1, R]`` (each
    reward's) and ``tokens [k + 1]`` (each completion's length)."""

    texts: List[str]
    scores: torch.Tensor
    tokens: torch.Tensor


def decode(model, tokenizer, task: Task, rows: dict, config: TrainConfig, dist: Distributed, on_token) -> list:
    """``eval_k + 1`` completions per row (greedy first), scored: a `Decoded` a row."""
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
    tokens = out.completion_mask.sum(1)
    return [
        Decoded(
            out.texts[i * (k + 1) : (i + 1) * (k + 1)],
            scores[i * (k + 1) : (i + 1) * (k + 1)],
            tokens[i * (k + 1) : (i + 1) * (k + 1)],
        )
        for i in range(len(rows[task.prompt_column]))
    ]


# A completion "reasons" where it writes at least this many words besides its answer: more than the recipe's old
# "The answer is 12." (4 words) or a bare sum "7 + 5 = 12" (5), as few as one sentence of working.
REASONING_MIN_WORDS = 10


def pass_ks(n: int) -> Tuple[int, ...]:
    """The k of the ``pass@k`` reported from ``n`` samples a problem: 1, 2, 4, ... below ``n``, and ``n``."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return (*ks, n) if n else ()


def pass_at(n: int, right: int, k: int) -> float:
    """The unbiased estimate of pass@k from ``n`` samples of which ``right`` are right: the chance that ``k`` of them
    drawn without replacement hold a right one, ``1 - C(n - right, k) / C(n, k)``."""
    if n - right < k:
        return 1.0
    miss = 1.0
    for i in range(n - right + 1, n + 1):  # C(n - c, k) / C(n, k) as a product: no huge binomials
        miss *= 1.0 - k / i
    return 1.0 - miss


def word_count(text: str) -> int:
    return len(text.split())


@dataclass
class HeldOutTotals(Totals):
    """The sums `evaluate` adds over batches and processes (`Totals`), each over the held-out problems."""

    problems: float = 0.0
    greedy_right: float = 0.0  # the greedy completion scored 1 on the accuracy reward
    pass_at: Optional[torch.Tensor] = None  # [K] each problem's `pass_at` estimate for each k of `pass_ks(eval_k)`
    maj_at_k: float = 0.0  # the samples' most common answer scored 1
    not_binary: float = 0.0  # problems on which some accuracy reward was neither 0 nor 1 (then no accuracy)
    reward: float = 0.0  # the greedy completion's weighted reward
    per_reward: Optional[torch.Tensor] = None  # [R] each reward's greedy values where it applies
    applies: Optional[torch.Tensor] = None  # [R] how many greedy completions each reward applies to
    greedy_rates: Optional[torch.Tensor] = None  # [Q] greedy completions passing each of the task's rate checks
    completions: float = 0.0  # every completion decoded (greedy and samples)
    completion_tokens: float = 0.0  # their tokens
    reasoning: float = 0.0  # completions with at least `REASONING_MIN_WORDS` words besides the answer
    reasoning_words: float = 0.0  # the words they all write besides the answer

    @classmethod
    def zeros(cls, task: Task, k: int) -> HeldOutTotals:
        rewards, rates = len(task.rewards), len(task.greedy_rates)
        zeros = lambda n: torch.zeros(n, dtype=torch.float64)  # noqa: E731
        return cls(
            pass_at=zeros(len(pass_ks(k))), per_reward=zeros(rewards), applies=zeros(rewards), greedy_rates=zeros(rates)
        )

    @classmethod
    def read(cls, task: Task, k: int, sums: torch.Tensor) -> HeldOutTotals:
        rewards, rates = len(task.rewards), len(task.greedy_rates)
        return cls.from_sums(sums, pass_at=len(pass_ks(k)), per_reward=rewards, applies=rewards, greedy_rates=rates)


def tally(task: Task, decoded: list, k: int) -> HeldOutTotals:
    """The held-out sums of ``decoded`` (`decode`'s problems)."""
    acc = task.reward_names.index(task.accuracy_reward)
    totals = HeldOutTotals.zeros(task, k)
    weights = torch.tensor(task.weights, dtype=torch.float32)
    for problem in decoded:
        texts, scores = problem.texts, problem.scores
        totals.completions += len(texts)
        totals.completion_tokens += float(problem.tokens.sum())
        words = [word_count(task.reasoning_of(t)) for t in texts]
        totals.reasoning += sum(w >= REASONING_MIN_WORDS for w in words)
        totals.reasoning_words += sum(words)
        right = scores[:, acc] == 1
        totals.problems += 1
        totals.greedy_right += bool(right[0])
        values = scores[:, acc]  # NaN (the reward does not apply): not right, and no reason to doubt it is 0/1
        totals.not_binary += bool((~values.isnan() & (values != 0) & (values != 1)).any())
        if k:
            samples_right = int(right[1:].sum())
            totals.pass_at += torch.tensor([pass_at(k, samples_right, j) for j in pass_ks(k)], dtype=torch.float64)
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


def greedy_answers_given(task: Task, decoded: list) -> Counter:
    """How many of ``decoded``'s problems got each greedy answer (by the task's ``answer_key``; ``None``: none)."""
    return Counter(task.answer_key(problem.texts[0]) for problem in decoded)


def answers_given(answers: Counter) -> Counter:
    """``answers`` without the problems that got none (``None``)."""
    return Counter({answer: count for answer, count in answers.items() if answer is not None})


def one_answer_figures(answers: Counter, problems: float) -> dict:
    """``distinct_answers`` (greedy answers given, ``None`` not counted) and ``top_answer_share`` (the problems
    given the most common one, of all ``problems``) from the whole held-out set's ``answers``."""
    given = answers_given(answers)
    top = given.most_common(1)[0][1] if given else 0
    return {"distinct_answers": float(len(given)), "top_answer_share": top / problems if problems else 0.0}


def metrics(task: Task, totals: HeldOutTotals, k: int, answers: Optional[Counter] = None) -> dict:
    """The held-out figures from the sums over all processes (and the greedy answers they gave, ``answers``)."""
    n = float(totals.problems)
    result = {}
    if not totals.not_binary:  # the accuracy reward was 0 or 1 on every completion
        result["accuracy"] = float(totals.greedy_right) / n
    for name, passed in zip(task.greedy_rates, totals.greedy_rates.tolist()):
        result[name] = passed / n
    if not totals.not_binary and k:
        for j, passed in zip(pass_ks(k), totals.pass_at.tolist()):
            result[f"pass@{j}"] = passed / n
        result[f"maj@{k}"] = float(totals.maj_at_k) / n
    result["reward"] = float(totals.reward) / n
    for name, value, count in zip(task.reward_names, totals.per_reward.tolist(), totals.applies.tolist()):
        result[f"rewards/{name}"] = value / count if count else float("nan")
    if answers is not None:
        result.update(one_answer_figures(answers, n))
    completions = float(totals.completions)
    per_completion = lambda total: float(total) / completions if completions else float("nan")  # noqa: E731
    result["mean_completion_tokens"] = per_completion(totals.completion_tokens)
    result["reasoning_share"] = per_completion(totals.reasoning)
    result["mean_reasoning_words"] = per_completion(totals.reasoning_words)
    return result


# Where the most common greedy answer is given to more than this share of the problems, the run warns.
ONE_ANSWER_WARNING = 0.5


def warn_of_one_answer(answers: Counter, problems: float, desc: str) -> None:
    """A warning on stderr where one greedy answer is given to more than `ONE_ANSWER_WARNING` of the problems."""
    figures = one_answer_figures(answers, problems)
    if figures["top_answer_share"] > ONE_ANSWER_WARNING:
        answer = answers_given(answers).most_common(1)[0][0]
        tqdm.write(
            f"warning: {desc}: the greedy answer {answer!r} was given to {figures['top_answer_share']:.0%} of the "
            f"{problems:.0f} held-out problems ({figures['distinct_answers']:.0f} distinct answers): the model may "
            "answer one thing whatever it is asked (one-answer collapse)",
            file=sys.stderr,
        )


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
    sums = HeldOutTotals.zeros(task, config.eval_k).to_sums()
    answers: Counter = Counter()  # this process's problems' greedy answers
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
        if dist.device.type == "cpu":  # what training or the last batch freed, before this batch's cache
            release_freed_memory()  # (trainer/allocator.py)
        try:
            decoded = decode(model, tokenizer, task, rows, config, dist, on_token)
        except Interrupted:  # one process, a stop request: the layers' hooks cut the batch short
            stopped = True
            break
        except RewardError as exc:  # raised below on every process together
            failed = exc
            break
        if greedy_answers is not None:
            for i, problem in enumerate(decoded):
                row = {column: values[i] for column, values in rows.items()}
                greedy_answers.append(
                    {
                        **row,
                        "completion": problem.texts[0],
                        "correct": bool(problem.scores[0, acc] == 1),
                        "samples_right": int((problem.scores[1:, acc] == 1).sum()),
                    }
                )
        sums += tally(task, decoded, config.eval_k).to_sums()
        answers += greedy_answers_given(task, decoded)
        bar.update(len(decoded))
    bar.close()
    model.train()
    stop_together(dist, failed)
    if dist.any(stopped):
        return None
    answers = sum(dist.gather_objects(answers), Counter())
    totals = HeldOutTotals.read(task, config.eval_k, dist.all_sum(sums.to(dist.device)).cpu())
    if dist.is_main:
        warn_of_one_answer(answers, float(totals.problems), desc)
    return metrics(task, totals, config.eval_k, answers)
