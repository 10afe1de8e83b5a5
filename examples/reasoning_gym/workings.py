"""Step-by-step workings of reasoning-gym problems: the worked example's reasoning in ``make_data.py``'s reasoning
recipe (``--recipe reasoning``), so that the model is shown steps to imitate rather than "The answer is X.".

`working(task, entry)` is reasoning-gym's own chain of thought where the task has one (``metadata["answer_cot"]``,
gsm_symbolic's), else the lines one of the writers below derives from the entry's metadata, each ending on the
entry's answer: its last line ends " ANSWER." (tests/test_reasoning_gym_example.py checks that on a hundred entries of
each). A task with neither
is refused by name.
"""

from __future__ import annotations

import re
from typing import Callable, Dict, List


def chain_sum(entry: dict) -> List[str]:
    """``57 + 87 - 70``: one operation a line, left to right."""
    tokens = entry["metadata"]["expression"].split()
    total = int(tokens[0])
    lines = ["Work from left to right, one term at a time."]
    for op, term in zip(tokens[1::2], tokens[2::2]):
        after = total + int(term) if op == "+" else total - int(term)
        lines.append(f"{total} {op} {term} = {after}")
        total = after
    return [*lines, f"So the result is {total}."]


def _euclid(a: int, b: int, lines: List[str]) -> int:
    """gcd(a, b) by Euclid's algorithm, a line per division."""
    a, b = max(a, b), min(a, b)
    lines.append(f"Divide {a} by {b} and keep the remainder, until the remainder is 0.")
    while b:
        q, r = divmod(a, b)
        lines.append(f"{a} = {q} x {b} + {r}")
        a, b = b, r
    lines.append(f"The last divisor is {a}, so the GCD is {a}.")
    return a


def gcd(entry: dict) -> List[str]:
    """Euclid's algorithm, number by number."""
    numbers = entry["metadata"]["numbers"]
    lines: List[str] = []
    g = numbers[0]
    for n in numbers[1:]:
        g = _euclid(g, n, lines)
    return lines


def lcm(entry: dict) -> List[str]:
    """The GCD by Euclid, then a x b / gcd, number by number."""
    numbers = entry["metadata"]["numbers"]
    lines: List[str] = []
    m = numbers[0]
    for n in numbers[1:]:
        g = _euclid(m, n, lines)
        lines.append(f"LCM = {m} x {n} / {g} = {m * n // g}")
        m = m * n // g
    return [*lines, f"So the LCM is {m}."]


def letter_counting(entry: dict) -> List[str]:
    """Word by word, the letter's count (either case, as reasoning-gym counts) and the running total."""
    letter, total = entry["metadata"]["target_letter"], 0
    lines = [f'Count the letter "{letter}" in each word and keep a running total.']
    for word in entry["metadata"]["span"]:
        here = word.lower().count(letter.lower())
        total += here
        lines.append(f"{word}: {here} (total {total})")
    return [*lines, f'So the count of "{letter}" is {total}.']


def spell_backward(entry: dict) -> List[str]:
    """The letters, then the same letters from the last."""
    word = entry["metadata"]["word"]
    return [
        f"The letters of {word} are: {', '.join(word)}.",
        f"From the last to the first: {', '.join(reversed(word))}.",
        f"So the word backward is {word[::-1]}.",
    ]


def prime_factorization(entry: dict) -> List[str]:
    """Trial division by the smallest factor left, a line per division."""
    n = entry["metadata"]["number"]
    lines, factors, left, d = [f"Divide {n} by the smallest prime that divides it, until 1 is left."], [], n, 2
    while left > 1:
        if left % d:
            d += 1
            continue
        lines.append(f"{left} / {d} = {left // d}")
        factors.append(d)
        left //= d
    return [*lines, f"So {n} = {' × '.join(map(str, factors))}."]


WRITERS: Dict[str, Callable[[dict], List[str]]] = {
    "chain_sum": chain_sum,
    "gcd": gcd,
    "lcm": lcm,
    "letter_counting": letter_counting,
    "spell_backward": spell_backward,
    "prime_factorization": prime_factorization,
}


def working(task: str, entry: dict) -> str:
    """The worked example's reasoning for ``entry``, one step a line (module docstring)."""
    cot = entry["metadata"].get("answer_cot")
    if cot:
        return re.sub(r"\n*####.*$", "", str(cot).strip(), flags=re.DOTALL)  # GSM8K's "#### 42" line: the answer's
    if task not in WRITERS:
        raise ValueError(
            f"--recipe reasoning: reasoning-gym's {task!r} has no chain of thought of its own and no writer here; "
            f"use one of {sorted(WRITERS)} or a task with metadata['answer_cot'] (gsm_symbolic), "
            "add a writer to examples/reasoning_gym/workings.py, or use --recipe answer"
        )
    return "\n".join(WRITERS[task](entry))
