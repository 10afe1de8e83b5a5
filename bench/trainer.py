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


def forwards_left_out(owner, name: str, totals: dict):
    """Wraps ``owner.name`` (the old and reference log-probs) so that the decoder forwards it runs are not added to
    ``totals["decoder_forward"]`` (the update's): they are its own phase. Returns what undoes it."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        before = totals.get("decoder_forward", 0.0)
        try:
            return inner(*args, **kwargs)
        finally:
            totals["decoder_forward"] = before

    setattr(owner, name, wrapper)
    return lambda: setattr(owner, name, inner)


def log_prob_passes(config, step: int) -> int:
    """How many forward passes `trainer.train.rollout_logprobs` runs at ``step`` (from 0): the sampling policy's (its
    entropy on the first step, its log-probs with ``--num-iterations`` above 1) and the reference's (``--beta``)."""
    return int(step == 0 or config.num_iterations > 1) + int(bool(config.beta))


def run_config(args):
    """The `TrainConfig` both trainers' work is read from: ``gtpo-train``'s defaults with the bench's sizes, so
    TRL gets the same chat, rewards, temperature, learning rate and problems whatever those defaults become."""
    from trainer.config import TrainConfig

    return TrainConfig(
        prompts_per_step=args.prompts,
        group_size=args.group_size,
        max_new_tokens=args.max_new_tokens,
        precision=args.precision,
        model_dtype=getattr(args, "model_dtype", TrainConfig.model_dtype),
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
    from trainer import rollout, sampling, train, update
    from trainer.checkpoint import RunState
    from trainer.precision import uses_bf16
    from trainer.session import load_session

    config = run_config(args)
    task, dist = task_and_process(config)
    session = load_session(config, dist, task)
    state, steps, totals, batches = RunState(), [], {}, []
    # The rollout's sampling (the rest of it scores them), its prompt pass; in the update, the decoder's forward (to
    # the hidden states), the fused loss (its forward computes the gradients too; its backward hands them on) and
    # AdamW (with the gradients' clipping).
    undoes = [
        _timed(rollout, "generate", totals, "sampling", batches),
        _timed(sampling, "prompt_pass", totals, "prompt_pass"),
        _timed(update, "completion_hidden_states", totals, "decoder_forward"),
        _timed(update, "fused_linear_gtpo_loss", totals, "loss"),
        _timed(session.optimizer, "clip_and_step", totals, "optimizer"),
        forwards_left_out(train, "rollout_logprobs", totals),
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
                    "prompt_pass": totals["prompt_pass"],
                    "old_logprobs": row["time_old_logprobs"],
                    "optimizer": totals.get("optimizer", 0.0),  # no step without a learning signal
                    "completion_tokens": row["completion_length"] * args.prompts * args.group_size,
                    "reward": row["reward"],
                    "work": phase_work(session.model, batches[-1], log_prob_passes(config, step)),
                }
            )
    finally:
        for undo in undoes:
            undo()
    if getattr(args, "roofline", False):
        rates = bare_rates(session.model, batches[-1], uses_bf16(config, dist.device))
        for step in steps:
            step["bare_gflops"] = rates
    return steps


def model_sizes(model) -> dict:
    """The decoder layers' matrix shapes ``[(in, out), ...]`` (every Linear but the head), the head's, and attention's
    sizes: ``layers`` (how many), ``query_width`` (query heads x head size)."""
    from gtpo_kernels.hf.model_config import linear_head, text_config, unwrap

    base = unwrap(model)
    head = linear_head(base)
    config = text_config(base)
    linears = [m for m in base.modules() if isinstance(m, torch.nn.Linear) and m is not head]
    shapes = [(m.in_features, m.out_features) for m in linears]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return {
        "shapes": shapes,
        "head": (head.in_features, head.out_features),
        "layers": config.num_hidden_layers,
        "query_width": config.num_attention_heads * head_dim,
    }


# Each phase of a step, as the roofline names it, in the order a step runs them.
PHASES = {
    "prompt_pass": "sampling: prompt pass",
    "decode": "sampling: decoding",
    "old_logprobs": "old / reference log-probs",
    "decoder_forward": "update: decoder forward",
    "loss": "update: fused loss (forward + gradients)",
    "backward": "update: decoder backward",
    "optimizer": "update: clip + AdamW",
}


