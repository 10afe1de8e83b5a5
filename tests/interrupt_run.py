"""The trainer with a tiny model slowed down so that each phase lasts a few seconds, printing ``PHASE name``
as it enters sampling, an update or an evaluation: for tests/test_interrupts.py, which sends real signals
to it. ``python tests/interrupt_run.py [gtpo-train flags]``."""

import sys
import time

import trainer.train as train

real_load = train.load_model_and_tokenizer


def slow_load(name, device):
    model, tokenizer = real_load(name, device)
    for layer in model.get_decoder().layers:
        layer.register_forward_pre_hook(lambda module, args: time.sleep(0.01))
    return model, tokenizer


def marked(fn, name):
    def wrapper(*args, **kwargs):
        print(f"PHASE {name}", flush=True)
        return fn(*args, **kwargs)
    return wrapper


train.load_model_and_tokenizer = slow_load
train.rollout = marked(train.rollout, "sampling")
train.update = marked(train.update, "update")
train.evaluate = marked(train.evaluate, "evaluation")

if __name__ == "__main__":
    train.main(sys.argv[1:])
