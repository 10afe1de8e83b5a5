"""The trainer on several processes (torchrun, gloo on the CPU): the update from a fixed rollout batch
equals the one-process update, with DDP and with FSDP2; a short torchrun run writes one log. Also what
a training step must not do on any number of processes: build [N, L, V] logits, or move the weights
when no completion carries signal."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from trainer import train as train_module  # noqa: E402
from trainer import update as update_module  # noqa: E402
from trainer.config import TrainConfig  # noqa: E402
from trainer.distributed import Distributed  # noqa: E402
from trainer.optimizer import PolicyOptimizer  # noqa: E402

from .distributed_update import fixed_batch  # noqa: E402
from .helpers import PeakTensorMemory  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*args, processes=2, timeout=240, succeeds=True):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(processes),
        "--master_port",
        str(free_port()),
        *args,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
    assert (proc.returncode == 0) == succeeds, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp2"])
def test_two_processes_update_as_one(tiny_model_dir, tmp_path, fsdp):
    flags = ["--fsdp"] if fsdp else []
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    # The one-process baseline: the plain model (FSDP and DDP only exist across processes).
    subprocess.run(
        [sys.executable, "tests/distributed_update.py", tiny_model_dir, str(one)],
        check=True,
        cwd=ROOT,
        env=env,
        capture_output=True,
    )
    torchrun("tests/distributed_update.py", tiny_model_dir, str(two), *flags)
    a, b = torch.load(one), torch.load(two)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
    assert a["metrics"] == pytest.approx(b["metrics"], rel=1e-6)
    # The gradient the optimiser stepped with, every entry to 1e-6 of the largest (float32 sums in another order).
    assert a["gradients"].keys() == b["gradients"].keys() and a["gradients"]
    largest = max(float(g.abs().max()) for g in a["gradients"].values())
    assert largest > 0
    for name, g in a["gradients"].items():
        torch.testing.assert_close(b["gradients"][name], g, rtol=0, atol=1e-6 * largest, msg=name)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6)
    assert a["params"].keys() == b["params"].keys()
    initial = __import__("transformers").AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    updates = {
        name: (a["params"][name] - initial[name[len("model.") :]], b["params"][name] - initial[name[len("model.") :]])
        for name in a["params"]
    }
    step = max(float(one.abs().max()) for one, _ in updates.values())
    assert step > 0  # it did update
    # The two updates (after AdamW) agree to 1 % of the largest step: Adam turns the rounding of gradient entries
    # near 0 into steps of up to 1e-3 of the learning rate whatever their size, so the gradients above carry the
    # 1e-6 bar and the weights this one.
    for name, (one, two) in updates.items():
        torch.testing.assert_close(two, one, rtol=0, atol=1e-2 * step, msg=name)


def test_torchrun_training_run_writes_one_log(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    torchrun(
        "-m",
        "trainer",
        "--model",
        tiny_model_dir,
        "--output-dir",
        str(out),
        "--steps",
        "2",
        "--prompts-per-step",
        "2",
        "--group-size",
        "3",
        "--max-new-tokens",
        "6",
        "--eval-size",
        "4",
        "--eval-k",
        "2",
        "--save-every",
        "1",
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in rows] == [("eval", 0), ("train", 1), ("train", 2), ("eval", 2)]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["steps"] == 2
    assert (out / "final" / "config.json").exists() and (out / "checkpoint-2" / "trainer_state.json").exists()


def test_a_step_without_signal_leaves_weights_and_optimiser_alone(tiny_model_dir):
    """The official preset's filter with a tiny threshold drops every completion: the loss has no gradient,
    and Adam's momentum must not move the weights either."""
    model = __import__("transformers").AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    config = TrainConfig(
        model=tiny_model_dir, group_size=3, prompts_per_step=4, preset="official", entropy_threshold=1e-6
    )
    policy = update_module.PolicyLoss(model)
    dist = Distributed()
    optimizer = PolicyOptimizer(policy.parameters(), TrainConfig(learning_rate=1e-2), dist.device, master=False)
    batch = fixed_batch(model.config.vocab_size)
    # A first step with signal, so that the optimiser has momentum to lose.
    signal_config = TrainConfig(model=tiny_model_dir, group_size=3, prompts_per_step=4)
    first = update_module.update(policy, optimizer, batch, signal_config, dist, 5.0)
    assert first.stepped
    params = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {k: v.clone() for k, v in optimizer.adamw.state_dict()["state"][0].items()}
    result = update_module.update(policy, optimizer, batch, config, dist, None)
    assert not result.stepped and float(result.metrics.filtered_fraction) == 1.0
    assert float(result.metrics.signal_fraction) == 0.0
    assert all(torch.equal(v, params[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(v, moments[k]) for k, v in optimizer.adamw.state_dict()["state"][0].items())
    assert "entropy filter" in update_module.no_signal_cause(result.metrics, config.loss_config())


def test_a_training_step_builds_no_vocabulary_sized_logits(tmp_path):
    """A tiny model with V = 128000: the old log-probs and the update never hold [N, L, V] float32 logits."""
    transformers = pytest.importorskip("transformers")
    vocab = 128_000
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    train_config = TrainConfig(group_size=3, prompts_per_step=4, num_iterations=2, loss_chunk_mib=4)
    batch = fixed_batch(vocab)
    policy = update_module.PolicyLoss(model)
    optimizer = PolicyOptimizer(policy.parameters(), TrainConfig(learning_rate=1e-3), torch.device("cpu"), master=False)
    n, length = batch.completions.completion_ids.shape
    full_logits = n * length * vocab * 4
    with PeakTensorMemory() as memory:
        batch.old_logprobs, _ = update_module.token_stats(model, batch, train_config)
        update_module.update(policy, optimizer, batch, train_config, Distributed(), 5.0)
    print(
        f"V = {vocab}: full float32 logits {full_logits / 2**20:.1f} MiB; largest tensor of the step "
        f"{memory.largest / 2**20:.1f} MiB, peak of tensors alive {memory.peak / 2**20:.1f} MiB"
    )
    # The weight and its gradients (V x H) are the largest tensors; the logits come in 4 MiB chunks.
    assert memory.largest <= max(vocab * 16 * 4, 4 * 2**20) < full_logits / 4


def test_gradient_checkpointing_with_shared_prompts(tiny_model_dir):
    """Under gradient checkpointing the shared-prompt path falls back to full rows: same hidden states and
    parameter gradients, no AttributeError."""
    transformers = pytest.importorskip("transformers")
    batch = fixed_batch(101)
    results = []
    for checkpointing in (False, True):
        model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        if checkpointing:
            (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
        model.train()
        hidden, weight, _ = update_module.completion_hidden_states(model, batch.completions, slice(0, 4), 3)
        (hidden.square() * batch.completions.completion_mask[..., None]).sum().backward()
        results.append(
            (hidden.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
        )
    valid = batch.completions.completion_mask  # after a completion's end the two paths' positions differ (both unused)
    torch.testing.assert_close(results[1][0][valid], results[0][0][valid], rtol=1e-5, atol=1e-5)
    assert results[1][1].keys() == results[0][1].keys() and len(results[0][1]) > 10
    for name, grad in results[0][1].items():  # summed in another order (the prompt G times, or once)
        torch.testing.assert_close(results[1][1][name], grad, rtol=1e-4, atol=1e-4 * float(grad.abs().max()), msg=name)


def test_trainer_runs_with_gradient_checkpointing(tiny_model_dir, tmp_path):
    summary = train_module.run(
        TrainConfig(
            model=tiny_model_dir,
            output_dir=str(tmp_path),
            steps=2,
            prompts_per_step=2,
            group_size=3,
            max_new_tokens=6,
            eval_size=2,
            eval_k=0,
            gradient_checkpointing=True,
        )
    )
    assert summary["steps"] == 2


@pytest.mark.parametrize("prompts, world, accumulation", [(6, 2, 2), (2, 2, 2), (4, 2, 4)])
def test_accumulation_that_would_drop_groups_is_refused_at_start(tmp_path, monkeypatch, prompts, world, accumulation):
    """--grad-accum-steps must divide each process's groups: 6 prompts on 2 processes in 2 micro-batches
    trained on 2 of each process's 3 groups (the dropped rows still counted in the denominators); 2/2/2 and
    4/2/4 made every micro-batch empty. Refused before anything is loaded or written, in one line."""
    from trainer.config import ConfigError, TrainConfig
    from trainer.distributed import Distributed
    from trainer.train import run

    def must_not_load(*args, **kwargs):
        raise AssertionError("loaded the model before refusing the setting")

    monkeypatch.setattr("trainer.session.load_model_and_tokenizer", must_not_load)
    out = tmp_path / "run"
    config = TrainConfig(model="unused", output_dir=str(out), prompts_per_step=prompts, grad_accum_steps=accumulation)
    with pytest.raises(ConfigError, match=f"--grad-accum-steps \\({accumulation}\\) must divide each process's") as err:
        run(config, dist=Distributed(rank=0, world=world))
    assert "\n" not in str(err.value)
    assert not out.exists()


@pytest.mark.parametrize("where", ["evaluation", "step"])
def test_a_reward_failing_on_one_process_stops_every_process(tiny_model_dir, tmp_path, where):
    """The reward raises on process 1 only, in the evaluation before training or in the first step: both processes
    stop in one line each (process 1's names the function), none waits for the other until the timeout, and no
    checkpoint is written."""
    rewards = tmp_path / "rank_rewards.py"
    rewards.write_text(
        "import os\n\n"
        "def fails_on_rank_1(completions, **kwargs):\n"
        "    in_step = bool(os.environ.get('IN_STEP'))  # the first call is the evaluation before training's\n"
        "    os.environ['IN_STEP'] = '1'\n"
        f"    if os.environ['RANK'] == '1' and in_step == {where == 'step'!r}:\n"
        "        raise RuntimeError('rank 1 cannot score')\n"
        "    return [0.0] * len(completions)\n"
    )
    out = tmp_path / "run"
    # fmt: off
    proc = torchrun(
        "-m", "trainer", "--model", tiny_model_dir, "--output-dir", str(out), "--steps", "2", "--prompts-per-step",
        "2", "--group-size", "3", "--max-new-tokens", "4", "--eval-size", "2", "--eval-k", "0", "--precision", "fp32",
        "--reward", f"{rewards}:fails_on_rank_1", timeout=120, succeeds=False,
    )
    # fmt: on
    # The two processes write at once: their lines may share one line of the captured stderr.
    # (in the evaluation case the function raises on its first call only, so no row raises alone: "a batch")
    failing = (
        r"reward fails_on_rank_1 raised on (?:row 0 \('[^']*'\)|a batch of 1 rows): RuntimeError: rank 1 cannot score"
    )
    other = r"a reward function failed on another process \(its message is in that one's output\)"
    errors = re.findall(f"gtpo-train: error: ({failing}|{other})", proc.stderr)
    assert len(errors) == 2 and re.fullmatch(failing, sorted(errors)[1]), proc.stderr[-3000:]
    assert not list(out.glob("checkpoint-*"))
