"""gtpo-train for real models, on tiny random ones: LoRA (only the adapters train and are saved; --merge-lora),
--beta's KL to the starting policy, bf16 weights with float32 master weights, checkpoint-STEP folders that
from_pretrained loads, a resume equal to the uninterrupted run, tampered checkpoints refused without running their
code, and a soft-capped head (Gemma 2) trained through the fused loss."""

import json
import math
import pickle
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("datasets")

from tests.test_trainer import tiny_config, train_rows  # noqa: E402
from trainer import train as train_module  # noqa: E402
from trainer.config import ConfigError, TrainConfig  # noqa: E402
from trainer.optimizer import PolicyOptimizer  # noqa: E402

LORA = dict(lora_r=4, learning_rate=2e-2, steps=4, save_every=2)


def needs_peft():
    return pytest.importorskip("peft")


def weights(folder):
    from safetensors.torch import load_file

    return load_file(Path(folder) / "model.safetensors")


def test_lora_trains_and_saves_only_the_adapters(tiny_model_dir, tmp_path):
    """The base weights stay as loaded, the adapters move, AdamW holds the adapters' moments only; final/ is an
    adapter that peft loads onto the base model, and final/merged (--merge-lora) is a plain model whose logits are
    the adapted model's."""
    peft = needs_peft()
    out = tmp_path / "lora"
    train_module.run(tiny_config(tiny_model_dir, out, merge_lora=True, **LORA))
    final = out / "final"
    assert (final / "adapter_config.json").exists() and not (final / "model.safetensors").exists()
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    adapted = peft.PeftModel.from_pretrained(base, final).eval()
    lora_b = [p for n, p in adapted.named_parameters() if "lora_B" in n]
    assert lora_b and all(float(p.abs().max()) > 0 for p in lora_b)  # initialised at 0: they moved
    original = weights(tiny_model_dir)
    in_base = adapted.get_base_model().state_dict()
    for name, value in original.items():  # LoRA's targets keep their weight as base_layer.weight
        key = name if name in in_base else name.replace(".weight", ".base_layer.weight")
        assert torch.equal(in_base[key], value), name
    merged = transformers.AutoModelForCausalLM.from_pretrained(final / "merged").eval()
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()  # peft adapted the first in place
    ids = torch.tensor([[5, 9, 14, 30, 7]])
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(merged(input_ids=ids).logits, base(input_ids=ids).logits, atol=1e-4)
    state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
    from safetensors.torch import load_file

    moments = {k for k in load_file(out / "checkpoint-4" / "optimizer.safetensors") if k.endswith("/exp_avg")}
    assert len(moments) == len(lora_b) * 2  # lora_A and lora_B of each adapted module, nothing else
    assert state["config"]["lora_r"] == 4


def test_lora_resume_reproduces_the_uninterrupted_run(tiny_model_dir, tmp_path):
    """Stopped after step 2 (its checkpoint) and resumed: the log equals the straight run's, row for row."""
    needs_peft()
    straight = tmp_path / "straight"
    train_module.run(tiny_config(tiny_model_dir, straight, **LORA))
    cut = tmp_path / "cut"
    train_module.run(tiny_config(tiny_model_dir, cut, **{**LORA, "steps": 2}))
    # The cut run's final evaluation (step 2) is not the straight run's: drop it, as a stop mid-run would have.
    train_module.run(tiny_config(tiny_model_dir, cut, resume=True, **LORA))
    assert [r for r in train_rows(cut) if r["kind"] == "train"] == [
        r for r in train_rows(straight) if r["kind"] == "train"
    ]


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_beta_logs_the_kl_to_the_starting_policy(tiny_model_dir, tmp_path, lora):
    """--beta: each step logs the k3 KL of the policy to its starting point: 0 at the first step (nothing has moved
    yet), positive once the weights moved; the reference stays the start (its KL grows over the run)."""
    if lora:
        needs_peft()
    settings = dict(LORA if lora else dict(steps=4, learning_rate=2e-2), beta=0.1, save_every=0)
    train_module.run(tiny_config(tiny_model_dir, tmp_path, **settings))
    rows = [r for r in train_rows(tmp_path) if r["kind"] == "train"]
    kl = [r["kl"] for r in rows]
    assert abs(kl[0]) < 1e-6, kl
    assert all(math.isfinite(k) for k in kl) and kl[-1] > 1e-5, kl


