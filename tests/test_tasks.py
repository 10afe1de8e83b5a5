"""`gtpo-train` on a task of the user's: their data (through ``datasets``), their prompts in TRL's two formats,
their reward functions with TRL's signature; what a bad dataset or a failing reward does. A tiny random model
(tests/conftest.py), so every figure here is about the plumbing, not about learning."""

import json
import math
import textwrap
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from trainer import train as train_module  # noqa: E402
from trainer.config import ConfigError, TrainConfig  # noqa: E402
from trainer.data import read_rows  # noqa: E402
from trainer.scoring import RewardError, combine, load_reward, score  # noqa: E402
from trainer.task import load_task  # noqa: E402

REWARDS = '''
calls = []


def length_reward(prompts, completions, completion_ids, **kwargs):
    """Longer completions score more: a signal for any model."""
    calls.append({"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **kwargs})
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [len(t) / 10 for t in texts]


def parity_reward(prompts, completions, completion_ids, target, **kwargs):
    """Needs the column 'target'; None (does not apply) on rows whose target is 'skip'; 1 or 2 (never 0: its mean
    over the rows it applies to is not its mean over all)."""
    return [None if t == "skip" else 1.0 + len(ids) % 2 for ids, t in zip(completion_ids, target)]


def broken_reward(prompts, completions, completion_ids, **kwargs):
    for p in prompts:
        if "seven" in str(p):
            raise KeyError("no such key")
    return [0.0] * len(completions)


def short_reward(completions, **kwargs):
    return [1.0] * (len(completions) - 1)


def nan_reward(completions, **kwargs):
    return [float("nan")] * len(completions)
'''

NUMBERS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]


def tiny(model_dir, out_dir, **overrides):
    values = dict(
        model=model_dir,
        output_dir=str(out_dir),
        steps=2,
        prompts_per_step=2,
        group_size=3,
        max_new_tokens=4,
        eval_size=2,
        eval_k=2,
        save_every=1,
        learning_rate=1e-3,
        precision="fp32",
    )
    values.update(overrides)
    return TrainConfig(**values)


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARDS)
    return path


def rows_of(out_dir):
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


def conversational_jsonl(path, n=8):
    with open(path, "w") as f:
        for i in range(n):
            messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Say {NUMBERS[i]}."}]
            f.write(json.dumps({"prompt": messages, "target": "skip" if i % 2 else "go", "id": i}) + "\n")
    return path


def test_a_conversational_jsonl_trains_with_a_reward_file(tiny_model_dir, tmp_path, reward_file):
    """Messages in, messages out: the rewards get the dataset's prompts as given, completions as lists of one
    assistant message, the ids up to EOS and every other column, one entry per completion; None is 'does not
    apply' (the mean of parity_reward is over the rows it applies to); each reward is logged by its name."""
    data = conversational_jsonl(tmp_path / "chat.jsonl")
    out = tmp_path / "run"
    spec = [f"{reward_file}:length_reward", f"{reward_file}:parity_reward"]
    train_module.run(tiny(tiny_model_dir, out, dataset=str(data), reward=spec, reward_weights=[1.0, 0.5]))
    import sys

    module = sys.modules["gtpo_train_reward_my_rewards"]
    first = module.calls[0]  # the evaluation before training: 2 held-out rows x (greedy + 2 samples)
    assert len(first["completions"]) == 6 and first["prompts"][0] == first["prompts"][2] != first["prompts"][3]
    assert all(c[0]["role"] == "assistant" and len(c) == 1 for c in first["completions"])
    assert first["prompts"][0][0] == {"role": "system", "content": "Be brief."}
    assert set(first) == {"prompts", "completions", "completion_ids", "target", "id"}
    train_call = module.calls[1]  # the first step: 2 prompts x 3 completions
    assert len(train_call["completions"]) == 6 and train_call["id"][:3] == [train_call["id"][0]] * 3
    for ids in train_call["completion_ids"]:
        assert all(isinstance(t, int) for t in ids) and 1 <= len(ids) <= 4
    steps = [r for r in rows_of(out) if r["kind"] == "train"]
    for step, call in zip(steps, module.calls[1:3]):  # the two steps' calls
        lengths = [len(c[0]["content"]) / 10 for c in call["completions"]]
        parity = [None if t == "skip" else 1.0 + len(ids) % 2 for ids, t in zip(call["completion_ids"], call["target"])]
        assert step["rewards/length_reward"] == pytest.approx(sum(lengths) / 6)
        applied = [p for p in parity if p is not None]
        expected_parity = sum(applied) / len(applied) if applied else None
        assert step["rewards/parity_reward"] == (pytest.approx(expected_parity) if applied else None)
        total = sum(a + 0.5 * (b or 0.0) for a, b in zip(lengths, parity)) / 6  # TRL's nansum of the weighted rewards
        assert step["reward"] == pytest.approx(total, rel=1e-6)
        assert "accuracy" not in step  # length_reward is not 0/1: no accuracy, pass@k or maj@k
    # The parity reward applied to some completions of the run, not to others: its mean is over the former.
    targets = [t for call in module.calls[1:3] for t in call["target"]]
    assert "skip" in targets and "go" in targets
    evals = [r for r in rows_of(out) if r["kind"] == "eval"]
    one_answer = {"distinct_answers", "top_answer_share", "mean_completion_tokens"}  # whatever the rewards
    one_answer |= {"reasoning_share", "mean_reasoning_words"}
    assert (
        set(evals[0])
        == {"kind", "step", "reward", "rewards/length_reward", "rewards/parity_reward", "intervals_95"} | one_answer
    )
    # Reward means and counts are not shares: no interval.
    assert set(evals[0]["intervals_95"]) == {"top_answer_share", "reasoning_share"}


