"""`LossRows`, the one bundle of per-row inputs: a slice is the rows' exact share of the call, the operator's
flat arguments round-trip, and no function of the package threads the inputs one by one any more."""

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest
import torch

import gtpo_kernels
from gtpo_kernels import GTPOConfig, conflict_weights, gtpo_loss
from gtpo_kernels.fused_linear import fused_linear_gtpo_loss
from gtpo_kernels.loss import loss_of_rows
from gtpo_kernels.reference import reference_gtpo_loss, reference_loss_from_token_stats
from gtpo_kernels.rows import NOT_OPERATOR_INPUTS, OP_PARAMETERS, ROW_KEYWORDS, LossRows

from .helpers import random_batch

PACKAGE = Path(gtpo_kernels.__file__).resolve().parent


def rows_of(n_groups=2, group=3, length=5, vocab=17, seed=0):
    logits, ids, mask, adv = random_batch(n_groups, group, length, vocab, dtype=torch.float64, seed=seed)
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(ids.shape, generator=g, dtype=torch.float64) - 2
    rows = LossRows(ids, mask, adv, conflict=conflict_weights(ids, mask, adv, group), old_logprobs=old)
    return logits, rows


def test_slices_add_up_to_the_call():
    """Shuffled slices of one call's rows, each a `LossRows.slice`, add up to the call's loss and gradient."""
    logits, rows = rows_of()
    logits = 8 * logits  # confident rows: not all above the entropy threshold
    config = GTPOConfig(preset="official", loss_reduction="token_mean")
    x = logits.clone().requires_grad_()
    whole = loss_of_rows(x, rows, config)
    assert whole.loss.abs() > 1e-3
    (grad_whole,) = torch.autograd.grad(whole.loss, x)
    parts = torch.randperm(rows.ids.shape[0], generator=torch.Generator().manual_seed(1)).split([2, 3, 1])
    y = logits.clone().requires_grad_()
    total = sum(loss_of_rows(y[p], rows.slice(p), config).loss for p in parts)
    (grad_parts,) = torch.autograd.grad(total, y)
    torch.testing.assert_close(total, whole.loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad_parts, grad_whole, rtol=1e-12, atol=1e-14)


def test_a_slice_keeps_the_whole_calls_counts_and_drops_the_group_size():
    _, rows = rows_of()
    rows = rows.replace(group_size=3)
    part = rows.slice(slice(1, 3))
    assert part.num_sequences == 6 and int(part.num_tokens) == int(rows.valid.sum())
    assert part.group_size is None  # two rows of a group of three are no whole group
    assert torch.equal(part.ids, rows.ids[1:3]) and torch.equal(part.lambda_, rows.lambda_[1:3])
    assert torch.equal(part.old_logprobs, rows.old_logprobs[1:3]) and part.ref_logprobs is None
    given = rows.replace(num_sequences=40, num_tokens=torch.tensor(90.0))
    assert given.slice([0]).num_sequences == 40 and float(given.slice([0]).num_tokens) == 90.0


def test_gtpo_loss_is_loss_of_rows():
    logits, rows = rows_of(seed=3)
    config = GTPOConfig()
    a = gtpo_loss(logits, rows.ids, rows.valid, rows.advantages, group_size=3, config=config).loss
    b = loss_of_rows(logits, LossRows(rows.ids, rows.valid, rows.advantages, group_size=3), config).loss
    assert torch.equal(a, b)


# Every field of LossRows but the three positional arguments and the computed entropy floor, written out here by
# hand (not read from the code under test): a field added to the bundle must reach every entry point.
EXPECTED_ROW_KEYWORDS = {
    "conflict",
    "old_logprobs",
    "ref_logprobs",
    "sampling_logprobs",
    "initial_entropy",
    "temperature",
    "num_sequences",
    "num_tokens",
    "group_size",
}
ENTRY_POINTS = [gtpo_loss, fused_linear_gtpo_loss, reference_gtpo_loss, reference_loss_from_token_stats]


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=lambda f: f.__name__)
def test_every_entry_point_takes_every_row_keyword(entry):
    """The row keywords are declared once (LossRows' fields) and each entry point's signature lists them all,
    keyword-only, with the bundle's defaults; the oracle on token statistics takes all but the temperature."""
    fields = {field.name: field.default for field in dataclasses.fields(LossRows)}
    assert set(fields) - {"ids", "valid", "advantages", "entropy_floor", "cov_selected"} == EXPECTED_ROW_KEYWORDS
    expected = EXPECTED_ROW_KEYWORDS - ({"temperature"} if entry is reference_loss_from_token_stats else set())
    parameters = inspect.signature(entry).parameters
    taken = {name for name in parameters if name in fields} - {"advantages", "valid"}  # positional arguments
    assert taken == expected
    for name in expected:
        assert parameters[name].kind is inspect.Parameter.KEYWORD_ONLY and parameters[name].default == fields[name]
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    assert set(ROW_KEYWORDS) == EXPECTED_ROW_KEYWORDS


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=lambda f: f.__name__)
def test_a_misspelt_row_keyword_is_refused_by_name(entry):
    logits, rows = rows_of()
    head = torch.randn(logits.shape[-1], 4, dtype=torch.float64)
    first = (logits[..., :4], head) if entry is fused_linear_gtpo_loss else (logits,)
    if entry is reference_loss_from_token_stats:
        first = (logits[..., 0], logits[..., 1])
    with pytest.raises(TypeError, match=rf"^{entry.__name__}\(\) got an unexpected keyword argument 'old_logprob'$"):
        entry(*first, rows.ids, rows.valid, rows.advantages, config=GTPOConfig(), old_logprob=rows.old_logprobs)
    if entry is reference_loss_from_token_stats:
        with pytest.raises(TypeError, match="unexpected keyword argument 'temperature'"):
            entry(*first, rows.ids, rows.valid, rows.advantages, config=GTPOConfig(), temperature=0.5)