def test_full_training_checkpoint_loads_with_from_pretrained_and_resumes_exactly(tiny_model_dir, tmp_path):
    """checkpoint-STEP/ holds a model from_pretrained loads, equal to the final model at the last step; a resume from
    step 2 gives the straight run's log; --save-total-limit 1 leaves the newest checkpoint only."""
    straight = tmp_path / "straight"
    settings = dict(steps=4, save_every=2, save_total_limit=1)
    train_module.run(tiny_config(tiny_model_dir, straight, **settings))
    assert sorted(p.name for p in straight.glob("checkpoint-*")) == ["checkpoint-4"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(straight / "checkpoint-4")
    final = weights(straight / "final")
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in final.items())
    assert transformers.AutoTokenizer.from_pretrained(straight / "checkpoint-4").eos_token == "<|im_end|>"
    cut = tmp_path / "cut"
    train_module.run(tiny_config(tiny_model_dir, cut, **{**settings, "steps": 2}))
    train_module.run(tiny_config(tiny_model_dir, cut, resume=True, **settings))
    assert [r for r in train_rows(cut) if r["kind"] == "train"] == [
        r for r in train_rows(straight) if r["kind"] == "train"
    ]
    assert torch.equal(
        torch.cat([v.flatten() for v in weights(cut / "final").values()]),
        torch.cat([v.flatten() for v in final.values()]),
    )


