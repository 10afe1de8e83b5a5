"""Running the Triton kernels on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``, how CI tests
them), and a fix for triton 3.6's interpreter with numpy >= 2.4. Imported by every Triton kernel module."""

from __future__ import annotations

import os


def triton_interpreted() -> bool:
    """Whether Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _interpreter_index_fix() -> None:
    """Triton 3.6's interpreter turns loop bounds into ints with ``int(array)`` on one-element arrays, which
    numpy >= 2.4 refuses ("only 0-dimensional arrays can be converted"); every kernel looping over a
    runtime bound then fails. Use ``.item()``, which takes any one-element array. Triton 3.9's interpreter
    does not need it; the fix is harmless there."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_gtpo_index_fix", False):
        return

    def patch_lang_tensor(tensor, *scope):  # triton 3.6 passes a scope to patch through; 3.0-3.2 patch in place
        original(tensor, *scope)
        index = lambda self: int(self.handle.data.item())
        if scope:
            scope[0].set_attr(tensor, "__index__", index)
        else:
            tensor.__index__ = index

    patch_lang_tensor._gtpo_index_fix = True
    interpreter._patch_lang_tensor = patch_lang_tensor


if triton_interpreted():
    _interpreter_index_fix()
