"""Peak memory of one gtpo-train step for each way of holding the weights: full float32, bf16 weights (with float32
master weights, and plain bf16 AdamW), LoRA, LoRA + ``--beta`` (and full float32 + ``--beta``, whose reference is a
frozen copy), for the built-in model and a 0.5B-class model built from Qwen2-0.5B's configuration with random
weights (no download).

    python -m bench trainer_memory [--models default qwen2-0.5b-random] [--settings ...] [--out FILE]

Each (model, setting) runs in a process of its own: the session is loaded as ``gtpo-train`` loads it
(`trainer.session.load_session`), then one step's work on a fixed synthetic batch (prompts and completions of
random token ids): the old log-probs and initial entropy, the reference log-probs under ``--beta``, and the
update with its optimiser step (the first, which allocates AdamW's moments). Reported: the resident set after
loading, and the kernel's high-water mark of the resident set during the step (VmHWM, reset before it): the
peak, not the largest buffer; glibc returns each freed allocation above 64 KiB at once, so the resident set follows
the live tensors. The sampling is left out: it runs without gradients and holds less than the update.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SETTINGS = {
    "fp32": dict(),
    "fp32 + beta": dict(beta=0.04),
    "bf16 (fp32 master)": dict(model_dtype="bf16"),
    "bf16 (plain AdamW)": dict(model_dtype="bf16", master_weights=False),
    "LoRA r=16": dict(lora_r=16),
    "LoRA r=16 + beta": dict(lora_r=16, beta=0.04),
}
# Qwen2-0.5B's published configuration (494M parameters, the embedding tied to the head).
QWEN2_05B = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
BATCH = dict(prompts=2, group_size=2, prompt_tokens=128, completion_tokens=48)


def synthetic_batch(vocab: int, device):
    """A `trainer.rollout.Rollout` of ``BATCH``'s shape: random ids, every position kept, advantages of +-1."""
    import torch

    from gtpo_kernels import conflict_weights
    from trainer.rollout import Completions, Rollout

    g = torch.Generator().manual_seed(0)
    b, n = BATCH["prompts"], BATCH["prompts"] * BATCH["group_size"]
    completions = Completions(
        prompt_ids=torch.randint(0, vocab, (b, BATCH["prompt_tokens"]), generator=g).to(device),
        prompt_mask=torch.ones(b, BATCH["prompt_tokens"], dtype=torch.long, device=device),
        completion_ids=torch.randint(0, vocab, (n, BATCH["completion_tokens"]), generator=g).to(device),
        completion_mask=torch.ones(n, BATCH["completion_tokens"], dtype=torch.bool, device=device),
        texts=[""] * n,
    )
    advantages = torch.tensor([1.0, -1.0] * (n // 2), device=device)
    ids, mask = completions.completion_ids, completions.completion_mask
    conflict = conflict_weights(ids, mask, advantages, BATCH["group_size"])
    return Rollout(completions, BATCH["group_size"], advantages, conflict=conflict)


def one(model: str, setting: str) -> dict:
    """In this process: load the session, run one step's work, return the figures."""
    import torch

    from bench.common import MEMORY_MMAP_THRESHOLD, ResidentPeak, mmap_threshold, status_bytes
    from trainer.adapters import reference_weights
    from trainer.config import TrainConfig
    from trainer.distributed import Distributed
    from trainer.session import load_session
    from trainer.task import load_task
    from trainer.update import token_stats, update

    config = TrainConfig(
        model=model,
        prompts_per_step=BATCH["prompts"],
        group_size=BATCH["group_size"],
        max_new_tokens=BATCH["completion_tokens"],
        precision="fp32",
        output_dir=tempfile.mkdtemp(),
        **SETTINGS[setting],
    )
    dist = Distributed(0, 1, torch.device("cpu"))
    # glibc hands every allocation above 64 KiB back to the system when it is freed: the resident set then follows
    # the live tensors, instead of keeping freed heap pages that a later setting may or may not reuse.
    mmap_threshold(MEMORY_MMAP_THRESHOLD)
    t0 = time.time()
    session = load_session(config, dist, load_task(config, train_size=16))
    loaded = status_bytes("VmRSS")
    params = sum(p.numel() for p in session.model.parameters())
    trainable = sum(p.numel() for p in session.model.parameters() if p.requires_grad)
    batch = synthetic_batch(min(session.tokenizer.vocab_size, session.model.config.vocab_size), dist.device)
    t1 = time.time()
    with ResidentPeak() as peak:  # the kernel's high-water mark, reset here: the step's own peak
        _, entropy = token_stats(session.model, batch, config, session.head)
        if config.beta:
            with reference_weights(session.model, session.reference) as reference:
                batch.ref_logprobs, _ = token_stats(reference, batch, config, session.head)
        initial_entropy = float(entropy.mean())
        policy, optimizer = session.policy, session.optimizer
        result = update(policy, optimizer, batch, config, dist, initial_entropy)
    return {
        "model": model,
        "setting": setting,
        "params": params,
        "trainable": trainable,
        "loaded_gib": loaded / 2**30,
        "peak_gib": peak.peak / 2**30,
        "peak_exact": peak.exact,
        "load_s": t1 - t0,
        "step_s": time.time() - t1,
        "stepped": bool(result.stepped),
        "kl": None if result.metrics.kl is None else float(result.metrics.kl),
    }


def random_qwen(folder: Path) -> str:
    """Qwen2-0.5B's architecture with random weights, with the built-in model's tokenizer (the synthetic batch's ids
    stay within both vocabularies)."""
    import torch
    import transformers

    from trainer.model import default_model_path

    if not (folder / "config.json").exists():
        torch.manual_seed(0)
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**QWEN2_05B))
        model.save_pretrained(folder)
        transformers.AutoTokenizer.from_pretrained(default_model_path()).save_pretrained(folder)
    return str(folder)