def phase_work(model, batch, log_prob_passes: int = 0) -> dict:
    """GFLOP of each phase's matrix products for ``batch`` (a rollout's `trainer.rollout.Completions`), attention's
    included (``4 x query width`` a query-key pair a layer: the scores and the weighted values, every pair a query
    attends to, padding included, none it does not): the prompt pass runs the shared prefix once and each prompt's
    own tokens once (the padded width), then the head on each prompt's last; decoding runs every row's tokens but its
    last (the first comes from the prompt pass), each through every layer and the head, attending to its prompt and
    the tokens before it; the update's decoder forward the same prompts plus the completions' positions, its
    backward twice that (where the model takes our grouped pass, `llama_layers.grouped_pass_issue`: the completions'
    tokens only, packed, and attention over every prompt and completion position of a row, the masked pairs
    computed too; else every completion position, as transformers' pass runs them); the fused loss the head's
    product forward and both of its gradients on the completions' tokens (not their padding, which it skips); the
    old/reference log-probs a decoder forward and the head for each of ``log_prob_passes``. ``optimizer_gb``: what
    AdamW reads and writes (float32 weights, gradients and both moments: 28 bytes a weight)."""
    from gtpo_kernels.hf import prefix_run_once
    from gtpo_kernels.hf.llama_layers import grouped_pass_issue

    sizes = model_sizes(model)
    layer_params = sum(i * o for i, o in sizes["shapes"])
    hidden, vocab = sizes["head"]
    pair = 4 * sizes["query_width"] * sizes["layers"]  # FLOPs of one query-key pair through every layer
    prompts, width = batch.prompt_ids.shape
    rows, length = batch.completion_ids.shape
    prefix = prefix_run_once(model, batch.prompt_ids, batch.prompt_mask)
    own = width - prefix
    prompt_tokens = prefix + prompts * own
    prompt_pairs = prefix * (prefix + 1) // 2 + prompts * (own * prefix + own * (own + 1) // 2)
    lengths = batch.completion_mask.sum(1).tolist()
    decode_tokens = sum(max(n - 1, 0) for n in lengths)
    decode_pairs = sum(width + t for n in lengths for t in range(1, n))  # token t attends to the prompt and t more
    if grouped_pass_issue(model) is None:
        update_tokens = prompt_tokens + sum(lengths)
        update_pairs = prompt_pairs + rows * length * (width + length)
    else:
        update_tokens = prompt_tokens + rows * length
        update_pairs = prompt_pairs + rows * sum(width + t + 1 for t in range(length))
    forward = 2 * layer_params * update_tokens + pair * update_pairs
    return {
        "prompt_pass": (2 * layer_params * prompt_tokens + pair * prompt_pairs + 2 * hidden * vocab * prompts) / 1e9,
        "decode": (2 * (layer_params + hidden * vocab) * decode_tokens + pair * decode_pairs) / 1e9,
        "old_logprobs": log_prob_passes * (forward + 2 * hidden * vocab * rows * length) / 1e9,
        "decoder_forward": forward / 1e9,
        "loss": 6 * hidden * vocab * sum(lengths) / 1e9,  # the fused loss skips the padding
        "backward": 2 * forward / 1e9,
        "optimizer_gb": 28 * sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e9,
        "prompt_tokens": prompt_tokens,
        "shared_prefix": prefix,
        "decode_tokens": decode_tokens,
        "update_tokens": update_tokens,
    }


def bare_rate(shapes, rows: int, dtype: torch.dtype, repeats: int = 3) -> float:
    """GFLOP/s of plain ``F.linear`` products of ``rows`` rows through each ``(in, out)`` of ``shapes`` in turn,
    weights and inputs in ``dtype`` (no autocast: the rate the machine reaches in that precision), the best of
    ``repeats`` after a warm-up."""
    weights = [torch.randn(o, i).to(dtype) for i, o in shapes]
    inputs = {i: torch.randn(rows, i).to(dtype) for i, _ in shapes}
    flops = sum(2 * rows * i * o for i, o in shapes)
    best = float("inf")
    for attempt in range(repeats + 1):
        started = time.perf_counter()
        for (i, _), w in zip(shapes, weights):
            torch.nn.functional.linear(inputs[i], w)
        if attempt:
            best = min(best, time.perf_counter() - started)
    return flops / best / 1e9


def bare_bandwidth(gigabytes: float = 1.0, repeats: int = 3) -> float:
    """GB/s of a float32 ``a + b -> out`` over ``gigabytes`` read and written (AdamW's kind of work), best of
    ``repeats``."""
    n = int(gigabytes * 1e9 / 12)
    a, b, out = torch.randn(n), torch.randn(n), torch.empty(n)
    best = float("inf")
    for attempt in range(repeats + 1):
        started = time.perf_counter()
        torch.add(a, b, out=out)
        if attempt:
            best = min(best, time.perf_counter() - started)
    return 12 * n / best / 1e9