def test_combine_is_trls_weighted_nansum():
    scores = torch.tensor([[1.0, float("nan")], [0.5, 2.0], [float("nan"), float("nan")]])
    assert combine(scores, [1.0, 0.5]).tolist() == [1.0, 1.5, 0.0]


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_csv_and_parquet_with_another_prompt_column_and_two_weighted_rewards(
    tiny_model_dir, tmp_path, reward_file, suffix
):
    """A string prompt in a column of another name: the user's turn in the chat template; the built-in
    correctness reward reads the 'answer' column, so it is 0/1 and gives accuracy, pass@k and maj@k."""
    ds = datasets.Dataset.from_dict(
        {"question": [f"What is {i} + 1?" for i in range(10)], "answer": [str(i + 1) for i in range(10)]}
    )
    path = tmp_path / f"data{suffix}"
    ds.to_csv(path, index=False) if suffix == ".csv" else ds.to_parquet(path)
    out = tmp_path / "run"
    config = tiny(
        tiny_model_dir,
        out,
        dataset=str(path),
        prompt_column="question",
        reward=["correctness", f"{reward_file}:length_reward"],
        reward_weights=[2.0, 0.25],
        system_prompt="Answer with a number.",
    )
    task = load_task(config)
    assert task.system_prompt == "Answer with a number." and not task.conversational
    assert len(task.train) == 8 and len(task.held_out) == 2
    assert task.messages("Q?") == [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "Q?"},
    ]
    summary = train_module.run(config)
    assert set(summary["after"]) == {
        "accuracy",
        "pass@1",
        "pass@2",
        "maj@2",
        "reward",
        "rewards/correctness_reward",
        "rewards/length_reward",
        "distinct_answers",
        "top_answer_share",
        "mean_completion_tokens",
        "reasoning_share",
        "mean_reasoning_words",
    }
    after = summary["after"]
    assert after["reward"] == pytest.approx(
        2.0 * after["rewards/correctness_reward"] + 0.25 * after["rewards/length_reward"]
    )
    assert after["accuracy"] == after["rewards/correctness_reward"]


def test_a_save_to_disk_folder_with_a_test_split(tiny_model_dir, tmp_path):
    """A DatasetDict folder: training rows from --dataset-split, held-out rows the first --eval-size of
    --eval-split (the same whatever the seed)."""
    make = lambda n, tag: datasets.Dataset.from_dict(  # noqa: E731
        {"prompt": [f"{tag} {i}: 2 + {i}?" for i in range(n)], "answer": [str(2 + i) for i in range(n)]}
    )
    folder = tmp_path / "saved"
    datasets.DatasetDict({"train": make(6, "train"), "test": make(5, "test")}).save_to_disk(folder)
    config = tiny(tiny_model_dir, tmp_path / "run", dataset=str(folder), eval_split="test", eval_size=3)
    task = load_task(config)
    assert task.held_out["prompt"] == [f"test {i}: 2 + {i}?" for i in range(3)]
    assert sorted(task.train["prompt"]) == sorted(f"train {i}: 2 + {i}?" for i in range(6))
    other_seed = load_task(
        tiny(tiny_model_dir, tmp_path / "r", dataset=str(folder), eval_split="test", eval_size=3, seed=1)
    )
    assert other_seed.held_out["prompt"][:3] == task.held_out["prompt"]
    summary = train_module.run(config)
    assert summary["eval_problems"] == 3 and summary["steps"] == 2
    # A Dataset folder (no splits) and a glob of files load too.
    make(7, "one").save_to_disk(tmp_path / "one")
    assert len(read_rows(str(tmp_path / "one"), "train")) == 7
    for i in range(2):
        make(3, f"part{i}").to_json(tmp_path / f"part{i}.jsonl")
    assert len(read_rows(str(tmp_path / "part*.jsonl"), "train")) == 6
    with pytest.raises(ConfigError, match="no split 'validation' \\(has \\['test', 'train'\\]\\)"):
        read_rows(str(folder), "validation")


