"""The sampler against the bare matrix products of its decoding step, on the default run's work.

    python -m bench sampler [--precision fp32|bf16] [--prompts 8 --group-size 4 --max-new-tokens 48] [--compile]
    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python -m bench sampler --compile    # a cold compile, as a first run has

Loads the built-in SmolLM2-135M-Instruct (or ``--model``), takes the first step's prompts of the built-in task and
times, in one process and one after the other (the best of ``--repeats``):

- *bare decode products*: ``F.linear`` of the step's rows (prompts x group size) through every linear layer and the
  head, the products one decoded token needs and nothing else: the machine's reachable rate for this work;
- *our decoding step* (`trainer.decode.Decoder` on our `KVCache`, the shared prefix read once) and, for comparison,
  a step through the model's forward with transformers' own cache;
- *the whole sampler* (`trainer.sampling.sample`: prompt pass, decoding, draws, end of rows) and the same with
  transformers' cache, in tokens per second: rows x decoded positions / seconds;
- with ``--compile``, our step under ``torch.compile``: the first call (the compile) and the compiled step.

The table gives each as decoded tokens per second and as a share of the bare products' rate.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from bench import common


def parser() -> argparse.ArgumentParser:
    from trainer.config import TrainConfig

    p = argparse.ArgumentParser(prog="python -m bench sampler", description=__doc__.splitlines()[0])
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--prompts", type=int, default=TrainConfig.prompts_per_step)
    p.add_argument("--group-size", type=int, default=TrainConfig.group_size)
    p.add_argument("--max-new-tokens", type=int, default=TrainConfig.max_new_tokens)
    p.add_argument("--model", help="a local model folder (default: the built-in SmolLM2-135M-Instruct)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--no-eos",
        action="store_true",
        help="no token ends a row: every row decodes --max-new-tokens (the cost of a long completion, length fixed)",
    )
    p.add_argument("--compile", action="store_true", help="also time the step under torch.compile (minutes on a CPU)")
    p.add_argument("--name", default=None, help="the table's file name (default sampler-cpu-PRECISION)")
    p.add_argument(
        "--profile", action="store_true", help="also profile five of our decoding steps (torch.profiler's table)"
    )
    return p


def best_of(repeats: int, call) -> float:
    """The fastest of ``repeats`` timings of ``call()`` (s), after one untimed call."""
    call()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - started)
    return best


def measure(args) -> dict:
    from bench.trainer import model_sizes
    from gtpo_kernels.hf import cache_kwarg, prefix_run_once, prompt_pass
    from trainer.config import TrainConfig
    from trainer.decode import Decoder, KVCache
    from trainer.distributed import Distributed
    from trainer.model import load_model_and_tokenizer
    from trainer.rollout import encode_prompts, eos_ids
    from trainer.sampling import sample
    from trainer.session import step_rows
    from trainer.task import load_task

    torch.set_num_threads(args.threads)
    config = TrainConfig(
        prompts_per_step=args.prompts,
        group_size=args.group_size,
        eval_size=1,
        **({"model": args.model} if args.model else {}),
    )
    device = torch.device("cpu")
    model, tokenizer = load_model_and_tokenizer(config.model, device, torch.float32)
    model.eval()
    task = load_task(config, train_size=args.prompts)
    rows = step_rows(task.train, 0, config, Distributed.start("cpu"))
    enc = encode_prompts(tokenizer, task, rows[task.prompt_column], device)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    n, new = args.group_size, args.max_new_tokens
    rows_count = ids.shape[0] * n
    sizes = model_sizes(model)
    step_flops = sum(2 * rows_count * i * o for i, o in sizes["shapes"] + [sizes["head"]])
    results = {"rows": rows_count, "prompt": tuple(ids.shape), "prefix": prefix_run_once(model, ids, mask)}
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16")
    with torch.no_grad(), autocast:
        # In the run's precision itself (bf16 weights, not float32 ones that autocast would cast at every call)
        dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
        weights = [torch.randn(o, i).to(dtype) for i, o in sizes["shapes"] + [sizes["head"]]]
        inputs = {i: torch.randn(rows_count, i).to(dtype) for i, _ in sizes["shapes"] + [sizes["head"]]}
        results["bare_step_s"] = best_of(
            args.repeats, lambda: [torch.nn.functional.linear(inputs[w.shape[1]], w) for w in weights]
        )
        out, cache, attention, lengths = prompt_pass(model, ids, mask, logits_to_keep=1)
        prefix = results["prefix"]
        positions = lengths.repeat_interleave(n, 0)
        tokens = torch.randint(0, sizes["head"][1], (rows_count,))
        start = attention.shape[1] - prefix

        def ours(decoder):
            kv = KVCache.from_prompts(cache, attention, n, new, prefix)
            return lambda: decoder(kv, tokens, positions, torch.tensor([start]))

        results["ours_step_s"] = best_of(args.repeats, ours(Decoder(model)))
        if args.profile:
            results["profile"] = profile_steps(ours(Decoder(model)))
        # transformers' step: the prompts' cache repeated, one token through the model's forward
        cache_kw = cache_kwarg(model)

        def theirs():
            _, fresh, att, _ = prompt_pass(model, ids, mask, logits_to_keep=1)
            fresh.batch_repeat_interleave(n)
            att = torch.cat([att.repeat_interleave(n, 0), torch.ones(rows_count, 1, dtype=att.dtype)], 1)
            return lambda: model(
                input_ids=tokens[:, None], attention_mask=att, position_ids=positions, **{cache_kw: fresh}
            )

        step = theirs()
        results["transformers_step_s"] = best_of(args.repeats, step)
        eos = [-1] if args.no_eos else eos_ids(model, tokenizer)  # -1: no token ends a row
        for own in (True, False):

            def run(own=own):
                torch.manual_seed(0)
                return sample(
                    model, ids, mask, n, new, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, own_cache=own
                )

            seconds = best_of(1, run)
            results["sampler_own" if own else "sampler_transformers"] = {
                "s": seconds,
                "positions": run().shape[1],
            }
        if args.compile:
            # Inductor keeps compiled code on disk: a first call is a real compile only with an empty cache folder.
            folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
            results["compile_cache"] = (
                "cold (TORCHINDUCTOR_CACHE_DIR empty)"
                if folder and not any(Path(folder).iterdir())
                else "possibly warm (set TORCHINDUCTOR_CACHE_DIR to an empty folder for a cold compile)"
            )
            decoder = Decoder(model, compile=True)
            kv = KVCache.from_prompts(cache, attention, n, new, prefix)
            started = time.perf_counter()
            decoder(kv, tokens, positions, torch.tensor([start]))
            results["compile_first_call_s"] = time.perf_counter() - started
            results["compile_issue"] = decoder.compile_issue
            results["compiled_step_s"] = best_of(args.repeats, ours(decoder))
    results["step_gflop"] = step_flops / 1e9
    return results


def profile_steps(step, steps: int = 5) -> str:
    """torch.profiler's operators over ``steps`` calls of ``step`` (after one untimed call), by self time: each
    operator, then each operator and input shape."""
    from torch.profiler import ProfilerActivity, profile

    step()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(steps):
            step()
    by_op = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    by_shape = prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=15)
    return f"Five of our decoding steps under torch.profiler, by self CPU time:\n\n```\n{by_op}\n{by_shape}\n```"


def table(results: dict, args) -> list:
    rows = results["rows"]
    bare = rows / results["bare_step_s"]
    lines = [
        f"`python -m bench sampler --precision {args.precision}`: {args.prompts} prompts x {args.group_size} "
        f"completions ({rows} rows), prompts {results['prompt'][1]} positions wide with a shared prefix of "
        f"{results['prefix']} tokens, up to {args.max_new_tokens} new tokens, {args.model or 'SmolLM2-135M-Instruct'}, "
        f"{args.precision}, {args.threads} threads; best of {args.repeats} (the whole sampler: one run).",
        "",
        "| what | s | decoded tokens/s | share of the bare products' rate |",
        "|---|---|---|---|",
        f"| bare decode products (every linear layer and the head, {results['step_gflop']:.1f} GFLOP a step) | "
        f"{results['bare_step_s']:.3f} | {bare:.0f} | 100% |",
    ]
    steps = [
        ("our decoding step", "ours_step_s"),
        ("transformers' step (its cache, the model's forward)", "transformers_step_s"),
    ]
    if "compiled_step_s" in results:
        steps.append(("our step under torch.compile", "compiled_step_s"))
    for name, key in steps:
        rate = rows / results[key]
        lines.append(f"| {name} | {results[key]:.3f} | {rate:.0f} | {rate / bare:.0%} |")
    for name, key in (
        ("the whole sampler, ours", "sampler_own"),
        ("the whole sampler, transformers' cache", "sampler_transformers"),
    ):
        run = results[key]
        rate = rows * run["positions"] / run["s"]
        lines.append(
            f"| {name} ({run['positions']} positions, prompt pass and draws included) | {run['s']:.2f} | {rate:.0f} "
            f"| {rate / bare:.0%} |"
        )
    if "compile_first_call_s" in results:
        lines += [
            "",
            f"torch.compile: the first call (compiling; inductor's cache {results['compile_cache']}) took "
            f"{results['compile_first_call_s']:.0f} s"
            + (f"; it failed: {results['compile_issue']}" if results["compile_issue"] else "")
            + ". A new shape (another prompt width or row count) compiles again.",
        ]
    if "profile" in results:
        lines += ["", results["profile"]]
    return lines


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    results = measure(args)
    common.write_markdown(args.name or f"sampler-cpu-{args.precision}", table(results, args))


if __name__ == "__main__":
    main()