def test_the_operator_arguments_round_trip():
    _, rows = rows_of()
    for temperature in (0.7, torch.rand(rows.ids.shape[0]) + 0.5):
        counts = dict(num_sequences=12, num_tokens=torch.tensor(9.0))
        rows = rows.replace(initial_entropy=0.3, temperature=temperature, **counts)
        back = LossRows.from_op_inputs(rows.op_inputs())
        for name in ROUND_TRIP:
            assert getattr(back, name) is getattr(rows, name), name
        assert back.conflict[0] is rows.conflict[0] and back.conflict[1] is rows.conflict[1]
    assert LossRows.from_op_inputs(rows.replace(conflict=None).op_inputs()).conflict is None


# Each field of LossRows reaches the fused operator by name, but these three (written here by hand: a field added to
# the bundle and not to the operator fails below).
NOT_AN_OPERATOR_INPUT = {"group_size", "entropy_floor", "cov_selected"}
ROUND_TRIP = EXPECTED_ROW_KEYWORDS - NOT_AN_OPERATOR_INPUT - {"conflict"} | {"ids", "valid", "advantages"}


def test_every_field_of_the_bundle_reaches_the_operator():
    """Every field but group_size, entropy_floor and cov_selected is an argument of the fused operator (the conflict
    pair as two, the temperature as a float and a per-row tensor), declared by name, and the operator takes no
    other row input."""
    from gtpo_kernels.fused_linear import fused_linear_gtpo

    fields = {field.name for field in dataclasses.fields(LossRows)}
    assert set(NOT_OPERATOR_INPUTS) == NOT_AN_OPERATOR_INPUT
    _, rows = rows_of()
    names = set(rows.op_inputs())
    assert names == {name for name, _ in OP_PARAMETERS}
    spelled = (fields - NOT_AN_OPERATOR_INPUT - {"conflict"}) | {"lambda_", "n_conflict", "row_temperature"}
    assert names == spelled
    assert names <= set(fused_linear_gtpo.input_names)


# Functions whose signature is not ours to shorten: the public entry points (their keywords are the users'
# API), the float64 oracle that mirrors them, registered operators and their fakes (torch.library takes flat
# tensors and numbers), Triton kernels (pointers and strides), the backends' kernel contract
# (`backends.base.Backend`), and overrides of TRL's methods (TRL's signatures).
EXEMPT = {
    "gtpo_loss",
    "fused_linear_gtpo_loss",
    "fused_linear_token_logprobs_and_entropy",
    "_get_per_token_logps_and_entropies",
}
KERNEL_CONTRACT = {"backends/torch_backend.py", "backends/cpu_backend.py", "backends/triton_token_stats.py"}
MAX_PARAMETERS = 8


def parameter_counts():
    """``[(count, "file:line name")]`` of every function in the package outside ``EXEMPT``."""
    counts = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name in EXEMPT:
                continue
            decorators = {ast.unparse(d).split("(")[0] for d in node.decorator_list}
            if decorators & {"triton.jit", "torch.library.custom_op", "register_operator"} or any(
                ".register_fake" in d for d in decorators
            ):
                continue
            if relative in KERNEL_CONTRACT and node.name in ("forward", "backward"):
                continue
            a = node.args
            n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
            n -= bool(a.args) and a.args[0].arg in ("self", "cls", "ctx")
            counts.append((n, f"{relative}:{node.lineno} {node.name}"))
    return sorted(counts, reverse=True)


def test_no_function_threads_the_inputs_one_by_one():
    counts = parameter_counts()
    assert counts and counts[0][0] <= MAX_PARAMETERS, counts[:5]
