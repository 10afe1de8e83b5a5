"""``python -m gtpo_train.offline.study``: a spec's mistakes in one line; a two-seed, two-variant smoke study of the
tiny model runs every cell as a plain gtpo-train run, skips finished cells, resumes a cell killed after its first
checkpoint, and reports each variant's paired difference from the baseline, seed by seed."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("yaml")

from trainer.config import ConfigError  # noqa: E402
from trainer.offline import study  # noqa: E402
from trainer.precision import Machine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def write_spec(path, model_dir, out, extra_common=(), **changes):
    spec = {
        "name": "smoke",
        "out": str(out),
        "seeds": [0, 1],
        "baseline": "grpo",
        "common": [
            "--model",
            model_dir,
            "--steps",
            "2",
            "--prompts-per-step",
            "2",
            "--group-size",
            "2",
            "--max-new-tokens",
            "4",
            "--eval-size",
            "4",
            "--eval-k",
            "2",
            "--save-every",
            "1",
            "--learning-rate",
            "1e-3",
        ],
        "tasks": {"arithmetic": []},
        "variants": {"grpo": ["--algo", "grpo"], "gtpo": ["--algo", "gtpo", "--preset", "paper"]},
    }
    spec["common"] += list(extra_common)
    spec.update(changes)
    path.write_text(json.dumps(spec))
    return path


@pytest.mark.parametrize(
    "change, message",
    [
        ({"seed": [0]}, "unknown key 'seed'"),
        ({"tasks": {}}, "'tasks' must map names"),
        ({"variants": {"a": "--algo grpo"}}, "variants.a must be a list of flags"),
        ({"baseline": "ppo"}, "baseline 'ppo' is not one of the variants"),
        ({"common": ["--seed", "3"]}, "--seed is set by the study"),
        ({"seeds": [-1]}, "'seeds' must be a list of non-negative integers"),
        (
            {"variants": {"grpo": [], "b": {"flags": [], "seed": [0]}}},
            "variants.b must be a list of flags or a mapping",
        ),
        ({"variants": {"grpo": [], "b": {"seeds": [0]}}}, "variants.b has no 'flags'"),
        ({"variants": {"grpo": [], "b": {"flags": [], "tasks": ["chess"]}}}, "variants.b.tasks must list some"),
        ({"variants": {"grpo": [], "b": {"flags": [], "against": "ppo"}}}, "variants.b.against: 'ppo' is not"),
        ({"variants": {"grpo": {"flags": [], "seeds": [0]}}}, "baseline 'grpo' must run every task and seed"),
        ({"keep_models": "no"}, "'keep_models' must be true or false"),
        ({"threads": 0}, "'threads' must be a positive integer"),
        ({"threads": True}, "'threads' must be a positive integer"),
    ],
)
def test_a_spec_mistake_is_one_line_naming_it(tmp_path, change, message):
    path = write_spec(tmp_path / "spec.json", "m", tmp_path / "out", **change)
    with pytest.raises(ConfigError, match=message):
        study.StudySpec.read(path)


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"tasks": {"letters": ["--dataset", "no/such/train.jsonl"]}},
            "cell letters/grpo: dataset 'no/such/train.jsonl': no such file or folder",
        ),
        (
            {"variants": {"grpo": ["--algo", "grpo"], "gtpo": ["--algo", "gtpo", "--temperature", "-1"]}},
            "cell arithmetic/gtpo: gtpo-train: error: --temperature must be a positive number",
        ),
        ({"common": ["--reward", "no_such_module:fn"]}, "cell arithmetic/grpo: --reward 'no_such_module:fn'"),
        (
            {"common": ["--model", "spec.json"]},
            "cell arithmetic/grpo: could not load model 'spec.json': not a folder with a config.json",
        ),
    ],
)
def test_a_cell_that_would_stop_in_its_first_second_stops_the_study_before_any_runs(
    tiny_model_dir, tmp_path, monkeypatch, capsys, change, message
):
    """A dataset that is not there, a bad value, a reward that cannot be imported or a model that is not one would
    stop every cell at once: the study says so in one line naming the cell, and runs nothing (no cell folder, no
    log)."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    spec = write_spec(tmp_path / "spec.json", tiny_model_dir, out, **change)
    with pytest.raises(SystemExit) as stopped:
        study.main([str(spec)])
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_a_failed_cell_is_listed_with_the_last_line_of_its_log(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """After the report, each failed cell with its exit status, its log and that log's last line (the trainer's
    one-line error), so that a user need not open 28 logs to see why."""
    spec = write_spec(tmp_path / "spec.json", tiny_model_dir, tmp_path / "out")

    def run_study(spec, jobs, only=None):
        cell = spec.cells()[0]
        cell.folder.parent.mkdir(parents=True)
        cell.folder.with_suffix(".log").write_text("loading\ngtpo-train: error: the reward raised on row 3\n")
        return [(cell, 2)]

    monkeypatch.setattr(study, "run_study", run_study)
    with pytest.raises(SystemExit) as stopped:
        study.main([str(spec)])
    assert stopped.value.code == 1
    err = capsys.readouterr().err
    assert "(exit 2; its log: " in err and err.rstrip().endswith("): gtpo-train: error: the reward raised on row 3")


def test_a_smoke_study_runs_resumes_and_reports_paired_differences(tiny_model_dir, tmp_path):
    out = tmp_path / "study"
    variants = {
        "grpo": ["--algo", "grpo"],
        "gtpo": ["--algo", "gtpo", "--preset", "paper"],
        # The untrained model, once: the cells themselves skip their evaluation before training.
        "base": {"flags": ["--steps", "0"], "seeds": [0], "reference": True},
    }
    spec_path = write_spec(
        tmp_path / "spec.json",
        tiny_model_dir,
        out,
        variants=variants,
        keep_models=False,
        extra_common=["--no-eval-before"],
    )
    spec = study.StudySpec.read(spec_path)
    assert [(c.variant, c.seed) for c in spec.cells()] == [
        ("grpo", 0),
        ("gtpo", 0),
        ("base", 0),
        ("grpo", 1),
        ("gtpo", 1),
    ]
    assert [c.state for c in spec.cells()] == ["new"] * 5
    assert "about ?" in "\n".join(study.dry_run(spec, 2))

    # Killed (SIGKILL: no chance to save) once its first cell has a checkpoint and no summary.
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer.offline.study", str(spec_path)], cwd=ROOT, env=env, start_new_session=True
    )
    first = spec.cells()[0]
    deadline = time.time() + 120
    while time.time() < deadline and first.state != "interrupted":
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert first.state == "interrupted", "the first cell never reached its first checkpoint"

    study.main([str(spec_path), "--jobs", "2"])
    assert [c.state for c in spec.cells()] == ["finished"] * 5
    # keep_models false: a finished cell keeps its figures and logs, not its models.
    assert not any((c.folder / "final").exists() or list(c.folder.glob("checkpoint-*")) for c in spec.cells())
    rows = [json.loads(x) for x in (spec.cells()[2].folder / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in rows] == [("eval", 0)]  # --steps 0: evaluated once, nothing trained
    for cell in spec.cells():  # each held-out problem's final greedy answer, as the summary counts them
        answers = [json.loads(x) for x in (cell.folder / "held-out-answers.jsonl").read_text().splitlines()]
        after = cell.summary()["after"]
        assert [a["problem"] for a in answers] == [0, 1, 2, 3]
        assert sum(a["correct"] for a in answers) / 4 == after["accuracy"]
        assert sum(a["samples_right"] > 0 for a in answers) / 4 == after["pass@2"]
    assert "resumed from" in first.folder.with_suffix(".log").read_text()
    steps = [
        json.loads(x)["step"]
        for x in (first.folder / "metrics.jsonl").read_text().splitlines()
        if json.loads(x)["kind"] == "train"
    ]
    assert steps == [1, 2]  # the resumed run logged each step once
    assert not any(
        json.loads(x)["kind"] == "eval" and json.loads(x)["step"] == 0
        for x in (first.folder / "metrics.jsonl").read_text().splitlines()
    )  # --no-eval-before

    # Finished cells are skipped: a second call runs nothing.
    mtimes = {c.folder: (c.folder / "summary.json").stat().st_mtime for c in spec.cells()}
    assert len(mtimes) == 5
    study.main([str(spec_path)])
    assert mtimes == {c.folder: (c.folder / "summary.json").stat().st_mtime for c in spec.cells()}
    assert "finished, took" in "\n".join(study.dry_run(spec, 1))

    # The report holds a row for every paired figure (their values are the next test's: this model scores 0).
    text = (out / "smoke.md").read_text()
    for metric in ("accuracy", "pass@2", "maj@2", "format_rate"):
        assert any(line.startswith(f"| arithmetic | gtpo | grpo | {metric} | 2 |") for line in text.splitlines())
        assert any(line.startswith(f"| arithmetic | base | 0 | 4 | {metric} |") for line in text.splitlines())
    assert not any(line.startswith("| arithmetic | base | grpo |") for line in text.splitlines())  # not paired
    assert (out / "smoke-arithmetic.png").exists()
    for metric in ("distinct_answers", "top_answer_share", "reasoning_share", "pass@1"):  # collapse and reasoning
        assert any(line.startswith(f"| arithmetic | gtpo | grpo | {metric} | 2 |") for line in text.splitlines())
    # The mechanisms' activity, from the cells' own step rows: each cell's mean over steps, the mean over seeds.
    for variant in ("grpo", "gtpo"):
        cells = [c for c in spec.cells() if c.variant == variant]
        steps = [[json.loads(x) for x in (c.folder / "metrics.jsonl").read_text().splitlines()] for c in cells]
        per_cell = [
            [sum(r[key] for r in rows if r["kind"] == "train") / 2 for rows in steps]
            for key in (
                "filtered_fraction",
                "amplified_fraction",
                "skipped_fraction",
                "clip_fraction",
                "cov_fraction",
                "signal_fraction",
            )
        ]
        row = " | ".join(f"{sum(v) / 2:.3f} ({min(v):.3f}-{max(v):.3f})" for v in per_cell)
        assert f"| arithmetic | {variant} | 2 | {row} |" in text, (variant, row)


def fake_cell(cell, after, minutes=2.0):
    """A finished run's files for ``cell``: its summary (held-out figures after training) and its log rows."""
    cell.folder.mkdir(parents=True)
    before = {k: 0.1 for k in after}
    (cell.folder / "summary.json").write_text(
        json.dumps(
            {"algo": cell.variant, "before": before, "after": after, "wall_minutes": minutes, "eval_problems": 64}
        )
    )
    rows = [{"kind": "eval", "step": 0, **before}, {"kind": "train", "step": 1, "entropy": 0.5, "reward": 0.6}]
    rows.append({"kind": "eval", "step": 1, **after})
    (cell.folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (cell.folder / "config.json").write_text(json.dumps({"seed": cell.seed, "algo": cell.variant}))


def test_the_report_pairs_each_seed_with_the_baseline(tmp_path):
    out = tmp_path / "study"
    spec = study.StudySpec.read(write_spec(tmp_path / "spec.json", "m", out, seeds=[0, 1, 2]))
    accuracy = {("grpo", 0): 0.50, ("grpo", 1): 0.60, ("grpo", 2): 0.40, ("gtpo", 0): 0.70, ("gtpo", 1): 0.65}
    for cell in spec.cells():
        if (cell.variant, cell.seed) in accuracy:  # gtpo's seed 2 has not finished: seed 2 has no pair yet
            fake_cell(cell, {"accuracy": accuracy[cell.variant, cell.seed], "format_rate": 1.0})
    text = study.report(spec)
    row = next(line for line in text.splitlines() if line.startswith("| arithmetic | gtpo | grpo | accuracy |"))
    # gtpo - grpo on seeds 0 and 1: +0.20 and +0.05, mean +0.125; seed 2 is left out (no gtpo run).
    assert "| grpo | accuracy | 2 | +0.125 |" in row and "| +0.200 +0.050 |" in row
    # t interval of two differences (+0.20, +0.05): +0.125 +- 12.706 * 0.075 / sqrt(2) * sqrt(2) = +-0.953.
    assert "[-0.828, +1.078]" in row
    assert "| arithmetic | grpo | 3 | accuracy | 0.500 |" in text  # the baseline's own mean over its three seeds
    assert "5 of 6 cells finished" in text
    assert (out / "smoke-arithmetic.png").exists()


def test_the_bootstrap_interval_holds_the_mean_and_narrows_with_agreement():
    assert study.bootstrap_interval([0.1, 0.1, 0.1]) == (pytest.approx(0.1), pytest.approx(0.1))
    low, high = study.bootstrap_interval([-0.2, 0.0, 0.2, 0.4])
    assert low < 0.1 < high and low >= -0.2 and high <= 0.4
    assert study.PairedDifference("t", "v", "b", "m", [0.05, 0.1, 0.08]).verdict() == "higher"
    assert study.PairedDifference("t", "v", "b", "m", [-0.2, 0.3, 0.1]).verdict() == "no difference detectable"
    # Two seeds one problem apart both times: an interval of zero width, and no verdict from it.
    assert study.PairedDifference("t", "v", "b", "m", [-0.004, -0.004]).verdict() == "two seeds: no verdict"
    # Four seeds that mostly agree: the bootstrap calls it, the t interval (what the verdict reads) does not.
    d = study.PairedDifference("t", "v", "b", "m", [0.10, 0.12, 0.11, -0.02])
    assert d.bootstrap[0] > 0 and d.interval[0] < 0 and d.verdict() == "no difference detectable"


def test_a_cell_run_with_other_flags_is_refused_before_anything_runs(tmp_path):
    out = tmp_path / "study"
    spec = study.StudySpec.read(write_spec(tmp_path / "spec.json", "m", out))
    cell = spec.cells()[0]
    cell.folder.mkdir(parents=True)
    (cell.folder / "study-cell.json").write_text(json.dumps({"flags": list(cell.flags)}))
    spec.check_shared_cells()  # the same flags: the cell is this spec's
    # Another spec sharing the folder, whose grpo is run at another learning rate: its cells are not this one's.
    other = study.StudySpec.read(
        write_spec(tmp_path / "other.json", "m", out, variants={"grpo": ["--algo", "grpo", "--learning-rate", "1"]})
    )
    with pytest.raises(ConfigError, match=r"runs/arithmetic/grpo/s0 was run with other flags"):
        other.check_shared_cells()
    with pytest.raises(SystemExit):
        study.main([str(tmp_path / "other.json"), "--dry-run"])


def test_only_runs_the_cells_it_names_each_with_the_specs_threads(tmp_path, monkeypatch, capsys):
    path = write_spec(tmp_path / "s.json", "m", tmp_path / "o", seeds=[0, 1, 2], threads=1)
    spec = study.StudySpec.read(path)
    ran = []
    monkeypatch.setattr(study, "run_cell", lambda cell, threads, keep: ran.append((cell.variant, cell.seed, threads)))
    study.run_study(spec, jobs=1, only="arithmetic/gtpo/s1, */grpo")
    # a pattern without a seed takes every seed; one thread, the spec's, though one job on this machine would get all
    assert sorted(ran) == [("grpo", 0, 1), ("grpo", 1, 1), ("grpo", 2, 1), ("gtpo", 1, 1)]
    ran.clear()
    study.run_study(spec, jobs=1, only="arithmetic/gtpo*")
    assert sorted(ran) == [("gtpo", 0, 1), ("gtpo", 1, 1), ("gtpo", 2, 1)]
    with pytest.raises(ConfigError, match=r"--only: 'arithmetic/ppo' names no cell"):
        study.run_study(spec, jobs=1, only="arithmetic/gtpo,arithmetic/ppo")
    ran.clear()
    with pytest.raises(SystemExit):  # from the command line: one line, before any cell is checked or run
        study.main([str(path), "--only", "arithmetic/ppo"])
    assert "--only: 'arithmetic/ppo' names no cell" in capsys.readouterr().err and not ran
    without = study.StudySpec.read(write_spec(tmp_path / "t.json", "m", tmp_path / "o"))
    ran.clear()
    study.run_study(without, jobs=1, only="*/grpo/s0")
    assert ran == [("grpo", 0, os.cpu_count())]  # no threads in the spec: the cores over the jobs


def test_only_checks_the_cells_it_names(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """A session that runs one task's cells (``--only``) needs no other task's data; without ``--only`` the task
    whose data is missing stops the study before anything runs."""
    monkeypatch.chdir(tmp_path)
    tasks = {"arithmetic": [], "missing": ["--dataset", "nowhere/train.jsonl"]}
    path = write_spec(tmp_path / "s.json", tiny_model_dir, tmp_path / "o", tasks=tasks)
    study.main([str(path), "--dry-run", "--only", "arithmetic/*"])
    assert "arithmetic/grpo/s0: new" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        study.main([str(path), "--dry-run"])
    assert "cell missing/grpo: dataset 'nowhere/train.jsonl'" in capsys.readouterr().err


def test_a_cells_time_is_estimated_from_finished_cells_of_its_kind(tmp_path):
    """A training cell's estimate comes from training cells (its variant's first, on any task), never from an
    evaluation-only cell's; with none of its kind finished it is unknown."""
    variants = {
        "base": {"flags": ["--steps", "0"], "seeds": [0], "reference": True},
        "grpo": ["--algo", "grpo"],
        "gtpo": ["--algo", "gtpo", "--preset", "paper"],
    }
    tasks = {"arithmetic": [], "other": []}
    spec = study.StudySpec.read(write_spec(tmp_path / "s.json", "m", tmp_path / "o", variants=variants, tasks=tasks))
    cells = {(c.task, c.variant, c.seed): c for c in spec.cells()}

    def finish(key, minutes):
        cells[key].folder.mkdir(parents=True)
        (cells[key].folder / "summary.json").write_text(json.dumps({"wall_minutes": minutes}))

    finish(("arithmetic", "base", 0), 10.0)
    assert study.estimate_minutes(cells[("arithmetic", "grpo", 0)], spec.cells()) is None
    assert study.estimate_minutes(cells[("other", "base", 0)], spec.cells()) == 10.0
    finish(("arithmetic", "grpo", 0), 30.0)
    finish(("arithmetic", "gtpo", 0), 50.0)
    assert study.estimate_minutes(cells[("arithmetic", "grpo", 1)], spec.cells()) == 30.0  # its own variant
    assert study.estimate_minutes(cells[("other", "gtpo", 1)], spec.cells()) == 50.0  # its variant, another task
    assert study.estimate_minutes(cells[("other", "base", 0)], spec.cells()) == 10.0
    assert "other/grpo/s0: new, about 30.0 min" in "\n".join(study.dry_run(spec, 2))


def test_a_cell_records_the_code_it_ran(tmp_path, monkeypatch):
    """study-cell.json holds the commit the study ran from (this checkout's, with "+changes" where tracked files
    differ from it), beside the cell's flags and threads."""
    spec = study.StudySpec.read(write_spec(tmp_path / "s.json", "m", tmp_path / "o", threads=1))
    cell = spec.cells()[0]
    monkeypatch.setattr(study, "code_version", lambda: "abc123+changes")
    monkeypatch.setattr(study.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0))  # no cell run
    study.run_cell(cell, 1)
    record = json.loads((cell.folder / "study-cell.json").read_text())
    machine = str(Machine.this())
    assert record == {"flags": list(cell.flags), "threads": 1, "code": "abc123+changes", "machine": machine}
    assert machine.startswith(Machine.this().cpu) and f"torch {torch.__version__}" in machine


def test_the_report_names_each_cells_machine_and_the_pairs_that_ran_on_two(tmp_path):
    """The report lists the machines the finished cells ran on (their summary's record, else study-cell.json's)
    and each pair whose two cells ran on different ones: bf16 rounds differently on CPUs with and without bf16
    units, so such a pair's difference holds the machines' too."""
    spec = study.StudySpec.read(write_spec(tmp_path / "s.json", "m", tmp_path / "o", seeds=[0, 1]))
    zen = Machine("AMD EPYC", 2, ("avx512_bf16",), None, "2.13.0+cpu")
    xeon = Machine("Intel Xeon", 2, ("avx512_bf16", "amx_bf16"), None, "2.13.0+cpu")
    ran_on = {("grpo", 0): zen, ("gtpo", 0): zen, ("grpo", 1): zen, ("gtpo", 1): xeon}
    for cell in spec.cells():
        fake_cell(cell, {"accuracy": 0.5})
        summary = json.loads((cell.folder / "summary.json").read_text())
        if (cell.variant, cell.seed) == ("gtpo", 1):  # recorded only where it started (a run before summaries did)
            (cell.folder / "study-cell.json").write_text(json.dumps({"machine": str(xeon)}))
        else:
            summary["machine"] = ran_on[cell.variant, cell.seed].as_dict()
        (cell.folder / "summary.json").write_text(json.dumps(summary))
    text = study.report(spec)
    assert "Machines: AMD EPYC (2 cores, avx512_bf16), torch 2.13.0+cpu: 3 cells; Intel Xeon (2 cores, " in text
    assert "Pairs run on different machines (their difference holds the machines' too): arithmetic/gtpo/s1 " in text
    assert "arithmetic/gtpo/s0" not in text.split("Pairs run on different machines")[1]


def test_the_code_version_is_this_checkouts_commit():
    head = shutil.which("git") and subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
    )
    if not head or head.returncode:
        pytest.skip("not a git checkout: no commit to record")
    assert study.code_version().split("+")[0] == head.stdout.strip()


def test_variants_run_their_own_seeds_and_tasks_and_pair_with_their_partner(tmp_path):
    variants = {
        "grpo": ["--algo", "grpo"],
        "gtpo": ["--algo", "gtpo"],
        "grpo-hot": {"flags": ["--learning-rate", "1e-4"], "tasks": ["chain_sum"]},
        "gtpo-hot": {
            "flags": ["--algo", "gtpo", "--learning-rate", "1e-4"],
            "tasks": ["chain_sum"],
            "against": "grpo-hot",
        },
        "base": {"flags": ["--steps", "0"], "seeds": [0], "reference": True},
    }
    tasks = {"arithmetic": [], "chain_sum": ["--dataset", "cs.jsonl"]}
    spec = study.StudySpec.read(write_spec(tmp_path / "s.json", "m", tmp_path / "o", variants=variants, tasks=tasks))
    cells = {(c.task, c.variant, c.seed) for c in spec.cells()}
    assert ("arithmetic", "base", 0) in cells and ("arithmetic", "base", 1) not in cells  # its own seeds
    assert ("chain_sum", "grpo-hot", 1) in cells and ("arithmetic", "grpo-hot", 0) not in cells  # its own tasks
    assert len(cells) == 2 * 2 * 2 + 2 * 2 + 2
    assert [spec.partner(v) for v in variants] == [None, "grpo", "grpo", "grpo-hot", None]


def test_the_untrained_figures_are_each_runs_first_evaluation(tmp_path):
    """Cells run with --no-eval-before have one evaluation, after training: the reference --steps 0 cell's figures
    are their step 0, so a run that ends far below the untrained model is counted as collapsed."""
    variants = {"grpo": ["--algo", "grpo"], "base": {"flags": ["--steps", "0"], "seeds": [0], "reference": True}}
    spec = study.StudySpec.read(write_spec(tmp_path / "s.json", "m", tmp_path / "o", variants=variants, seeds=[0]))
    base, grpo = sorted(spec.cells(), key=lambda c: c.variant)
    base.folder.mkdir(parents=True)
    (base.folder / "summary.json").write_text(json.dumps({"steps": 0, "after": {"accuracy": 0.5}, "eval_problems": 64}))
    (base.folder / "metrics.jsonl").write_text(json.dumps({"kind": "eval", "step": 0, "accuracy": 0.5}) + "\n")
    grpo.folder.mkdir(parents=True)
    (grpo.folder / "summary.json").write_text(
        json.dumps({"algo": "grpo", "seed": 0, "steps": 1, "after": {"accuracy": 0.1}, "eval_problems": 64})
    )
    rows = [{"kind": "train", "step": 1, "entropy": 0.5, "reward": 0.6}, {"kind": "eval", "step": 1, "accuracy": 0.1}]
    (grpo.folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    answers = [{"problem": i, "answer": a, "correct": False} for i, a in enumerate(["1", "1", "1", "2"])]
    (grpo.folder / "held-out-answers.jsonl").write_text("".join(json.dumps(a) + "\n" for a in answers))
    text = study.report(spec)
    assert "| arithmetic | base | 0 | 64 | accuracy | 0.500 [0.38, 0.62] |" in text
    assert "| arithmetic | grpo | 1 of 1 | s0: accuracy 0.50 -> 0.10 | s0: 2 / '1' 0.75 |" in text  # 3 of 4 say 1


def test_each_variant_shows_its_change_from_the_untrained_model(tmp_path):
    """Beside each variant's mean after training: the untrained model's figure and the change from it, marked where
    the change is larger than the seed spread (training moved the figure by more than the seeds disagree)."""
    variants = {"grpo": ["--algo", "grpo"], "base": {"flags": ["--steps", "0"], "seeds": [0], "reference": True}}
    spec = study.StudySpec.read(write_spec(tmp_path / "s.json", "m", tmp_path / "o", variants=variants, seeds=[0, 1]))
    for cell in spec.cells():
        if cell.variant == "base":
            cell.folder.mkdir(parents=True)
            after = {"accuracy": 0.25, "pass@16": 0.80}
            (cell.folder / "summary.json").write_text(json.dumps({"steps": 0, "after": after, "eval_problems": 64}))
            (cell.folder / "metrics.jsonl").write_text(json.dumps({"kind": "eval", "step": 0, **after}) + "\n")
        else:  # accuracy 0.45 and 0.55 (spread 0.10, change +0.25); pass@16 0.70 and 0.90 (spread 0.20, change 0)
            fake_cell(cell, {"accuracy": [0.45, 0.55][cell.seed], "pass@16": [0.70, 0.90][cell.seed]})
    text = study.report(spec)
    assert "| 0.250 | +0.250 (> spread) |" in text.split("| arithmetic | grpo | 2 | accuracy |")[1].splitlines()[0]
    assert "| 0.800 | +0.000 |" in text.split("| arithmetic | grpo | 2 | pass@16 |")[1].splitlines()[0]


def test_a_run_without_train_rows_is_plotted(tmp_path):
    """A --steps 0 run (the untrained model's evaluation) logs one evaluation and no step: its plot is drawn."""
    pytest.importorskip("matplotlib")
    from trainer.offline.plots import plot_run

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"kind": "eval", "step": 0, "accuracy": 0.1, "pass@4": 0.2}))
    assert plot_run(tmp_path / "metrics.jsonl", tmp_path / "run.png", title="untrained") == tmp_path / "run.png"
    assert (tmp_path / "run.png").stat().st_size > 0


