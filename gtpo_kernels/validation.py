"""Input checks for the public API. Each error names the argument and says how to fix it."""

from __future__ import annotations

import math
from typing import Optional

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _fail(message: str) -> None:
    raise ValueError(message)


def check_float(name: str, tensor: torch.Tensor, shape: tuple, what: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor of shape {what}, got {type(tensor).__name__}")
    if not tensor.is_floating_point():
        _fail(f"{name} must be a floating-point tensor, got {tensor.dtype}; "
              f"did you pass ids or a mask in its place?")
    if tuple(tensor.shape) != tuple(shape):
        _fail(f"{name} must have shape {what} = {tuple(shape)}, got {tuple(tensor.shape)}")


def check_group_size(group_size, n_rows: Optional[int]) -> None:
    """``group_size`` is a positive int dividing ``n_rows`` (``n_rows=None``: the type only)."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        _fail(f"group_size must be a positive int (completions per prompt), got {group_size!r}")
    if n_rows is not None and n_rows % group_size:
        _fail(f"group_size ({group_size}) must divide the number of completions N = {n_rows}; "
              f"pass whole groups (rows b*G .. b*G+G-1 are one prompt's completions), or, for a slice of a "
              f"batch that cuts through groups, pass conflict=conflict_weights(...) computed on whole groups")


def check_temperature(temperature) -> float:
    if torch.compiler.is_compiling():  # checked in eager mode; a traced float may be symbolic
        return temperature
    if isinstance(temperature, torch.Tensor) and temperature.numel() == 1:
        temperature = float(temperature)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
            math.isfinite(temperature) and temperature > 0):
        _fail(f"temperature must be a finite number > 0 (the sampling temperature), got {temperature!r}")
    return float(temperature)


def check_conflict(conflict, shape: tuple, anchor: torch.Tensor, anchor_name: str, sync: bool) -> None:
    """``conflict = (lambda_ [N, L] float, n_conflict [N] integer)``, as `conflict_weights` returns."""
    if not (isinstance(conflict, (tuple, list)) and len(conflict) == 2
            and all(isinstance(t, torch.Tensor) for t in conflict)):
        _fail(f"conflict must be the pair (lambda_ [N, L], n_conflict [N]) returned by conflict_weights(...), "
              f"got {type(conflict).__name__}")
    lambda_, n_conflict = conflict
    check_float("conflict[0] (lambda_)", lambda_, shape, "[N, L]")
    if n_conflict.is_floating_point() or n_conflict.dtype == torch.bool or tuple(n_conflict.shape) != shape[:1]:
        _fail(f"conflict[1] (n_conflict) must be an integer tensor of shape [N] = {shape[:1]}, got "
              f"{n_conflict.dtype} {tuple(n_conflict.shape)}")
    check_same_device(**{anchor_name: anchor, "conflict[0]": lambda_, "conflict[1]": n_conflict})
    if sync and not bool((torch.isfinite(lambda_) & (lambda_ >= 0)).all()):
        _fail("conflict[0] (lambda_) must be finite and >= 0; pass what conflict_weights(...) returned, sliced "
              "like the rows")


def check_count(name: str, value, at_least, sync: bool, what: str) -> None:
    """A whole-batch count: an int or a 0-d tensor, at least this call's own count."""
    if value is None:
        return
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            _fail(f"{name} must be a number or a one-element tensor ({what}), got a {value.dtype} tensor of "
                  f"shape {tuple(value.shape)}")
        if not sync:
            return
        value = float(value)
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(f"{name} must be a number ({what}), got {value!r}")
    at_least = float(at_least)
    if not (math.isfinite(value) and value >= at_least and value > 0):
        _fail(f"{name} = {value!r} is less than this call's own count ({at_least:g}): it must be {what}, "
              f"summed over every rank and micro-batch")


def check_mask(completion_mask: torch.Tensor, shape: tuple, sync: bool) -> torch.Tensor:
    """Returns the mask as bool after checking it is ``[N, L]`` and a contiguous prefix of ones."""
    if not isinstance(completion_mask, torch.Tensor):
        _fail(f"completion_mask must be a torch.Tensor [N, L], got {type(completion_mask).__name__}")
    if tuple(completion_mask.shape) != tuple(shape):
        _fail(f"completion_mask must have shape [N, L] = {tuple(shape)}, got {tuple(completion_mask.shape)}")
    if completion_mask.dtype != torch.bool:
        if sync and not bool(((completion_mask == 0) | (completion_mask == 1)).all()):
            _fail("completion_mask must hold only 0 and 1 (or be a bool tensor)")
        completion_mask = completion_mask != 0
    if sync and completion_mask.shape[1] > 1:
        gaps = completion_mask[:, 1:] & ~completion_mask[:, :-1]
        if bool(gaps.any()):
            row = int(gaps.any(dim=1).nonzero()[0, 0])
            _fail(f"completion_mask must be a contiguous prefix of ones per row (right padding), but "
                  f"row {row} has a 1 after a 0; left-padded or gapped masks are not supported: "
                  f"shift each completion to start at position 0")
    return completion_mask


def check_ids(completion_ids: torch.Tensor) -> tuple:
    """Checks ``completion_ids`` is a 2-D integer tensor and returns its shape ``(N, L)``."""
    if not isinstance(completion_ids, torch.Tensor):
        _fail(f"completion_ids must be a torch.Tensor [N, L], got {type(completion_ids).__name__}")
    if completion_ids.is_floating_point() or completion_ids.is_complex() or completion_ids.dtype == torch.bool:
        _fail(f"completion_ids must be an integer tensor (token ids), got {completion_ids.dtype}; "
              f"did you swap completion_ids with the mask or the logits?")
    if completion_ids.dim() != 2:
        _fail(f"completion_ids must be 2-D [N, L], got shape {tuple(completion_ids.shape)}")
    return tuple(completion_ids.shape)


def check_ids_in_vocab(completion_ids: torch.Tensor, valid: torch.Tensor, vocab_size: int) -> None:
    out_of_range = valid & ((completion_ids < 0) | (completion_ids >= vocab_size))
    if bool(out_of_range.any()):
        row, pos = (int(x) for x in out_of_range.nonzero()[0])
        _fail(f"completion_ids must lie in [0, V={vocab_size}) at unmasked positions, but "
              f"completion_ids[{row}, {pos}] = {int(completion_ids[row, pos])}; check the tokenizer "
              f"matches the model's vocabulary and that padding is masked out")


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
    if isinstance(initial_entropy, bool) or not isinstance(initial_entropy, (int, float)) \
            or not math.isfinite(initial_entropy):
        _fail(f"initial_entropy must be a finite number (the policy's mean token entropy on the first "
              f"step), got {initial_entropy!r}")
    return float(initial_entropy)


def check_loss_inputs(logits, completion_ids, completion_mask, advantages, group_size, old_logprobs,
                      ref_logprobs, initial_entropy, sync: bool, vocab_size: Optional[int] = None):
    """Checks everything `gtpo_loss` takes except the logits' own shape, given as ``logits=[N, L, *]``,
    and the conflict and count arguments (`check_conflict`, `check_count`).

    ``group_size`` may be ``None`` (checked only when given). Returns
    ``(valid [N, L] bool, initial_entropy float|None)``. ``sync=False`` skips the checks that read tensor
    values (mask pattern, id range, NaN advantages).
    """
    shape = check_ids(completion_ids)
    n_rows = shape[0]
    check_same_device(logits=logits, completion_ids=completion_ids, completion_mask=completion_mask,
                      advantages=advantages, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs)
    valid = check_mask(completion_mask, shape, sync)
    if sync and vocab_size is not None:
        check_ids_in_vocab(completion_ids, valid, vocab_size)
    check_float("advantages", advantages, (n_rows,), "[N]")
    if sync and not bool(torch.isfinite(advantages).all()):
        _fail("advantages must be finite, got NaN or inf; check the rewards (a group with std 0 and "
              "normalize_std=True needs eps > 0)")
    if group_size is not None:
        check_group_size(group_size, n_rows)
    if old_logprobs is not None:
        check_float("old_logprobs", old_logprobs, shape, "[N, L]")
    if ref_logprobs is not None:
        check_float("ref_logprobs", ref_logprobs, shape, "[N, L]")
    return valid, check_initial_entropy(initial_entropy)


def check_logits(logits: torch.Tensor) -> None:
    if not isinstance(logits, torch.Tensor):
        _fail(f"logits must be a torch.Tensor [N, L, V], got {type(logits).__name__}")
    if logits.dtype not in FLOAT_DTYPES:
        _fail(f"logits must be float16, bfloat16, float32 or float64, got {logits.dtype}")
    if logits.dim() != 3:
        _fail(f"logits must be 3-D [N, L, V] (N completions, L positions, V vocabulary), got shape "
              f"{tuple(logits.shape)}; reshape [B*G, L, V] and drop the prompt positions")
    if logits.shape[-1] < 1:
        _fail("logits must have a vocabulary dimension V >= 1")


def check_token_stats_finite(logp: torch.Tensor, entropy: torch.Tensor, valid: torch.Tensor) -> None:
    """Non-finite statistics at unmasked positions mean NaN or +inf logits, or a target token whose
    logit is -inf (a banned token that was sampled). Reported instead of returning a NaN loss."""
    bad = valid & ~(torch.isfinite(logp) & torch.isfinite(entropy))
    if bool(bad.any()):
        row, pos = (int(x) for x in bad.nonzero()[0])
        _fail(f"logits give a non-finite log-prob or entropy at unmasked position [{row}, {pos}]: the "
              f"logits there contain NaN or +inf, or the target token's logit is -inf. Fix the model "
              f"output or mask the position (set config.validate_inputs=False to skip this check)")
