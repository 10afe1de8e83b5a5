"""`LossRows`: the per-row inputs of one loss call, checked once at the API and passed whole below it.

Every GTPO loss entry point (`gtpo_loss`, `fused_linear_gtpo_loss`) takes the same per-row inputs: the
completions' ids and mask, their advantages, the conflict weights (given, or computed here from whole
groups), the old and reference log-probs, the whole batch's counts, the initial entropy and the sampling
temperature. `checked_rows` validates them and returns one frozen `LossRows`; the objective
(`objective.py`) and the fused chunk walk (`fused_chunks.py`) take it as it is, and only the registered
operator's boundary (`fused_linear.fused_linear_gtpo`) flattens it into tensors and numbers, by name
(`LossRows.op_inputs`, `OP_PARAMETERS`).
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from dataclasses import dataclass
from typing import Callable, Dict, Mapping, Optional, Tuple, TypeVar, Union

import torch

from . import validation
from .config import GTPOConfig

Count = Union[int, float, torch.Tensor]
Conflict = Tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class LossRows:
    """The per-row inputs of one loss call (``N`` completions of ``L`` positions).

    Attributes:
        ids: ``[N, L]`` integer token ids.
        valid: ``[N, L]`` the completion mask; a bool tensor once checked (`checked_rows`).
        advantages: ``[N]`` raw advantages.
        conflict: ``(lambda_ [N, L], n_conflict [N])`` from whole groups, or ``None`` (not used by the config,
            or not computed yet: `with_conflict_weights`).
        old_logprobs, ref_logprobs: ``[N, L]`` or ``None``.
        sampling_logprobs: ``[N, L]`` the sampler's own log-probs of the tokens (vLLM's), for
            ``config.sampling_correction``, or ``None``.
        initial_entropy: the policy's first-step mean token entropy (the entropy gate), or ``None``.
        temperature: the sampling temperature: a float, or ``[N]`` each completion's (mixed-temperature rollouts).
        num_sequences, num_tokens: the whole optimisation batch's completions and unmasked tokens, or ``None``
            for this call's own.
        group_size: ``G`` when the rows are whole groups and the conflict weights are still to be computed from
            them; ``None`` otherwise (a slice of a batch holds no whole groups).
        entropy_floor: ``(threshold, kept_share)`` 0-d tensors of ``config.top_entropy_quantile``, from the whole
            call's entropies (`objective.entropy_floor`), for a step that sees part of the call's rows (a chunk of
            the fused path); ``None``: computed from the rows at hand.
        cov_selected: ``[N, L]`` bool, the tokens ``config.cov_mode`` picked from the whole call's tokens
            (`objective.covariance_tokens`), for a step that sees part of the call's rows; ``None``: picked from
            the rows at hand.
    """

    ids: torch.Tensor
    valid: torch.Tensor
    advantages: torch.Tensor
    conflict: Optional[Conflict] = None
    old_logprobs: Optional[torch.Tensor] = None
    ref_logprobs: Optional[torch.Tensor] = None
    sampling_logprobs: Optional[torch.Tensor] = None
    initial_entropy: Optional[float] = None
    temperature: Union[float, torch.Tensor] = 1.0
    num_sequences: Optional[Count] = None
    num_tokens: Optional[Count] = None
    group_size: Optional[int] = None
    entropy_floor: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
    cov_selected: Optional[torch.Tensor] = None

    @property
    def lambda_(self) -> Optional[torch.Tensor]:
        return None if self.conflict is None else self.conflict[0]

    @property
    def n_conflict(self) -> Optional[torch.Tensor]:
        return None if self.conflict is None else self.conflict[1]

    @property
    def token_temperature(self) -> Union[float, torch.Tensor]:
        """The temperature of each token: the float, or ``[N, L]`` (each completion's, expanded: a view)."""
        return validation.token_temperature(self.temperature, tuple(self.ids.shape))

    def replace(self, **changes) -> LossRows:
        # Not dataclasses.replace: torch 2.6's compiler cannot trace its look-up of the class's fields.
        return LossRows(**{**{name: getattr(self, name) for name in _FIELDS}, **changes})

    def slice(self, rows) -> LossRows:
        """The same inputs for ``rows`` (a slice or an index tensor) as this call's share: the counts stay this
        call's whole (``N`` and its unmasked tokens where none were given), so the slices' losses add up to
        this call's loss."""

        def pick(tensor):
            return None if tensor is None else tensor[rows]

        return self.replace(
            ids=self.ids[rows],
            valid=self.valid[rows],
            advantages=self.advantages[rows],
            conflict=None if self.conflict is None else (self.conflict[0][rows], self.conflict[1][rows]),
            old_logprobs=pick(self.old_logprobs),
            ref_logprobs=pick(self.ref_logprobs),
            sampling_logprobs=pick(self.sampling_logprobs),
            cov_selected=pick(self.cov_selected),
            temperature=pick(self.temperature) if isinstance(self.temperature, torch.Tensor) else self.temperature,
            num_sequences=self.valid.shape[0] if self.num_sequences is None else self.num_sequences,
            num_tokens=self.valid.sum() if self.num_tokens is None else self.num_tokens,
            group_size=None,
        )

    def row_keywords(self) -> Dict[str, object]:
        """The rows as an entry point's keywords (`ROW_KEYWORDS`), beside its three positional row arguments:
        ``gtpo_loss(logits, rows.ids, rows.valid, rows.advantages, **rows.row_keywords())``."""
        return {name: getattr(self, name) for name in ROW_KEYWORDS}

    def op_inputs(self) -> Dict[str, object]:
        """The rows as a registered operator takes them: flat tensors and numbers named as in `OP_PARAMETERS`
        (``group_size`` is not among them: the conflict weights are computed before an operator runs). The
        temperature is two: a float (1.0 when per completion) and an optional ``[N]`` tensor."""
        per_row = isinstance(self.temperature, torch.Tensor)
        return dict(
            ids=self.ids,
            valid=self.valid,
            advantages=self.advantages,
            lambda_=self.lambda_,
            n_conflict=self.n_conflict,
            old_logprobs=self.old_logprobs,
            ref_logprobs=self.ref_logprobs,
            sampling_logprobs=self.sampling_logprobs,
            initial_entropy=self.initial_entropy,
            temperature=1.0 if per_row else self.temperature,
            row_temperature=self.temperature if per_row else None,
            num_sequences=self.num_sequences,
            num_tokens=self.num_tokens,
        )

    @classmethod
    def from_op_inputs(cls, inputs: Mapping[str, object]) -> LossRows:
        """The inverse of `op_inputs` (``inputs`` may hold an operator's other arguments too)."""
        row_temperature, lambda_ = inputs["row_temperature"], inputs["lambda_"]
        return cls(
            ids=inputs["ids"],
            valid=inputs["valid"],
            advantages=inputs["advantages"],
            conflict=None if lambda_ is None else (lambda_, inputs["n_conflict"]),
            old_logprobs=inputs["old_logprobs"],
            ref_logprobs=inputs["ref_logprobs"],
            sampling_logprobs=inputs["sampling_logprobs"],
            initial_entropy=inputs["initial_entropy"],
            temperature=inputs["temperature"] if row_temperature is None else row_temperature,
            num_sequences=inputs["num_sequences"],
            num_tokens=inputs["num_tokens"],
        )


# The rows' arguments of a registered operator, typed as its schema takes them (`operators.signature_of`): what
# `LossRows.op_inputs` gives. The counts are 0-d float64 tensors by then (`fused_linear` converts them).
OP_PARAMETERS = (
    ("ids", torch.Tensor),
    ("valid", torch.Tensor),
    ("advantages", torch.Tensor),
    ("lambda_", Optional[torch.Tensor]),
    ("n_conflict", Optional[torch.Tensor]),
    ("old_logprobs", Optional[torch.Tensor]),
    ("ref_logprobs", Optional[torch.Tensor]),
    ("sampling_logprobs", Optional[torch.Tensor]),
    ("initial_entropy", Optional[float]),
    ("temperature", float),
    ("row_temperature", Optional[torch.Tensor]),
    ("num_sequences", Optional[torch.Tensor]),
    ("num_tokens", Optional[torch.Tensor]),
)
# The fields that do not reach an operator, and why (tests/test_rows.py holds every other field to it).
NOT_OPERATOR_INPUTS = {
    "group_size": "the conflict weights are computed from whole groups before an operator runs",
    "entropy_floor": "computed inside the operator, from the whole call's entropies",
    "cov_selected": "picked inside the operator, from the whole call's tokens",
}


_FIELDS = tuple(field.name for field in dataclasses.fields(LossRows))  # read once, outside any compiled code

# The per-row keywords every loss entry point takes, declared once: `LossRows`' fields after the three that are
# positional arguments (``completion_ids``, ``completion_mask``, ``advantages``), less the one the loss computes.
# A new per-row input is a new field; `takes_row_keywords` puts it in every entry point's signature.
_POSITIONAL = ("ids", "valid", "advantages")
_COMPUTED = ("entropy_floor", "cov_selected")
ROW_KEYWORDS = tuple(name for name in _FIELDS if name not in _POSITIONAL + _COMPUTED)

Entry = TypeVar("Entry", bound=Callable)


def rows_of_call(
    entry: str, completion_ids, completion_mask, advantages, row_keywords: dict, not_taken: Tuple[str, ...] = ()
) -> LossRows:
    """The `LossRows` of a loss call: its three positional row arguments and its ``row_keywords`` (the ``**``
    of an entry point that `takes_row_keywords`). A keyword that is not a row keyword is refused as Python
    refuses one, naming the entry point."""
    for name in row_keywords:
        if name not in ROW_KEYWORDS or name in not_taken:
            raise TypeError(f"{entry}() got an unexpected keyword argument {name!r}")
    return LossRows(completion_ids, completion_mask, advantages, **row_keywords)


def takes_row_keywords(not_taken: Tuple[str, ...] = ()) -> Callable[[Entry], Entry]:
    """Declares that a loss entry point's ``**row_keywords`` are `ROW_KEYWORDS` (less ``not_taken``): its
    signature, as ``help`` and ``inspect.signature`` show it, lists each one, keyword-only, with its type and
    default from `LossRows`, in place of the ``**``. The function reads them with `rows_of_call`."""
    hints = typing.get_type_hints(LossRows)
    defaults = {field.name: field.default for field in dataclasses.fields(LossRows)}
    declared = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=defaults[name], annotation=hints[name])
        for name in ROW_KEYWORDS
        if name not in not_taken
    ]

    def declare(entry: Entry) -> Entry:
        signature = inspect.signature(entry)
        own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        clash = {p.name for p in own} & {p.name for p in declared}
        if len(own) == len(signature.parameters) or clash:
            raise TypeError(f"{entry.__name__} must end in **row_keywords and not name a row keyword itself: {clash}")
        positional = [p for p in own if p.kind is not inspect.Parameter.KEYWORD_ONLY]
        keyword_only = [p for p in own if p.kind is inspect.Parameter.KEYWORD_ONLY]
        entry.__signature__ = signature.replace(parameters=positional + declared + keyword_only)
        return entry

    return declare


