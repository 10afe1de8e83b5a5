"""`python -m gtpo_train.offline.answers`: a saved model's wrong greedy answers, through the trainer's own
evaluation."""

import json

import pytest
import torch

pytest.importorskip("transformers")

import trainer.evaluation as evaluation  # noqa: E402
from trainer.config import TrainConfig  # noqa: E402
from trainer.data import arithmetic_rows  # noqa: E402
from trainer.offline import answers  # noqa: E402
from trainer.rollout import Completions  # noqa: E402


def test_operation_reads_the_first_one_between_numbers():
    assert answers.operation("Ana has 6 and gives 5: 6 - 5 = 1.") == "-"
    assert answers.operation("<reasoning>\n2 + 6 = 8\n</reasoning>") == "+"
    assert answers.operation("3 x 4 = 12, then 12 - 2") == "*"
    assert answers.operation("no numbers-here, 7") == "none"


def test_wrong_greedy_answers_come_from_the_final_evaluation(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """Each problem's greedy completion (the first of its rows) is what is judged, with the run's answer rule, on
    the run's held-out problems; the samples after it only feed pass@k and maj@k. The report counts the
    operations the wrong answers write, and the metrics are the evaluation's."""
    config = TrainConfig(model=tiny_model_dir, eval_size=6, eval_k=2, max_new_tokens=4, steps=3, precision="fp32")
    _, held_out = arithmetic_rows(config.seed, config.eval_size, config.difficulty)
    gold = dict(zip(held_out["prompt"], held_out["answer"]))
    wrong_questions = set(held_out["prompt"][1::2])  # every other problem answered wrong, by subtracting

    def fake_generate(model, tokenizer, task, questions, n, config, device, greedy_first=False, **kwargs):
        assert greedy_first and n == 3
        texts = []
        for q in questions:
            value = int(gold[q]) + 1 if q in wrong_questions else int(gold[q])
            greedy = f"<reasoning>\n9 - 2 = {value}\n</reasoning>\n<answer>\n{value}\n</answer>"
            texts += [greedy, f"<answer>\n{gold[q]}\n</answer>", "no answer"]  # a right sample, a wrong one
        ids = torch.ones(len(texts), 2, dtype=torch.long)
        return Completions(ids[:0], ids[:0], ids, ids.bool(), texts)  # no prompt is read

    monkeypatch.setattr(evaluation, "generate", fake_generate)
    metrics, wrong = answers.wrong_answers(tiny_model_dir, config)
    assert {q for q, _, _ in wrong} == wrong_questions
    assert all(g == gold[q] and f"<answer>\n{int(g) + 1}\n</answer>" in text for q, g, text in wrong)
    one_answer = {"distinct_answers", "top_answer_share", "mean_completion_tokens"}  # their own test is below
    one_answer |= {"reasoning_share", "mean_reasoning_words"}
    assert one_answer <= set(metrics) and metrics["mean_completion_tokens"] == 2.0  # every completion: 2 tokens
    assert {k: v for k, v in metrics.items() if k not in one_answer} == {
        "accuracy": 0.5,
        "format_rate": 1.0,
        "pass@1": 0.5,  # one of each problem's two samples is right
        "pass@2": 1.0,
        "maj@2": 1.0,
        "reward": 1.0,  # half right (1) and every one in the layout (0.5)
        "rewards/correctness_reward": 0.5,
        "rewards/format_reward": 0.5,
    }

    # The command line reads the run's config.json beside the model folder and writes the report.
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(config.to_dict()))
    monkeypatch.setattr(answers, "load_model_and_tokenizer", lambda path, device: (torch.nn.Linear(1, 1), None))
    answers.main([str(run / "final"), "--out", str(tmp_path / "wrong.md")])
    text = (tmp_path / "wrong.md").read_text()
    assert text == capsys.readouterr().out.rstrip("\n") + "\n"
    assert "**3 wrong**; the operation their reasoning writes: `-` 3." in text
    assert "accuracy 0.500" in text and sum(q in text for q in wrong_questions) == 3


