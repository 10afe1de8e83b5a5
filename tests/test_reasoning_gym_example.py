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


def test_the_training_rows_are_as_many_as_asked_though_the_seeds_streams_overlap(tmp_path):
    """reasoning-gym's seed s + 1 is seed s shifted by one entry: the training draws must go past the held-out ones
    (drawing only --train of them left 1 training row of 100 beside 128 held out)."""
    load("make_data").main(["--task", "gcd", "--train", "100", "--test", "128", "--out", str(tmp_path)])
    question = lambda row: row["prompt"][-1]["content"]  # noqa: E731
    test = [json.loads(x) for x in (tmp_path / "test.jsonl").read_text().splitlines()]
    train = [json.loads(x) for x in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert len(train) == 100 and len(test) > 100
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


def test_each_working_ends_on_the_entrys_answer():
    """The reasoning recipe's worked example: for a hundred entries of each task with a writer, several lines of
    working whose last ends on reasoning-gym's own answer (its `score_answer` is the judge of every task)."""
    import reasoning_gym

    workings = load("workings")
    for task in workings.WRITERS:
        for entry in reasoning_gym.create_dataset(task, size=100, seed=5):
            lines = workings.working(task, entry).splitlines()
            assert len(lines) >= 2 and lines[-1].endswith(f" {entry['answer']}."), (task, entry["question"], lines)
            score = reasoning_gym.get_score_answer_fn(task)
            answer = lines[-1].rsplit(" ", 1)[-1].rstrip(".")
            if task != "prime_factorization":  # its answer holds spaces: the line's ending is checked above
                assert score(answer=answer, entry=entry) == 1.0


def test_the_reasoning_recipe_shows_its_steps_and_refuses_a_task_without_them(tmp_path, capsys):
    make_data = load("make_data")
    make_data.main(["--task", "gcd", "--recipe", "reasoning", "--train", "5", "--test", "5", "--out", str(tmp_path)])
    row = json.loads((tmp_path / "train.jsonl").read_text().splitlines()[0])
    system, question, example = row["prompt"][0], row["prompt"][1], row["prompt"][2]
    assert system["content"] == make_data.SYSTEM_PROMPTS["reasoning"] and "step by step" in system["content"]
    assert "Divide" in example["content"] and example["content"].count(" x ") >= 2  # Euclid's divisions
    entry = next(iter(__import__("reasoning_gym").create_dataset("gcd", size=1, seed=make_data.EXAMPLE_SEED)))
    assert question["content"] == entry["question"]
    assert example["content"].endswith(f"<answer>\n{entry['answer']}\n</answer>")

    make_data.main(["--task", "gcd", "--train", "5", "--test", "5", "--out", str(tmp_path / "short")])
    short = json.loads((tmp_path / "short" / "train.jsonl").read_text().splitlines()[0])["prompt"][2]["content"]
    assert short.startswith(f"<reasoning>\nThe answer is {entry['answer']}.\n</reasoning>")

    with pytest.raises(SystemExit):
        make_data.main(["--task", "word_sorting", "--recipe", "reasoning", "--out", str(tmp_path / "none")])
    err = capsys.readouterr().err
    assert "'word_sorting' has no chain of thought" in err and "--recipe answer" in err
    assert not (tmp_path / "none").exists()


def test_the_reasoning_recipes_settings_load_as_a_run_config():
    from trainer.config import TrainConfig

    config = TrainConfig.from_file(str(ROOT / "examples" / "reasoning_gym" / "reasoning.yaml"))
    assert (config.max_new_tokens, config.eval_k, config.stop) == (256, 16, ["</answer>"])
    assert config.reward[0].endswith("reward.py:reasoning_gym_solved") and config.reward_weights == [1.0, 1.0, 0.0]
    for reward in config.reward:
        if ":" in reward:
            assert (ROOT / reward.split(":")[0]).exists(), reward
