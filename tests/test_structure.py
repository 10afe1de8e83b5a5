"""How the package hangs together: an import graph without cycles, backends that never import upward,
an oracle nothing on the hot path imports, second derivatives refused rather than wrong, and per-token
statistics that do not depend on the batch a token sits in."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gtpo_kernels import GTPOConfig, fused_linear_gtpo_loss, gtpo_loss
from gtpo_kernels.backends import get_backend, registered

from .helpers import device_for, random_batch

PACKAGE = Path(__file__).resolve().parents[1] / "gtpo_kernels"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph():
    """``module -> {modules of the package it imports}`` (any level of the file, lazy imports included)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                stem = node.module if node.level == 0 else ".".join(x for x in (base, node.module) if x)
                # `from pkg import mod` imports the module; `from pkg import name` imports pkg itself.
                targets = [
                    f"{stem}.{alias.name}" if f"{stem}.{alias.name}" in modules else stem for alias in node.names
                ]
            edges |= {t for t in targets if t in modules and t != name}
        graph[name] = edges
    return graph


def test_import_graph_has_no_cycles():
    graph = import_graph()
    state = {}

    def visit(node, path):
        if state.get(node) == "done":
            return
        assert state.get(node) != "open", f"import cycle: {' -> '.join(path + [node])}"
        state[node] = "open"
        for nxt in sorted(graph[node]):
            visit(nxt, path + [node])
        state[node] = "done"

    for node in sorted(graph):
        visit(node, [])


def test_backends_never_import_upward():
    for name, edges in import_graph().items():
        if name.startswith("gtpo_kernels.backends"):
            upward = [e for e in edges if not e.startswith("gtpo_kernels.backends")]
            assert not upward, f"{name} imports {upward}: backend modules import only their own package"


