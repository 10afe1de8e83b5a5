"""Refusing second derivatives through closed-form backwards (shared by the autograd Functions and the
registered operators)."""

from __future__ import annotations

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
