"""`Task`: what a run trains on, one bundle for the built-in default and a user's data alike: the rows, how a
row's prompt is put to the model, and the reward functions that score its completions.

The loop knows nothing of arithmetic: the built-in task (`arithmetic_task`) is generated rows with an ``answer``
column, a system prompt and worked examples, and the correctness and format rewards, through the same path as
``--dataset my.jsonl --reward my_rewards.py:fn``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Dict, Hashable, List, Optional

from datasets import Dataset

from .config import ConfigError, TrainConfig
from .data import check_prompts, load_rows
from .rewards import SYSTEM_PROMPT, WORKED_EXAMPLES, completion_text, extract_answer, parse_number
from .scoring import check_columns, load_reward, reward_name

_ANSWER_BLOCK = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def last_answer(text: str) -> Optional[str]:
    """The answer maj@k votes on by default: the last ``<answer>`` block if there is one, else the last non-empty
    line, whitespace-normalised (None for an empty completion)."""
    blocks = _ANSWER_BLOCK.findall(text)
    lines = [line for line in (blocks[-1] if blocks else text).splitlines() if line.strip()]
    return " ".join(lines[-1].split()) if lines else None


_TAGS = re.compile(r"</?(?:reasoning|think)>")


def outside_answer(text: str) -> str:
    """What a completion writes besides its answer, the words `evaluation` counts as its reasoning: the text without
    its ``<answer>`` blocks and the ``<reasoning>`` / ``<think>`` tags; without an answer block, the text but its
    last non-empty line (the answer `last_answer` reads)."""
    if _ANSWER_BLOCK.search(text):
        return _TAGS.sub(" ", _ANSWER_BLOCK.sub(" ", text))
    lines = [line for line in text.splitlines() if line.strip()]
    return _TAGS.sub(" ", "\n".join(lines[:-1]))


@dataclass
class Task:
    """A run's task. ``train`` and ``held_out`` hold ``prompt_column`` and any other columns (passed to the rewards).

    A string prompt is the user's turn, after ``system_prompt`` and ``examples`` (earlier chat turns), in the
    tokenizer's chat template unless ``chat_template`` is off; a conversational prompt (a list of messages) is used
    as given. ``accuracy_reward`` names the reward behind accuracy, pass@k and maj@k, reported where its values
    are 0 or 1; maj@k votes on ``answer_key`` of each sample; ``reasoning_of`` is what a completion writes besides its
    answer (the held-out reasoning share counts its words). ``greedy_rates`` are further held-out shares of the
    greedy completions (the built-in task's format rate)."""

    name: str
    train: Dataset
    held_out: Dataset
    prompt_column: str
    conversational: bool
    rewards: List[Callable]
    weights: List[float]
    accuracy_reward: str
    system_prompt: Optional[str] = None
    examples: List[Dict[str, str]] = field(default_factory=list)
    chat_template: bool = True
    answer_key: Callable[[str], Optional[Hashable]] = last_answer
    reasoning_of: Callable[[str], str] = outside_answer
    greedy_rates: Dict[str, Callable[[str], bool]] = field(default_factory=dict)

    @property
    def reward_names(self) -> List[str]:
        return [reward_name(fn) for fn in self.rewards]

    def messages(self, prompt) -> List[Dict[str, str]]:
        """The conversation a prompt is asked in."""
        if not isinstance(prompt, str):
            return list(prompt)
        system = [] if self.system_prompt is None else [{"role": "system", "content": self.system_prompt}]
        return [*system, *self.examples, {"role": "user", "content": prompt}]

    def prompt_text(self, tokenizer, prompt) -> str:
        """The text the model continues: the chat template with the assistant's turn opened, or (``chat_template``
        off, string prompts) the system prompt and the prompt as plain text."""
        if self.chat_template:
            return tokenizer.apply_chat_template(self.messages(prompt), tokenize=False, add_generation_prompt=True)
        return prompt if self.system_prompt is None else f"{self.system_prompt}\n\n{prompt}"

    def drop_long_prompts(self, tokenizer, limit: int) -> Dict[str, int]:
        """Drops the rows whose prompt text is longer than ``limit`` tokens (a cut prompt would lose its question or
        its system turn); returns how many rows each split lost. A split left empty is a `ConfigError`."""
        lost = {}
        for split in ("train", "held_out"):
            rows = getattr(self, split)
            lengths = [
                len(tokenizer(self.prompt_text(tokenizer, p), add_special_tokens=not self.chat_template)["input_ids"])
                for p in rows[self.prompt_column]
            ]
            keep = [i for i, n in enumerate(lengths) if n <= limit]
            if not keep:
                raise ConfigError(
                    f"--max-prompt-length {limit}: every {'training' if split == 'train' else 'held-out'} prompt "
                    f"is longer (shortest {min(lengths)} tokens)"
                )
            lost[split] = len(rows) - len(keep)
            setattr(self, split, rows.select(keep) if lost[split] else rows)
        return lost

    def completion(self, text: str):
        """A completion in the prompt's format, as TRL hands it to reward functions."""
        return [{"role": "assistant", "content": text}] if self.conversational else text


def worked_example_turns(count: int) -> List[Dict[str, str]]:
    if not 0 <= count <= len(WORKED_EXAMPLES):
        raise ValueError(f"worked_examples must be between 0 and {len(WORKED_EXAMPLES)} (got {count})")
    return [
        {"role": role, "content": text}
        for q, a in WORKED_EXAMPLES[:count]
        for role, text in (("user", q), ("assistant", a))
    ]


def numeric_answer(in_block: bool) -> Callable[[str], Optional[float]]:
    """The built-in task's vote: the number its correctness reward reads."""

    def key(text: str) -> Optional[float]:
        return parse_number(extract_answer(completion_text(text), in_block))

    return key


def has_answer_block(text: str) -> bool:
    return "<answer>" in text and "</answer>" in text


@dataclass(frozen=True)
class TaskFraming:
    """How a task's string prompts are asked and what else its greedy completions are scored on: for a dataset of
    the user's, its --system-prompt and nothing else; for the built-in task, its own system prompt (unless one is
    given), its worked examples and its format rate."""

    system_prompt: Optional[str] = None
    examples: List[Dict[str, str]] = field(default_factory=list)
    greedy_rates: Dict[str, Callable[[str], bool]] = field(default_factory=dict)


def framing(config: TrainConfig) -> TaskFraming:
    """The task's `TaskFraming`, its settings checked against it (one line naming the flag, before any data)."""
    if config.dataset != "arithmetic":
        return TaskFraming(system_prompt=config.system_prompt)
    if config.prompt_column != "prompt" or config.eval_dataset or config.eval_split:
        raise ConfigError(
            "--dataset arithmetic is generated with its own prompts and held-out problems: --prompt-column, "
            "--eval-dataset and --eval-split apply to a dataset of your own"
        )
    if not config.chat_template and config.worked_examples:
        raise ConfigError(
            "--no-chat-template: the built-in task's worked examples are chat turns; add --worked-examples 0"
        )
    return TaskFraming(
        system_prompt=SYSTEM_PROMPT if config.system_prompt is None else config.system_prompt,
        examples=worked_example_turns(config.worked_examples),
        greedy_rates={"format_rate": has_answer_block},
    )


def load_task(config: TrainConfig, train_size: int = 100_000) -> Task:
    """The run's task from its settings; every check that needs no model runs here, before the model loads."""
    framed = framing(config)
    train, held_out = load_rows(config, train_size)
    conversational = check_prompts(train, config.prompt_column, config.dataset)
    if check_prompts(held_out, config.prompt_column, config.eval_dataset or config.dataset) != conversational:
        raise ConfigError("the held-out rows' prompts are in another format than the training rows': use one format")
    if conversational and not config.chat_template:
        raise ConfigError("--no-chat-template: the prompts are chat messages, which need the chat template")
    specs = config.reward or ["correctness", "format"]
    rewards = [load_reward(spec, config.answer_in_block) for spec in specs]
    names = [reward_name(fn) for fn in rewards]
    if len(set(names)) < len(names):
        raise ConfigError(f"--reward: two functions share a name ({names}): each is logged by its name")
    for rows, source in ((train, config.dataset), (held_out, config.eval_dataset or config.dataset)):
        check_columns(rewards, [c for c in rows.column_names if c != config.prompt_column], source)
    accuracy = config.accuracy_reward or names[0]
    if accuracy not in names:
        raise ConfigError(f"--accuracy-reward {accuracy!r} is not one of the rewards {names}")
    # The built-in correctness reward reads a number: maj@k votes on that number, as the reward compares it.
    numeric = (
        rewards[names.index(accuracy)].__name__ == "correctness_reward"
        and specs[names.index(accuracy)] == "correctness"
    )
    return Task(
        name=config.dataset,
        train=train,
        held_out=held_out,
        prompt_column=config.prompt_column,
        conversational=conversational,
        rewards=rewards,
        weights=list(config.reward_weights or [1.0] * len(rewards)),
        accuracy_reward=accuracy,
        system_prompt=framed.system_prompt,
        examples=framed.examples,
        chat_template=config.chat_template,
        answer_key=numeric_answer(config.answer_in_block) if numeric else last_answer,
        greedy_rates=framed.greedy_rates,
    )
