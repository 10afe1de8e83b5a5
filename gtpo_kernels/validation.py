"""Input checks for the public API. Each error names the argument and says how to fix it.

Checks of shapes, dtypes and devices run on the host. Checks of values (mask pattern, ids in the
vocabulary, finite advantages and statistics, whole-batch counts) need the device's answer: each adds a
0-d flag to a `DeferredChecks`, and a loss call reads all of its flags, with anything else it needs from
the device, in one host synchronisation (`DeferredChecks.read`). Only when a flag is up does the
matching ``explain`` run the check again on the host, to name the first bad entry.
"""

from __future__ import annotations

import math
import warnings
from typing import Callable, List, Optional, Tuple

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _fail(message: str) -> None:
    raise ValueError(message)


_WARNED = set()  # warnings given in this process (each once)


def no_signal_message(filtered_fraction: Optional[float], config) -> str:
    why = (
        "every completion was dropped by the entropy filter (metrics.filtered_fraction = 1: their mean "
        f"entropy is above entropy_threshold = {config.entropy_threshold:.3g} nats; a trained policy is far more "
        "confident than random logits, or pass initial_entropy for the paper preset's gate)"
        if filtered_fraction is not None and filtered_fraction >= 1
        else "no completion carries a non-zero advantage (groups whose rewards are all equal, or every token "
        "masked; metrics.signal_fraction = 0)"
    )
    return (
        f"gtpo_kernels: this loss call has no learning signal, so its loss and gradient are exactly 0: {why}. "
        f"Warned once per process; GTPOConfig(warn_no_signal=False) turns it off"
    )


class DeferredChecks:
    """Value checks answered by the device and read together: one host synchronisation per loss call.

    ``enabled=False`` (``validate_inputs=False``, or tracing under ``torch.compile``) records nothing."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._flags: List[torch.Tensor] = []
        self._explain: List[Callable[[], None]] = []
        self._warnings: List[Tuple[torch.Tensor, str, Callable[[], str]]] = []

    def add_warning(self, raised: torch.Tensor, key: str, message: Callable[[], str]) -> None:
        """A 0-d bool read with the flags: when true, ``warnings.warn(message())`` once per process per ``key``."""
        if self.enabled and key not in _WARNED:
            self._warnings.append((raised.reshape(1), key, message))

    def add(self, bad: torch.Tensor, explain: Callable[[], None]) -> None:
        """``bad``: a 0-d bool tensor, true when the check fails; ``explain()`` raises the check's error."""
        if self.enabled:
            self._flags.append(bad.reshape(1))
            self._explain.append(explain)

    def read(self, values: Optional[torch.Tensor] = None, stacklevel: int = 3) -> Optional[List[int]]:
        """Reads every flag, and ``values`` (an integer tensor on the same device, e.g. row lengths) with
        them, in one synchronisation; raises the first failed check's error; returns ``values`` as a list."""
        parts = [flag.to(torch.int64) for flag in self._flags + [w[0] for w in self._warnings]]
        if values is not None:
            parts.append(values.reshape(-1).to(torch.int64))
        if not parts:
            return None
        data = torch.cat(parts).tolist()
        n_flags, n_warnings = len(self._flags), len(self._warnings)
        for flag, explain in zip(data[:n_flags], self._explain):
            if flag:
                explain()
                raise AssertionError("a gtpo_kernels input check failed on the device but not on the host")
        for flag, (_, key, message) in zip(data[n_flags : n_flags + n_warnings], self._warnings):
            if flag and key not in _WARNED:
                _WARNED.add(key)
                warnings.warn(message(), RuntimeWarning, stacklevel=stacklevel)  # at the user's call
        self._flags, self._explain, self._warnings = [], [], []
        return None if values is None else data[n_flags + n_warnings :]


