"""The private torch names the package needs, each looked up by name on the installed torch (a release that removes
one fails the test named for it), all of them in `gtpo_kernels.torch_internals` and nowhere else, and each still
doing the job the package uses it for."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from gtpo_kernels import torch_internals
from gtpo_kernels._autograd import eager_autograd, is_plain
from gtpo_kernels.torch_internals import INTERNALS, internal

PACKAGE = Path(torch_internals.__file__).resolve().parent


@pytest.mark.parametrize("name", sorted(INTERNALS))
def test_this_torch_has(name):
    assert callable(internal(name)), f"torch {torch.__version__}: {name} is not callable"


def test_a_missing_internal_is_named_with_this_torch(monkeypatch):
    monkeypatch.setitem(INTERNALS, "torch._C._gtpo_never_existed", "a reason")
    with pytest.raises(RuntimeError, match=r"torch's private torch\._C\._gtpo_never_existed \(a reason\), which torch"):
        internal("torch._C._gtpo_never_existed")


def test_no_other_module_of_the_package_reaches_into_torch_privately():
    private = re.compile(r"\btorch\.(?:_C\b|_[a-z]\w*|\w+\._\w+)|from torch\._|from torch\.\w+\._")
    found = [
        f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "torch_internals.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if private.search(re.sub(r"\"[^\"]*\"|'[^']*'", "", line).replace("torch.__version__", ""))
    ]
    assert not found, "private torch names outside gtpo_kernels/torch_internals.py:\n" + "\n".join(found)


def test_eager_autograd_records_inside_a_registered_operator():
    """Where the dispatcher runs an operator's body below autograd, `eager_autograd` records a graph again."""

    @torch.library.custom_op("gtpo_kernels_test::square_grad", mutates_args=())
    def square_grad(x: torch.Tensor, reenter: bool) -> torch.Tensor:
        y = x.detach().requires_grad_()
        if not reenter:
            with torch.enable_grad():
                return torch.tensor(float((y * y).sum().requires_grad))
        with eager_autograd():
            (grad,) = torch.autograd.grad((y * y).sum(), y)
        return grad

    x = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
    assert torch.equal(square_grad(x, True), 2 * x.detach())
    # The reason the guard exists: enable_grad alone records nothing there.
    assert float(square_grad(x, False).detach()) == 0.0


def test_is_plain_tells_a_functional_wrapper_from_a_tensor():
    seen = []

    def record(x):
        seen.append(is_plain(x))
        return x + 1

    record(torch.ones(2))
    torch.func.functionalize(record)(torch.ones(2))
    assert seen == [True, False]
