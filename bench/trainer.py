"""One training step of ``gtpo-train`` against one of TRL's ``GRPOTrainer`` on the same work, side by side.

    python -m bench trainer [--precision fp32|bf16] [--steps 2] [--prompts 8 --group-size 4 --max-new-tokens 48]

Both load the built-in SmolLM2-135M-Instruct, take the same first prompts of the built-in arithmetic stream
(``--seed``'s), asked in the same chat (system prompt, worked examples), sample ``--group-size`` completions of
at most ``--max-new-tokens`` tokens each at temperature 1, score them with the same two rewards and take one
AdamW step at the same learning rate, in the same precision (``bf16``: autocast, as both trainers run it), with
the same threads. TRL runs as its defaults for this work have it (``beta = 0``: no reference model; its
"dapo" loss; prompts repeated ``G`` times for ``model.generate``); ``gtpo-train`` runs its default loss (GTPO,
``paper`` preset) and its own sampler. Each trainer runs ``--steps`` steps in a process of its own; the table
reports the last (the first also warms the allocator and oneDNN's kernels, and ``gtpo-train``'s first step
measures the initial entropy).

Parts: *sampling* is the decoding (``gtpo-train``'s sampler; TRL's ``_generate``); *scoring* the rewards and
advantages (the rest of the rollout; TRL: its ``_prepare_inputs`` less generation, which also tokenises); *the
update* the loss's forward and backward over the batch and the optimiser step (what remains of the step); for
``gtpo-train`` also split into the decoder's forward (prompts and completions to the last hidden states), the fused
loss (``hidden @ lm_head``, statistics, objective and its gradients, all in its forward) and the rest (the decoder's
backward, clipping, AdamW).
Tokens per second count the completions' tokens (up to and including each EOS).

``--against PATH`` also runs another checkout's step (its code, this harness), after this one's; with
``--against-first`` before it. One run in each order is a before/after comparison that a drifting clock
favours neither way.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from bench import common

ROOT = Path(__file__).resolve().parents[1]


def _timed(owner, name: str, totals: dict, key: str, results: Optional[list] = None):
    """Wraps ``owner.name`` so that each call adds its wall time to ``totals[key]`` (and its result to ``results``,
    if given); returns what undoes it."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            result = inner(*args, **kwargs)
            if results is not None:
                results.append(result)
            return result
        finally:
            totals[key] = totals.get(key, 0.0) + time.perf_counter() - start

    setattr(owner, name, wrapper)
    return lambda: setattr(owner, name, inner)


def run_config(args):
    """The `TrainConfig` both trainers' work is read from: ``gtpo-train``'s defaults with the bench's sizes, so
    TRL gets the same chat, rewards, temperature, learning rate and problems whatever those defaults become."""
    from trainer.config import TrainConfig

    return TrainConfig(
        prompts_per_step=args.prompts,
        group_size=args.group_size,
        max_new_tokens=args.max_new_tokens,
        precision=args.precision,
        steps=args.steps,
        seed=args.seed,
        device="cpu",
        model=args.model or TrainConfig.model,
        output_dir=tempfile.mkdtemp(prefix="bench-trainer-"),
        eval_size=1,
    )


def task_and_process(config):
    """``config``'s task (the built-in one: its rows, prompts and rewards) and the one process the bench runs as."""
    from trainer.distributed import Distributed
    from trainer.task import load_task

    return load_task(config, train_size=config.steps * config.prompts_per_step), Distributed.start("cpu")


def ours(args) -> list:
    """``gtpo-train``'s steps, as its run takes them (`trainer.train.train_step`), each step's parts and, for the
    roofline, the work of each phase and the bare matrix products' rate on its shapes (`phase_work`, `bare_rates`)."""
    from trainer import rollout, train, update
    from trainer.checkpoint import RunState
    from trainer.session import load_session

    config = run_config(args)
    task, dist = task_and_process(config)
    session = load_session(config, dist, task)
    state, steps, totals, batches = RunState(), [], {}, []
    # The rollout's sampling (the rest of it scores them); in the update, the decoder's forward (to the hidden
    # states) and the fused loss (its forward computes the gradients too; its backward hands them on).
    undoes = [
        _timed(rollout, "generate", totals, "sampling", batches),
        _timed(update, "completion_hidden_states", totals, "decoder_forward"),
        _timed(update, "fused_linear_gtpo_loss", totals, "loss"),
    ]
    try:
        for step in range(args.steps):
            totals.clear()
            row = train.train_step(session, state, step)
            steps.append(
                {
                    "step": row["time_step"],
                    "sampling": totals["sampling"],
                    "scoring": row["time_generation"] - totals["sampling"],
                    "update": row["time_old_logprobs"] + row["time_update"],
                    "decoder_forward": totals["decoder_forward"],
                    "loss": totals["loss"],
                    "completion_tokens": row["completion_length"] * args.prompts * args.group_size,
                    "reward": row["reward"],
                    "work": phase_work(session.model, batches[-1]),
                }
            )
    finally:
        for undo in undoes:
            undo()
    if getattr(args, "roofline", False):
        from trainer.precision import autocast

        with autocast(config, dist.device):
            rates = bare_rates(session.model, batches[-1])
        for step in steps:
            step["bare_gflops"] = rates
    return steps


