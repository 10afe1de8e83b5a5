"""Registered operators whose inputs are read by name.

A ``torch.library`` operator takes flat tensors and numbers, and hands its fake, its ``setup_context`` and its
backward the same flat list. `register_operator` registers a function as an operator (``mutates_args=()``) and
keeps its parameter names on it, so that code around it reads ``Inputs(op, inputs).logits`` and returns
``gradients_for(op, logits=grad)`` instead of ``inputs[0]`` and ``(grad,) + (None,) * 9``. An operator whose
parameters come from typed bundles (`rows.LossRows`, a config) is given its signature whole (`signature_of`):
the bundles declare their fields once, and a new field is a new argument without editing an index anywhere.
"""

# No `from __future__ import annotations` here: the annotations below are handed to torch.library, which cannot read
# them as strings on torch 2.4-2.6 (tools/torch-matrix.md).
import inspect
from typing import Any, Callable, Iterable, Optional, Sequence, Tuple

import torch

Parameters = Sequence[Tuple[str, Any]]  # (name, annotation) in the operator's order


def signature_of(*groups: Parameters, returns: Any) -> inspect.Signature:
    """The positional signature made of ``groups`` of ``(name, annotation)`` in order; a name given twice is
    refused (two bundles claiming one argument)."""
    parameters = [
        inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=annotation)
        for group in groups
        for name, annotation in group
    ]
    names = [p.name for p in parameters]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise TypeError(f"an operator's argument is declared twice: {twice}")
    return inspect.Signature(parameters, return_annotation=returns)


def register_operator(name: str, signature: Optional[inspect.Signature] = None) -> Callable:
    """``torch.library.custom_op(name, mutates_args=())`` on the decorated function, with ``signature`` in place of
    the function's own when given (the function then takes ``*inputs``). The operator keeps its parameter names as
    ``input_names``, which `Inputs` and `gradients_for` read."""

    def register(function: Callable):
        if signature is not None:
            function.__signature__ = signature
        operator = torch.library.custom_op(name, mutates_args=())(function)
        operator.input_names = tuple(inspect.signature(function).parameters)
        return operator

    return register


class Inputs:
    """An operator's flat inputs as attributes named by its parameters: ``Inputs(op, inputs).ids``."""

    def __init__(self, operator, values: Iterable[Any]) -> None:
        values = tuple(values)
        if len(values) != len(operator.input_names):
            raise TypeError(f"{len(values)} inputs for an operator of {len(operator.input_names)}")
        self.__dict__.update(zip(operator.input_names, values))

    def pick(self, names: Iterable[str]) -> dict:
        """``{name: value}`` of ``names`` (a bundle's share of the inputs)."""
        return {name: self.__dict__[name] for name in names}


def gradients_for(operator, **gradients) -> tuple:
    """A backward's return value: the named inputs' gradients, ``None`` for every other input."""
    unknown = sorted(set(gradients) - set(operator.input_names))
    if unknown:
        raise TypeError(f"gradients for inputs the operator does not take: {unknown}")
    return tuple(gradients.get(name) for name in operator.input_names)
