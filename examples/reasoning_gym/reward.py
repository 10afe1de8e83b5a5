"""reasoning-gym's own scorer as a reward function with TRL's signature (``gtpo-train --reward
examples/reasoning_gym/reward.py:reasoning_gym_reward``, or ``reward_funcs=[reasoning_gym_reward]`` in TRL).

Each row carries reasoning-gym's entry (``make_data.py``'s ``entry`` column, JSON text); the completion's answer is
its last ``<answer>`` block (reasoning-gym's ``extract_answer``), scored by the entry's dataset's ``score_answer``.
"""

from __future__ import annotations

import json

import reasoning_gym
from reasoning_gym.utils import extract_answer


def reasoning_gym_reward(prompts, completions, completion_ids, entry, **kwargs) -> list:
    """reasoning-gym's score of each completion's answer (0 without an answer block)."""
    scores = []
    for completion, text in zip(completions, entry):
        content = completion if isinstance(completion, str) else completion[-1]["content"]
        row = json.loads(text)
        answer = extract_answer(content, tag_name="answer")
        score_answer = reasoning_gym.get_score_answer_fn(row["metadata"]["source_dataset"])
        scores.append(float(score_answer(answer=answer, entry=row)) if answer is not None else 0.0)
    return scores


def reasoning_gym_solved(prompts, completions, completion_ids, entry, **kwargs) -> list:
    """1 where reasoning-gym's score is full marks, else 0: the 0/1 reward behind accuracy, pass@k and maj@k
    (``score_answer`` gives partial credit, ``len(answer) / len(text)``, to an answer that contains the right one)."""
    return [1.0 if score == 1.0 else 0.0 for score in reasoning_gym_reward(prompts, completions, completion_ids, entry)]
