"""Where one update's time goes: ``gtpo-train``'s update on one rollout of the default's shapes, the completions
through our grouped attention ("auto", gtpo_kernels/hf/llama_layers.py) and through transformers' forward on a
repeated cache ("model", what a model `grouped_pass_issue` refuses takes), alternated on the same rollout in one
process, then one update of each under torch's profiler: the operators that took the most time, with their shapes.

    python -m bench update_profile [--precision bf16] [--max-new-tokens 48] [--repeats 3]

The updates step the optimiser (as a run does), so the weights move between them; the work's shapes do not.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
import types
from typing import Optional

from . import common

PASSES = ("model", "auto")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench update_profile", description=__doc__.splitlines()[0])
    p.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3, help="timed updates of each pass (default 3)")
    p.add_argument("--top", type=int, default=12, help="operators listed per profile (default 12)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None)
    p.add_argument("--name", default=None, help="the table's name under bench/results/local/")
    return p


def one_rollout(args):
    """A session of the default run at the bench's sizes, and the arguments of its first step's update."""
    from trainer import train
    from trainer import update as update_module
    from trainer.checkpoint import RunState
    from trainer.session import load_session

    from .trainer import run_config, task_and_process

    config = run_config(types.SimpleNamespace(**vars(args), steps=1))
    task, dist = task_and_process(config)
    session = load_session(config, dist, task)
    captured = []
    real = update_module.update

    def capture(*call, **keywords):
        captured.append((call, keywords))
        return real(*call, **keywords)

    train.update = capture
    try:
        train.train_step(session, RunState(), 0)
    finally:
        train.update = real
    return captured[-1]


def with_pass(completion_pass: str):
    """Has the trainer's update run its completions through ``completion_pass``: ``"model"`` as for a model that
    `grouped_pass_issue` refuses."""
    from gtpo_kernels.hf import llama_layers, prompt_cache

    refused = lambda model: "transformers' pass, for the comparison"  # noqa: E731
    prompt_cache.grouped_pass_issue = llama_layers.grouped_pass_issue if completion_pass == "auto" else refused


def timed_update(call) -> tuple:
    """``(seconds, minor page faults)`` of one update."""
    from trainer.update import update

    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    started = time.perf_counter()
    update(*call[0], **call[1])
    return time.perf_counter() - started, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults


def loss_and_gradient(call, completion_pass: str, bf16: bool) -> tuple:
    """``(loss, flat gradient)`` of the update's loss on its rollout, as one micro-batch, without stepping: the
    completions through ``completion_pass``, under bf16 autocast or in float32."""
    import torch

    policy, optimizer, rollout, config, dist, initial_entropy = call[0][:6]
    with_pass(completion_pass)
    mask = rollout.completions.completion_mask
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = policy(
            rollout,
            slice(0, rollout.prompts),
            config,
            initial_entropy=initial_entropy,
            num_sequences=torch.tensor(float(mask.shape[0]), dtype=torch.float64),
            num_tokens=mask.sum().double(),
        )
    out.loss.backward()
    grads = torch.cat([p.grad.flatten() for p in policy.parameters() if p.grad is not None])
    optimizer.zero_grad()
    return float(out.loss.detach()), grads


def accuracy_lines(call) -> list:
    """Each completion pass's loss and gradient on the same rollout and weights, in float32 and under bf16, against
    transformers' pass in float32."""
    reference_loss, reference = loss_and_gradient(call, "model", bf16=False)
    lines = [
        "The update's loss and gradient on this rollout (the weights after its step), against transformers' pass in "
        "float32:",
        "",
        "| completion pass | precision | loss | relative difference of the loss | gradient norm | "
        "relative difference of the gradient |",
        "|---|---|---|---|---|---|",
    ]
    for bf16 in (False, True):
        for completion_pass in PASSES:
            loss, grads = loss_and_gradient(call, completion_pass, bf16)
            loss_diff = abs(loss - reference_loss) / abs(reference_loss)
            grad_diff = float((grads - reference).norm() / reference.norm())
            lines.append(
                f"| {completion_pass} | {'bf16' if bf16 else 'fp32'} | {loss:.6g} | {loss_diff:.1e} | "
                f"{float(grads.norm()):.6g} | {grad_diff:.1e} |"
            )
    return lines + [""]


def profile_lines(call, top: int) -> list:
    """The ``top`` operators of one profiled update by their own time, with their input shapes."""
    from torch.profiler import ProfilerActivity, profile

    from trainer.update import update

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        update(*call[0], **call[1])
    events = sorted(prof.key_averages(group_by_input_shape=True), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events)
    lines = ["| operator | input shapes | calls | own s | share |", "|---|---|---|---|---|"]
    for e in events[:top]:
        shapes = str(e.input_shapes)[:90].replace("|", "/")
        seconds = e.self_cpu_time_total / 1e6
        lines.append(f"| `{e.key}` | `{shapes}` | {e.count} | {seconds:.2f} | {e.self_cpu_time_total / total:.0%} |")
    return lines + ["", f"All operators' own time: {total / 1e6:.2f} s (the profiler's overhead included)."]


def main(argv: Optional[list] = None) -> None:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    call = one_rollout(args)
    rollout = call[0][2]
    mask = rollout.completions.completion_mask
    timings = {p: [] for p in PASSES}
    for _ in range(args.repeats):
        for completion_pass in PASSES:
            with_pass(completion_pass)
            timings[completion_pass].append(timed_update(call))
    medians = {p: statistics.median(t for t, _ in timings[p]) for p in PASSES}
    lines = [
        f"`python -m bench update_profile {' '.join(sys.argv[1:] if argv is None else argv)}`: one rollout of "
        f"{args.prompts} prompts x {args.group_size} completions of at most {args.max_new_tokens} tokens "
        f"({int(mask.sum())} completion tokens, prompts {rollout.completions.prompt_ids.shape[1]} positions wide), "
        f"{args.precision}; its update run {args.repeats} times with each completion pass, alternated.",
        "",
        "| completion pass | update s, each | median s | minor page faults, each |",
        "|---|---|---|---|",
    ]
    for p in PASSES:
        each = ", ".join(f"{t:.2f}" for t, _ in timings[p])
        faults = ", ".join(str(f) for _, f in timings[p])
        lines.append(f"| {p} | {each} | {medians[p]:.2f} | {faults} |")
    lines += ["", f"auto / model, medians: **{medians['auto'] / medians['model']:.2f}**.", ""]
    lines += accuracy_lines(call)
    for p in PASSES:
        with_pass(p)
        lines += [f"Profile of one update, completion pass `{p}`:", ""] + profile_lines(call, args.top) + [""]
    common.write_markdown(args.name or f"update-profile-cpu-{args.precision}", lines)


if __name__ == "__main__":
    main()