def model_sizes(model) -> dict:
    """The decoder layers' matrix shapes ``[(in, out), ...]`` (every Linear but the head) and the head's."""
    from gtpo_kernels.hf.model_config import linear_head, unwrap

    base = unwrap(model)
    head = linear_head(base)
    layers = [
        (m.in_features, m.out_features) for m in base.modules() if isinstance(m, torch.nn.Linear) and m is not head
    ]
    return {"layers": layers, "head": (head.in_features, head.out_features)}


def phase_work(model, batch) -> dict:
    """GFLOP of each phase's matrix products for ``batch`` (a rollout's `trainer.rollout.Completions`), attention's
    products left out: the prompt pass runs the shared prefix once and each prompt's own tokens once (the padded
    width), decoding one token per row and step; the update's decoder forward the same prompts plus every completion
    position, its backward twice that; the fused loss the head's product forward and both of its gradients."""
    from gtpo_kernels.hf import prefix_run_once

    sizes = model_sizes(model)
    layer_params = sum(i * o for i, o in sizes["layers"])
    hidden, vocab = sizes["head"]
    prompts, width = batch.prompt_ids.shape
    rows, length = batch.completion_ids.shape
    prefix = prefix_run_once(model, batch.prompt_ids, batch.prompt_mask)
    prompt_tokens = prefix + prompts * (width - prefix)
    decode_tokens = rows * (length - 1)  # the first token comes from the prompt pass
    forward = 2 * layer_params * (prompt_tokens + rows * length)
    return {
        "sampling": (
            2 * layer_params * (prompt_tokens + decode_tokens) + 2 * hidden * vocab * (prompts + decode_tokens)
        )
        / 1e9,
        "decoder_forward": forward / 1e9,
        "loss": 6 * hidden * vocab * rows * length / 1e9,
        "backward": 2 * forward / 1e9,
        "prompt_tokens": prompt_tokens,
        "shared_prefix": prefix,
        "update_tokens": prompt_tokens + rows * length,
    }


def bare_rate(shapes, rows: int, repeats: int = 3) -> float:
    """GFLOP/s of plain ``F.linear`` products of ``rows`` rows through each ``(in, out)`` of ``shapes`` in turn (the
    best of ``repeats``, after a warm-up), in the caller's autocast."""
    weights = [torch.randn(o, i) for i, o in shapes]
    inputs = {i: torch.randn(rows, i) for i, _ in shapes}
    flops = sum(2 * rows * i * o for i, o in shapes)
    best = float("inf")
    for attempt in range(repeats + 1):
        started = time.perf_counter()
        for (i, _), w in zip(shapes, weights):
            torch.nn.functional.linear(inputs[i], w)
        if attempt:
            best = min(best, time.perf_counter() - started)
    return flops / best / 1e9


def bare_rates(model, batch) -> dict:
    """The bare products' GFLOP/s on each phase's shapes: decoding (one row a token: the batch's rows through every
    layer and the head), the update's decoder (its tokens through every layer once), the head (the completions)."""
    sizes = model_sizes(model)
    work = phase_work(model, batch)
    rows, length = batch.completion_ids.shape
    update_rows = min(work["update_tokens"], 4096)  # as many rows as the update runs (capped: a rate, not a step)
    decoder = bare_rate(sizes["layers"], update_rows)
    return {
        "sampling": bare_rate(sizes["layers"] + [sizes["head"]], rows),
        "decoder_forward": decoder,
        "loss": bare_rate([sizes["head"]], rows * length),
        "backward": decoder,
    }


