"""GTPOTrainer under a real two-process launch (torchrun, gloo on the CPU), every prompt group spread across the
two processes (``num_generations`` 6, 3 completions per process), TRL's top-entropy token mask on (its threshold a
quantile over both processes' tokens): one training step of
``GTPOTrainer(from_grpo_config(args))`` moves the weights exactly as TRL's own ``GRPOTrainer`` under the same
launch does, with DDP. (TRL's FSDP2 configuration cannot run on CPUs: accelerate enables FSDP only for
accelerator devices, its MULTI_CPU type takes no FSDP plugin, and the run silently falls back to DDP; the
script checks sharding so that the same test serves on a GPU machine.)"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")

ROOT = Path(__file__).resolve().parents[1]


def launch(model_dir, out, which, fsdp):
    from .test_trainer_distributed import free_port

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    cmd += ["tests/trl_two_processes.py", model_dir, str(out), which] + (["--fsdp"] if fsdp else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return [torch.load(f"{out}.{name}", weights_only=False) for name in which.split(",")]


@pytest.mark.parametrize("fsdp", [False], ids=["ddp"])
def test_two_processes_train_as_grpo_trainer(tiny_model_dir, tmp_path, fsdp):
    import transformers

    before = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    theirs, ours = launch(tiny_model_dir, tmp_path / "step.pt", "grpo,gtpo", fsdp)
    assert ours["sharded"] == theirs["sharded"] == fsdp
    moved = 0
    for name, start in before.items():
        if name not in theirs["params"]:
            continue
        step_theirs = theirs["params"][name] - start  # -lr x the gradient (SGD, no clipping)
        step_ours = ours["params"][name] - start
        scale = float(step_theirs.abs().max())
        torch.testing.assert_close(step_ours, step_theirs, rtol=1e-4, atol=1e-4 * scale + 1e-9, msg=name)
        moved += scale > 0
    assert moved > 5  # the step moved the weights (the rewards differ within groups)
