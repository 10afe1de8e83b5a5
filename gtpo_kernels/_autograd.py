"""Autograd helpers shared by the registered operators: refusing second derivatives through closed-form backwards,
telling eager tensors from traced ones, and recording autograd inside an operator's body."""

from __future__ import annotations

import contextlib
import functools

import torch

SECOND_DERIVATIVE = (
    "trying to differentiate twice a gtpo_kernels loss: its backward is closed-form and "
    "once_differentiable (second derivatives: use gtpo_kernels.reference on float64 logits)"
)


def first_derivative_only(backward):
    """Marks a custom ``backward`` as not differentiable. Like ``torch.autograd.function.once_differentiable``,
    a second derivative through it raises instead of silently treating the gradient as a constant, but
    always: the stock decorator lets the gradient through as a constant when the incoming gradient does not
    require grad (``loss = logp.sum()``, the fused loss), which gives a wrong second derivative."""
    message = SECOND_DERIVATIVE.encode()

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        if not torch.is_grad_enabled():
            return outputs
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        flags = [isinstance(o, torch.Tensor) for o in outputs]
        tensors = [o.detach().requires_grad_() for o, is_tensor in zip(outputs, flags) if is_tensor]
        guarded = torch._C._functions.DelayedError(message, len(tensors))(*tensors)
        guarded = iter((guarded,) if isinstance(guarded, torch.Tensor) else guarded)
        return tuple(next(guarded) if is_tensor else o for o, is_tensor in zip(outputs, flags))

    return wrapper


# The dispatcher's exclude set of plain eager code (autocast off, nothing else excluded), read at import.
_EAGER_EXCLUDE = torch._C._dispatch_tls_local_exclude_set()


@contextlib.contextmanager
def eager_autograd():
    """A region where autograd records operations, also inside a registered operator's body: the dispatcher runs an
    operator's implementation below autograd (and, inside a compiled graph, below every transform), where
    ``torch.enable_grad`` alone records nothing. The fused walk differentiates each chunk's ``O(rows x L)`` objective
    here (`objective.loss_and_gradients`), so that the loss's maths is written once."""
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), _EAGER_EXCLUDE):
        with torch.enable_grad():
            yield


def is_plain(tensor: torch.Tensor) -> bool:
    """An eager tensor holding data (not a fake, functional or other traced stand-in)."""
    return type(tensor) is torch.Tensor and not torch._is_functional_tensor(tensor)