def table(rows: list) -> str:
    lines = [
        "| model | setting | parameters | trained | after loading (GiB) | step peak (GiB) | step (s) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['setting']} | failed: {r['error'][:120]} | | | | |")
            continue
        lines.append(
            f"| {r['label']} | {r['setting']} | {r['params'] / 1e6:.0f}M | {r['trainable'] / 1e6:.2f}M | "
            f"{r['loaded_gib']:.2f} | {r['peak_gib']:.2f} | {r['step_s']:.1f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench trainer_memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["default", "qwen2-0.5b-random"])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--out", default=str(ROOT / "bench/results/local/trainer-memory-cpu.md"))
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "SETTING"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(one(*args.one)), flush=True)
        return
    from trainer.config import DEFAULT_MODEL

    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.models:
            model = DEFAULT_MODEL if name == "default" else random_qwen(Path(scratch) / "qwen")
            for setting in args.settings:
                env = dict(os.environ, PYTHONPATH=str(ROOT))
                proc = subprocess.run(
                    [sys.executable, "-m", "bench", "trainer_memory", "--one", model, setting],
                    capture_output=True,
                    text=True,
                    env=env,
                    cwd=ROOT,
                )
                found = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
                row = json.loads(found[0][7:]) if found else {"error": proc.stderr.strip().splitlines()[-1:]}
                row.update(model=model, setting=setting, label=name)
                if "error" in row:
                    row["error"] = str(row["error"])
                rows.append(row)
                print(json.dumps(row), flush=True)
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    text = (
        f"# Peak memory of one gtpo-train step\n\n"
        f"`python -m bench trainer_memory` on {cpu}, {os.cpu_count()} CPUs, "
        f"{time.strftime('%Y-%m-%d')}. Batch: {BATCH['prompts']} prompts x {BATCH['group_size']} completions, "
        f"{BATCH['prompt_tokens']} prompt and {BATCH['completion_tokens']} completion tokens (synthetic ids), "
        f"float32 compute (--precision fp32). Resident set (CPU): after loading, and the kernel's high-water mark "
        f"during the step (old log-probs, reference log-probs under beta, the update and AdamW's first step).\n\n"
        + table(rows)
        + "\n"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
