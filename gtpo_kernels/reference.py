"""The float64 oracle: the GTPO loss written straight from ``docs/method.md``, for tests only.

Nothing on the package's hot path imports this module (a test checks it), and it shares no code with
the production path beyond the config and result containers and the declaration of the row keywords
(`rows.takes_row_keywords`: the signature, not the maths): the per-token statistics come from
``log_softmax``, the conflict weights from loops over the rows of each group, and the per-completion
step is a loop over completions that follows the spec term by term. Slow and readable on purpose;
every backend and entry point is tested against it, in float64.

Shapes: ``N`` completions (rows of a group contiguous), ``L`` positions, ``V`` vocabulary.
"""

from __future__ import annotations

import math
from functools import partial
from typing import List, Optional, Tuple

import torch

from .config import GTPOConfig
from .result import GTPOLossOutput, GTPOMetrics
from .rows import rows_of_call, takes_row_keywords


def token_logprobs_and_entropy(logits: torch.Tensor, completion_ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``logp = z[y] - lse`` and ``H = -sum_v p_v log p_v``, each ``[...]``, by plain autograd.

    ``logits: [..., V]`` (float64 stays float64; other dtypes are upcast to float32), ``completion_ids:
    [...]`` in ``[0, V)``. ``-inf`` logits (banned tokens) contribute nothing to the entropy.
    """
    z = logits if logits.dtype == torch.float64 else logits.float()
    log_p = torch.log_softmax(z, dim=-1)
    logp = log_p.gather(-1, completion_ids.long().unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p.masked_fill(torch.isneginf(z), 0.0)).sum(-1)
    return logp, entropy


def reference_conflict_weights(
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    advantages: torch.Tensor,
    group_size: int,
    weight: float = 2.0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(lambda [N, L] float64, n_conflict [N] int64)`` by loops over each group's rows (docs/method.md)."""
    ids: List[List[int]] = completion_ids.tolist()
    lengths: List[int] = completion_mask.bool().sum(dim=1).tolist()
    adv: List[float] = advantages.tolist()
    n_rows, length = completion_ids.shape
    lambda_ = torch.ones((n_rows, length), dtype=torch.float64)
    n_conflict = torch.zeros(n_rows, dtype=torch.long)

    def token_at(row: int, k: int, reverse: bool) -> Optional[int]:
        if k >= lengths[row]:
            return None
        return ids[row][lengths[row] - 1 - k] if reverse else ids[row][k]

    for i in range(n_rows):
        if adv[i] == 0:
            continue
        group = range(i - i % group_size, i - i % group_size + group_size)
        runs = []
        for reverse in (False, True):
            run = 0
            while run < lengths[i]:
                token = token_at(i, run, reverse)
                in_positive = any(adv[j] > 0 and token_at(j, run, reverse) == token for j in group)
                in_negative = any(adv[j] < 0 and token_at(j, run, reverse) == token for j in group)
                if not (in_positive and in_negative):
                    break
                run += 1
            runs.append(run)
        on_run = weight if adv[i] > 0 else 0.0
        forward_run, reverse_run = runs
        for t in range(lengths[i]):
            if t < forward_run:
                lambda_[i, t] *= on_run
            if t >= lengths[i] - reverse_run:
                lambda_[i, t] *= on_run
        n_conflict[i] = max(forward_run, reverse_run)
    return lambda_, n_conflict


@takes_row_keywords()
def reference_gtpo_loss(
    logits: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    config: Optional[GTPOConfig] = None,
    **row_keywords,
) -> GTPOLossOutput:
    """The whole GTPO loss by plain autograd, unchunked and unvalidated, with `gtpo_loss`'s row keywords.

    ``logits: [N, L, V]`` (use float64), ``completion_ids, completion_mask: [N, L]``, ``advantages: [N]``.
    """
    rows = rows_of_call("reference_gtpo_loss", completion_ids, completion_mask, advantages, row_keywords)
    valid = completion_mask.bool()
    safe_ids = torch.where(valid, completion_ids.long(), 0)  # masked ids may be pad values like -100
    temperature = rows.temperature
    if isinstance(temperature, torch.Tensor):  # each completion's own: [N] -> [N, 1, 1]
        temperature = temperature.to(logits.dtype)[:, None, None]
    logp, entropy = token_logprobs_and_entropy(logits / temperature, safe_ids)
    statistics_keywords = {name: value for name, value in row_keywords.items() if name != "temperature"}
    config = config or GTPOConfig()
    return reference_loss_from_token_stats(
        logp, entropy, completion_ids, valid, advantages, config=config, **statistics_keywords
    )


def reference_sampling_weights(old: List[float], sampled: List[float], config: GTPOConfig) -> List[float]:
    """One completion's weights of the policy term, token by token, for ``config.sampling_correction``:
    ``exp(old - sampled)`` per token or ``exp(sum)`` for every token of the completion, truncated to or
    zeroed outside ``[sampling_ratio_min, sampling_ratio_max]``; a NaN sampler log-prob counts as ``old``."""
    diffs = [0.0 if math.isnan(s) else o - s for o, s in zip(old, sampled)]
    mode = config.sampling_correction
    weights = [math.exp(sum(diffs))] * len(diffs) if mode.startswith("sequence") else [math.exp(d) for d in diffs]
    low = -math.inf if config.sampling_ratio_min is None else config.sampling_ratio_min
    high = math.inf if config.sampling_ratio_max is None else config.sampling_ratio_max
    if mode.endswith("_truncate"):
        return [min(max(w, low), high) for w in weights]
    return [w if low <= w <= high else 0.0 for w in weights]


def reference_covariance_tokens(logp, entropy, valid: torch.Tensor, lambda_, rows, config: GTPOConfig) -> set:
    """The ``(row, position)`` pairs ``config.cov_mode`` picks (docs/method.md, "Clip-Cov and KL-Cov"), in float64
    Python: each unmasked token's advantage ``lambda delta (A - gamma Hbar)`` and log-prob, centred by their means
    over every unmasked token; ``k = max(1, floor(share * tokens))``; KL-Cov the ``k`` highest products (ties: the
    first position), Clip-Cov ``k`` at random in the band ``(clip_cov_low, clip_cov_high)``, leaving out tokens PPO's
    clip holds: the ``k`` smallest of ``torch.rand([N, L], float64)`` (torch's CPU generator) among them. Empty
    without a mode. ``rows``: the call's (its advantages, old log-probs and initial entropy)."""
    if config.cov_mode is None:
        return set()
    advantages, old_logprobs, initial_entropy = rows.advantages, rows.old_logprobs, rows.initial_entropy
    tau, gamma = config.entropy_threshold, config.entropy_coef
    filter_on = tau is not None and math.isfinite(tau)
    if filter_on and config.entropy_gate and initial_entropy is not None and float(initial_entropy) > tau:
        filter_on = False
    low, high = config.clip_bounds
    tokens = []  # (row, position, advantage, log-prob, clipped)
    for i in range(valid.shape[0]):
        at = [t for t in range(valid.shape[1]) if bool(valid[i, t])]
        if not at:
            continue
        h_bar = sum(float(entropy[i, t]) for t in at) / len(at)
        a = float(advantages[i])
        shaped = 0.0 if filter_on and h_bar > tau else 1.0
        shifted = config.entropy_mode == "advantage_shift" and (a != 0 or config.entropy_shift_scope == "all")
        shaped *= a - gamma * h_bar if shifted else a
        lp = [float(logp[i, t]) for t in at]
        old = lp if old_logprobs is None else [float(old_logprobs[i, t]) for t in at]
        ratios = [math.exp(x - o) for x, o in zip(lp, old)]
        if config.importance_sampling_level == "sequence":
            ratios = [math.exp(sum(x - o for x, o in zip(lp, old)) / len(at))] * len(at)
        for t, x, r in zip(at, lp, ratios):
            a_t = float(lambda_[i, t]) * shaped
            clipped = config.clipping and ((r < low and a_t < 0) or (r > high and a_t > 0))
            tokens.append((i, t, a_t, x, clipped))
    if not tokens:
        return set()
    mean_a = sum(tok[2] for tok in tokens) / len(tokens)
    mean_logp = sum(tok[3] for tok in tokens) / len(tokens)
    cov = [(tok[2] - mean_a) * (tok[3] - mean_logp) for tok in tokens]
    k = max(1, math.floor(config.cov_share * len(tokens)))
    if config.cov_mode == "kl_cov":
        ranked = sorted(range(len(tokens)), key=lambda j: (-cov[j], tokens[j][0], tokens[j][1]))
    else:
        draw = torch.rand(tuple(valid.shape), dtype=torch.float64)
        band = [j for j in range(len(tokens)) if config.clip_cov_low < cov[j] < config.clip_cov_high]
        band = [j for j in band if not tokens[j][4]]
        ranked = sorted(band, key=lambda j: (float(draw[tokens[j][0], tokens[j][1]]), tokens[j][0], tokens[j][1]))
    return {(tokens[j][0], tokens[j][1]) for j in ranked[:k]}


def reference_cov_terms(terms, weight: Optional[List[float]], lp, old, picked: List[bool], config: GTPOConfig):
    """One completion's ``(terms, weight)`` after ``config.cov_mode`` on its ``picked`` tokens: Clip-Cov takes their
    policy term away (weight 0: they carry no signal), KL-Cov adds ``kl_cov_coef * |logp - old|`` to it."""
    flags = torch.tensor([float(p) for p in picked], dtype=terms.dtype, device=terms.device)
    if config.cov_mode == "clip_cov":
        weight = [w * (1.0 - float(p)) for w, p in zip(weight or [1.0] * len(picked), picked)]
        return terms * (1 - flags), weight
    if config.cov_mode == "kl_cov":
        return terms + config.kl_cov_coef * flags * (lp - old).abs(), weight
    return terms, weight


@takes_row_keywords(not_taken=("temperature",))
def reference_loss_from_token_stats(
    logp: torch.Tensor,
    entropy: torch.Tensor,
    completion_ids: torch.Tensor,
    valid: torch.Tensor,
    advantages: torch.Tensor,
    *,
    config: GTPOConfig,
    **row_keywords,
) -> GTPOLossOutput:
    """The loss from per-token ``logp, entropy [N, L]`` (its gradient w.r.t. them is the ``c, e`` of docs/method.md's
    "Gradient with respect to the logits"); ``valid`` a bool mask: a prefix of ones per row, or with holes
    (masked positions inside a completion take no part in the loss, but count in the conflict runs). The row
    keywords are `gtpo_loss`'s but ``temperature`` (already in the statistics).

    One long function on purpose: it is the spec read top to bottom (conflict weights, entropy filter, then one
    completion at a time through shaping, ratio, clipping and reduction), the order a reader checks it against
    docs/method.md; split into helpers it would share their names, and so their mistakes, with `objective`."""
    rows = rows_of_call(
        "reference_loss_from_token_stats", completion_ids, valid, advantages, row_keywords, ("temperature",)
    )
    group_size, conflict, initial_entropy = rows.group_size, rows.conflict, rows.initial_entropy
    old_logprobs, ref_logprobs, sampling_logprobs = rows.old_logprobs, rows.ref_logprobs, rows.sampling_logprobs
    num_sequences, num_tokens = rows.num_sequences, rows.num_tokens
    n_rows, length = completion_ids.shape
    dtype = logp.dtype
    if not config.use_conflict_weights:
        lambda_, n_conflict = torch.ones((n_rows, length), dtype=dtype), torch.zeros(n_rows, dtype=torch.long)
    elif conflict is not None:
        lambda_, n_conflict = conflict
    else:
        # Runs are those of the completions as generated: a masked position inside a completion (a tool's
        # output) is still part of it there, and only the positions after the last unmasked one are not.
        as_generated = torch.tensor(
            [[any(row[t:]) for t in range(length)] for row in valid.cpu().tolist()], dtype=torch.bool
        ).reshape(n_rows, length)
        lambda_, n_conflict = reference_conflict_weights(
            completion_ids.cpu(), as_generated, advantages.cpu(), group_size, config.conflict_weight
        )
    device = logp.device
    lambda_, n_conflict = lambda_.to(device), n_conflict.tolist()
    lengths = valid.sum(dim=1).tolist()  # the tokens that take part in the loss
    cov_tokens = reference_covariance_tokens(logp.detach(), entropy.detach(), valid, lambda_, rows, config)

    tau = config.entropy_threshold
    filter_on = tau is not None and math.isfinite(tau)
    if filter_on and config.entropy_gate and initial_entropy is not None and float(initial_entropy) > tau:
        filter_on = False
    low, high = config.clip_bounds
    gamma = config.entropy_coef
    # top_entropy_quantile: torch.quantile of every unmasked token's entropy, and the share of tokens at or above it.
    entropy_floor, kept_share = -math.inf, 1.0
    if config.top_entropy_quantile < 1:
        values = [float(entropy[i, t].detach()) for i in range(n_rows) for t in range(length) if bool(valid[i, t])]
        if values:
            quantile = torch.quantile(torch.tensor(values, dtype=torch.float64), 1 - config.top_entropy_quantile)
            entropy_floor = float(quantile)
            kept_share = sum(v >= entropy_floor for v in values) / len(values)

    row_losses, row_entropies, kept, signal = [], [], [], []
    phis = [1.0] * n_rows  # VESPO's weight of each completion (an empty one's ratio is 1, its weight 1)
    row_clip_low, row_clip_high = [float("nan")] * n_rows, [float("nan")] * n_rows  # NaN: empty completion
    token_count = amplified = skipped = clipped_low = clipped_high = 0
    entropy_sum = ratio_sum = kl_sum = 0.0
    for i in range(n_rows):
        n = lengths[i]
        if n == 0:
            row_losses.append(torch.where(valid[i], logp[i], 0.0).sum() * 0)  # keeps the graph, zero gradient
            row_entropies.append(0.0)
            kept.append(True)
            signal.append(False)
            continue
        # The positions that take part (a prefix, or with holes where a mask has them).
        at = valid[i].nonzero().squeeze(1)
        lp, h = logp[i, at], entropy[i, at]
        h_bar = float(h.detach().mean())
        delta = 0.0 if filter_on and h_bar > tau else 1.0
        a = float(advantages[i])
        shifted = config.entropy_mode == "advantage_shift" and (config.entropy_shift_scope == "all" or a != 0)
        shaped = delta * (a - gamma * h_bar) if shifted else delta * a
        old = lp.detach() if old_logprobs is None else old_logprobs[i, at].to(dtype)
        lam = lambda_[i, at].to(dtype)
        token_adv = lam * shaped
        ratio = torch.exp(lp - old)
        if config.importance_sampling_level == "sequence":  # GSPO: one ratio per completion, the tokens' mean
            ratio = torch.exp((lp - old).sum() / n) * torch.ones_like(lp)
        first = ratio if config.ratio_cap is None else torch.clamp(ratio, max=config.ratio_cap)
        row_clip_low[i] = row_clip_high[i] = 0.0  # the clip's sides set them below
        if config.ratio_function == "cispo":
            cap = math.inf if config.cispo_ratio_max is None else config.cispo_ratio_max
            capped = torch.tensor([min(float(r), cap) for r in ratio.detach()], dtype=dtype, device=device)
            terms = -capped * token_adv * lp
            row_high = int(sum(float(r) > cap and float(t) > 0 for r, t in zip(ratio.detach(), token_adv)))
            clipped_high += row_high
            row_clip_high[i] = row_high / n
        elif config.ratio_function == "vespo":
            floor = math.log(1e-8)
            log_w = sum(min(max(float(x) - float(o), -20.0), 20.0) for x, o in zip(lp.detach(), old))
            if config.sampling_correction is not None:
                sampler = reference_sampling_weights(
                    [float(x) for x in old], [float(x) for x in sampling_logprobs[i, at]], config
                )
                log_w += sum(min(max(math.log(s) if s > 0 else -math.inf, floor), 20.0) for s in sampler)
            log_w = min(max(log_w, floor), 20.0)
            k_v = config.vespo_k_pos if shaped >= 0 else config.vespo_k_neg
            lam_v = max(config.vespo_lambda_pos if shaped >= 0 else config.vespo_lambda_neg, 1e-4)
            phi = math.exp(lam_v + k_v * log_w - lam_v * math.exp(log_w))
            phis[i] = phi if math.isfinite(phi) else 0.0
            terms = -phi * token_adv * lp
        elif config.ratio_function == "sapo":
            temps = torch.tensor(
                [config.sapo_temperature_pos if float(a_t) > 0 else config.sapo_temperature_neg for a_t in token_adv],
                dtype=dtype,
                device=device,
            )
            terms = -4 / temps * torch.sigmoid(temps * (ratio - 1)) * token_adv
        elif config.clipping:
            terms = -torch.minimum(first * token_adv, ratio.clamp(low, high) * token_adv)
            r = ratio.detach()
            row_low, row_high = int(((r < low) & (token_adv < 0)).sum()), int(((r > high) & (token_adv > 0)).sum())
            clipped_low, clipped_high = clipped_low + row_low, clipped_high + row_high
            row_clip_low[i], row_clip_high[i] = row_low / n, row_high / n
        else:
            terms = -first * token_adv
        weight = None
        if config.sampling_correction is not None and config.ratio_function != "vespo":  # VESPO folds it into phi
            sampled = [float(x) for x in sampling_logprobs[i, at]]
            weight = reference_sampling_weights([float(x) for x in old], sampled, config)
            terms = terms * torch.tensor(weight, dtype=dtype, device=device)
        if config.off_policy_mask_threshold is not None:
            behaviour = sampling_logprobs if sampling_logprobs is not None else old_logprobs
            current = [float(x) for x in lp.detach()]
            seen = current if behaviour is None else [float(x) for x in behaviour[i, at]]
            mean_kl = sum(0.0 if math.isnan(b) else b - c for b, c in zip(seen, current)) / n
            if shaped < 0 and mean_kl > config.off_policy_mask_threshold:
                terms = terms * 0.0
                weight = [0.0] * n
        if config.top_entropy_quantile < 1:  # the policy term of the tokens below the entropy quantile: none
            high_entropy = [1.0 if float(x) >= entropy_floor else 0.0 for x in h.detach()]
            terms = terms * torch.tensor(high_entropy, dtype=dtype, device=device)
            weight = high_entropy if weight is None else [w * k for w, k in zip(weight, high_entropy)]
        terms, weight = reference_cov_terms(terms, weight, lp, old, [(i, int(t)) in cov_tokens for t in at], config)
        if config.entropy_mode == "penalty":
            terms = terms + gamma * h
        if ref_logprobs is not None:
            r = ref_logprobs[i, at].to(dtype) - lp
            k3 = torch.exp(r) - r - 1
            if config.kl_ratio_weighted:
                k3 = k3 * ratio
            kl_sum += float(k3.detach().sum())
            if config.kl_beta:
                terms = terms + config.kl_beta * k3
        amplified += int((lam > 1).sum())
        skipped += int((lam == 0).sum())
        ratio_sum += float(ratio.detach().sum())
        row_loss = terms.sum()
        if config.divide_by_conflict_count:
            row_loss = row_loss / max(1, n_conflict[i])
        row_losses.append(row_loss)
        row_entropies.append(h_bar)
        kept.append(delta == 1.0)
        carries = [float(a_t) != 0 and (weight is None or weight[k] != 0) for k, a_t in enumerate(token_adv)]
        signal.append(
            any(carries)
            or (config.entropy_mode == "penalty" and gamma > 0)
            or config.entropy_bonus > 0
            or (config.kl_beta > 0 and ref_logprobs is not None)
        )
        token_count += n
        entropy_sum += float(h.detach().sum())

    sequences = n_rows if num_sequences is None else num_sequences
    tokens = token_count if num_tokens is None else num_tokens
    if config.loss_reduction in ("sequence_mean", "sum"):
        loss = sum(row_losses[i] / max(1, lengths[i]) for i in range(n_rows))
        if config.loss_reduction == "sequence_mean":
            loss = loss / sequences
    elif config.loss_reduction == "token_mean":
        loss = sum(row_losses) / max(1, tokens)
    elif config.loss_reduction == "sequence_sum":
        loss = sum(row_losses) / sequences
    else:
        loss = sum(row_losses) / (sequences * (config.max_completion_length or length))
    if config.entropy_bonus > 0:  # TRL's bonus: minus the token mean of every unmasked (kept) token's entropy
        entropies = [entropy[i, t] for i in range(n_rows) for t in range(length) if bool(valid[i, t])]
        entropies = [h for h in entropies if float(h.detach()) >= entropy_floor]
        loss = loss - config.entropy_bonus * sum(entropies) / (max(1, tokens) * kept_share)
    if not isinstance(loss, torch.Tensor):  # no rows at all
        loss = logp.sum() * 0
    loss = loss.to(dtype)

    non_empty = [i for i in range(n_rows) if lengths[i] > 0]

    scalar = partial(torch.tensor, dtype=dtype, device=device)
    per_token = max(1, token_count)
    metrics = GTPOMetrics(
        entropy=scalar(entropy_sum / per_token),
        completion_entropy=torch.tensor(row_entropies, dtype=dtype, device=device),
        filtered_fraction=scalar(sum(not kept[i] for i in non_empty) / max(1, len(non_empty))),
        signal_fraction=scalar(sum(signal[i] for i in non_empty) / max(1, len(non_empty))),
        amplified_fraction=scalar(amplified / per_token),
        skipped_fraction=scalar(skipped / per_token),
        ratio_mean=scalar(ratio_sum / per_token),
        clip_fraction=scalar((clipped_low + clipped_high) / per_token),
        clip_low_fraction=scalar(clipped_low / per_token),
        clip_high_fraction=scalar(clipped_high / per_token),
        completion_clip_low=torch.tensor(row_clip_low, dtype=dtype, device=device),
        completion_clip_high=torch.tensor(row_clip_high, dtype=dtype, device=device),
        kl=None if ref_logprobs is None else scalar(kl_sum / per_token),
        cov_fraction=scalar(len(cov_tokens) / per_token),
        vespo_weight_mean=scalar(sum(phis) / max(1, n_rows)) if config.ratio_function == "vespo" else None,
        num_tokens=torch.tensor(float(token_count), dtype=torch.float64),
        num_sequences=torch.tensor(float(n_rows), dtype=torch.float64),
        num_nonempty=torch.tensor(float(len(non_empty)), dtype=torch.float64),
    )
    return GTPOLossOutput(loss, metrics)