def test_the_final_evaluation_writes_each_problems_greedy_answer(tiny_model_dir, tmp_path, monkeypatch):
    """held-out-answers.jsonl (a run's final evaluation): each problem's greedy answer by the task's answer rule,
    whether it is right, and how many of its samples are right; what a collapse to one answer, or a comparison
    problem by problem, reads."""
    from types import SimpleNamespace

    from trainer.distributed import Distributed
    from trainer.task import load_task
    from trainer.train import write_held_out_answers

    config = TrainConfig(model=tiny_model_dir, eval_size=6, eval_k=2, max_new_tokens=4, precision="fp32")
    config.output_dir = str(tmp_path)
    _, held_out = arithmetic_rows(config.seed, config.eval_size, config.difficulty)
    gold = dict(zip(held_out["prompt"], held_out["answer"]))
    wrong_questions = set(held_out["prompt"][1::2])

    def fake_generate(model, tokenizer, task, questions, n, config, device, greedy_first=False, **kwargs):
        texts = []
        for q in questions:
            value = int(gold[q]) + 1 if q in wrong_questions else int(gold[q])
            right_samples = 2 if q in wrong_questions else 1
            samples = [f"<answer>\n{gold[q]}\n</answer>"] * right_samples + ["no answer"] * (2 - right_samples)
            texts += [f"<answer>\n{value}\n</answer>", *samples]
        ids = torch.ones(len(texts), 2, dtype=torch.long)
        return Completions(ids[:0], ids[:0], ids, ids.bool(), texts)  # no prompt is read

    monkeypatch.setattr(evaluation, "generate", fake_generate)
    task = load_task(config, train_size=config.prompts_per_step)
    found = []
    dist = Distributed.start("cpu")
    evaluation.evaluate(torch.nn.Linear(1, 1), None, task, config, dist, seed=0, greedy_answers=found)
    write_held_out_answers(SimpleNamespace(config=config, task=task), found)
    rows = [json.loads(x) for x in (tmp_path / "held-out-answers.jsonl").read_text().splitlines()]
    assert [r["problem"] for r in rows] == list(range(6))
    for r, question in zip(rows, held_out["prompt"]):
        wrong = question in wrong_questions
        assert r["answer"] == float(gold[question]) + wrong  # the built-in task votes on the number
        assert (r["correct"], r["samples_right"]) == ((False, 2) if wrong else (True, 1))


@pytest.mark.parametrize("collapsed", [True, False], ids=["one-answer", "varied"])
def test_every_evaluation_counts_distinct_greedy_answers_and_warns_of_one_answer(
    tiny_model_dir, monkeypatch, capsys, collapsed
):
    """Eight held-out problems whose greedy answers are 7, 7, 7, 7, 7, 3, 9 and none (collapsed: five of eight, over
    half) or 7, 7, 3, 9, 4, 5, 6 and none: the distinct answers (an unanswered problem is not one), the top answer's
    share of all eight with its interval, the mean length of every completion decoded, and a warning naming the
    answer only where it passes half."""
    from trainer.distributed import Distributed
    from trainer.intervals import metric_intervals
    from trainer.task import load_task

    config = TrainConfig(model=tiny_model_dir, eval_size=8, eval_k=2, max_new_tokens=4, precision="fp32")
    greedy = ([7] * 5 + [3, 9]) if collapsed else [7, 7, 3, 9, 4, 5, 6]
    texts_of = [f"<answer>\n{a}\n</answer>" for a in greedy] + ["I do not know"]

    def fake_generate(model, tokenizer, task, questions, n, config, device, greedy_first=False, **kwargs):
        texts, lengths = [], []
        for q in questions:
            i = task.held_out["prompt"].index(q)
            texts += [texts_of[i], "<answer>\n1\n</answer>", "none"]
            lengths += [1 + i % 4, 2, 3]  # completions of 1 to 4 tokens, then 2 and 3
        mask = torch.arange(4) < torch.tensor(lengths)[:, None]
        return Completions(mask[:0].long(), mask[:0].long(), mask.long(), mask, texts)

    monkeypatch.setattr(evaluation, "generate", fake_generate)
    task = load_task(config, train_size=config.prompts_per_step)
    result = evaluation.evaluate(torch.nn.Linear(1, 1), None, task, config, Distributed.start("cpu"), seed=0)
    assert result["distinct_answers"] == (3 if collapsed else 6)
    assert result["top_answer_share"] == (5 / 8 if collapsed else 2 / 8)
    lengths = [1 + i % 4 for i in range(8)] + [2, 3] * 8
    assert result["mean_completion_tokens"] == pytest.approx(sum(lengths) / 24)
    intervals = metric_intervals(result, 8)
    assert "top_answer_share" in intervals and not {"distinct_answers", "mean_completion_tokens"} & set(intervals)
    warned = capsys.readouterr().err
    assert ("the greedy answer 7.0 was given to 62% of the 8 held-out problems" in warned) == collapsed