def trl_steps(args) -> list:
    """TRL's ``GRPOTrainer`` on the same prompts, rewards and settings; each step's parts."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from trainer.model import default_model_path
    from trainer.session import step_rows

    config = run_config(args)
    path = args.model or default_model_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    task, dist = task_and_process(config)
    # gtpo-train's prompts as conversations, step by step; TRL takes them in order (shuffle_dataset=False).
    steps = [step_rows(task.train, step, config, dist) for step in range(config.steps)]
    dataset = Dataset.from_dict(
        {
            "prompt": [task.messages(p) for rows in steps for p in rows[task.prompt_column]],
            "answer": [a for rows in steps for a in rows["answer"]],
        }
    )

    totals: dict = {}
    per_step: list = []

    class StepClock(TrainerCallback):
        """Each optimiser step's wall time and the parts timed inside it (generation, preparation)."""

        def on_step_begin(self, *args, **kwargs):
            totals.clear()
            totals["begin"] = time.perf_counter()

        def on_step_end(self, *args, **kwargs):
            per_step.append({**totals, "step": time.perf_counter() - totals["begin"]})

    trl_config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-trl-"),
        per_device_train_batch_size=args.prompts * args.group_size,
        num_generations=args.group_size,
        max_completion_length=args.max_new_tokens,
        temperature=config.temperature,
        learning_rate=config.learning_rate,
        max_steps=args.steps,
        shuffle_dataset=False,
        bf16=args.precision == "bf16",
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        seed=args.seed,
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=task.rewards,  # TRL's signature: the same functions
        args=trl_config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepClock()],
    )
    for name, key in (("_generate", "sampling"), ("_prepare_inputs", "prepare")):
        _timed(trainer, name, totals, key)
    trainer.train()
    logged = [row for row in trainer.state.log_history if "completions/mean_length" in row]
    rows = args.prompts * args.group_size
    return [
        {
            "step": parts["step"],
            "sampling": parts["sampling"],
            "scoring": parts["prepare"] - parts["sampling"],
            "update": parts["step"] - parts["prepare"],
            "completion_tokens": row["completions/mean_length"] * rows,
            "reward": row["reward"],
        }
        for parts, row in zip(per_step, logged)
    ]


def measure(which: str, args, root: Path = ROOT, argv: Optional[list] = None) -> list:
    """``which``'s steps in a process of its own (``--threads`` threads), with the code of the checkout ``root``."""
    code = (
        f"import sys, json; sys.path.insert(0, {str(root)!r}); from bench import trainer as b; "
        f"args = b.parser().parse_args({args.argv if argv is None else argv!r}); "
        f"print('RESULT ' + json.dumps(b.{which}(args)))"
    )
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{which}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def parser() -> argparse.ArgumentParser:
    from trainer.config import TrainConfig

    p = argparse.ArgumentParser(prog="python -m bench trainer", description=__doc__.splitlines()[0])
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--steps", type=int, default=2, help="steps per trainer; the table reports the last")
    p.add_argument("--prompts", type=int, default=TrainConfig.prompts_per_step, help="prompts per step (gtpo-train's)")
    p.add_argument("--group-size", type=int, default=TrainConfig.group_size, help="completions per prompt")
    p.add_argument("--max-new-tokens", type=int, default=TrainConfig.max_new_tokens, help="completion cap")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", help="a local model folder (default: the built-in SmolLM2-135M-Instruct)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--name", default=None, help="the table's file name (default trainer-cpu-PRECISION)")
    p.add_argument("--against", metavar="PATH", help="also run the step of another checkout (e.g. the last commit's)")
    p.add_argument(
        "--against-first",
        action="store_true",
        help="run --against's checkout before this one (a second run in this order evens out a drifting clock)",
    )
    p.add_argument("--no-trl", action="store_true", help="leave TRL's GRPOTrainer out (it needs the [trl] extra)")
    p.add_argument("--no-roofline", dest="roofline", action="store_false", help="no bare-product rates")
    return p


# Options of this bench that an older checkout's parser may not know: not passed to --against's run.
OWN_OPTIONS = {"--against": 1, "--against-first": 0, "--no-trl": 0, "--no-roofline": 0, "--name": 1}


def argv_for_older(argv: list) -> list:
    """``argv`` without this bench's newer options (and their values), for an older checkout's parser."""
    kept, skip = [], 0
    for arg in argv:
        if skip:
            skip -= 1
        elif arg in OWN_OPTIONS:
            skip = OWN_OPTIONS[arg]
        else:
            kept.append(arg)
    return kept


def split(step: dict) -> str:
    """The update's parts where they were timed (``gtpo-train``), else ``-``."""
    if "loss" not in step:
        return "-"
    rest = step["update"] - step["decoder_forward"] - step["loss"]
    return f"{step['decoder_forward']:.1f} / {step['loss']:.1f} / {rest:.1f}"


