"""The benchmark harness runs end to end (tiny shapes; Triton rows under the interpreter), so it does
not rot between GPU sessions. Timings here mean nothing; the structure of the output does."""

import importlib.util
from pathlib import Path

import pytest
import torch

from bench import common, logits


def test_logits_benchmark_harness(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    rows, bandwidth = logits.run(
        torch.device("cpu"), [32], [50], [torch.float32], reps=1, with_compile=False, only=[], triton_rows=True
    )
    names = {r.impl for r in rows}
    assert {"reference-eager", "gtpo-torch", "gtpo-triton", "gtpo-triton-inplace"} <= names
    if importlib.util.find_spec("liger_kernel"):
        assert "liger-grpo" in names
    assert all(r.error is None and r.total_ms > 0 for r in rows), [r.error for r in rows]
    assert bandwidth is None  # CPU: no copy-bandwidth floor
    eager = next(r for r in rows if r.impl == "reference-eager")
    assert eager.extra["speedup vs eager"] == 1.0
    table = common.markdown_table(rows, sorted({k for r in rows for k in r.extra}))
    path = common.save("t", {"device": "cpu"}, rows, table)
    assert path.exists() and (tmp_path / "t.json").exists()


def test_fused_linear_benchmark_harness(tmp_path, monkeypatch):
    from bench import fused_linear

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    rows = fused_linear.run(
        torch.device("cpu"), [32], [40], [8], [torch.float32], reps=1, only=[], peak_tflops=1.0, gpu_rows=True
    )
    names = {r.impl for r in rows}
    assert {"materialised-torch", "fused-torch", "materialised-triton", "fused-triton"} <= names
    if importlib.util.find_spec("liger_kernel"):
        assert "liger-fused-grpo" in names
    assert all(r.error is None and r.total_ms > 0 and r.extra["TFLOP/s"] > 0 for r in rows), [r.error for r in rows]


def test_fused_linear_benchmark_rows_for_the_settings_against_collapse(tmp_path, monkeypatch):
    """--remedies: the clip-higher, old-log-prob, shift-scope, Clip-Cov and KL-Cov rows beside today's loss, each
    timed without error."""
    from bench import fused_linear

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    rows = fused_linear.run(
        torch.device("cpu"), [32], [40], [8], [torch.float32], 1, [], 1.0, gpu_rows=False, remedies=True
    )
    backend = "cpu" if common.cpu_kernels_available() else "torch"
    names = {r.impl for r in rows}
    assert {
        f"fused-{backend}+{k}" for k in ("old-logprobs", "clip-higher", "shift-scope", "clip-cov", "kl-cov")
    } <= names, names
    assert all(r.error is None and r.total_ms > 0 for r in rows), [r.error for r in rows]


@pytest.mark.cpu_kernels
def test_cpu_kernels_forward_against_a_read_runs(tmp_path, monkeypatch):
    """`--forward-only` (and the full table's "fwd / read" column, the same loop) calls the C++ forward as the
    backend exposes it: it once passed an argument the forward no longer takes, and the benchmark died after
    minutes of reference rows."""
    from bench import cpu_kernels

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    cpu_kernels.forward_only("t", tokens_scale=0.001)
    table = (tmp_path / "t.md").read_text()
    assert table.count("| gtpo-cpu forward |") == len(cpu_kernels.SHAPES)
    assert "fwd / read" in table and "in cache" in table


def test_sampler_benchmark_harness(tiny_model_dir):
    """`python -m bench sampler` end to end on the tiny model, with `--profile`: every row of its table, and the
    profiler's operators."""
    from bench import sampler

    args = sampler.parser().parse_args(
        ["--model", str(tiny_model_dir), "--prompts", "2", "--group-size", "2", "--max-new-tokens", "3"]
        + ["--repeats", "1", "--profile"]
    )
    text = "\n".join(sampler.table(sampler.measure(args), args))
    for row in ("| bare decode products", "| our decoding step |", "| the whole sampler, ours"):
        assert row in text, text
    assert "torch.profiler" in text and "aten::mm" in text


def test_layouts_benchmark_harness(tmp_path):
    """`python -m bench layouts` starts its own two processes and writes one table: every row timed, ratios to the
    padded row (tiny shapes)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, GTPO_BENCH_OUT=str(tmp_path), PYTHONPATH=str(root))
    cmd = [sys.executable, "-m", "bench", "layouts", "--device", "cpu", "--tokens", "64", "--vocab", "101"]
    proc = subprocess.run(cmd + ["--reps", "1", "--name", "t"], env=env, cwd=root, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = {r["impl"]: r for r in json.loads((tmp_path / "t.json").read_text())["rows"]}
    assert set(rows) == {"padded", "packed", "vocab-parallel", "vocab-parallel-packed"}
    assert all(r["error"] is None and r["total_ms"] > 0 for r in rows.values())
    assert rows["vocab-parallel"]["extra"]["ranks"] == 2 and rows["padded"]["extra"]["time vs padded"] == 1.0


def test_gpu_summary_says_plainly_whether_the_cuda_tests_were_green(tmp_path):
    """bench/gpu_check.sh's verdict: green only with a JUnit file, tests that ran, none failed and the step passed."""
    from bench.gpu_summary import tests_verdict

    junit = tmp_path / "tests.xml"
    assert tests_verdict(junit, False).startswith("CUDA tests: NOT GREEN: no JUnit file")

    def write(failures: int, skipped: int = 0, tests: int = 3) -> None:
        cases = "".join(
            f'<testcase classname="tests.t" name="c{i}">{"<failure/>" if i < failures else ""}</testcase>'
            for i in range(tests)
        )
        junit.write_text(
            f'<testsuites><testsuite tests="{tests}" failures="{failures}" errors="0" skipped="{skipped}">'
            f"{cases}</testsuite></testsuites>"
        )

    write(failures=1)
    verdict = tests_verdict(junit, False)
    assert verdict.startswith("CUDA tests: NOT GREEN: 2 passed, 1 failed") and "tests.t::c0" in verdict
    write(failures=0)
    assert tests_verdict(junit, False) == "CUDA tests: GREEN: 3 passed, 0 failed, 0 errors, 0 skipped"
    assert tests_verdict(junit, True).startswith("CUDA tests: NOT GREEN")  # the step itself failed
    write(failures=0, skipped=3)
    assert tests_verdict(junit, False).startswith("CUDA tests: NOT GREEN: 0 passed")  # nothing ran


def test_the_roofline_counts_each_phases_products_by_hand(tiny_model_dir):
    """The tiny Llama (hidden 32, MLP 64, 2 layers, 4 heads of 8, 2 key/value heads, vocabulary 100): per layer
    q 32x32, k 32x16, v 32x16, o 32x32, gate, up 32x64, down 64x32 = 9216 weights, 18432 for both layers; head
    32x100; a query-key pair costs 4 x 32 FLOPs a layer, 256 for both. Two prompts of 10 positions sharing 6 tokens
    run 6 + 2 x 4 = 14 tokens; the prefix's 6 attend to 21 pairs, each prompt's own 4 to 4 x 6 + 10. Completion rows
    of 5, 3 and 1 tokens (three more rows of 5): decoding runs 4 + 2 + 0 tokens a row of each kind, a row's token t
    attending to the 10 prompt positions and t more; the update (our grouped pass: a Llama) runs the rows' 24 tokens
    packed, and attention over all 6 rows x 5 positions x (10 + 5) pairs, the masked ones computed too."""
    transformers = pytest.importorskip("transformers")
    from bench import trainer as bench_trainer
    from trainer.rollout import Completions

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.config.vocab_size == 100
    prompt_ids = torch.tensor([[5, 6, 7, 8, 9, 10] + [11, 12, 13, 14], [5, 6, 7, 8, 9, 10] + [21, 22, 23, 24]])
    ids = torch.ones(6, 5, dtype=torch.long)
    mask = torch.arange(5) < torch.tensor([[5], [3], [1], [5], [5], [5]])
    batch = Completions(prompt_ids, torch.ones_like(prompt_ids), ids, mask, texts=[""] * 6)
    import gtpo_kernels.hf.prompt_cache as prompt_cache

    old = prompt_cache.MIN_SHARED_PREFIX
    prompt_cache.MIN_SHARED_PREFIX = 2  # the tiny prompts' prefix counts as shared
    try:
        work = bench_trainer.phase_work(model, batch)
        with_old = bench_trainer.phase_work(model, batch, log_prob_passes=2)
    finally:
        prompt_cache.MIN_SHARED_PREFIX = old
    assert (work["shared_prefix"], work["prompt_tokens"], work["update_tokens"]) == (6, 14, 14 + 24)
    assert work["decode_tokens"] == 4 * 4 + 2 + 0
    layers, head, pair = 18432, 3200, 256
    prompt_pairs = 21 + 2 * (4 * 6 + 10)
    decode_pairs = 4 * (11 + 12 + 13 + 14) + (11 + 12)
    update_pairs = prompt_pairs + 6 * 5 * 15
    assert work["prompt_pass"] == pytest.approx((2 * layers * 14 + pair * prompt_pairs + 2 * head * 2) / 1e9)
    assert work["decode"] == pytest.approx((2 * (layers + head) * 18 + pair * decode_pairs) / 1e9)
    forward = 2 * layers * 38 + pair * update_pairs
    assert work["decoder_forward"] == pytest.approx(forward / 1e9)
    assert work["backward"] == pytest.approx(2 * forward / 1e9)
    assert work["loss"] == pytest.approx(6 * head * (5 + 3 + 1 + 5 + 5 + 5) / 1e9)  # the tokens, not the padding
    assert work["old_logprobs"] == 0 and with_old["old_logprobs"] == pytest.approx(2 * (forward + 2 * head * 30) / 1e9)
    weights = sum(p.numel() for p in model.parameters())
    assert work["optimizer_gb"] == pytest.approx(28 * weights / 1e9)


def test_trainer_benchmark_harness(tiny_model_dir, tmp_path, monkeypatch):
    """`python -m bench trainer`'s two workers on a tiny model, one step each: the parts of a step add up to at
    most the step, the completions' tokens are what was sampled, and the table's ratio is the two steps'."""
    pytest.importorskip("trl")
    from bench import trainer as bench_trainer
    from trainer import rollout

    generate = rollout.generate
    args = bench_trainer.parser().parse_args(
        ["--model", tiny_model_dir, "--steps", "1", "--prompts", "2", "--group-size", "2", "--max-new-tokens", "4"]
    )
    results = {"gtpo-train": bench_trainer.ours(args), "TRL GRPOTrainer": bench_trainer.trl_steps(args)}
    assert rollout.generate is generate  # the timing wrapper is undone
    for steps in results.values():
        (step,) = steps
        assert step["sampling"] > 0 and step["scoring"] >= 0 and step["update"] > 0
        assert step["sampling"] + step["scoring"] + step["update"] <= step["step"] + 1e-6
        assert 4 <= step["completion_tokens"] <= 4 * 4  # 4 completions of 1 to 4 tokens
    (ours,) = results["gtpo-train"]
    assert 0 < ours["decoder_forward"] and 0 < ours["loss"] and ours["decoder_forward"] + ours["loss"] < ours["update"]
    lines = bench_trainer.table(results, args)
    ratio = results["gtpo-train"][0]["step"] / results["TRL GRPOTrainer"][0]["step"]
    assert f"gtpo-train's step / TRL GRPOTrainer's: **{ratio:.2f}**" in "\n".join(lines)
    # The roofline: every phase's rate beside the bare products of its shapes, measured in the same process.
    assert set(ours["bare_gflops"]) == set(bench_trainer.PHASES)
    assert all(rate > 0 for rate in ours["bare_gflops"].values())
    times = bench_trainer.phase_times(ours)
    assert all(t >= 0 for t in times.values()) and sum(times.values()) <= ours["sampling"] + ours["update"] + 1e-6
    shown = bench_trainer.roofline(results["gtpo-train"])
    rows = {line.split(" | ")[0][2:]: line for line in shown if line.startswith("| ") and "---" not in line}
    assert set(bench_trainer.PHASES.values()) <= set(rows)
    assert "not run" not in rows["old / reference log-probs"]  # the first step's entropy of the sampling policy
    without = bench_trainer.roofline([dict(ours, old_logprobs=0.0, work=dict(ours["work"], old_logprobs=0))])
    assert any(line.startswith("| old / reference log-probs |") and "not run" in line for line in without)
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    text = common.write_markdown("trainer-t", lines).read_text()
    assert text.startswith("# trainer-t\n") and "- cpu_bf16_units: " in text and text.endswith(lines[-1] + "\n")


def test_the_trainer_tables_ratio_is_this_checkouts_step_whichever_ran_first():
    """`--against-first` runs the other checkout first: the ratio still divides this checkout's step by the
    other's, and the option is not passed to an older checkout's parser."""
    from bench import trainer as bench_trainer

    args = bench_trainer.parser().parse_args(["--against", "/x", "--against-first", "--steps", "1"])
    step = {"sampling": 1.0, "scoring": 0.0, "update": 1.0, "completion_tokens": 10.0, "reward": 0.5}
    results = {"gtpo-train at old": [dict(step, step=4.0)], "gtpo-train": [dict(step, step=3.0)]}
    text = "\n".join(bench_trainer.table(results, args))
    assert "gtpo-train's step / gtpo-train at old's: **0.75**" in text
    kept = bench_trainer.argv_for_older(["--against", "/x", "--against-first", "--steps", "1"])
    assert kept == ["--steps", "1"]


@pytest.mark.parametrize("first", [False, True])
def test_against_first_runs_the_other_checkout_first(tmp_path, monkeypatch, first):
    """`--against PATH` measures this checkout, then PATH's; `--against-first` the other way round. Each run gets its
    own root and arguments (the older one without this bench's own options)."""
    from bench import trainer as bench_trainer

    calls = []
    step = {"step": 2.0, "sampling": 1.0, "scoring": 0.0, "update": 1.0, "completion_tokens": 10.0, "reward": 0.5}

    def measure(which, args, root=bench_trainer.ROOT, argv=None):
        calls.append((Path(root).name, argv))
        return [dict(step, work={}, bare_gflops={})]

    monkeypatch.setattr(bench_trainer, "measure", measure)
    monkeypatch.setattr(bench_trainer, "roofline", lambda steps, precision="fp32": [])
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    other = tmp_path / "old"
    argv = ["--against", str(other), "--no-trl", "--steps", "1"] + (["--against-first"] if first else [])
    bench_trainer.main(argv)
    ours = (bench_trainer.ROOT.name, None)
    theirs = ("old", ["--steps", "1"])
    assert calls == ([theirs, ours] if first else [ours, theirs])


def test_precision_auto_is_resolved_once_and_passed_to_both_checkouts(tmp_path, monkeypatch):
    """`--precision auto` takes gtpo-train's choice once, before either run, and hands both checkouts the choice
    itself (an older checkout's parser knows no ``auto``), with no second ``--precision`` left behind."""
    from bench import trainer as bench_trainer
    from trainer import precision

    calls = []
    step = {"step": 2.0, "sampling": 1.0, "scoring": 0.0, "update": 1.0, "completion_tokens": 10.0, "reward": 0.5}

    def measure(which, args, root=bench_trainer.ROOT, argv=None):
        calls.append((args.precision, list(args.argv if argv is None else argv)))
        return [dict(step, work={}, bare_gflops={})]

    monkeypatch.setattr(bench_trainer, "measure", measure)
    monkeypatch.setattr(bench_trainer, "roofline", lambda steps, precision="fp32": [])
    monkeypatch.setattr(precision, "measure_cpu", lambda: precision.PrecisionChoice(True, "timed here"))
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    bench_trainer.main(["--precision=auto", "--against", str(tmp_path / "old"), "--no-trl", "--steps", "1"])
    (ours_precision, ours_argv), (_, theirs_argv) = calls
    assert ours_precision == "bf16"
    for argv in (ours_argv, theirs_argv):
        assert [a for a in argv if a.startswith("--precision")] == ["--precision"]
        assert argv[argv.index("--precision") + 1] == "bf16"
