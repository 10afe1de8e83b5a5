"""One TRL training step on however many processes torchrun starts, for tests/test_trl_distributed.py:
``python tests/trl_two_processes.py MODEL_DIR OUT_FILE {grpo,gtpo} [--fsdp]``.

Each process holds 3 completions of a group of 6 (``num_generations`` larger than the per-device batch, so that
every prompt group is spread across the two processes), TRL generates them (seeded: both runs sample the same),
and one SGD step is taken, whose parameter change is the gradient. ``grpo`` trains TRL's own GRPOTrainer,
``gtpo`` GTPOTrainer with ``from_grpo_config(args)``; process 0 writes the parameters after the step (gathered
whole under FSDP2) and whether they were sharded."""

import sys

import torch
import transformers
import trl
from datasets import Dataset

from gtpo_kernels.integrations.trl import GTPOTrainer
from gtpo_kernels.integrations.trl_settings import from_grpo_config


def reward_length(completions, **kwargs):
    return [float(len(c) % 4) for c in completions]


def main(model_dir: str, out_file: str, which: str, fsdp: bool) -> None:
    extra = dict(fsdp="full_shard", fsdp_config={"fsdp_version": 2}) if fsdp else {}
    args = trl.GRPOConfig(
        output_dir=out_file + ".run",
        per_device_train_batch_size=3,
        num_generations=6,
        max_completion_length=6,
        max_steps=1,
        learning_rate=0.1,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=1e9,  # no clipping: the change is -lr times the gradient
        temperature=0.7,
        loss_type="grpo",
        top_entropy_quantile=0.7,  # the threshold a quantile over both processes' tokens (TRL's gather, ours)
        beta=0.0,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        seed=3,
        **extra,
    )
    data = Dataset.from_dict({"prompt": ["1+2?", "3+4?", "5+6?", "7+8?"]})
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    for name in which.split(","):  # one launch for both trainers: each starts from the saved model and seeds itself
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        common = dict(
            model=model, reward_funcs=[reward_length], args=args, train_dataset=data, processing_class=tokenizer
        )
        if name == "gtpo":
            trainer = GTPOTrainer(gtpo_config=from_grpo_config(args), **common)
        else:
            trainer = trl.GRPOTrainer(**common)
        trainer.train()
        sharded = any(type(p).__name__ == "DTensor" for p in trainer.model_wrapped.parameters())
        state = trainer.accelerator.get_state_dict(trainer.model_wrapped)  # whole on process 0, every process helps
        if trainer.accelerator.is_main_process:
            params = {k: v.detach().clone() for k, v in state.items()}
            torch.save({"params": params, "sharded": sharded}, f"{out_file}.{name}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], "--fsdp" in sys.argv[4:])
