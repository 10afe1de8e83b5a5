"""The losses under ``torch.compile(fullgraph=True)``: registered operators (``gtpo_kernels::*``) with fake
implementations and autograd, `torch.library.opcheck` on each, a tiny Llama's forward + loss + backward
compiled without a graph break and equal to eager mode, no recompilation for new data."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from gtpo_kernels import (  # noqa: E402
    GTPOConfig,
    conflict_weights,
    custom_ops,
    fused_linear,
    fused_linear_gtpo_loss,
    gtpo_loss,
    token_logprobs_and_entropy,
)

from .helpers import random_batch  # noqa: E402

CPU_BACKENDS = ["torch", "cpu"]


# ---- the fused walk's chunks: each one's gradient from the objective itself ---------------------------


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
        ("top_entropy+bonus", GTPOConfig(top_entropy_quantile=0.6, entropy_bonus=0.05)),
    ],
)
def test_fused_chunks_equal_the_logits_path_for_every_term(name, config):
    """Every term of the objective through the fused walk in chunks of 7 tokens (groups cut across chunks, each chunk's
    gradient by autograd of its rows' objective with the whole call's counts): the loss, the gradients and the
    per-row metrics of `gtpo_loss` on the same logits, in float64, per-completion temperatures included."""
    g = torch.Generator().manual_seed(1)
    n_rows, length, hidden_size, vocab = 6, 6, 5, 11
    _, ids, mask, adv = random_batch(2, 3, length, vocab, dtype=torch.float64, seed=2)
    h = torch.randn(n_rows, length, hidden_size, generator=g, dtype=torch.float64)
    w = 2 * torch.randn(vocab, hidden_size, generator=g, dtype=torch.float64)
    temperature = 0.6 + torch.rand(n_rows, generator=g, dtype=torch.float64)
    logp, _ = token_logprobs_and_entropy(h @ w.T, torch.where(mask, ids, 0), temperature=temperature)
    kw = dict(
        old_logprobs=logp + 0.4 * torch.randn(n_rows, length, generator=g, dtype=torch.float64),
        ref_logprobs=logp + 0.3 * torch.randn(n_rows, length, generator=g, dtype=torch.float64),
        initial_entropy=0.2,
        num_sequences=10,
        num_tokens=40,
        temperature=temperature,
        group_size=3,
    )
    if config.sampling_correction:
        kw["sampling_logprobs"] = logp + 0.3 * torch.randn(n_rows, length, generator=g, dtype=torch.float64)
    chunked = config.replace(max_chunk_bytes=7 * vocab * 4)
    hx, wx = h.clone().requires_grad_(), w.clone().requires_grad_()
    out = fused_linear_gtpo_loss(hx, wx, ids, mask, adv, config=chunked, backend="torch", **kw)
    out.loss.backward()
    logits = (h @ w.T).requires_grad_()
    ref = gtpo_loss(logits, ids, mask, adv, config=config, backend="torch", **kw)
    ref.loss.backward()
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(hx.grad, logits.grad @ w, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(wx.grad, logits.grad.flatten(0, 1).T @ h.flatten(0, 1), rtol=1e-10, atol=1e-13)
    assert hx.grad.abs().max() > 0
    for metric in ("completion_entropy", "completion_clip_low", "completion_clip_high"):
        torch.testing.assert_close(getattr(out.metrics, metric), getattr(ref.metrics, metric), equal_nan=True)
    for metric, value in ref.metrics.to_dict().items():
        assert out.metrics.to_dict()[metric] == pytest.approx(value, rel=1e-12, abs=1e-15), metric


# ---- opcheck: schema, fake tensors, autograd registration --------------------------------------------


@pytest.mark.parametrize("per_token", [False, True], ids=["one temperature", "per-token temperatures"])
@pytest.mark.parametrize("backend", CPU_BACKENDS + ["triton"])
def test_opcheck_token_stats(backend, per_token):
    logits, ids, mask, _ = random_batch(2, 2, 4, 13, seed=3)
    temperatures = (0.5 + torch.rand(4, 4, generator=torch.Generator().manual_seed(0))) if per_token else None
    settings = (0.7, temperatures, backend, 0)
    variants = (False, None, None)  # not in place, no vocabulary group
    torch.library.opcheck(custom_ops.token_stats, (logits.requires_grad_(), ids, mask, *settings, *variants))
    stats = custom_ops.token_stats(logits.detach(), ids, mask, *settings, *variants)
    c, e = torch.randn(4, 4), torch.randn(4, 4)
    torch.library.opcheck(
        custom_ops.token_stats_backward,
        (logits.detach(), ids, mask, *stats, c, e, *settings),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"),
    )


@pytest.mark.parametrize("backend", CPU_BACKENDS + ["triton"])
def test_opcheck_conflict_weights(backend):
    _, ids, mask, adv = random_batch(2, 3, 5, 7, seed=4)
    torch.library.opcheck(custom_ops.conflict_weights, (ids, mask, adv, 3, 2.0, backend))


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_opcheck_fused_linear(backend, packed):
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(4, 3, 8, generator=g, requires_grad=True)
    weight = torch.randn(11, 8, generator=g, requires_grad=True)
    ids = torch.randint(0, 11, (4, 3), generator=g)
    mask = torch.ones(4, 3, dtype=torch.bool)
    hidden_index = None
    if packed:  # the same tokens as [12, H], each position's row given
        hidden = hidden.detach().reshape(12, 8).flip(0).requires_grad_()
        hidden_index = torch.arange(12).flip(0).reshape(4, 3)
    # opcheck differentiates |sum| of the outputs: the loss's incoming gradient is its sign, by which the eager backward
    # scales the stored gradients in place (outputs 1-3 included). A positive loss keeps them comparable.
    adv = torch.tensor([-1.0, 1.0, -0.5, 0.5])
    lambda_, n_conflict = conflict_weights(ids, mask, adv, 2)
    inputs = dict(
        hidden=hidden,
        weight=weight,
        bias=None,
        hidden_index=hidden_index,
        ids=ids,
        valid=mask,
        advantages=adv,
        lambda_=lambda_,
        n_conflict=n_conflict,
        old_logprobs=None,
        ref_logprobs=None,
        sampling_logprobs=None,
        initial_entropy=None,
        temperature=0.7,
        row_temperature=torch.tensor([0.7, 1.3, 0.9, 1.1]) if packed else None,  # each completion's (packed case)
        num_sequences=None,
        num_tokens=None,
        logit_scale=0.5 if packed else 1.0,  # the head's logit scale
        logit_softcap=3.0 if packed else None,  # and soft cap (the packed case)
        backend=backend,
        compute_dtype=torch.float32,
        row_lengths=None,
        vocab_group=None,
        shard_sizes=None,
        entropy_quantile_group=None,
        need_grads=[True, True, False],
        **{k: v for k, v in GTPOConfig().to_dict().items() if k not in fused_linear.CONFIG_NOT_IN_OPERATOR},
    )
    operator = fused_linear.fused_linear_gtpo
    assert set(inputs) == set(operator.input_names)
    torch.library.opcheck(operator, tuple(inputs[name] for name in operator.input_names))


# ---- a compiled training step ----------------------------------------------------------------------


# Compiling a whole transformers model step: under the compilers of torch 2.6 and 2.7, transformers 5's own model
# code does not trace (its `func.__code__.co_varnames` look-up; its DynamicCache), whatever the loss; 2.11 and later
# do (tools/torch-matrix.md; 2.8-2.10 not run).
MODEL_COMPILES = pytest.mark.skipif(
    tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 8),
    reason="transformers' model code does not trace under torch < 2.8's compiler (the loss alone does)",
)


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
@MODEL_COMPILES
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


@MODEL_COMPILES
@pytest.mark.cpu_kernels
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