def test_pass_at_k_is_the_share_of_k_sample_subsets_holding_a_right_one():
    """The unbiased estimate against counting: of every way to pick k of n samples (c of them right), the share
    that holds a right one; the k reported: powers of two below n, then n."""
    from itertools import combinations

    for n in range(1, 7):
        for right in range(n + 1):
            samples = [True] * right + [False] * (n - right)
            for k in range(1, n + 1):
                subsets = list(combinations(samples, k))
                counted = sum(any(s) for s in subsets) / len(subsets)
                assert evaluation.pass_at(n, right, k) == pytest.approx(counted, abs=1e-12), (n, right, k)
    assert evaluation.pass_ks(16) == (1, 2, 4, 8, 16) and evaluation.pass_ks(6) == (1, 2, 4, 6)
    assert evaluation.pass_ks(1) == (1,) and evaluation.pass_ks(0) == ()


def test_every_evaluation_reports_pass_at_k_to_eval_k_and_the_reasoning_share(tiny_model_dir, monkeypatch):
    """Three held-out problems with 4 samples each, 0, 1 and 3 of them right: pass@1, pass@2 and pass@4 are the
    means of each problem's unbiased estimate (by hand: pass@2 of 1 right in 4 is 1/2, of 3 right 1); the reasoning
    share counts the completions writing at least 10 words besides their answer block, and its tags are not words."""
    from trainer.distributed import Distributed
    from trainer.task import load_task

    config = TrainConfig(model=tiny_model_dir, eval_size=3, eval_k=4, max_new_tokens=4, precision="fp32")
    right_samples = [0, 1, 3]
    steps = "<reasoning>\nFirst add 2 and 3 to get 5, then take 1 away: 4 is left.\n</reasoning>\n"  # 15 words
    short = "<reasoning>\nThe answer is 4.\n</reasoning>\n"  # 4 words

    def fake_generate(model, tokenizer, task, questions, n, config, device, greedy_first=False, **kwargs):
        assert n == 5 and greedy_first
        texts = []
        for q in questions:
            gold = task.held_out["answer"][task.held_out["prompt"].index(q)]
            right = right_samples[task.held_out["prompt"].index(q)]
            samples = [f"<answer>{gold}</answer>"] * right + ["<answer>\nnot a number\n</answer>"] * (4 - right)
            texts += [steps + f"<answer>\n{gold}\n</answer>", *(short + s for s in samples)]
        mask = torch.ones(len(texts), 4, dtype=torch.bool)
        return Completions(mask[:0].long(), mask[:0].long(), mask.long(), mask, texts)

    monkeypatch.setattr(evaluation, "generate", fake_generate)
    task = load_task(config, train_size=config.prompts_per_step)
    result = evaluation.evaluate(torch.nn.Linear(1, 1), None, task, config, Distributed.start("cpu"), seed=0)
    assert result["accuracy"] == 1.0
    assert result["pass@1"] == pytest.approx((0 + 1 / 4 + 3 / 4) / 3)
    assert result["pass@2"] == pytest.approx((0 + 1 / 2 + 1) / 3)
    assert result["pass@4"] == pytest.approx(2 / 3) and "pass@3" not in result
    assert result["reasoning_share"] == pytest.approx(1 / 5)  # the greedy completion of each problem, of five
    assert result["mean_reasoning_words"] == pytest.approx((15 + 4 * 4) / 5)


def test_the_reasoning_is_what_a_completion_writes_besides_its_answer():
    from trainer.task import outside_answer

    assert outside_answer("<think>a b</think>\n<answer>\nc d e\n</answer>").split() == ["a", "b"]
    assert outside_answer("7 + 5 = 12\n\nso 12").split() == ["7", "+", "5", "=", "12"]  # the last line: the answer
    assert outside_answer("12").split() == []