def bare_rates(model, batch, bf16: bool) -> dict:
    """The bare products' GFLOP/s on each phase's shapes in the step's precision (bf16 weights and inputs where the
    step runs bf16 autocast): the prompt pass (its tokens through every layer), decoding (the batch's rows through
    every layer and the head), the update's decoder (its tokens through every layer once; its backward and the old
    log-probs the same), the head (the completions); AdamW's GB/s beside a plain float32 sum's."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    sizes = model_sizes(model)
    work = phase_work(model, batch)
    rows, length = batch.completion_ids.shape
    update_rows = min(work["update_tokens"], 4096)  # as many rows as the update runs (capped: a rate, not a step)
    decoder = bare_rate(sizes["shapes"], update_rows, dtype)
    return {
        "prompt_pass": bare_rate(sizes["shapes"], min(work["prompt_tokens"], 4096), dtype),
        "decode": bare_rate(sizes["shapes"] + [sizes["head"]], rows, dtype),
        "old_logprobs": decoder,
        "decoder_forward": decoder,
        "loss": bare_rate([sizes["head"]], rows * length, dtype),
        "backward": decoder,
        "optimizer": bare_bandwidth(),
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
    p.add_argument(
        "--precision",
        default="fp32",
        choices=["fp32", "bf16", "auto"],
        help="auto: gtpo-train's choice on this CPU (trainer/precision.py), made once here for every trainer",
    )
    p.add_argument(
        "--model-dtype",
        default=TrainConfig.model_dtype,
        help="this checkout's --model-dtype (TRL's model and an --against checkout keep their float32 default)",
    )
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
OWN_OPTIONS = {"--model-dtype": 1, "--against": 1, "--against-first": 0, "--no-trl": 0, "--no-roofline": 0, "--name": 1}


def without_option(argv: list, option: str) -> list:
    """``argv`` without ``option`` and its value (``--option value`` or ``--option=value``)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == option:
            skip = True
        elif not arg.startswith(option + "="):
            kept.append(arg)
    return kept


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


def phase_times(step: dict) -> dict:
    """Seconds of each of `PHASES` in one of ``gtpo-train``'s steps (the decoder's backward: what the update's
    other parts leave; the gradients' clipping is in the optimiser's, `PolicyOptimizer.clip_and_step`)."""
    times = {
        "prompt_pass": step["prompt_pass"],
        "decode": step["sampling"] - step["prompt_pass"],
        "old_logprobs": step["old_logprobs"],
        "decoder_forward": step["decoder_forward"],
        "loss": step["loss"],
        "optimizer": step["optimizer"],
    }
    times["backward"] = step["update"] - sum(times[k] for k in ("old_logprobs", "decoder_forward", "loss", "optimizer"))
    return times


def roofline(steps: list, precision: str = "fp32") -> list:
    """The last step's phases against the bare products of their shapes, in the step's precision, measured in the
    same run."""
    last = steps[-1]
    if "bare_gflops" not in last:
        return []
    work, bare, times = last["work"], last["bare_gflops"], phase_times(last)
    lines = [
        "",
        f"Roofline of gtpo-train's step {len(steps)} ({precision}): each phase's matrix products, attention's "
        "included, against plain `F.linear` products of the same shapes with weights and inputs in that precision, "
        "timed in the same process (the reachable rate). Prompt tokens run once per batch: "
        f"{work['prompt_tokens']} (a shared prefix of {work['shared_prefix']} tokens, then each prompt's own); "
        f"decoding runs {work['decode_tokens']} tokens; the update's decoder runs {work['update_tokens']} tokens. "
        "Clip + AdamW: GB/s of the 28 bytes AdamW reads and writes a weight, against a plain float32 sum's.",
        "",
        "| phase | s | GFLOP (AdamW: GB) | GFLOP/s (AdamW: GB/s) | bare, same shapes and precision | share of bare |",
        "|---|---|---|---|---|---|",
    ]
    for phase, name in PHASES.items():
        amount = work["optimizer_gb"] if phase == "optimizer" else work[phase]
        if not amount or times[phase] <= 0:
            lines.append(f"| {name} | {times[phase]:.2f} | - | - | - | not run in this step |")
            continue
        rate = amount / times[phase]
        share = rate / bare[phase]
        lines.append(f"| {name} | {times[phase]:.2f} | {amount:.1f} | {rate:.0f} | {bare[phase]:.0f} | {share:.0%} |")
    return lines


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    args.argv = argv
    if args.steps < 1:
        raise SystemExit("--steps must be at least 1")
    if args.against_first and not args.against:
        raise SystemExit("--against-first needs --against PATH")
    if args.precision == "auto":  # one choice for every trainer and checkout, so that they run the same precision
        from trainer.precision import measure_cpu

        choice = measure_cpu()
        print(f"--precision auto took {choice.name}: {choice.reason}", flush=True)
        args.precision = choice.name
        argv = without_option(argv, "--precision") + ["--precision", choice.name]
        args.argv = argv
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
    lines = table(results, args) + roofline(results["gtpo-train"], args.precision)
    common.write_markdown(args.name or f"trainer-cpu-{args.precision}", lines)


if __name__ == "__main__":
    main()
