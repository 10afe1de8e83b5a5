"""The trainer with a tiny model, printing ``PHASE name`` as it enters sampling, an update or an evaluation
and ``PHASE-END name`` when that phase completes: for tests/test_interrupts.py, which sends real signals to
it. While the phase named by ``$SLOW_PHASE`` runs, every decoder layer sleeps 0.1 s in its forward and in
its backward, so that this phase lasts seconds and a signal lands inside it (the other phases run at full
speed). ``SLOW_PHASE=update python tests/interrupt_run.py [gtpo-train flags]``."""

import os
import sys
import time

import trainer.session as session
import trainer.train as train

SLOW_PHASE = os.environ.get("SLOW_PHASE")
LAYER_SECONDS = 0.1
slow = {"on": False}


def sleep_if_slow(*args):
    if slow["on"]:
        time.sleep(LAYER_SECONDS)


def slow_layers(model):
    def after_forward(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        if hidden.requires_grad:
            hidden.register_hook(lambda grad: sleep_if_slow())

    for layer in model.get_decoder().layers:
        layer.register_forward_pre_hook(lambda module, args: sleep_if_slow())
        layer.register_forward_hook(after_forward)


real_load = session.load_model_and_tokenizer


def load(name, device, *args, **kwargs):
    model, tokenizer = real_load(name, device, *args, **kwargs)
    slow_layers(model)
    return model, tokenizer


def marked(fn, name):
    def wrapper(*args, **kwargs):
        print(f"PHASE {name}", flush=True)
        slow["on"] = name == SLOW_PHASE
        try:
            result = fn(*args, **kwargs)
        finally:
            slow["on"] = False
        if result is not None:  # evaluate returns None when a stop cut it short
            print(f"PHASE-END {name}", flush=True)
        return result

    return wrapper


session.load_model_and_tokenizer = load
train.rollout = marked(train.rollout, "sampling")
train.update = marked(train.update, "update")
session.evaluate = marked(session.evaluate, "evaluation")

if __name__ == "__main__":
    train.main(sys.argv[1:])