class Payload:
    """A pickle that writes a marker file when unpickled: what a tampered checkpoint could run."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "ran"))


@pytest.fixture(scope="module")
def saved_run(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("saved")
    train_module.run(tiny_config(tiny_model_dir, out, steps=2, save_every=2))
    return out


@pytest.mark.parametrize("tamper", ["pickled optimizer", "pickled weights", "cut weights", "bad state", "old pickle"])
def test_a_tampered_checkpoint_is_refused_without_running_its_code(tiny_model_dir, saved_run, tmp_path, tamper):
    """Each tampering stops --resume with one error naming the file, before any step; no pickle is ever opened."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(saved_run, out)
    folder = out / "checkpoint-2"
    marker = tmp_path / "marker"
    evil = pickle.dumps(Payload(marker))
    if tamper == "pickled optimizer":
        (folder / "optimizer.safetensors").write_bytes(evil)
        expected = "could not read .*checkpoint-2/optimizer.safetensors"
    elif tamper == "pickled weights":
        (folder / "pytorch_model.bin").write_bytes(evil)
        expected = r"checkpoint-2 holds pickled files \(pytorch_model.bin\)"
    elif tamper == "cut weights":
        data = (folder / "model.safetensors").read_bytes()
        (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
        expected = "could not read .*checkpoint-2/model.safetensors"
    elif tamper == "bad state":
        (folder / "trainer_state.json").write_text('{"format": 1, "state": ')
        expected = "could not read .*checkpoint-2/trainer_state.json"
    else:
        shutil.rmtree(folder)
        (out / "checkpoint.pt").write_bytes(evil)
        expected = r"checkpoint.pt is an older trainer's checkpoint, a pickle"
    rows_before = (out / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match=expected):
        train_module.run(tiny_config(tiny_model_dir, out, steps=4, save_every=2, resume=True))
    assert not marker.exists()
    assert (out / "metrics.jsonl").read_text() == rows_before


def test_master_weights_keep_updates_a_bf16_weight_cannot_hold():
    """An update of 1e-4 of a weight of 1 is below bf16's resolution there (2**-8): plain bf16 AdamW leaves the
    weight where it was, the float32 master copy accumulates 50 of them and the weight follows it."""
    config = TrainConfig(learning_rate=1e-4)
    moved = {}
    for master in (False, True):
        p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
        optimizer = PolicyOptimizer([p], config, torch.device("cpu"), master=master)
        for _ in range(50):
            p.grad = torch.full_like(p, -1.0)  # Adam's step: lr, whatever the gradient's size
            optimizer.clip_and_step(max_norm=1e9)
        moved[master] = float(p.detach().float().mean()) - 1.0
        if master:
            assert abs(float(optimizer.master[0].mean()) - 1.0 - 50e-4) < 1e-5
    assert moved[False] == 0.0
    assert abs(moved[True] - 50e-4) <= 2**-8  # the bf16 weight nearest the float32 one


def test_bf16_weights_train_and_resume_exactly(tiny_model_dir, tmp_path):
    """--model-dtype bf16 (master weights): the run trains, its checkpoint holds the float32 master weights, and a
    resume from step 2 gives the straight run's log."""
    settings = dict(steps=4, save_every=2, model_dtype="bf16", precision="fp32", learning_rate=1e-2)
    straight = tmp_path / "straight"
    train_module.run(tiny_config(tiny_model_dir, straight, **settings))
    assert weights(straight / "final")["model.norm.weight"].dtype == torch.bfloat16
    from safetensors.torch import load_file

    master = [k for k in load_file(straight / "checkpoint-4" / "optimizer.safetensors") if k.startswith("master/")]
    assert master
    cut = tmp_path / "cut"
    train_module.run(tiny_config(tiny_model_dir, cut, **{**settings, "steps": 2}))
    train_module.run(tiny_config(tiny_model_dir, cut, resume=True, **settings))
    assert [r for r in train_rows(cut) if r["kind"] == "train"] == [
        r for r in train_rows(straight) if r["kind"] == "train"
    ]


@pytest.fixture(scope="module")
def tiny_gemma2_dir(tiny_model_dir, tmp_path_factory):
    """A 2-layer Gemma-2-style model (final logits soft-capped at 2: the cap changes every logit) with the tiny
    character tokenizer."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    config = transformers.Gemma2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        final_logit_softcapping=2.0,
        sliding_window=16,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(config)
    path = tmp_path_factory.mktemp("gemma2")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_a_soft_capped_head_trains_through_the_fused_loss(tiny_gemma2_dir, tmp_path):
    """The fused loss on a Gemma-2-style model equals the loss on the model's own (soft-capped) logits, value and
    gradient, on one rollout batch; and gtpo-train runs on it."""
    from trainer import rollout, session, update
    from trainer.task import load_task

    config = tiny_config(tiny_gemma2_dir, tmp_path / "g", algo="grpo", steps=2, save_every=0)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_gemma2_dir, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_gemma2_dir)
    head = session.check_head(model, config)
    assert head is not None and head.softcap == 2.0
    torch.manual_seed(0)
    task = load_task(config, train_size=16)
    completions = rollout.generate(model, tokenizer, task, ["1+2?", "3+4?"], 3, config, torch.device("cpu"))
    batch = rollout.Rollout(completions, 3, torch.tensor([1.0, -1.0, 0.5, -0.5, 1.0, -1.0]))
    results = []
    for fused in (True, False):
        cfg = tiny_config(tiny_gemma2_dir, tmp_path / "g", algo="grpo", fused_linear=fused)
        model.zero_grad()
        out = update.PolicyLoss(model, head if fused else None)(
            batch, slice(0, 2), cfg, initial_entropy=1.0,
            num_sequences=None, num_tokens=None,
        )  # fmt: skip
        out.loss.backward()
        results.append((out.loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-6)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    summary = train_module.run(config)
    assert summary["steps"] == 2
    assert all(math.isfinite(r["loss"]) for r in train_rows(tmp_path / "g") if r["kind"] == "train")


def test_a_model_the_fused_loss_cannot_take_is_one_line(tiny_gemma2_dir, tmp_path, capsys):
    """A head with two logit transforms: gtpo-train stops with one line naming the model and why, no traceback."""
    import shutil

    folder = tmp_path / "two-transforms"
    shutil.copytree(tiny_gemma2_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "logit_scale": 2.0}))
    with pytest.raises(SystemExit) as exit_info:
        train_module.main(["--model", str(folder), "--output-dir", str(tmp_path / "out"), "--steps", "1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("gtpo-train: error:")]
    assert len(errors) == 1 and "two-transforms" in errors[0] and "several logit transforms" in errors[0], err
    assert "Traceback" not in "\n".join(err)