def checked_rows(
    source: torch.Tensor, name: str, given: LossRows, config: GTPOConfig
) -> Tuple[LossRows, validation.DeferredChecks]:
    """Checks the per-row inputs of a loss call on ``source`` (the ``[N, L, *]`` argument ``name``: "logits" or
    "hidden_states") and returns them checked (a bool mask, the initial entropy and temperature as floats,
    ``group_size`` kept only where the conflict weights are still to be computed) with the value checks queued
    on ``checks``: the caller adds its own (the ids' range, the statistics) and reads them all once."""
    shape = validation.check_rows_match_ids(source, name, given.ids)
    # Value checks need the device's answer: eager mode only (under torch.compile they would break the graph).
    checks = validation.DeferredChecks(config.validate_inputs and not torch.compiler.is_compiling())
    group_size = given.group_size
    needs_groups = config.use_conflict_weights and given.conflict is None
    if needs_groups and group_size is None:
        raise ValueError(
            "the config uses conflict weights, which compare the completions of a group: pass "
            "group_size=G with whole groups, or conflict=conflict_weights(ids, mask, advantages, G) "
            "computed on whole groups and sliced like these rows (or set use_conflict_weights=False)"
        )
    if group_size is not None and not needs_groups:
        validation.check_group_size(group_size, None)
        group_size = None  # unused: not required to divide a slice's rows
    valid, initial_entropy = validation.check_loss_inputs(source, given, group_size, checks)
    if config.use_conflict_weights and given.conflict is not None:
        validation.check_conflict(given.conflict, shape, source, name, checks)
    if config.loss_reduction == "dr_grpo" and given.num_sequences is not None and config.max_completion_length is None:
        raise ValueError(
            "loss_reduction='dr_grpo' divides by num_sequences * max_completion_length; for a call that "
            "holds a slice of the batch (num_sequences given) set GTPOConfig(max_completion_length=...) "
            "to the generation cap, or each slice would divide by its own padded length and the "
            "slices would not add up to the whole batch's loss"
        )
    if config.sampling_correction is not None and given.sampling_logprobs is None:
        raise ValueError(
            f"config.sampling_correction = {config.sampling_correction!r} needs sampling_logprobs [N, L], the "
            f"sampler's log-probs of the tokens (vLLM's); pass them or set sampling_correction=None"
        )
    readers = config.sampling_correction is not None or config.off_policy_mask_threshold is not None
    if not readers and given.sampling_logprobs is not None:
        raise ValueError(
            "sampling_logprobs were given but neither config.sampling_correction nor off_policy_mask_threshold is "
            "set, so nothing would read them: set one (e.g. sampling_correction='token_truncate') or leave "
            "sampling_logprobs out"
        )
    if config.kl_beta and given.ref_logprobs is None:
        raise ValueError(
            f"config.kl_beta = {config.kl_beta} needs ref_logprobs [N, L]; pass the reference "
            f"model's log-probs or set kl_beta=0"
        )
    validation.check_count(
        "num_sequences",
        given.num_sequences,
        shape[0],
        checks,
        "the number of completions in the whole optimisation batch",
    )
    # No lower bound from this call: under DDP, which averages the processes' gradients, each process passes
    # the whole batch's tokens divided by the number of processes, which a process with long completions
    # may exceed on its own.
    validation.check_count(
        "num_tokens",
        given.num_tokens,
        0,
        checks,
        "the number of unmasked tokens in the whole optimisation batch (summed over every "
        "rank and micro-batch; divided by the number of processes when DDP averages them)",
    )
    rows = given.replace(
        valid=valid,
        initial_entropy=initial_entropy,
        temperature=validation.check_temperature(given.temperature, shape[0], checks),
        group_size=group_size,
    )
    return rows, checks


def resolved_config(config: Optional[GTPOConfig]) -> GTPOConfig:
    """``config``, or the default (``"paper"``) one; anything else is refused."""
    config = config or GTPOConfig()
    if not isinstance(config, GTPOConfig):
        raise TypeError(f"config must be a GTPOConfig, got {type(config).__name__}")
    return config
