"""``--report-to``: what TensorBoard, Weights & Biases (offline) and trackio wrote, read back and compared with
``metrics.jsonl``; a tracker that is not installed stops the run before anything loads."""

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from trainer import train as train_module  # noqa: E402
from trainer.tracking import scalars  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def wandb_history(run_file: str) -> list:
    """The history rows of an offline W&B run file: LevelDB-style framing (7-byte header, 32 KiB blocks, each
    record a 7-byte frame of checksum, length and kind: full, or first/middle/last pieces), protobuf records."""
    from wandb.proto import wandb_internal_pb2

    raw, block, pos, pending, history = Path(run_file).read_bytes(), 32768, 7, b"", []
    assert raw[:4] == b":W&B", raw[:8]
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a frame is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(raw[pos + 4 : pos + 6], "little"), raw[pos + 6]
        if length == 0 and kind == 0:
            break
        pending += raw[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                history.append(
                    {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                )
    return history


def test_every_tracker_records_the_metrics_rows(tiny_model_dir, tmp_path):
    """One run with all three: each holds every number of metrics.jsonl under train/ or eval/ at its step (a
    skipped step's missing gradient norm is left out, as it is not a number)."""
    for module in ("tensorboard", "wandb", "trackio"):
        pytest.importorskip(module)
    out = tmp_path / "run"
    env = {
        **os.environ,
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "TRACKIO_DIR": str(tmp_path / "trackio"),
        "TRACKIO_PROJECT": "tracking-test",
    }
    command = [
        sys.executable, "-m", "trainer", "--model", tiny_model_dir, "--output-dir", str(out), "--steps", "2",
        "--prompts-per-step", "2", "--group-size", "3", "--max-new-tokens", "4", "--eval-size", "2", "--eval-k", "2",
        "--precision", "fp32", "--report-to", "tensorboard", "wandb", "trackio", "--run-name", "read-back",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    expected = {}  # (step, key) -> value; an evaluation and a step share the last step
    for row in rows:
        for key, value in scalars(row).items():
            expected[(row["step"], key)] = value
    assert ("2", "train/loss") not in expected and (2, "train/loss") in expected and (0, "eval/reward") in expected
    assert any(key == "train/rewards/correctness_reward" for _, key in expected)
    assert expected[(0, "eval/accuracy_ci95_high")] > expected[(0, "eval/accuracy")] >= 0  # the intervals too

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(out / "tensorboard"))
    board.Reload()
    written = {(e.step, tag): e.value for tag in board.Tags()["scalars"] for e in board.Scalars(tag)}
    assert written.keys() == expected.keys()
    assert all(written[k] == pytest.approx(v, rel=1e-6, abs=1e-7) for k, v in expected.items())  # float32 there

    (run_file,) = glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb"))
    logged = {}
    for entry in wandb_history(run_file):
        logged.update({(entry["_step"], k): v for k, v in entry.items() if not k.startswith("_")})
    assert logged == expected

    read = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json, trackio; print(json.dumps(trackio.SQLiteStorage.get_logs("
            "project='tracking-test', run='read-back')))",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert read.returncode == 0, read.stderr[-2000:]
    tracked = {}
    for entry in json.loads(read.stdout.strip().splitlines()[-1]):
        tracked.update({(entry["step"], k): v for k, v in entry.items() if k.startswith(("train/", "eval/"))})
    assert tracked == expected


def test_a_tracker_that_is_not_installed_stops_before_loading(tmp_path, monkeypatch, capsys):
    import importlib.util

    from trainer import session

    real = importlib.util.find_spec
    # wandb missing and tensorboard present, whichever of them this machine has (the README's install has neither)
    installed = {"wandb": None, "tensorboard": importlib.util.find_spec("importlib")}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: installed.get(name, real(name, *a)))

    def must_not_load(*args, **kwargs):
        raise AssertionError("loaded the model before checking the trackers")

    monkeypatch.setattr(session, "load_model_and_tokenizer", must_not_load)
    with pytest.raises(SystemExit) as exit_info:
        train_module.main(["--report-to", "tensorboard", "wandb", "--output-dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["gtpo-train: error: --report-to tensorboard wandb: not installed: wandb; pip install wandb (or "
                     "pip install 'gtpo-kernels[tracking]')"]  # fmt: skip
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "value, message",
    [(["mlflow"], "--report-to takes none, tensorboard, wandb, trackio"), (["none", "wandb"], "'none' cannot be")],
)
def test_report_to_takes_known_trackers(value, message):
    from trainer.config import ConfigError, TrainConfig

    with pytest.raises(ConfigError, match=message):
        TrainConfig(report_to=value)


def test_scalars_are_the_rows_numbers_under_their_kind():
    row = {"kind": "train", "step": 3, "loss": 0.5, "grad_norm": None, "updates": 1, "flag": True, "x": float("nan")}
    assert scalars(row) == {"train/loss": 0.5, "train/updates": 1.0}
    evaluation = {"kind": "eval", "step": 0, "accuracy": 0.5, "intervals_95": {"accuracy": [0.2, 0.8]}}
    assert scalars(evaluation) == {"eval/accuracy": 0.5, "eval/accuracy_ci95_low": 0.2, "eval/accuracy_ci95_high": 0.8}
