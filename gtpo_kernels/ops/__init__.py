"""Backends for the vocabulary-sized work (per-token log-prob and entropy, forward and backward).

Each backend module (`token_stats_torch`, `token_stats_triton`, `token_stats_cpu`) exposes
``forward(logits, ids, valid, chunk_size) -> (lse, logp, H)`` and
``backward(logits, ids, valid, lse, H, grad_logp, grad_H, out, chunk_size)``; `function.TokenStats`
wraps any of them for autograd. Everything else in the loss is ``O(N L)`` and shared
(`reference.gtpo_loss_from_token_stats`). Conflict weights have a Triton and a C++ version beside
the reference one.
"""
