"""The built-in reward functions, with TRL's signature: ``f(prompts, completions, completion_ids, **columns) ->
list[float | None]`` (``--reward correctness``, ``format``, ``math_verify``); completions are strings, or lists of
one assistant message for conversational prompts.

The layout the GTPO authors train for, which the built-in task's system prompt asks for::

    <reasoning>
    ...
    </reasoning>
    <answer>
    42
    </answer>
"""

from __future__ import annotations

import re
from typing import Callable, Dict, List, Optional, Union

Completion = Union[str, List[dict]]

SYSTEM_PROMPT = (
    "Solve the problem. Respond in the following format:\n"
    "<reasoning>\nshort reasoning\n</reasoning>\n<answer>\nthe number\n</answer>"
)
# Worked examples, shown as earlier chat turns before the question (TrainConfig.worked_examples), one per operation of
# the built-in problems at --difficulty 1. A 135M model ignores the layout when it is only described and follows it
# after an example, which also makes most prompt groups mixed (some right, some wrong), so the rewards carry signal.
# With the addition example alone, short runs split by seed between learning to subtract and adding every pair of
# numbers; with both, the untrained model already keeps the layout (figures:
# results/trainer-cpu/first-hour/README.md). Their names and items are outside the built-in generator's, so an example
# never equals a training or held-out problem.
WORKED_EXAMPLES = [
    (
        "Tom has 3 pens. Ann gives Tom 4 more. How many pens does Tom have now?",
        "<reasoning>\nTom has 3 pens and gets 4 more: 3 + 4 = 7.\n</reasoning>\n<answer>\n7\n</answer>",
    ),
    (
        "Sam has 8 cups and gives 3 of them to Mia. How many cups does Sam have left?",
        "<reasoning>\nSam has 8 cups and gives away 3: 8 - 3 = 5.\n</reasoning>\n<answer>\n5\n</answer>",
    ),
]
_STRICT = re.compile(r"^\s*<reasoning>.*?</reasoning>\s*<answer>.*?</answer>\s*$", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def extract_answer(completion: str, in_block: bool = True) -> Optional[str]:
    """The text of the last ``<answer>...</answer>`` block; without one, None (``in_block=False``: the last
    number of the completion instead).

    Only the block counts by default: a 135M model answers a bare number right far more often than it
    does in the reasoning/answer layout, so when a bare number also earned the correctness reward, short
    runs split by seed between keeping the layout and dropping it for bare answers (held-out format rate
    1.0 or 0.0; see results/trainer-cpu/probes/README.md)."""
    blocks = _ANSWER.findall(completion)
    if blocks:
        return blocks[-1].strip()
    if in_block:
        return None
    numbers = _NUMBER.findall(completion)
    return numbers[-1] if numbers else None


def parse_number(text: Optional[str]) -> Optional[float]:
    """The last number in ``text`` (thousands separators and a trailing period allowed), or None."""
    if text is None:
        return None
    numbers = _NUMBER.findall(text.replace("−", "-"))
    if not numbers:
        return None
    try:
        return float(numbers[-1].replace(",", ""))
    except ValueError:
        return None


def answers_match(predicted: Optional[str], gold: str) -> bool:
    """Exact numeric match; LaTeX answers (``\\frac``, ``\\sqrt``...) go through math-verify if installed."""
    if predicted is None:
        return False
    if "\\" in gold or "\\" in predicted:
        try:
            from math_verify import parse, verify

            return bool(verify(parse(gold), parse(predicted)))
        except ImportError:
            return predicted.strip() == gold.strip()
    p, g = parse_number(predicted), parse_number(gold)
    return p is not None and g is not None and abs(p - g) < 1e-9


def completion_text(completion: Completion) -> str:
    """A completion's text: the string itself, or the content of a conversational completion's last message."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def final_answer(answer: str) -> str:
    """A reference answer's final value: GSM8K's solutions end with ``#### <number>``; other answers pass through."""
    match = re.search(r"####\s*(.+?)\s*$", answer.strip())
    return (match.group(1) if match else answer).replace(",", "").strip()


def correctness_reward(
    completions: List[Completion], answer: List[str], answer_in_block: bool = True, **kwargs
) -> List[float]:
    """1 when the completion's answer (``extract_answer(c, answer_in_block)``) equals the row's ``answer`` column
    (GSM8K's ``#### 42`` read as 42), else 0."""
    return [
        1.0 if answers_match(extract_answer(completion_text(c), answer_in_block), final_answer(str(a))) else 0.0
        for c, a in zip(completions, answer)
    ]


def format_reward(completions: List[Completion], **kwargs) -> List[float]:
    """0.5 for the full reasoning/answer layout; 0.25 for an answer block alone."""
    texts = [completion_text(c) for c in completions]
    return [0.5 if _STRICT.match(c) else 0.25 if _ANSWER.search(c) else 0.0 for c in texts]


def math_verify_reward(
    completions: List[Completion], solution: Optional[List[str]] = None, answer: Optional[List[str]] = None, **kwargs
) -> List[Optional[float]]:
    """math-verify's equivalence of the completion's last math expression (``\\boxed{}`` first) and the row's
    ``solution`` column (else its ``answer``): 1 or 0, None where the reference does not parse (TRL's rule)."""
    from math_verify import parse, verify

    gold = solution if solution is not None else answer
    if gold is None:
        raise ValueError("math_verify_reward reads a 'solution' or an 'answer' column; the rows have neither")
    rewards: List[Optional[float]] = []
    for completion, reference in zip(completions, gold):
        parsed_gold = parse(str(reference))
        if not parsed_gold:
            rewards.append(None)
            continue
        rewards.append(float(verify(parsed_gold, parse(completion_text(completion)))))
    return rewards


# --reward NAME: the built-in functions, and the package each needs beyond the trainer's (pip's name).
BUILTIN_REWARDS: Dict[str, Callable] = {
    "correctness": correctness_reward,
    "format": format_reward,
    "math_verify": math_verify_reward,
}
BUILTIN_REQUIRES = {"math_verify": ("math_verify", "math-verify")}
