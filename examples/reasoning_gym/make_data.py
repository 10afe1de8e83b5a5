"""A task of reasoning-gym's as JSONL files for ``gtpo-train``: its questions as chat prompts (a system turn, one
worked example of the same task, the question), each row carrying reasoning-gym's own entry for its scorer.

    python examples/reasoning_gym/make_data.py --task chain_sum --out data/chain_sum [--train 2000 --test 64]
        [--config '{"min_terms": 2, "max_terms": 2}'] [--recipe answer|reasoning]

Two recipes (docs/tasks.md): ``answer`` (the default), whose worked example reasons "The answer is X." and which
48 new tokens hold; ``reasoning``, whose system turn asks for the working step by step and whose worked example
shows it (`workings.working`: reasoning-gym's own chain of thought, or steps written from the entry), for
completions of 192-256 new tokens (``examples/reasoning_gym/reasoning.yaml`` holds the recipe's settings).

writes ``OUT/train.jsonl`` and ``OUT/test.jsonl`` (generated offline: reasoning-gym draws its problems from a seed;
the test rows from another seed than the training rows and the example, and no test question is a training one).
Train on them with ``examples/reasoning_gym/reward.py`` (see docs/tasks.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import reasoning_gym

sys.path.insert(0, str(Path(__file__).resolve().parent))  # workings.py beside this file, run as a script or loaded
from workings import working  # noqa: E402

SYSTEM_PROMPTS = {
    "answer": (
        "Answer the question. Respond in the following format:\n"
        "<reasoning>\nshort reasoning\n</reasoning>\n<answer>\nthe answer only\n</answer>"
    ),
    "reasoning": (
        "Solve the problem step by step. Respond in the following format:\n"
        "<reasoning>\nyour working, one step a line\n</reasoning>\n<answer>\nthe answer only\n</answer>"
    ),
}
SYSTEM_PROMPT = SYSTEM_PROMPTS["answer"]
TRAIN_SEED, TEST_SEED, EXAMPLE_SEED = 1, 2, 3


def worked_example(task: str, config: dict, recipe: str = "answer") -> list:
    """One problem of the task and its answer in the asked-for layout, as two chat turns: reasoning "The answer is
    X." (recipe ``answer``) or the working step by step (``reasoning``)."""
    entry = next(iter(reasoning_gym.create_dataset(task, size=1, seed=EXAMPLE_SEED, **config)))
    reasoning = working(task, entry) if recipe == "reasoning" else f"The answer is {entry['answer']}."
    answer = f"<reasoning>\n{reasoning}\n</reasoning>\n<answer>\n{entry['answer']}\n</answer>"
    return [{"role": "user", "content": entry["question"]}, {"role": "assistant", "content": answer}]


def rows(
    task: str,
    size: int,
    seed: int,
    config: dict,
    example: list,
    exclude=frozenset(),
    distinct=False,
    system_prompt: str = SYSTEM_PROMPT,
) -> list:
    out, seen = [], set()
    for entry in reasoning_gym.create_dataset(task, size=size, seed=seed, **config):
        if entry["question"] in exclude or entry["question"] == example[0]["content"]:
            continue
        if distinct and entry["question"] in seen:  # a held-out question twice would count twice
            continue
        seen.add(entry["question"])
        question = {"role": "user", "content": entry["question"]}
        prompt = [{"role": "system", "content": system_prompt}, *example, question]
        # The entry as JSON text: its metadata differs from task to task, which a column of one type cannot hold.
        out.append({"prompt": prompt, "answer": str(entry["answer"]), "entry": json.dumps(entry, default=str)})
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="chain_sum", help="a reasoning-gym dataset name")
    p.add_argument("--config", default="{}", help="the dataset's settings, as JSON")
    p.add_argument("--train", type=int, default=2000)
    p.add_argument("--test", type=int, default=64)
    p.add_argument("--out", required=True)
    p.add_argument(
        "--recipe",
        choices=sorted(SYSTEM_PROMPTS),
        default="answer",
        help="answer: a worked example that reasons 'The answer is X.'; reasoning: one that shows its steps",
    )
    args = p.parse_args(argv)
    config = json.loads(args.config)
    try:
        example = worked_example(args.task, config, args.recipe)
    except ValueError as exc:  # a task the reasoning recipe has no working for
        p.error(str(exc))
    system = SYSTEM_PROMPTS[args.recipe]
    test = rows(args.task, args.test, TEST_SEED, config, example, distinct=True, system_prompt=system)
    held = {r["prompt"][-1]["content"] for r in test}
    # reasoning-gym draws entry i of seed s from seed s + i, so the training seed's stream is the test seed's shifted
    # by one: its first --test entries are (nearly all) held-out questions, dropped. Draw past them, keep --train.
    draws = args.train + args.test + 1
    train = rows(args.task, draws, TRAIN_SEED, config, example, exclude=held, system_prompt=system)[: args.train]
    if len(train) < args.train:
        print(f"{args.task}: only {len(train)} training questions of {draws} draws are not held out or the example")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, split in (("train", train), ("test", test)):
        with open(out / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in split)
    print(f"{args.task}: {len(train)} training rows, {len(test)} test rows in {out}")


if __name__ == "__main__":
    main()