def test_a_trl_reward_function_runs_unchanged(tiny_model_dir, tmp_path):
    """trl.rewards.accuracy_reward, as GRPOTrainer calls it: conversational completions, a 'solution' column, None
    where the reference does not parse; named by module:function."""
    pytest.importorskip("trl")
    pytest.importorskip("math_verify")
    from trl.rewards import accuracy_reward

    fn = load_reward("trl.rewards:accuracy_reward")
    assert fn is accuracy_reward
    path = tmp_path / "math.jsonl"
    with open(path, "w") as f:
        for i in range(6):
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"{i} + 1?"}], "solution": f"${i + 1}$"}) + "\n")
    # Its own values on completions we choose: right, wrong, and what GRPOTrainer would pass.
    right = [[{"role": "assistant", "content": "The answer is $\\boxed{2}$"}]]
    wrong = [[{"role": "assistant", "content": "The answer is $\\boxed{3}$"}]]
    values = score(
        [fn],
        prompts=["p", "p"],
        completions=right + wrong,
        completion_ids=[[1], [1]],
        columns={"solution": ["$2$", "$2$"]},
    )
    assert values[:, 0].tolist() == [1.0, 0.0]
    out = tmp_path / "run"
    summary = train_module.run(tiny(tiny_model_dir, out, dataset=str(path), reward=["trl.rewards:accuracy_reward"]))
    assert "rewards/accuracy_reward" in summary["after"] and "accuracy" in summary["after"]
    assert all("rewards/accuracy_reward" in r for r in rows_of(out) if r["kind"] == "train")


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("FILE:broken_reward", r"reward broken_reward raised on row 3 \('Say seven\.'\): KeyError: 'no such key'"),
        ("FILE:short_reward", r"reward short_reward returned 5 values for 6 completions"),
        ("FILE:nan_reward", r"reward nan_reward returned nan for row 0 .*finite number, or None"),
    ],
)
def test_a_failing_reward_stops_the_run_in_one_line_with_its_checkpoint_intact(
    tiny_model_dir, tmp_path, reward_file, capsys, spec, expected
):
    """The failing function, the row and the error, as one line (exit 2); the checkpoint of the last completed
    step is left as it was."""
    path = tmp_path / "numbers.jsonl"
    with open(path, "w") as f:
        for i in range(7):
            f.write(json.dumps({"prompt": f"Say {NUMBERS[i]}."}) + "\n")
    out = tmp_path / "run"
    base = [
        "--model", tiny_model_dir, "--output-dir", str(out), "--dataset", str(path), "--eval-size", "1",
        "--eval-k", "0", "--prompts-per-step", "2", "--group-size", "3", "--max-new-tokens", "4",
        "--precision", "fp32", "--save-every", "1", "--reward", f"{reward_file}:length_reward",
    ]  # fmt: skip
    # Two good steps first: the held-out row is 'Say seven.' or another; rows 0-5 train in a fixed order.
    train_module.main([*base, "--steps", "2"])
    saved = {p.name: p.read_bytes() for p in (out / "checkpoint-2").iterdir()}
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        train_module.main([*base, "--steps", "6", "--resume", "--reward", spec.replace("FILE", str(reward_file))])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err  # the run's progress bars, then the error
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("gtpo-train: error: reward ") and "Traceback" not in err, err
    import re

    message = errors[0]
    if "broken" in spec:  # the row is where the prompt 'Say seven.' sits in that step's batch
        assert re.search(r"reward broken_reward raised on row \d+ \('Say seven\.'\): KeyError: 'no such key'", message)
    else:
        assert re.search(expected, message), message
    # The checkpoint is the last completed step's, whole: the failing step wrote nothing.
    from trainer.checkpoint import latest_checkpoint, read_trainer_state

    steps = [r["step"] for r in rows_of(out) if r["kind"] == "train"]
    latest = latest_checkpoint(out)
    assert read_trainer_state(latest)["state"]["step"] == max(steps)
    if "broken" not in spec:  # these fail on their first call, the step after the saved one
        assert {p.name: p.read_bytes() for p in latest.iterdir()} == saved and max(steps) == 2