def test_a_run_answering_one_thing_to_every_problem_has_collapsed(tmp_path):
    """Its accuracy may rise (a constant answer scores the share of the problems it fits): the answers show it."""
    variants = {"grpo": ["--algo", "grpo"], "base": {"flags": ["--steps", "0"], "seeds": [0], "reference": True}}
    spec = study.StudySpec.read(write_spec(tmp_path / "s.json", "m", tmp_path / "o", variants=variants, seeds=[0]))
    base, grpo = sorted(spec.cells(), key=lambda c: c.variant)
    base.folder.mkdir(parents=True)
    (base.folder / "summary.json").write_text(json.dumps({"steps": 0, "after": {"accuracy": 0.2}, "eval_problems": 10}))
    grpo.folder.mkdir(parents=True)
    summary = {"algo": "grpo", "seed": 0, "steps": 1, "after": {"accuracy": 0.7}, "eval_problems": 10}
    (grpo.folder / "summary.json").write_text(json.dumps(summary))
    rows = [{"kind": "train", "step": 1, "entropy": 0.5, "reward": 0.6}, {"kind": "eval", "step": 1, "accuracy": 0.7}]
    (grpo.folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    answers = [{"problem": i, "answer": "Yes" if i else "No"} for i in range(10)]  # 9 of 10 say Yes: 0.90
    (grpo.folder / "held-out-answers.jsonl").write_text("".join(json.dumps(a) + "\n" for a in answers))
    text = study.report(spec)
    assert "| arithmetic | grpo | 1 of 1 | s0: one greedy answer ('Yes') on 0.90 | s0: 2 / 'Yes' 0.90 |" in text


def test_paired_cells_are_compared_answer_by_answer(tmp_path):
    spec = study.StudySpec.read(write_spec(tmp_path / "s.json", "m", tmp_path / "o", seeds=[0]))
    for cell, answers in zip(spec.cells(), (["1", "2", "3", "4"], ["1", "2", "3", "5"])):  # grpo, then gtpo
        fake_cell(cell, {"accuracy": 0.5})
        rows = [{"problem": i, "answer": a} for i, a in enumerate(answers)]
        if cell.variant == "gtpo":
            rows.reverse()  # (written in another order: read by problem)
        (cell.folder / "held-out-answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert "| arithmetic | gtpo | grpo | s0: 0.75 |" in study.report(spec)


def test_the_final_train_entropy_is_paired_too(tmp_path):
    spec = study.StudySpec.read(write_spec(tmp_path / "s.json", "m", tmp_path / "o", seeds=[0]))
    for cell, entropies in zip(spec.cells(), ([0.9, 0.6, 0.5, 0.4], [0.9, 0.5, 0.3, 0.1])):  # grpo, then gtpo
        fake_cell(cell, {"accuracy": 0.5})
        rows = [{"kind": "train", "step": i + 1, "entropy": e, "reward": 0.5} for i, e in enumerate(entropies)]
        (cell.folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # The last 3 steps' mean: 0.5 for grpo, 0.3 for gtpo.
    assert "| arithmetic | gtpo | grpo | train entropy, last 3 steps | 1 | -0.200 |" in study.report(spec)