def test_the_oracle_is_off_the_hot_path():
    importers = [name for name, edges in import_graph().items() if "gtpo_kernels.reference" in edges]
    assert importers == [], importers
    code = (
        "import sys, torch, gtpo_kernels as g; "
        "x = torch.randn(2, 3, 5, requires_grad=True); ids = torch.zeros(2, 3, dtype=torch.long); "
        "g.gtpo_loss(x, ids, torch.ones(2, 3), torch.tensor([1., -1.]), group_size=2).loss.backward(); "
        "assert 'gtpo_kernels.reference' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_new_backend_is_one_module_and_one_registry_line():
    text = (PACKAGE / "backends" / "__init__.py").read_text()
    for name in registered():
        assert get_backend(name).name == name
        assert f'"{name}": "{name}_backend"' in text


@pytest.mark.parametrize("backend", registered())
def test_double_backward_is_refused(backend):
    logits, ids, mask, adv = random_batch(2, 2, 4, 9, seed=1)
    x = logits.to(device_for(backend)).requires_grad_()
    loss = gtpo_loss(
        x * 1,
        ids.to(x.device),
        mask.to(x.device),
        adv.to(x.device),
        group_size=2,
        config=GTPOConfig(entropy_mode="penalty"),
        backend=backend,
    ).loss
    (grad,) = torch.autograd.grad(loss, x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad.pow(2).sum().backward()


def test_double_backward_is_refused_by_the_fused_loss():
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(4, 3, 5, generator=g, requires_grad=True)
    weight = torch.randn(11, 5, generator=g, requires_grad=True)
    ids = torch.randint(0, 11, (4, 3), generator=g)
    loss = fused_linear_gtpo_loss(
        hidden, weight, ids, torch.ones(4, 3), torch.tensor([1.0, -1.0, 0.5, -0.5]), group_size=2, backend="torch"
    ).loss
    (grad,) = torch.autograd.grad(loss, hidden, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad.pow(2).sum().backward()


@pytest.mark.parametrize("backend", [b for b in registered() if b != "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_statistics_do_not_depend_on_the_batch(backend, dtype):
    """A token's log-prob and entropy are bitwise the same whatever batch, row or position it sits in."""
    logits, ids, mask, _ = random_batch(3, 3, 5, 301, dtype=dtype, seed=4)
    kernels = get_backend(backend)
    dev = device_for(backend)
    logits, ids, mask = logits.to(dev), ids.to(dev), mask.to(dev)
    everything = torch.ones_like(mask)
    _, _, logp, entropy = kernels.forward(logits, ids, everything, 0.7)
    # Row 4 alone, and row 4's positions moved to the front of another batch shape.
    _, _, logp_one, entropy_one = kernels.forward(logits[4:5], ids[4:5], everything[4:5], 0.7)
    assert torch.equal(logp_one[0], logp[4]) and torch.equal(entropy_one[0], entropy[4])
    shuffled = logits[[4, 0, 2]][:, [3, 1]]
    _, _, logp_s, entropy_s = kernels.forward(shuffled.contiguous(), ids[[4, 0, 2]][:, [3, 1]], everything[:3, :2], 0.7)
    assert torch.equal(logp_s[0], logp[4, [3, 1]]) and torch.equal(entropy_s[0], entropy[4, [3, 1]])
    # Neighbours masked or not: the same.
    _, _, logp_m, _ = kernels.forward(logits, ids, mask, 0.7)
    assert torch.equal(logp_m[mask], logp[mask])


def test_modules_that_register_operators_keep_their_annotations_as_objects():
    """torch.library.custom_op reads an operator's signature, and torch 2.4-2.6 cannot read annotations written as
    strings (`from __future__ import annotations`): the package would not import there (tools/torch-matrix.md)."""
    registering = [
        path.name
        for path in sorted(PACKAGE.rglob("*.py"))
        if "torch.library.custom_op(" in path.read_text() or "@register_operator(" in path.read_text()
    ]
    assert registering, "no module registers an operator: the test looks in the wrong place"
    future = re.compile(r"^from __future__ import annotations", re.M)
    postponed = [name for name in registering if future.search((PACKAGE / name).read_text())]
    assert not postponed, f"string annotations in modules that register operators: {postponed}"


# The names the code around a registered operator gives its flat inputs and outputs.
FLAT_LISTS = {"inputs", "output", "outputs", "rest", "args", "settings"}


def test_no_operator_is_read_by_index():
    """Around a registered operator (its call, fake, setup and backward) the inputs and outputs are read by name
    (`operators.Inputs`, `fused_chunks.FusedOutputs`, `operators.gradients_for`): no ``inputs[2]``, ``rest[-6]`` or
    ``outputs[5:]``, and no backward that counts its ``None`` gradients (``(None,) * 9``)."""
    registering = [path for path in sorted(PACKAGE.rglob("*.py")) if "@register_operator(" in path.read_text()]
    assert {path.name for path in registering} >= {"custom_ops.py", "fused_linear.py"}
    by_index = []
    for path in registering:
        for node in ast.walk(ast.parse(path.read_text())):
            flat = isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in FLAT_LISTS
            if flat and not (isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str)):  # a key
                by_index.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
                if any(isinstance(side, ast.Tuple) and "None" in ast.unparse(side) for side in (node.left, node.right)):
                    by_index.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    assert not by_index, f"operator inputs or outputs read by position: {by_index}"


TRAINER = PACKAGE.parent / "trainer"
LONGEST_FUNCTION = 80  # lines: a trainer read top to bottom, each function in one screen


def test_the_trainer_reads_in_short_functions_and_nothing_imports_the_script():
    """No function of ``trainer/`` is over 80 lines, and no module imports ``trainer/train.py`` (the script at the
    top: evaluation, the session and the report live in modules of their own that it and others import)."""
    long = []
    for path in sorted(TRAINER.rglob("*.py")):
        tree = ast.parse(path.read_text())
        depth = len(path.relative_to(TRAINER).parts)  # 1: trainer/x.py; 2: trainer/offline/x.py
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > LONGEST_FUNCTION:
                    long.append(f"{path.name}:{node.name} ({length} lines)")
        imports_train = [
            node
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.level == depth and node.module == "train"
        ]
        if path.name not in ("train.py", "__main__.py"):
            assert not imports_train, f"{path.name} imports the script trainer/train.py"
    assert not long, long


def test_the_training_loop_does_not_import_the_offline_tools():
    """trainer/offline/ (the study, compare, answers, quantisation, plots) is run beside or after training: no module
    of the loop imports it, but train.py, which draws the run's figure once at its end (plots.plot_run)."""
    offline = {path.stem for path in (TRAINER / "offline").glob("*.py") if path.stem != "__init__"}
    assert {"study", "compare", "answers", "quantisation", "plots"} <= offline
    assert not offline & {path.stem for path in TRAINER.glob("*.py")}, "an offline tool beside the loop's modules"
    reaching = []
    for path in sorted(TRAINER.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and (node.module or "").startswith("offline"):
                names = {alias.name for alias in node.names}
                if not (path.name == "train.py" and node.module == "offline.plots" and names == {"plot_run"}):
                    reaching.append(f"{path.name}: from .{node.module} import {sorted(names)}")
    assert not reaching, reaching


# The functions longer than 80 lines, each at its length when this test was written: none may grow, and a new one
# is a failure. The oracle reads better whole (its docstring says why); the Triton forward kernel is one GPU program
# whose split into jit helpers could only be checked here under the interpreter, not compiled for a GPU (owed a
# split where a GPU can check it). Shorten one, and lower its number here; split it, and delete its line.
LONG_FUNCTIONS = {
    "gtpo_kernels/reference.py:reference_loss_from_token_stats": 217,
    "gtpo_kernels/backends/triton_token_stats.py:_token_stats_forward_kernel": 97,
}
LONGEST = 80


def function_lengths():
    """``{"path:name": lines}`` of every function and method of the package and the trainer."""
    lengths = {}
    for root in (PACKAGE, TRAINER):
        for path in sorted(root.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    key = f"{path.relative_to(PACKAGE.parent)}:{node.name}"
                    lengths[key] = max(lengths.get(key, 0), node.end_lineno - node.lineno + 1)
    return lengths


def test_no_function_grows_past_80_lines():
    lengths = function_lengths()
    too_long = {key: n for key, n in lengths.items() if n > LONG_FUNCTIONS.get(key, LONGEST)}
    assert not too_long, f"functions over {LONGEST} lines (or longer than LONG_FUNCTIONS allows): {too_long}"
    stale = {key for key in LONG_FUNCTIONS if key not in lengths or lengths[key] <= LONGEST}
    assert not stale, f"split or gone: delete these from LONG_FUNCTIONS: {sorted(stale)}"