def test_none_means_the_reward_does_not_apply():
    values = score([lambda completions, **k: [None, 0.5]], ["a", "b"], ["x", "y"], [[1], [2]], {})
    assert math.isnan(values[0, 0]) and values[1, 0] == 0.5


def test_score_names_the_row_and_function():
    def broken(prompts, completions, completion_ids, **kwargs):
        return [1.0 / (len(c) - 3) for c in completions]

    with pytest.raises(RewardError, match=r"reward broken raised on row 1 \('b'\): ZeroDivisionError"):
        score([broken], ["a", "b"], ["xy", "xyz"], [[1], [2]], {})
    with pytest.raises(RewardError, match="returned True for row 0"):
        score([lambda completions, **k: [True]], ["a"], ["x"], [[1]], {})
    with pytest.raises(RewardError, match="returned NoneType, not a list of 1 values"):
        score([lambda completions, **k: None], ["a"], ["x"], [[1]], {})


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(prompt_column="text"), "no column 'text' (has ['prompt', 'target', 'id']): name the prompts' column"),
        (dict(reward=["FILE:parity_reward"], dataset="PLAIN"), "reward parity_reward needs the column(s) ['target']"),
        (dict(reward=["FILE:missing_fn"]), "has no function 'missing_fn'"),
        (dict(reward=["nofile.py:fn"]), "no file nofile.py"),
        (dict(reward=["no_such_module_xyz:fn"]), "cannot import no_such_module_xyz: ModuleNotFoundError"),
        (dict(reward=["oops"]), "give a built-in name (correctness, format, math_verify)"),
        (dict(reward=["FILE:length_reward"], accuracy_reward="other"), "--accuracy-reward 'other' is not one of"),
        (dict(dataset="EMPTY"), "empty.jsonl: no rows (empty file)"),
        (dict(dataset="BADPROMPT"), "row 0: column 'prompt' must hold a string or a list of chat messages"),
        (dict(chat_template=False), "--no-chat-template: the prompts are chat messages"),
        (dict(eval_split="test"), "local files hold one split, 'train'"),
        (dict(dataset="arithmetic", prompt_column="question"), "--dataset arithmetic is generated"),
        (dict(dataset="arithmetic", chat_template=False), "worked examples are chat turns; add --worked-examples 0"),
    ],
)
def test_a_bad_dataset_or_reward_stops_before_the_model_loads(
    tmp_path, reward_file, monkeypatch, capsys, overrides, message
):
    from trainer import session

    def must_not_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the dataset and rewards were checked")

    monkeypatch.setattr(session, "load_model_and_tokenizer", must_not_load)
    data = conversational_jsonl(tmp_path / "chat.jsonl")
    (tmp_path / "empty.jsonl").write_text("")
    datasets.Dataset.from_dict({"prompt": ["a"] * 5}).to_json(tmp_path / "plain.jsonl")
    (tmp_path / "badprompt.jsonl").write_text('{"prompt": ["a", "b"]}\n{"prompt": ["c"]}\n{"prompt": ["d"]}\n')
    names = {"PLAIN": "plain.jsonl", "EMPTY": "empty.jsonl", "BADPROMPT": "badprompt.jsonl"}
    dataset = overrides.pop("dataset", str(data))
    dataset = str(tmp_path / names[dataset]) if dataset in names else dataset
    reward = [r.replace("FILE", str(reward_file)) for r in overrides.pop("reward", [f"{reward_file}:length_reward"])]
    argv = ["--output-dir", str(tmp_path / "out"), "--dataset", dataset, "--eval-size", "2"]
    for spec in reward:
        argv += ["--reward", spec]
    capsys.readouterr()  # the fixtures' own output
    for key, value in overrides.items():
        flag = "--" + key.replace("_", "-")
        argv += [flag if value is not False else "--no-" + flag[2:]] + ([] if isinstance(value, bool) else [str(value)])
    with pytest.raises(SystemExit) as exit_info:
        train_module.main(argv)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines
    assert not (tmp_path / "out").exists()


