"""``python -m gtpo_kernels``: which backends this installation has, and why one is missing."""

from __future__ import annotations

import sys


def report() -> str:
    import torch

    import gtpo_kernels
    from gtpo_kernels.backends import get_backend, registered, resolve_backend_name

    lines = [f"gtpo_kernels {gtpo_kernels.__version__} (torch {torch.__version__}"]
    try:
        import triton

        lines[0] += f", triton {triton.__version__})"
    except ImportError:
        lines[0] += ", triton not installed)"
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    for name in registered():
        try:
            backend = get_backend(name)
        except ImportError as exc:
            lines.append(f"  {name:<7} unavailable: cannot be imported ({exc})")
            continue
        for device in devices:
            why = backend.unavailable(device)
            state = "available" if why is None else f"unavailable: {why}"
            if why is None and name == "cpu":
                state += f" ({torch.ops.gtpo_cpu.capability()} build)"
            lines.append(f"  {name:<7} on {device.type}: {state}")
    for device in devices:
        lines.append(f"backend='auto' on {device.type} tensors uses: {resolve_backend_name('auto', device.type)}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
    sys.exit(0)