def check_float(name: str, tensor: torch.Tensor, shape: tuple, what: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor of shape {what}, got {type(tensor).__name__}")
    if not tensor.is_floating_point():
        _fail(f"{name} must be a floating-point tensor, got {tensor.dtype}; did you pass ids or a mask in its place?")
    if tuple(tensor.shape) != tuple(shape):
        _fail(f"{name} must have shape {what} = {tuple(shape)}, got {tuple(tensor.shape)}")


def check_group_size(group_size, n_rows: Optional[int]) -> None:
    """``group_size`` is a positive int dividing ``n_rows`` (``n_rows=None``: the type only)."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        _fail(f"group_size must be a positive int (completions per prompt), got {group_size!r}")
    if n_rows is not None and n_rows % group_size:
        _fail(
            f"group_size ({group_size}) must divide the number of completions N = {n_rows}; "
            f"pass whole groups (rows b*G .. b*G+G-1 are one prompt's completions), or, for a slice of a "
            f"batch that cuts through groups, pass conflict=conflict_weights(...) computed on whole groups"
        )


def check_temperature(temperature, n_rows: Optional[int] = None, checks: Optional[DeferredChecks] = None):
    """The sampling temperature: a finite number > 0 (returned as a float), or ``[N]`` one per completion
    (mixed-temperature rollouts: returned as a float32 tensor, float64 kept; its values checked on ``checks``).
    A one-element tensor is read as a number."""
    if isinstance(temperature, torch.Tensor) and temperature.numel() == 1 and not torch.compiler.is_compiling():
        temperature = float(temperature)
    if isinstance(temperature, torch.Tensor):
        if not temperature.is_floating_point() or temperature.shape != (n_rows,):
            _fail(
                f"temperature must be a number or a float tensor [N] = [{n_rows}] (each completion's sampling "
                f"temperature), got {temperature.dtype} {tuple(temperature.shape)}"
            )
        temperature = temperature.detach()
        if temperature.dtype != torch.float64:
            temperature = temperature.float()
        if checks is not None:
            checks.add(
                ~(torch.isfinite(temperature) & (temperature > 0)).all(),
                lambda: _fail(
                    f"temperature must be finite and > 0 for every completion; completions "
                    f"{(~(torch.isfinite(temperature) & (temperature > 0))).nonzero().flatten().tolist()[:8]} are not"
                ),
            )
        return temperature
    if torch.compiler.is_compiling():  # checked in eager mode; a traced float may be symbolic
        return temperature
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or not (math.isfinite(temperature) and temperature > 0)
    ):
        _fail(f"temperature must be a finite number > 0 (the sampling temperature), got {temperature!r}")
    return float(temperature)


def token_temperature(temperature, shape: tuple):
    """The temperature of each token of ``[N, L]`` rows: a float as it is, ``[N]`` expanded to ``[N, L]`` (a view)."""
    if isinstance(temperature, torch.Tensor):
        return temperature[:, None].expand(shape)
    return temperature


def check_conflict(conflict, shape: tuple, anchor: torch.Tensor, anchor_name: str, checks: DeferredChecks) -> None:
    """``conflict = (lambda_ [N, L] float, n_conflict [N] integer)``, as `conflict_weights` returns."""
    if not (
        isinstance(conflict, (tuple, list))
        and len(conflict) == 2
        and all(isinstance(t, torch.Tensor) for t in conflict)
    ):
        _fail(
            f"conflict must be the pair (lambda_ [N, L], n_conflict [N]) returned by conflict_weights(...), "
            f"got {type(conflict).__name__}"
        )
    lambda_, n_conflict = conflict
    check_float("conflict[0] (lambda_)", lambda_, shape, "[N, L]")
    if n_conflict.is_floating_point() or n_conflict.dtype == torch.bool or tuple(n_conflict.shape) != shape[:1]:
        _fail(
            f"conflict[1] (n_conflict) must be an integer tensor of shape [N] = {shape[:1]}, got "
            f"{n_conflict.dtype} {tuple(n_conflict.shape)}"
        )
    check_same_device(**{anchor_name: anchor, "conflict[0]": lambda_, "conflict[1]": n_conflict})

    def explain():
        _fail(
            "conflict[0] (lambda_) must be finite and >= 0; pass what conflict_weights(...) returned, sliced "
            "like the rows"
        )

    checks.add(~(torch.isfinite(lambda_) & (lambda_ >= 0)).all(), explain)


def check_count(name: str, value, at_least, checks: DeferredChecks, what: str) -> None:
    """A whole-batch count: an int or a one-element tensor, finite, > 0 and at least ``at_least`` (an int or
    a 0-d tensor: this call's own count, or 0 where a smaller share is legitimate)."""
    if value is None:
        return
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            _fail(
                f"{name} must be a number or a one-element tensor ({what}), got a {value.dtype} tensor of "
                f"shape {tuple(value.shape)}"
            )
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(f"{name} must be a number ({what}), got {value!r}")

    def explain():
        shown = float(value) if isinstance(value, torch.Tensor) else value
        if not float(at_least):
            _fail(f"{name} = {shown!r} must be a finite number > 0: {what}")
        _fail(
            f"{name} = {shown!r} is less than this call's own count ({float(at_least):g}): it must be {what}, "
            f"summed over every rank and micro-batch"
        )

    if isinstance(value, torch.Tensor) or isinstance(at_least, torch.Tensor):
        device = (value if isinstance(value, torch.Tensor) else at_least).device
        v = torch.as_tensor(value, dtype=torch.float64, device=device).reshape(())
        floor = torch.as_tensor(at_least, dtype=torch.float64, device=device)
        checks.add(~(torch.isfinite(v) & (v >= floor) & (v > 0)), explain)
    elif not (math.isfinite(value) and value >= at_least and value > 0):
        explain()


def check_mask(completion_mask: torch.Tensor, shape: tuple, checks: DeferredChecks) -> torch.Tensor:
    """Returns the mask as bool after checking it is ``[N, L]`` of 0/1 and that every non-empty row starts
    with a 1 (right padding). Holes inside a row are allowed: those positions take no part in the loss (e.g.
    a tool's output inside a completion; see docs/method.md, "Inputs")."""
    if not isinstance(completion_mask, torch.Tensor):
        _fail(f"completion_mask must be a torch.Tensor [N, L], got {type(completion_mask).__name__}")
    if tuple(completion_mask.shape) != tuple(shape):
        _fail(f"completion_mask must have shape [N, L] = {tuple(shape)}, got {tuple(completion_mask.shape)}")
    if completion_mask.dtype != torch.bool:

        def explain_values():
            _fail("completion_mask must hold only 0 and 1 (or be a bool tensor)")

        checks.add(~((completion_mask == 0) | (completion_mask == 1)).all(), explain_values)
        completion_mask = completion_mask != 0
    if completion_mask.shape[1] > 0:
        # A row whose first position is masked but a later one is not: left padding, which would misalign the
        # completions' positions (holes after the first token are a completion's tool outputs).
        left_padded = completion_mask.any(dim=1) & ~completion_mask[:, 0]

        def explain_left_padding():
            row = int(left_padded.nonzero()[0, 0])
            _fail(
                f"completion_mask must start each non-empty row with a 1 (right padding), but row {row} starts "
                f"with a 0; left-padded masks are not supported: shift each completion to start at position 0"
            )

        checks.add(left_padded.any(), explain_left_padding)
    return completion_mask


def check_ids(completion_ids: torch.Tensor) -> tuple:
    """Checks ``completion_ids`` is a 2-D integer tensor and returns its shape ``(N, L)``."""
    if not isinstance(completion_ids, torch.Tensor):
        _fail(f"completion_ids must be a torch.Tensor [N, L], got {type(completion_ids).__name__}")
    if completion_ids.is_floating_point() or completion_ids.is_complex() or completion_ids.dtype == torch.bool:
        _fail(
            f"completion_ids must be an integer tensor (token ids), got {completion_ids.dtype}; "
            f"did you swap completion_ids with the mask or the logits?"
        )
    if completion_ids.dim() != 2:
        _fail(f"completion_ids must be 2-D [N, L], got shape {tuple(completion_ids.shape)}")
    return tuple(completion_ids.shape)


# The tensor a loss or statistics call reads its rows from, by argument name, and its layout (for errors).
LAYOUTS = {"logits": "[N, L, V]", "hidden_states": "[N, L, H]"}


def check_rows_match_ids(source: torch.Tensor, name: str, completion_ids: torch.Tensor) -> tuple:
    """Checks ``completion_ids`` (`check_ids`) and that ``source`` (the argument ``name``, "logits" or
    "hidden_states") has one position per id; returns ``(N, L)``."""
    shape = check_ids(completion_ids)
    if tuple(source.shape[:2]) != shape:
        _fail(
            f"{name} {LAYOUTS[name]} = {tuple(source.shape)} and completion_ids [N, L] = {shape} disagree on N or L; "
            f"position t of row i must predict completion_ids[i, t]"
        )
    return shape


def check_stats_inputs(
    source: torch.Tensor,
    name: str,
    completion_ids: torch.Tensor,
    completion_mask: Optional[torch.Tensor],
    temperature,
    checks: DeferredChecks,
) -> Tuple[torch.Tensor, object]:
    """The checks of the no-grad statistics functions (on logits or on hidden states): ids, mask (default:
    every position), device and temperature. Returns ``(valid [N, L] bool, temperature)``."""
    shape = check_rows_match_ids(source, name, completion_ids)
    temperature = check_temperature(temperature, shape[0], checks)
    check_same_device(
        **{name: source, "completion_ids": completion_ids, "completion_mask": completion_mask},
        temperature=temperature if isinstance(temperature, torch.Tensor) else None,
    )
    if completion_mask is None:
        valid = torch.ones(shape, dtype=torch.bool, device=source.device)
    else:
        valid = check_mask(completion_mask, shape, checks)
    return valid, temperature


def ids_outside_vocab(completion_ids: torch.Tensor, valid: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[N, L]`` bool: unmasked positions whose id is not in ``[0, vocab_size)``."""
    return valid & ((completion_ids < 0) | (completion_ids >= vocab_size))


def add_ids_check(checks: DeferredChecks, completion_ids: torch.Tensor, valid: torch.Tensor, vocab_size: int) -> None:
    """Ids in ``[0, vocab_size)`` at unmasked positions, as a deferred check (the fused path, which has no
    statistics yet when it reads the flags; the logits path lets the kernels report them, `add_stats_check`)."""
    checks.add(
        ids_outside_vocab(completion_ids, valid, vocab_size).any(),
        lambda: check_ids_in_vocab(completion_ids, valid, vocab_size),
    )


def add_stats_check(
    checks: DeferredChecks,
    logp: torch.Tensor,
    entropy: torch.Tensor,
    valid: torch.Tensor,
    completion_ids: torch.Tensor,
    vocab_size: int,
) -> None:
    """Finite statistics at unmasked positions, as a deferred check. The kernels return NaN for an id
    outside the vocabulary, NaN or +inf logits and a sampled token at -inf, so this one small reduction over
    ``[N, L]`` covers all of them; ``explain`` tells which."""

    def explain():
        check_ids_in_vocab(completion_ids, valid, vocab_size)
        check_token_stats_finite(logp, entropy, valid)

    checks.add((valid & ~(torch.isfinite(logp) & torch.isfinite(entropy))).any(), explain)


def add_finite_check(checks: DeferredChecks, name: str, tensor: Optional[torch.Tensor]) -> None:
    """``tensor`` holds no NaN or inf (hidden states and lm_head weights: what makes the fused path's logits)."""
    if tensor is None:
        return

    def explain():
        _fail(
            f"{name} holds NaN or inf values; fix the model's output or parameters (set "
            f"config.validate_inputs=False to skip this check)"
        )

    if not tensor.numel():
        return
    # The extremes, not isfinite(tensor): that one builds |tensor| and two masks of its size (1.6 GB for a bf16
    # head at H = 3584, V = 151936, on every call). A NaN propagates through both reductions; an inf is one.
    low, high = torch.aminmax(tensor)
    checks.add(~(torch.isfinite(low) & torch.isfinite(high)), explain)


def check_ids_in_vocab(completion_ids: torch.Tensor, valid: torch.Tensor, vocab_size: int) -> None:
    out_of_range = ids_outside_vocab(completion_ids, valid, vocab_size)
    if bool(out_of_range.any()):
        row, pos = (int(x) for x in out_of_range.nonzero()[0])
        _fail(
            f"completion_ids must lie in [0, V={vocab_size}) at unmasked positions, but "
            f"completion_ids[{row}, {pos}] = {int(completion_ids[row, pos])}; check the tokenizer "
            f"matches the model's vocabulary and that padding is masked out"
        )


def check_same_device(**tensors: Optional[torch.Tensor]) -> None:
    devices = {name: t.device for name, t in tensors.items() if isinstance(t, torch.Tensor)}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{name} on {dev}" for name, dev in devices.items())
        _fail(f"all tensors must be on one device, got {listing}; move them with .to(logits.device)")


def check_initial_entropy(initial_entropy) -> Optional[float]:
    if initial_entropy is None:
        return None
    if isinstance(initial_entropy, torch.Tensor):
        if initial_entropy.numel() != 1:
            _fail(f"initial_entropy must be a number, got a tensor of shape {tuple(initial_entropy.shape)}")
        initial_entropy = float(initial_entropy)
    if (
        isinstance(initial_entropy, bool)
        or not isinstance(initial_entropy, (int, float))
        or not math.isfinite(initial_entropy)
    ):
        _fail(
            f"initial_entropy must be a finite number (the policy's mean token entropy on the first "
            f"step), got {initial_entropy!r}"
        )
    return float(initial_entropy)


def check_loss_inputs(logits, given, group_size, checks: DeferredChecks):
    """Checks the per-row inputs ``given`` (a `rows.LossRows` as the caller passed them) except the logits' own
    shape, given as ``logits=[N, L, *]``, the ids' range, and the conflict and count arguments
    (`add_stats_check`, `check_conflict`, `check_count`).

    ``group_size`` may be ``None`` (checked only when given). Returns
    ``(valid [N, L] bool, initial_entropy float|None)``. The checks of values (mask pattern, finite
    advantages) go to ``checks``.
    """
    shape = check_ids(given.ids)
    n_rows = shape[0]
    advantages = given.advantages
    check_same_device(
        logits=logits,
        completion_ids=given.ids,
        completion_mask=given.valid,
        advantages=advantages,
        old_logprobs=given.old_logprobs,
        ref_logprobs=given.ref_logprobs,
        sampling_logprobs=given.sampling_logprobs,
        temperature=given.temperature if isinstance(given.temperature, torch.Tensor) else None,
    )
    valid = check_mask(given.valid, shape, checks)
    check_float("advantages", advantages, (n_rows,), "[N]")

    def explain_advantages():
        _fail(
            "advantages must be finite, got NaN or inf; check the rewards (a group with std 0 and "
            "normalize_std=True needs eps > 0)"
        )

    checks.add(~torch.isfinite(advantages).all(), explain_advantages)
    if group_size is not None:
        check_group_size(group_size, n_rows)
    for name in ("old_logprobs", "ref_logprobs", "sampling_logprobs"):
        logprobs = getattr(given, name)
        if logprobs is not None:
            check_float(name, logprobs, shape, "[N, L]")
            add_logprobs_check(checks, name, logprobs, valid)
    return valid, check_initial_entropy(given.initial_entropy)


def add_logprobs_check(checks: DeferredChecks, name: str, logprobs: torch.Tensor, valid: torch.Tensor) -> None:
    """Per-token log-probs given by the caller are finite at unmasked positions (a NaN old or reference log-prob
    would make the loss NaN; an infinite one a meaningless ratio or KL). ``sampling_logprobs`` may be NaN: a
    token the sampler gave no log-prob for (its weight is then 1), but never +-inf."""
    allow_nan = name == "sampling_logprobs"
    bad = ~torch.isfinite(logprobs)
    if allow_nan:
        bad = bad & ~torch.isnan(logprobs)
    bad = bad & valid

    def explain():
        row, pos = (int(x) for x in bad.nonzero()[0])
        allowed = "finite or NaN (not reported by the sampler)" if allow_nan else "finite"
        _fail(
            f"{name} must be {allowed} at unmasked positions, but {name}[{row}, {pos}] = "
            f"{float(logprobs[row, pos])}; pass the log-probs of those tokens, or mask the position"
        )

    checks.add(bad.any(), explain)


def check_logits(logits: torch.Tensor) -> None:
    if not isinstance(logits, torch.Tensor):
        _fail(f"logits must be a torch.Tensor [N, L, V], got {type(logits).__name__}")
    if logits.dtype not in FLOAT_DTYPES:
        _fail(f"logits must be float16, bfloat16, float32 or float64, got {logits.dtype}")
    if logits.dim() != 3:
        _fail(
            f"logits must be 3-D [N, L, V] (N completions, L positions, V vocabulary), got shape "
            f"{tuple(logits.shape)}; reshape [B*G, L, V] and drop the prompt positions"
        )
    if logits.shape[-1] < 1:
        _fail("logits must have a vocabulary dimension V >= 1")


def check_token_stats_finite(logp: torch.Tensor, entropy: torch.Tensor, valid: torch.Tensor) -> None:
    """Non-finite statistics at unmasked positions mean NaN or +inf logits, or a target token whose
    logit is -inf (a banned token that was sampled). Reported instead of returning a NaN loss."""
    bad = valid & ~(torch.isfinite(logp) & torch.isfinite(entropy))
    if bool(bad.any()):
        row, pos = (int(x) for x in bad.nonzero()[0])
        _fail(
            f"logits give a non-finite log-prob or entropy at unmasked position [{row}, {pos}]: the "
            f"logits there contain NaN or +inf, or the target token's logit is -inf. Fix the model "
            f"output or mask the position (set config.validate_inputs=False to skip this check)"
        )