def test_prompts_longer_than_the_limit_are_dropped_and_counted(tiny_model_dir, tmp_path, capsys):
    path = tmp_path / "lengths.jsonl"
    datasets.Dataset.from_dict({"prompt": ["hi"] * 6 + ["x" * 200] * 3, "answer": ["1"] * 9}).to_json(path)
    config = tiny(tiny_model_dir, tmp_path / "run", dataset=str(path), eval_size=2, max_prompt_length=120, steps=1)
    train_module.run(config)
    out = capsys.readouterr().out
    task = load_task(config)
    total = len(task.train) + len(task.held_out)
    assert total == 9
    import re

    match = re.search(r"--max-prompt-length 120: dropped (\d+) training and (\d+) held-out rows", out)
    assert match and int(match.group(1)) + int(match.group(2)) == 3, out
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    with pytest.raises(ConfigError, match="every training prompt is longer"):
        task.drop_long_prompts(tokenizer, 5)


def test_no_chat_template_puts_the_plain_text_to_the_model(tiny_model_dir, tmp_path):
    """For base models: the system prompt and the prompt as plain text, with the tokenizer's own special tokens."""
    from trainer.rollout import encode_prompts

    path = tmp_path / "plain.jsonl"
    datasets.Dataset.from_dict({"prompt": [f"{i}+1=" for i in range(5)], "answer": ["1"] * 5}).to_json(path)
    config = tiny(tiny_model_dir, tmp_path / "run", dataset=str(path), chat_template=False, system_prompt="Add.")
    task = load_task(config)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir, padding_side="left")
    assert task.prompt_text(tokenizer, "3+1=") == "Add.\n\n3+1="
    enc = encode_prompts(tokenizer, task, ["3+1="], "cpu")
    assert enc["input_ids"][0].tolist() == tokenizer("Add.\n\n3+1=")["input_ids"]
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") not in enc["input_ids"][0].tolist()
    assert train_module.run(config)["steps"] == 2


def test_reward_weights_must_match_the_rewards():
    with pytest.raises(ConfigError, match="gives 1 weight\\(s\\) for 2 --reward function\\(s\\)"):
        TrainConfig(reward=["correctness", "format"], reward_weights=[1.0])
    with pytest.raises(ConfigError, match="weighs the --reward functions"):
        TrainConfig(reward_weights=[1.0])
    with pytest.raises(ConfigError, match="finite numbers"):
        TrainConfig(reward=["format"], reward_weights=[math.inf])


def test_the_builtin_task_is_one_task_like_any_other():
    """The default: generated rows with an 'answer' column, its system prompt and worked examples, the built-in
    correctness and format rewards, accuracy from correctness and maj@k over the numbers it reads."""
    from trainer.rewards import SYSTEM_PROMPT, correctness_reward, format_reward

    task = load_task(TrainConfig(eval_size=4), train_size=8)
    assert task.rewards == [correctness_reward, format_reward] and task.weights == [1.0, 1.0]
    assert task.accuracy_reward == "correctness_reward" and task.system_prompt == SYSTEM_PROMPT
    assert len(task.examples) == 4 and task.train.column_names == ["prompt", "answer"]
    assert task.answer_key("<answer>\n1,000\n</answer>") == 1000.0
    assert list(task.greedy_rates) == ["format_rate"]


def test_rewards_of_a_file_see_the_rows_columns_as_keywords(reward_file):
    fn = load_reward(f"{reward_file}:parity_reward")
    assert fn(prompts=["a"], completions=["b"], completion_ids=[[1, 2, 3]], target=["go"]) == [2.0]
    assert textwrap.dedent(fn.__doc__).startswith("Needs the column")


def test_the_math_verify_reward_reads_solution_then_answer():
    pytest.importorskip("math_verify")
    from trainer.rewards import math_verify_reward

    completions = ["so it is $\\frac{1}{2}$", [{"role": "assistant", "content": "It is 0.5"}], "it is 3"]
    assert math_verify_reward(completions, solution=["$0.5$", "$\\frac{1}{2}$", "$2$"]) == [1.0, 1.0, 0.0]
    assert math_verify_reward(["x = 4"], answer=["4"]) == [1.0]
    assert math_verify_reward(["x = 4"], solution=["4"], answer=["5"]) == [1.0]  # solution first, as TRL's reward
    assert math_verify_reward(["x = 4"], solution=["no math here"]) == [None]  # the reference does not parse
    assert load_reward("math_verify") is math_verify_reward
