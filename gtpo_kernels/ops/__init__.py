"""Backends for the vocabulary-sized work (per-token log-prob and entropy, forward and backward).

Each backend is an `autograd.Function` mapping ``logits [T, V]`` and ``ids [T]`` to
``(logp [T], H [T])`` whose backward writes ``dlogits = g_logp (onehot - p) + g_H dH/dz``.
Everything else in the loss is ``O(N L)`` and shared (`reference.gtpo_loss_from_token_stats`).
"""
