"""The update's decoder forward inside a training step and alone on the same batch, in one checkout.

    python bench/results/refactor-59/probe_decoder_forward.py CHECKOUT   # run from CHECKOUT, OMP_NUM_THREADS=2

Loads the default run as `python -m bench trainer` does, takes two steps with `completion_hidden_states` timed,
then calls it five more times on the last step's arguments. Prints one ``RESULT {json}`` line: the calls in the
last step, their seconds, and the five calls alone. Written for issue 59's before/after (README.md beside it);
it reads the arguments it records, so it runs on checkouts from before and after the typed rollout.
"""

import json
import sys
import time

root = sys.argv[1]
sys.path.insert(0, root)

from bench import trainer as bench_trainer  # noqa: E402  (the checkout's own, after the path)
from trainer import train, update  # noqa: E402
from trainer.checkpoint import RunState  # noqa: E402
from trainer.session import load_session  # noqa: E402

args = bench_trainer.parser().parse_args(["--steps", "2"])
config = bench_trainer.run_config(args)
task, dist = bench_trainer.task_and_process(config)
session = load_session(config, dist, task)
calls = []
forward = update.completion_hidden_states


def timed(*a, **k):
    start = time.perf_counter()
    out = forward(*a, **k)
    calls.append((a, k, time.perf_counter() - start))
    return out


update.completion_hidden_states = timed
state = RunState()
for step in range(2):
    calls.clear()
    train.train_step(session, state, step)
in_step = [seconds for _, _, seconds in calls]
a, k, _ = calls[-1]
alone = []
for _ in range(5):
    start = time.perf_counter()
    out = forward(*a, **k)
    alone.append(time.perf_counter() - start)
    del out
print("RESULT", json.dumps({"calls": len(calls), "in_step": in_step, "alone": alone}))
