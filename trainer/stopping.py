"""How a run stops before its last step: stop requests (Ctrl-C, SIGTERM) deferred to a point where nothing is
half-applied, and why a run stopped (`Stopped`), which decides whether it still evaluates and saves its model
(the --max-minutes cap) or saves its last completed step and exits non-zero (a signal)."""

from __future__ import annotations

import enum
import signal
import sys
from dataclasses import dataclass
from typing import Optional

import torch


class StopReason(enum.Enum):
    TIME_CAP = "time cap"  # --max-minutes reached: the run evaluates and saves as a finished one does
    SIGNAL = "signal"  # a stop request: the last completed step is saved, the exit status says which signal


@dataclass(frozen=True)
class Stopped:
    """Why a run stopped early: the reason, and the message the summary and the terminal show."""

    reason: StopReason
    message: str

    @property
    def finishes(self) -> bool:
        """Whether the run still evaluates and saves its model as a finished run does."""
        return self.reason is StopReason.TIME_CAP


class Interrupted(Exception):
    """A stop request cut the current phase (sampling, an update, an evaluation) short; nothing of that phase
    was applied, so the run is still at its last completed step."""


EXIT_STATUS = {"SIGINT": 130, "SIGTERM": 143}  # 128 + the signal's number, as shells report it


class StopRequests:
    """While active, SIGINT (Ctrl-C) and SIGTERM set ``requested``. In one process the decoder layers then
    raise `Interrupted` at their next forward or backward (`interrupt_layers`), so sampling, an update or an
    evaluation stops within a layer's time; under torchrun, where the processes must agree, the run stops
    at the next step or evaluation-batch boundary. Either way it saves the last completed step and exits with
    ``exit_status``. A second Ctrl-C stops at once (`KeyboardInterrupt`; the last checkpoint and the
    cut-back log still make the resume exact)."""

    def __init__(self) -> None:
        self.requested: Optional[str] = None
        self._previous = {}
        self._hooks = []
        self.paused = False  # set while a step has applied part of itself (see train.update)

    def stopped(self, during: str = "") -> Stopped:
        """The `Stopped` record of the request received (``during``: where the run was, for the message)."""
        message = f"{self.requested or 'a stop request'} received" + (f" {during}" if during else "")
        return Stopped(StopReason.SIGNAL, message)

    @property
    def exit_status(self) -> int:
        return EXIT_STATUS.get(self.requested, 1)

    def _handle(self, signum, frame) -> None:
        if self.requested is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name
        print(
            f"\n{self.requested} received: saving the last completed step and stopping (Ctrl-C again to stop at once)",
            file=sys.stderr,
            flush=True,
        )

    def check(self) -> None:
        """Raises `Interrupted` if a stop was requested (and the current phase may be abandoned)."""
        if self.requested is not None and not self.paused:
            raise Interrupted(self.requested)

    def interrupt_layers(self, layers) -> None:
        """Hooks on ``layers`` (the decoder's blocks) that call `check` before each one's forward, and before its
        backward (a hook on its output: lighter than a module backward hook, which rewraps inputs and outputs)."""

        def before_backward(grad):
            self.check()

        def after_forward(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
                hidden.register_hook(before_backward)

        for layer in layers:
            self._hooks.append(layer.register_forward_pre_hook(lambda module, args: self.check()))
            self._hooks.append(layer.register_forward_hook(after_forward))

    def __enter__(self) -> StopRequests:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: signals stay as they are
                pass
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
