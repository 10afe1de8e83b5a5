"""The held-out rows a saved model answers wrong: ``python -m gtpo_train.offline.answers RUN/final [--out FILE]``.

The run's final evaluation again (its ``config.json`` beside the model folder: the same task, rows, prompts,
rewards, precision and batches, so the same greedy answers as its summary's accuracy where the machine and thread
count are the same), then each greedy answer its accuracy reward does not score 1, in full, and how many of them
write each operation (``+ - * /``): a model that learned one worked example's wording for every problem of the
built-in task shows there (results/README.md).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path
from typing import List, Optional, Tuple

from ..config import ConfigError, TrainConfig
from ..distributed import Distributed
from ..evaluation import evaluate
from ..model import load_model_and_tokenizer
from ..task import load_task

_OPERATION = re.compile(r"\d\s*([-+*/x×])\s*\d")


def operation(completion: str) -> str:
    """The first operation between two numbers that ``completion`` writes (``x`` and ``×`` read as ``*``), or
    ``none``."""
    match = _OPERATION.search(completion)
    return "none" if match is None else {"x": "*", "×": "*"}.get(match.group(1), match.group(1))


def wrong_answers(model_dir: str, config: TrainConfig) -> Tuple[dict, List[tuple]]:
    """``(metrics, wrong)``: the held-out metrics of the model in ``model_dir`` as the run's final evaluation
    measures them, and its wrong greedy answers as ``(prompt, reference answer or "-", completion)``."""
    dist = Distributed.start(config.device)
    task = load_task(config, train_size=config.prompts_per_step)
    model, tokenizer = load_model_and_tokenizer(model_dir, dist.device)
    if config.max_prompt_length is not None:
        task.drop_long_prompts(tokenizer, config.max_prompt_length)
    answers: List[dict] = []
    metrics = evaluate(model, tokenizer, task, config, dist, seed=config.steps, greedy_answers=answers)
    reference = next((c for c in ("answer", "solution") if c in task.held_out.column_names), None)
    wrong = [
        (_text(a[task.prompt_column]), a[reference] if reference else "-", a["completion"])
        for a in answers
        if not a["correct"]
    ]
    return metrics, wrong


def _text(prompt) -> str:
    return prompt if isinstance(prompt, str) else prompt[-1]["content"]


def report(model_dir: str, config: TrainConfig, metrics: dict, wrong: List[tuple]) -> str:
    """Markdown: the metrics, the operations the wrong answers write, and each wrong answer."""
    ops = Counter(operation(text) for _, _, text in wrong)
    lines = [
        f"# Wrong greedy answers of `{model_dir}`",
        "",
        f"{config.eval_size} held-out rows (`{config.dataset}`), precision "
        f"{config.precision}: " + ", ".join(f"{k} {v:.3f}" for k, v in metrics.items()) + ".",
        "",
        f"**{len(wrong)} wrong**; the operation their reasoning writes: "
        + (", ".join(f"`{op}` {n}" for op, n in ops.most_common()) or "-")
        + ".",
        "",
        "| prompt | answer | greedy completion |",
        "|---|---|---|",
    ]
    for question, gold, text in wrong:
        lines.append(f"| {question} | {gold} | `{text.strip()}` |".replace("\n", "\\n"))
    return "\n".join(lines) + "\n"


def main(argv: Optional[list] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m gtpo_train.offline.answers", description=__doc__)
    p.add_argument("model", help="a saved model folder (a run's final/), or the built-in model's name")
    p.add_argument("--config", help="the run's config.json (default: the one beside the model folder)")
    p.add_argument("--precision", choices=["auto", "bf16", "fp32"], help="override the run's precision")
    p.add_argument("--out", help="write the markdown report here (it is printed either way)")
    args = p.parse_args(argv)
    config_path = Path(args.config) if args.config else Path(args.model).parent / "config.json"
    try:
        config = TrainConfig.from_file(str(config_path)) if config_path.exists() else TrainConfig()
        if args.precision:
            config = TrainConfig(**{**config.to_dict(), "precision": args.precision})
        metrics, wrong = wrong_answers(args.model, config)
    except ConfigError as exc:
        print(f"gtpo_train.offline.answers: error: {exc}", file=sys.stderr)
        sys.exit(2)
    text = report(args.model, config, metrics, wrong)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
