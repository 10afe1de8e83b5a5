"""Autograd helpers shared by the registered operators: refusing second derivatives through closed-form backwards,
telling eager tensors from traced ones, and recording autograd inside an operator's body."""

from __future__ import annotations

import contextlib
import functools

import torch

from .torch_internals import internal

SECOND_DERIVATIVE = (
    "trying to differentiate twice a gtpo_kernels loss: its backward is closed-form and "
    "once_differentiable (second derivatives: use gtpo_kernels.reference on float64 logits)"
)


def first_derivative_only(backward):
    """Marks a custom ``backward`` as not differentiable. Like ``torch.autograd.function.once_differentiable``,
    a second derivative through it raises instead of silently treating the gradient as a constant, but
    always: the stock decorator lets the gradient through as a constant when the incoming gradient does not
    require grad (``loss = logp.sum()``, the fused loss), which gives a wrong second derivative."""
    message = SECOND_DERIVATIVE

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        if not torch.is_grad_enabled():
            return outputs
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        flags = [isinstance(o, torch.Tensor) for o in outputs]
        tensors = [o.detach().requires_grad_() for o, is_tensor in zip(outputs, flags) if is_tensor]
        guarded = iter(_RefuseDifferentiation.apply(message, *tensors))
        return tuple(next(guarded) if is_tensor else o for o, is_tensor in zip(outputs, flags))

    return wrapper


class _RefuseDifferentiation(torch.autograd.Function):
    """The identity on its tensors, whose backward raises ``message``: a gradient computed with ``create_graph`` goes
    through it, so differentiating that gradient again fails with the message (what torch's own
    ``once_differentiable`` does with a private error node)."""

    @staticmethod
    def forward(ctx, message: str, *tensors):
        ctx.message = message
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(ctx.message)


def _read_eager_exclude():
    """The dispatcher's exclude set of plain eager code (autocast off, nothing else excluded): read at import, outside
    any operator (inside one it excludes autograd). ``None`` on a torch without it: `eager_autograd` then names it."""
    try:
        return internal("torch._C._dispatch_tls_local_exclude_set")()
    except RuntimeError:
        return None


_EAGER_EXCLUDE = _read_eager_exclude()


@contextlib.contextmanager
def eager_autograd():
    """A region where autograd records operations, also inside a registered operator's body: the dispatcher runs an
    operator's implementation below autograd (and, inside a compiled graph, below every transform), where
    ``torch.enable_grad`` alone records nothing. The fused walk differentiates each chunk's ``O(rows x L)`` objective
    here (`objective.loss_and_gradients`), so that the loss's maths is written once."""
    if _EAGER_EXCLUDE is None:
        internal("torch._C._dispatch_tls_local_exclude_set")  # raises, naming it
    include = internal("torch._C._dispatch_tls_local_include_set")()
    with internal("torch._C._ForceDispatchKeyGuard")(include, _EAGER_EXCLUDE):
        with torch.enable_grad():
            yield


def is_plain(tensor: torch.Tensor) -> bool:
    """An eager tensor holding data (not a fake, functional or other traced stand-in)."""
    return type(tensor) is torch.Tensor and not internal("torch._is_functional_tensor")(tensor)
