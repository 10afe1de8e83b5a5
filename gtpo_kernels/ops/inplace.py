"""The guard for backends that write the gradient into the logits' storage (``inplace_backward``).

After the write the logits' version counter is bumped: any autograd node that saved the same tensor
and unpacks it later raises "one of the variables needed for gradient computation has been modified
by an inplace operation" instead of silently reading gradients as logits.
"""

import torch


def increment_version(tensor: torch.Tensor) -> None:
    bump = getattr(torch.autograd.graph, "increment_version", None)
    if bump is not None:
        bump(tensor)
    else:  # torch < 2.1
        torch._C._autograd._increment_version(tensor)
