"""One trainer update from a fixed rollout batch, on however many processes torchrun starts (or one), for
tests/test_trainer_distributed.py: ``python tests/distributed_update.py MODEL_DIR OUT_FILE [--fsdp]``.

Every process builds the same batch (4 prompt groups of 3, fixed seed) and keeps its share of the groups,
as the trainer does; process 0 writes the updated parameters and the step's loss to OUT_FILE."""

import gc
import sys

import torch
import transformers

from gtpo_kernels import compute_advantages, conflict_weights
from trainer.config import TrainConfig
from trainer.distributed import Distributed, full_parameters, full_state, wrap
from trainer.optimizer import PolicyOptimizer
from trainer.rollout import Completions, Rollout
from trainer.update import PolicyLoss, token_stats, update


def fixed_batch(vocab: int, groups: int = 4, group_size: int = 3, prompt_len: int = 5, length: int = 6):
    g = torch.Generator().manual_seed(0)
    n = groups * group_size
    completion_ids = torch.randint(4, vocab, (n, length), generator=g)
    completion_ids[1::group_size, :2] = completion_ids[0::group_size, :2]  # shared prefixes: conflict tokens
    lengths = torch.randint(2, length + 1, (n,), generator=g)
    prompt_mask = torch.ones(groups, prompt_len, dtype=torch.long)
    prompt_mask[1, :2] = 0  # left padding
    rewards = torch.tensor([1.0, 0.0, 0.5] * groups)
    advantages = compute_advantages(rewards, group_size)
    completion_mask = torch.arange(length)[None] < lengths[:, None]
    prompt_ids = torch.randint(4, vocab, (groups, prompt_len), generator=g)
    completions = Completions(prompt_ids, prompt_mask, completion_ids, completion_mask, texts=[""] * n)
    conflict = conflict_weights(completion_ids, completion_mask, advantages, group_size)
    return Rollout(completions, group_size, advantages, conflict=conflict)


def share(batch: Rollout, rank: int, world: int, group_size: int) -> Rollout:
    groups = batch.prompts // world
    g0, g1 = rank * groups, (rank + 1) * groups
    rows = slice(g0 * group_size, g1 * group_size)
    c = batch.completions
    completions = Completions(
        c.prompt_ids[g0:g1], c.prompt_mask[g0:g1], c.completion_ids[rows], c.completion_mask[rows], c.texts[rows]
    )
    conflict = tuple(t[rows] for t in batch.conflict)
    return Rollout(completions, group_size, batch.advantages[rows], conflict=conflict)


def main(model_dir: str, out_file: str, fsdp: bool) -> None:
    dist = Distributed.start("cpu")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = TrainConfig(
        model=model_dir,
        group_size=3,
        prompts_per_step=4,
        temperature=0.7,
        num_iterations=2,
        learning_rate=1e-4,
        precision="fp32",
        grad_accum_steps=2 // dist.world if dist.world <= 2 else 1,
        fsdp=fsdp,
    )
    batch = share(fixed_batch(model.config.vocab_size), dist.rank, dist.world, config.group_size)
    policy = wrap(PolicyLoss(model), model.get_decoder().layers, dist, fsdp)
    # The trainer's optimiser at a training-sized rate (Adam's normalisation turns the rounding of gradient
    # entries near 0 into updates of up to 1e-3 lr whatever their size).
    optimizer = PolicyOptimizer(policy.parameters(), config, dist.device, master=False)
    gradients = {}  # the whole gradient the optimiser steps with (FSDP2's shards gathered), by parameter name

    def keep_gradients(optimizer, args, kwargs):
        for name, p in policy.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            gradients[name.removeprefix("module.")] = g.detach().clone()

    optimizer.adamw.register_step_pre_hook(keep_gradients)
    with full_parameters(policy):
        batch.old_logprobs, _ = token_stats(model, batch, config)
    result = update(policy, optimizer, batch, config, dist, initial_entropy=5.0)
    model_state, _ = full_state(policy, None)
    if dist.is_main:
        torch.save(
            {
                "params": model_state,
                "gradients": gradients,
                "grad_norm": result.grad_norm,
                "loss": result.loss,
                "metrics": result.metrics.to_dict(),
            },
            out_file,
        )
    dist.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], "--fsdp" in sys.argv[3:])
    gc.collect()  # FSDP2's cycles that hold the process group, before the interpreter's exit (as gtpo-train's main)
