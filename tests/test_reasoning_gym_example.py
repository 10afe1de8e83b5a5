"""examples/reasoning_gym: the held-out questions ``make_data.py`` writes are distinct and none is a training one (a
question twice would count twice in every held-out figure); its scorer gives 1 to the right answer, 0 otherwise."""

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("reasoning_gym")

ROOT = Path(__file__).resolve().parents[1]


def load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / "reasoning_gym" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_held_out_questions_are_distinct_and_not_trained_on(tmp_path):
    # One-digit sums of two terms: about 200 questions, so 300 draws repeat many of them.
    settings = '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}'
    load("make_data").main(
        ["--task", "chain_sum", "--config", settings, "--train", "300", "--test", "300", "--out", str(tmp_path)]
    )
    question = lambda row: row["prompt"][-1]["content"]  # noqa: E731
    test = [json.loads(x) for x in (tmp_path / "test.jsonl").read_text().splitlines()]
    train = [json.loads(x) for x in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert 50 < len(test) < 300  # repeats were drawn, and dropped
    assert len({question(r) for r in test}) == len(test)
    assert not {question(r) for r in test} & {question(r) for r in train}


def test_solved_is_reasoning_gyms_full_marks(tmp_path):
    load("make_data").main(["--task", "chain_sum", "--train", "5", "--test", "5", "--out", str(tmp_path)])
    row = json.loads((tmp_path / "test.jsonl").read_text().splitlines()[0])
    reward = load("reward")
    right = f"<reasoning>\nsum\n</reasoning>\n<answer>\n{row['answer']}\n</answer>"
    wrong = f"<answer>\n{int(row['answer']) + 1}\n</answer>"
    partial = f"<answer>\nabout {row['answer']}, I think\n</answer>"  # holds the right one: partial credit
    texts = [right, wrong, "no answer", partial]
    graded = reward.reasoning_gym_reward(None, texts, None, [row["entry"]] * 4)
    assert graded[:3] == [1.0, 0.0, 0.0] and 0 < graded[3] < 1
    assert reward.reasoning_gym_solved(None, texts, None, [row["entry"]] * 4) == [1.0, 0.0, 0.0, 0.0]