def table(results: dict, args) -> list:
    """The benchmark's lines: each trainer's last step and its parts, the ratio of the two steps."""
    lines = [
        f"`python -m bench trainer --precision {args.precision} --steps {args.steps}`: {args.prompts} prompts x "
        f"{args.group_size} completions of at most {args.max_new_tokens} tokens, "
        f"{args.model or 'SmolLM2-135M-Instruct'}, "
        f"{args.precision}, {args.threads} threads; step {args.steps} of {args.steps} (each trainer in its own "
        "process, one after the other).",
        "",
        "| trainer | step s | sampling s | scoring s | update s | of which decoder forward / loss / decoder backward "
        "and AdamW s | completion tokens | sampling tok/s | update tok/s | mean reward |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, steps in results.items():
        last = steps[-1]
        tokens = last["completion_tokens"]
        lines.append(
            f"| {name} | {last['step']:.1f} | {last['sampling']:.1f} | {last['scoring']:.2f} | {last['update']:.1f} "
            f"| {split(last)} | {tokens:.0f} | {tokens / last['sampling']:.0f} | {tokens / last['update']:.0f} | "
            f"{last['reward']:.2f} |"
        )
    first = "gtpo-train"  # this checkout's, whichever ran first: the ratios are its step over each other's
    for other in [name for name in results if name != first]:
        ratio = results[first][-1]["step"] / results[other][-1]["step"]
        lines.append("")
        lines.append(
            f"{first}'s step / {other}'s: **{ratio:.2f}**" + (" (goal: at most 0.12)." if "TRL" in other else ".")
        )
    if args.steps > 1:
        medians = {k: statistics.median(s["step"] for s in steps) for k, steps in results.items()}
        lines.append(
            "Every step (s): "
            + "; ".join(f"{k} " + ", ".join(f"{s['step']:.1f}" for s in v) for k, v in results.items())
            + " (medians: "
            + ", ".join(f"{k} {m:.1f}" for k, m in medians.items())
            + ")."
        )
    return lines


def roofline(steps: list) -> list:
    """The last step's phases against the bare products of their shapes, measured in the same run."""
    last = steps[-1]
    if "bare_gflops" not in last:
        return []
    work, bare = last["work"], last["bare_gflops"]
    backward = last["update"] - last["decoder_forward"] - last["loss"]  # with clipping and AdamW
    times = {"sampling": last["sampling"], "decoder_forward": last["decoder_forward"], "loss": last["loss"]}
    times["backward"] = backward
    lines = [
        "",
        f"Roofline of gtpo-train's step {len(steps)}: each phase's matrix products (attention's left out) against "
        "plain `F.linear` products of the same shapes, timed in the same process (the reachable rate). "
        f"Prompt tokens run once per batch: {work['prompt_tokens']} (a shared prefix of {work['shared_prefix']} "
        f"tokens, then each prompt's own); the update's decoder runs {work['update_tokens']} tokens.",
        "",
        "| phase | s | GFLOP | GFLOP/s | bare products GFLOP/s | share of bare |",
        "|---|---|---|---|---|---|",
    ]
    names = {
        "sampling": "sampling (prompt pass + decoding)",
        "decoder_forward": "update: decoder forward",
        "loss": "update: fused loss (forward + gradients)",
        "backward": "update: decoder backward + clip + AdamW",
    }
    for phase, name in names.items():
        rate = work[phase] / times[phase]
        lines.append(
            f"| {name} | {times[phase]:.2f} | {work[phase]:.1f} | {rate:.0f} | {bare[phase]:.0f} | "
            f"{rate / bare[phase]:.0%} |"
        )
    return lines


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    args.argv = argv
    if args.steps < 1:
        raise SystemExit("--steps must be at least 1")
    if args.against_first and not args.against:
        raise SystemExit("--against-first needs --against PATH")
    runs = [("gtpo-train", lambda: measure("ours", args))]
    if args.against:
        other = Path(args.against)
        older = argv_for_older(argv)
        runs.append((f"gtpo-train at {other.name}", lambda: measure("ours", args, root=other.resolve(), argv=older)))
        if args.against_first:
            runs.reverse()
    results = {name: run() for name, run in runs}
    if not args.no_trl:
        results["TRL GRPOTrainer"] = measure("trl_steps", args)
    lines = table(results, args) + roofline(results["gtpo-train"])
    common.write_markdown(args.name or f"trainer-cpu-{args.precision}", lines)


if __name__ == "__main__":
    main()
