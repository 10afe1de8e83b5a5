"""The losses under ``torch.compile(fullgraph=True)``: registered operators (``gtpo_kernels::*``) with fake
implementations and autograd, `torch.library.opcheck` on each, a tiny Llama's forward + loss + backward
compiled without a graph break and equal to eager mode, no recompilation for new data."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from gtpo_kernels import GTPOConfig, conflict_weights, custom_ops, fused_linear_gtpo_loss, gtpo_loss  # noqa: E402
from gtpo_kernels.objective import loss_from_token_stats, loss_gradients  # noqa: E402
from gtpo_kernels.rows import LossRows  # noqa: E402

from .helpers import random_batch  # noqa: E402

CPU_BACKENDS = ["torch", "cpu"]


# ---- the closed-form per-completion gradient (the fused operator's coefficients) -----------------------


@pytest.mark.parametrize(
    "name, config",
    [
        ("paper", GTPOConfig()),
        ("official", GTPOConfig(preset="official")),
        ("grpo+kl", GTPOConfig(preset="grpo", kl_beta=0.1, clip_eps_high=0.28)),
        ("penalty", GTPOConfig(entropy_mode="penalty", loss_reduction="token_mean")),
        ("dr_grpo", GTPOConfig(preset="grpo", loss_reduction="dr_grpo", max_completion_length=9)),
        (
            "cap+weighted_kl",
            GTPOConfig(preset="grpo", ratio_cap=1.1, kl_beta=0.1, kl_ratio_weighted=True),
        ),  # cap inside the clip
        ("cispo+kl", GTPOConfig(ratio_function="cispo", cispo_ratio_max=1.2, kl_beta=0.1)),
        ("sapo+weighted_kl", GTPOConfig(ratio_function="sapo", kl_beta=0.1, kl_ratio_weighted=True)),
        ("sampler:token_mask", GTPOConfig(sampling_correction="token_mask", sampling_ratio_min=0.8)),
        ("sampler:sequence_truncate+sapo", GTPOConfig(ratio_function="sapo", sampling_correction="sequence_truncate")),
        ("bonus+penalty", GTPOConfig(entropy_bonus=0.1, entropy_mode="penalty")),
        ("opsm+cispo", GTPOConfig(off_policy_mask_threshold=0.05, ratio_function="cispo")),
        ("vespo+sampler+kl", GTPOConfig(ratio_function="vespo", sampling_correction="token_truncate", kl_beta=0.1)),
        (
            "gspo+weighted_kl",
            GTPOConfig(preset="grpo", importance_sampling_level="sequence", kl_beta=0.1, kl_ratio_weighted=True),
        ),
        ("gspo+sapo+kl", GTPOConfig(importance_sampling_level="sequence", ratio_function="sapo", kl_beta=0.1)),
        (
            "gspo+cispo+sampler",
            GTPOConfig(
                importance_sampling_level="sequence", ratio_function="cispo", sampling_correction="token_truncate"
            ),
        ),
    ],
)
def test_loss_gradients_equal_autograd(name, config):
    g = torch.Generator().manual_seed(1)
    logits, ids, mask, adv = random_batch(2, 3, 6, 11, dtype=torch.float64, seed=2)
    logp = torch.randn(6, 6, generator=g, dtype=torch.float64) - 1
    entropy = torch.rand(6, 6, generator=g, dtype=torch.float64)
    kw = dict(
        old_logprobs=logp + 0.4 * torch.randn(6, 6, generator=g, dtype=torch.float64),
        ref_logprobs=logp + 0.3 * torch.randn(6, 6, generator=g, dtype=torch.float64),
        initial_entropy=0.2,
        num_sequences=10,
        num_tokens=40,
    )
    if config.sampling_correction:
        kw["sampling_logprobs"] = logp + 0.3 * torch.randn(6, 6, generator=g, dtype=torch.float64)
    conflict = conflict_weights(ids, mask, adv, 3) if config.use_conflict_weights else None
    rows = LossRows(ids, mask, adv, conflict=conflict, **kw)
    lp, h = logp.clone().requires_grad_(), entropy.clone().requires_grad_()
    loss = loss_from_token_stats(lp, h, rows, config).loss
    c_ref, e_ref = torch.autograd.grad(loss, (lp, h), allow_unused=True)
    c, e = loss_gradients(logp, entropy, rows, config)
    torch.testing.assert_close(c, c_ref, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(e, torch.zeros_like(e) if e_ref is None else e_ref, rtol=1e-12, atol=1e-15)
    assert c.abs().max() > 0


# ---- opcheck: schema, fake tensors, autograd registration --------------------------------------------


@pytest.mark.parametrize("backend", CPU_BACKENDS + ["triton"])
def test_opcheck_token_stats(backend):
    logits, ids, mask, _ = random_batch(2, 2, 4, 13, seed=3)
    torch.library.opcheck(custom_ops.token_stats, (logits.requires_grad_(), ids, mask, 0.7, backend, 0))
    stats = custom_ops.token_stats(logits.detach(), ids, mask, 0.7, backend, 0)
    c, e = torch.randn(4, 4), torch.randn(4, 4)
    torch.library.opcheck(
        custom_ops.token_stats_backward,
        (logits.detach(), ids, mask, *stats, c, e, 0.7, backend, 0),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"),
    )


@pytest.mark.parametrize("backend", CPU_BACKENDS + ["triton"])
def test_opcheck_conflict_weights(backend):
    _, ids, mask, adv = random_batch(2, 3, 5, 7, seed=4)
    torch.library.opcheck(custom_ops.conflict_weights, (ids, mask, adv, 3, 2.0, backend))


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_opcheck_fused_linear(backend, packed):
    import json

    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(4, 3, 8, generator=g, requires_grad=True)
    weight = torch.randn(11, 8, generator=g, requires_grad=True)
    ids = torch.randint(0, 11, (4, 3), generator=g)
    mask = torch.ones(4, 3, dtype=torch.bool)
    hidden_index = None
    if packed:  # the same tokens as [12, H], each position's row given
        hidden = hidden.detach().reshape(12, 8).flip(0).requires_grad_()
        hidden_index = torch.arange(12).flip(0).reshape(4, 3)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    lambda_, n_conflict = conflict_weights(ids, mask, adv, 2)
    config = json.dumps(GTPOConfig().to_dict())
    torch.library.opcheck(
        custom_ops.fused_linear_gtpo,
        (
            hidden,
            weight,
            None,
            hidden_index,
            ids,
            mask,
            adv,
            lambda_,
            n_conflict,
            None,  # old log-probs
            None,  # reference log-probs
            None,  # the sampler's log-probs
            None,  # initial entropy
            0.7,  # temperature
            None,  # num_sequences
            None,  # num_tokens
            config,
            backend,
            torch.float32,
            None,  # row lengths
            [True, True, False],
        ),
    )


# ---- a compiled training step ----------------------------------------------------------------------


def tiny_llama(vocab=101):
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def step_batch(seed, n=6, prompt=4, length=5, vocab=101):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (n, prompt + length), generator=g)
    lengths = torch.randint(1, length + 1, (n,), generator=g)
    mask = torch.arange(length)[None] < lengths[:, None]
    adv = torch.randn(n, generator=g)
    return input_ids, mask, adv, conflict_weights(input_ids[:, prompt:], mask, adv, 3)


def make_step(model, backend, fused, prompt=4):
    config = GTPOConfig(entropy_mode="penalty")

    def step(input_ids, mask, adv, conflict):
        ids = input_ids[:, prompt:]
        if fused:
            hidden = model.model(input_ids=input_ids).last_hidden_state[:, prompt - 1 : -1]
            out = fused_linear_gtpo_loss(
                hidden,
                model.lm_head.weight,
                ids,
                mask,
                adv,
                conflict=conflict,
                config=config,
                temperature=0.7,
                backend=backend,
                initial_entropy=5.0,
            )
        else:
            logits = model(input_ids=input_ids).logits[:, prompt - 1 : -1]
            out = gtpo_loss(
                logits,
                ids,
                mask,
                adv,
                conflict=conflict,
                config=config,
                temperature=0.7,
                backend=backend,
                initial_entropy=5.0,
            )
        return out.loss, out.metrics.entropy

    return step


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused_linear"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_compiled_step_equals_eager_without_graph_breaks_or_recompiles(backend, fused):
    model = tiny_llama()
    compiled = torch.compile(make_step(model, backend, fused), fullgraph=True)  # fullgraph: a break raises
    eager = make_step(model, backend, fused)
    for seed in range(2):
        # New data, same shapes: the second call must reuse the graph. The patch is undone when the block
        # ends, pass or fail (the global setting used to stay on after a failure).
        with torch._dynamo.config.patch(error_on_recompile=seed > 0):
            compare_step(compiled, eager, model, step_batch(seed))


def compare_step(compiled, eager, model, batch):
    """One step compiled and eager: equal loss, entropy metric and parameter gradients."""
    results = []
    for fn in (eager, compiled):
        model.zero_grad()
        loss, entropy = fn(*batch)
        loss.backward()
        results.append((loss.detach(), entropy, [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    (loss_e, ent_e, grads_e), (loss_c, ent_c, grads_c) = results
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(ent_c, ent_e, rtol=1e-5, atol=1e-7)
    assert len(grads_c) == len(grads_e) > 5
    for a, b in zip(grads_c, grads_e):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_dynamic_shapes_compile_once_more_at_most():
    from torch._dynamo.utils import counters

    model = tiny_llama()
    counters.clear()
    compiled = torch.compile(make_step(model, "cpu", fused=False), fullgraph=True, dynamic=True)
    for n, length in ((6, 5), (9, 7), (12, 4)):
        loss, _ = compiled(*step_batch(n, n=n, length=length))
        loss.backward()
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])


# ---- the config built where a user builds it: inside the compiled function -----------------------------


@pytest.mark.parametrize("entry", ["logits", "fused_linear"])
@pytest.mark.parametrize("how", ["no config", "GTPOConfig(...)", "replace(...)"])
def test_config_built_inside_the_compiled_function(entry, how):
    """The most natural call, gtpo_loss(...) without a config, once failed under fullgraph: Dynamo inlined the
    config's __init__ and could not wrap its preset sentinel."""
    logits, ids, mask, adv = random_batch(2, 2, 5, 11, seed=8, sharpness=8.0)  # some completions kept
    g = torch.Generator().manual_seed(8)
    hidden, weight = torch.randn(4, 5, 6, generator=g), 3 * torch.randn(11, 6, generator=g)

    def config():
        if how == "no config":
            return None
        if how == "GTPOConfig(...)":
            return GTPOConfig(preset="official", entropy_coef=0.05)
        return GTPOConfig(preset="official").replace(entropy_coef=0.05)

    def step(x):
        if entry == "logits":
            return gtpo_loss(
                x, ids, mask, adv, group_size=2, config=config(), initial_entropy=0.5, backend="torch"
            ).loss
        return fused_linear_gtpo_loss(
            x, weight, ids, mask, adv, group_size=2, config=config(), initial_entropy=0.5, backend="torch"
        ).loss

    x = (logits if entry == "logits" else hidden).clone().requires_grad_()
    compiled = torch.compile(step, fullgraph=True, backend="eager")  # Dynamo's tracing is what failed
    loss_c = compiled(x)
    (grad_c,) = torch.autograd.grad(loss_c, x)
    loss_e = step(x)
    (grad_e,) = torch.autograd.grad(loss_e, x)
    torch.testing.assert_close(loss_c, loss_e)
    torch.testing.assert_close(grad_c, grad_e)
    assert grad_e.abs().max() > 0
