"""Ctrl-C and SIGTERM on a real training process, at each stage: it stops within seconds, saves the last
completed step, prints one line with the command that resumes, and exits 130 (SIGINT) or 143 (SIGTERM); a
second Ctrl-C stops at once. The trainer runs in a subprocess (tests/interrupt_run.py slows the tiny model
down during the phase under test, so that it lasts seconds, and prints when a phase starts and ends: the
test checks that the phase was cut short, not finished)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
STOP_WITHIN_S = 10.0  # a slowed layer takes 0.1 s; the last completed step's checkpoint is written too


def start(tiny_model_dir, out, slow_phase, *extra):
    flags = [
        "--model",
        tiny_model_dir,
        "--output-dir",
        str(out),
        "--steps",
        "3",
        "--prompts-per-step",
        "2",
        "--group-size",
        "3",
        "--max-new-tokens",
        "24",
        "--eval-size",
        "4",
        "--eval-k",
        "2",
        "--save-every",
        "0",
        *extra,
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", SLOW_PHASE=slow_phase)
    return subprocess.Popen(
        [sys.executable, "tests/interrupt_run.py", *flags],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_phase(proc, phase: str, occurrence: int = 1) -> None:
    seen = 0
    for line in proc.stdout:
        if line.strip() == f"PHASE {phase}":
            seen += 1
            if seen == occurrence:
                return
    raise AssertionError(f"the run ended before entering {phase}: {proc.stderr.read()[-2000:]}")


def phase_finished(stdout: str, phase: str) -> bool:
    return f"PHASE-END {phase}" in stdout.splitlines()


@pytest.mark.parametrize(
    "phase, occurrence, sig, status",
    [
        ("sampling", 2, signal.SIGINT, 130),  # the second step's rollout
        ("update", 1, signal.SIGINT, 130),
        ("evaluation", 2, signal.SIGTERM, 143),  # the final evaluation
    ],
)
def test_a_signal_stops_the_run_within_seconds(tiny_model_dir, tmp_path, phase, occurrence, sig, status):
    out = tmp_path / "run"
    proc = start(tiny_model_dir, out, phase)
    wait_for_phase(proc, phase, occurrence)
    time.sleep(0.3)  # inside the phase, which lasts seconds (its layers sleep)
    sent = time.time()
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=120)
    took = time.time() - sent
    assert proc.returncode == status, stderr[-2000:]
    assert took < STOP_WITHIN_S, took
    assert not phase_finished(stdout, phase), "the phase ran to its end instead of stopping"
    resume_lines = [line for line in stderr.splitlines() if "resume with:" in line]
    assert len(resume_lines) == 1, stderr[-2000:]
    assert f"--config {out / 'config.json'} --resume" in resume_lines[0]
    assert any(out.glob("checkpoint-*/trainer_state.json"))
    if phase == "update":  # the printed command finishes the run
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        done = subprocess.run(
            [sys.executable, "-m", "trainer", "--config", str(out / "config.json"), "--resume"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert (out / "summary.json").exists()


def test_a_second_ctrl_c_stops_at_once(tiny_model_dir, tmp_path):
    proc = start(tiny_model_dir, tmp_path / "run", "update")
    wait_for_phase(proc, "update")
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert proc.returncode == 130
