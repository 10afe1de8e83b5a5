"""Every private torch name the package uses, in one place, each with the reason no public API does its job.

`tests/test_torch_internals.py` looks each one up by name on the installed torch, so the day a release removes or
renames one, a test named for it fails, instead of a loss call deep inside the fused walk. Each is looked up when
first used: a torch without one still imports the package, and the call that needs it says which name is missing.
"""

from __future__ import annotations

import functools

import torch

# name -> why the package needs it and why no public API does the same job
INTERNALS = {
    "torch._C._dispatch_tls_local_include_set": "the dispatcher's keys of this thread, read to re-enter autograd "
    "inside a registered operator's body (`eager_autograd`); torch.enable_grad alone does not add autograd back",
    "torch._C._dispatch_tls_local_exclude_set": "the keys plain eager code excludes (autocast off), read once at "
    "import: `eager_autograd` restores them inside an operator's body, where the dispatcher excludes autograd",
    "torch._C._ForceDispatchKeyGuard": "sets both key sets for a region (`eager_autograd`): the fused walk "
    "differentiates each chunk's small objective with autograd inside its operator, so its maths is written once",
    "torch._is_functional_tensor": "tells a functionalization wrapper (torch.func.functionalize, AOTAutograd) from a "
    "plain tensor, whose memory the in-place backward may write over (`is_plain`); no public predicate exists",
}


@functools.cache
def internal(name: str):
    """The torch object called ``name`` (a key of `INTERNALS`), or a RuntimeError naming it and this torch."""
    if name not in INTERNALS:
        raise KeyError(f"{name} is not listed in gtpo_kernels.torch_internals.INTERNALS")
    obj = torch
    for part in name.split(".")[1:]:
        obj = getattr(obj, part, None)
        if obj is None:
            raise RuntimeError(
                f"gtpo_kernels needs torch's private {name} ({INTERNALS[name]}), which torch {torch.__version__} "
                "does not have: install a torch that tools/torch-matrix.md lists as working"
            )
    return obj
