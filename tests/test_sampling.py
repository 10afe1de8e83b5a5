"""trainer.sampling: the token draw follows the tempered distribution, and the top-k / top-p / min-p cuts keep the
tokens they should; our own decoding step on our own key/value cache gives the logits of the model's whole-sequence
forward (Llama, Qwen2, Qwen3; with a shared prefix read once) and the tokens of transformers' own cache, a shared
prompt prefix run once the tokens of the plain way (they are only faster); models it does not take, and a compiler
that fails, fall back; a row ends at any EOS id or stop string, and nothing after it is kept."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from gtpo_kernels.hf import prefix_run_once, prompt_pass  # noqa: E402
from trainer.decode import Decoder, KVCache, decoder_issue  # noqa: E402
from trainer.sampling import DRAW_BLOCK, StopStrings, cut_logits, draw_tokens, sample  # noqa: E402

inf = float("inf")


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def prefixed_prompts(vocab_size, seed=4, prefix_length=24):
    """Two left-padded prompts that share their first ``prefix_length`` tokens, then differ (in length too)."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(4, vocab_size, (prefix_length,), generator=g)
    ids = torch.stack(
        [
            torch.cat([torch.zeros(2, dtype=torch.long), prefix, torch.tensor([7, 8])]),
            torch.cat([prefix, torch.tensor([9, 10, 11, 12])]),
        ]
    )
    return ids, (torch.arange(ids.shape[1]) >= torch.tensor([[2], [0]])).long()


@pytest.mark.parametrize("greedy", [False, True], ids=["sampled", "greedy"])
@pytest.mark.parametrize("prompts", ["own", "shared-prefix"])
def test_our_decoder_gives_the_tokens_of_transformers_cache(tiny_model, greedy, prompts):
    if prompts == "own":
        g = torch.Generator().manual_seed(1)
        prompt_ids = torch.randint(4, tiny_model.config.vocab_size, (3, 7), generator=g)
        prompt_mask = torch.ones_like(prompt_ids)
        prompt_mask[1, :3] = 0  # left padding
    else:
        prompt_ids, prompt_mask = prefixed_prompts(tiny_model.config.vocab_size)
    assert decoder_issue(tiny_model) is None  # the path under test is ours
    runs = []
    for own_cache in (False, True):
        torch.manual_seed(0)
        runs.append(
            sample(
                tiny_model,
                prompt_ids,
                prompt_mask,
                4,
                12,
                temperature=1.3,
                greedy=greedy,
                eos_token_id=tiny_model.config.eos_token_id,
                pad_token_id=0,
                own_cache=own_cache,
            )
        )
    assert runs[0].shape[0] == 4 * prompt_ids.shape[0] and runs[0].shape[1] >= 2
    assert torch.equal(runs[0], runs[1])


def tiny_family_model(kind):
    """A 2-layer model of ``kind`` (random weights): Llama, Qwen2 (biased q/k/v), Qwen3 (per-head q/k norms)."""
    config_class = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}[kind]
    model_class = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[kind]
    config = getattr(transformers, config_class)(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        rope_theta=500.0,
    )
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():  # biases and norms away from their zeros and ones, so that leaving one out shows
        for name, p in model.named_parameters():
            if "bias" in name or "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("prefix", [0, 24], ids=["own-prompts", "shared-prefix"])
@pytest.mark.parametrize("reads", ["written", "whole-buffer"])
def test_decode_step_logits_equal_the_whole_sequence_forward(kind, prefix, reads):
    model = tiny_family_model(kind)
    assert decoder_issue(model) is None
    ids, mask = prefixed_prompts(97)
    n, steps = 2, 5
    with torch.no_grad():
        out, cache, attention, lengths = prompt_pass(model, ids, mask, logits_to_keep=1, share_prefix=bool(prefix))
        assert prefix_run_once(model, ids, mask, bool(prefix)) == prefix
        kv = KVCache.from_prompts(cache, attention, n, steps, prefix)
        assert kv.prefix == prefix
        decoder = Decoder(model)
        g = torch.Generator().manual_seed(2)
        new = torch.randint(4, 97, (ids.shape[0] * n, steps), generator=g)
        positions = lengths.repeat_interleave(n, 0)
        rows_ids, rows_mask = ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0)
        for t in range(steps):
            index = attention.shape[1] - prefix + t
            used = index + 1 if reads == "written" else 0  # the positions written so far, or the whole buffer
            got = decoder(kv, new[:, t], positions + t, torch.tensor([index]), used)
            whole = torch.cat([rows_ids, new[:, : t + 1]], 1)
            whole_mask = torch.cat([rows_mask, torch.ones_like(new[:, : t + 1])], 1)
            expected = model(
                input_ids=whole, attention_mask=whole_mask, position_ids=(whole_mask.cumsum(1) - 1).clamp(min=0)
            ).logits[:, -1]
            assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_under_autocast_the_cache_is_held_in_its_dtype_and_the_logits_stay_the_models():
    """A float32 model under bf16 autocast: the cache holds bf16 (what the attention products run in, so no step
    casts the whole cache), and the decoding step's logits stay within bf16's rounding of the float32 forward's."""
    model = tiny_family_model("llama")
    ids, mask = prefixed_prompts(97)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out, cache, attention, lengths = prompt_pass(model, ids, mask, logits_to_keep=1, share_prefix=True)
        kv = KVCache.from_prompts(cache, attention, 2, 3, 24)
        token = torch.randint(4, 97, (ids.shape[0] * 2,), generator=torch.Generator().manual_seed(3))
        positions = lengths.repeat_interleave(2, 0)
        index = attention.shape[1] - 24
        got = Decoder(model)(kv, token, positions, torch.tensor([index]), index + 1).float()
    assert {t.dtype for t in kv.keys + kv.values + kv.prefix_keys + kv.prefix_values} == {torch.bfloat16}
    with torch.no_grad():
        whole = torch.cat([ids.repeat_interleave(2, 0), token[:, None]], 1)
        whole_mask = torch.cat([mask.repeat_interleave(2, 0), torch.ones_like(token[:, None])], 1)
        expected = model(
            input_ids=whole, attention_mask=whole_mask, position_ids=(whole_mask.cumsum(1) - 1).clamp(min=0)
        ).logits[:, -1]
    assert (got - expected).abs().max() <= 2e-2 * expected.abs().max()


@pytest.mark.parametrize("greedy_first", [False, True], ids=["sampled", "greedy-first"])
def test_rows_that_end_leave_the_batch_and_the_rows_that_go_on_take_the_same_tokens(greedy_first, monkeypatch):
    """With several EOS ids the rows end at different steps; each one that ends leaves the decoding batch (the
    cache keeps the others, moved up), and every row takes the tokens it takes when all decode to the end, and those
    of transformers' own cache (sampled rows, and an evaluation's greedy first row of each prompt)."""
    model = tiny_family_model("qwen3")
    ids, mask = prefixed_prompts(97)
    batches = []
    keep = KVCache.keep

    def counted_keep(self, rows, used):
        batches.append(rows.numel())
        keep(self, rows, used)

    monkeypatch.setattr(KVCache, "keep", counted_keep)
    runs = {}
    for name, options in {
        "compacted": {},
        "every row to the end": {"compact": False},
        "transformers' cache": {"own_cache": False},
    }.items():
        torch.manual_seed(5)
        runs[name] = sample(
            model,
            ids,
            mask,
            4,
            16,
            temperature=1.5,
            greedy_first=greedy_first,
            eos_token_id=[3, 11, 17, 22, 29, 41, 53, 67, 79],
            pad_token_id=0,
            with_lengths=True,
            **options,
        )
        if name == "compacted":
            assert len(batches) >= 2 and batches == sorted(batches, reverse=True) and batches[-1] < 8, batches
            batches.clear()
    assert batches == []  # the other two decode every row to the end
    tokens, lengths = runs["compacted"]
    assert lengths.min() < lengths.max() <= tokens.shape[1]  # rows ended at different steps
    for name in ("every row to the end", "transformers' cache"):
        assert torch.equal(runs[name][0], tokens), name
        assert torch.equal(runs[name][1], lengths), name


def test_models_our_decoder_does_not_take_decode_through_transformers():
    llama = tiny_family_model("llama")
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    ).eval()
    assert "model type 'gpt2'" in decoder_issue(gpt2)
    sliding = transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(
            vocab_size=97,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=0,
        )
    )
    assert "sliding-window" in decoder_issue(sliding)
    del llama.model.rotary_emb
    assert "no rotary_emb" in decoder_issue(llama)
    ids, mask = prefixed_prompts(97)
    torch.manual_seed(0)
    tokens = sample(gpt2, ids, mask, 2, 6, eos_token_id=0, pad_token_id=0)
    assert tokens.shape[0] == 4 and bool((tokens < 97).all())


def test_a_step_the_compiler_cannot_take_falls_back_to_the_eager_step(monkeypatch):
    model = tiny_family_model("llama")

    def failing(*args, **kwargs):
        raise RuntimeError("the compiler gave up")

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: failing)
    ids, mask = prefixed_prompts(97)
    compiled, eager = Decoder(model, compile=True), Decoder(model)
    with torch.no_grad():
        out, cache, attention, lengths = prompt_pass(model, ids, mask, logits_to_keep=1)
        tokens, index = torch.tensor([5, 6]), torch.tensor([attention.shape[1] - 24])
        caches = [KVCache.from_prompts(cache, attention, 1, 3, 24) for _ in range(2)]
        with pytest.warns(UserWarning, match="the compiler gave up.*decoding eagerly"):
            got = compiled(caches[0], tokens, lengths, index)
        expected = eager(caches[1], tokens, lengths, index)
    assert torch.equal(got, expected)
    assert "RuntimeError: the compiler gave up" == compiled.compile_issue


def test_draw_tokens_follows_the_tempered_distribution():
    """Counts of 60000 draws against softmax(logits / T), token by token within five standard errors; a token
    of probability 0 (logit -inf) is never drawn, in any position of the vocabulary."""
    logits = torch.tensor([[0.3, -inf, 1.2, -0.7, 2.0, -inf], [-inf, 0.0, 0.0, -inf, -3.0, 1.0]])
    temperature = 1.7
    rows = 30000
    torch.manual_seed(0)
    drawn = draw_tokens(logits.repeat_interleave(rows, 0), temperature).view(2, rows)
    for r in range(2):
        expected = torch.softmax(logits[r].double() / temperature, -1)
        counts = torch.bincount(drawn[r], minlength=logits.shape[1]).double()
        assert counts[expected == 0].sum() == 0
        err = (expected * (1 - expected) / rows).sqrt()
        assert ((counts / rows - expected).abs() <= 5 * err + 1e-12).all(), (counts / rows, expected)


def test_draw_tokens_never_passes_the_last_possible_token(monkeypatch):
    """A draw that rounds to the very top of the cumulative sum still lands on a token of positive probability
    (the trailing tokens of probability 0 are never taken)."""
    monkeypatch.setattr(torch, "rand", lambda shape, **kw: torch.ones(shape, **kw))  # the worst draw there is
    assert draw_tokens(torch.tensor([[1.0, 2.0, -inf, -inf], [0.5, -inf, 0.1, -inf]])).tolist() == [1, 2]


@pytest.mark.parametrize("vocab", [DRAW_BLOCK // 2 + 3, 3 * DRAW_BLOCK, 5 * DRAW_BLOCK + 17])
def test_draw_tokens_inverts_the_whole_cumulative_distribution(vocab):
    """The two-level lookup (block, then entry) takes the token that one cumulative sum over the whole
    vocabulary gives for the same uniform number, over rows whose probability is spread, peaked, or held in
    a few entries with whole blocks of probability 0 between them."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(96, vocab, generator=g) * torch.tensor([0.5, 4.0, 12.0]).repeat(32)[:, None]
    sparse = torch.rand(32, vocab, generator=g) < 4 / vocab
    sparse[:, vocab // 2] = True
    logits[64:] = torch.where(sparse, logits[64:], -inf)
    temperature = 0.8
    torch.manual_seed(3)
    drawn = draw_tokens(logits, temperature)
    torch.manual_seed(3)
    u = torch.rand(logits.shape[0], 1, dtype=torch.float64)
    cdf = torch.softmax(logits.double() / temperature, -1).cumsum(-1)
    expected = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)
    assert torch.equal(drawn, expected)
    assert bool(torch.isfinite(logits.gather(1, drawn[:, None])).all())


@pytest.mark.parametrize("draw", [0.0, 1.0], ids=["lowest", "highest"])
def test_draw_tokens_at_the_ends_of_the_draw_take_the_first_and_last_possible_tokens(monkeypatch, draw):
    """The lowest and the highest uniform number land on the first and the last token of positive probability,
    past whole blocks of probability 0 before and after them."""
    vocab = 4 * DRAW_BLOCK + 9
    logits = torch.full((2, vocab), -inf)
    first, last = [DRAW_BLOCK + 7, 2 * DRAW_BLOCK - 1], [3 * DRAW_BLOCK + 2, 3 * DRAW_BLOCK]
    for r in range(2):
        logits[r, first[r]], logits[r, last[r]] = 0.3, -0.2
        logits[r, (first[r] + last[r]) // 2] = 1.0
    monkeypatch.setattr(torch, "rand", lambda shape, **kw: torch.full(shape, draw, **kw))
    assert draw_tokens(logits).tolist() == (first if draw == 0.0 else last)


def test_the_highest_draw_stays_in_its_block_when_the_block_sums_round_apart(monkeypatch):
    """The highest draw takes the last token on rows where the block's entries, summed one by one, round below
    the sum that chose the block (a quarter of these rows): never the entry past the block's end."""
    logits = torch.randn(256, 2 * DRAW_BLOCK, generator=torch.Generator().manual_seed(0)) * 5
    monkeypatch.setattr(torch, "rand", lambda shape, **kw: torch.ones(shape, **kw))
    assert draw_tokens(logits).tolist() == [2 * DRAW_BLOCK - 1] * 256


@pytest.mark.parametrize("greedy", [False, True], ids=["sampled", "greedy"])
def test_shared_prefix_gives_the_same_tokens(tiny_model, greedy):
    ids, mask = prefixed_prompts(tiny_model.config.vocab_size)
    runs = []
    for share_prefix in (False, True):
        torch.manual_seed(0)
        runs.append(
            sample(
                tiny_model,
                ids,
                mask,
                3,
                10,
                temperature=1.1,
                greedy=greedy,
                share_prefix=share_prefix,
                eos_token_id=tiny_model.config.eos_token_id,
                pad_token_id=0,
            )
        )
    assert torch.equal(runs[0], runs[1])


def test_cut_logits_keeps_what_each_cut_should():
    """Against hand-worked cuts on probabilities 0.5, 0.25, 0.15, 0.1: top-k 2 keeps two; top-p 0.7 keeps the
    first two (0.5 < 0.7 <= 0.75), top-p 0.75 the same, 0.76 three; min-p 0.3 keeps those >= 0.15; the most likely
    token always stays; the kept logits are unchanged."""
    probs = torch.tensor([[0.15, 0.5, 0.1, 0.25]])
    logits = probs.log()
    kept = lambda **kw: (cut_logits(logits, **kw) > -inf).squeeze(0).tolist()  # noqa: E731
    assert kept(top_k=2) == [False, True, False, True]
    assert kept(top_p=0.7) == [False, True, False, True]
    assert kept(top_p=0.75) == [False, True, False, True]
    assert kept(top_p=0.76) == [True, True, False, True]
    assert kept(top_p=0.01) == [False, True, False, False]
    assert kept(min_p=0.3) == [True, True, False, True]
    assert kept(min_p=0.31) == [False, True, False, True]
    assert kept(top_k=3, top_p=0.7) == [False, True, False, True]
    assert kept() == [True] * 4
    cut = cut_logits(logits, top_k=3)
    assert torch.equal(cut[cut > -inf], logits[logits >= logits.sort(descending=True).values[0, 2]])


def test_top_p_sampling_draws_only_from_the_nucleus_in_its_proportions(tiny_model):
    """Sampled with top-p through `sample`: no token outside the nucleus of the tempered distribution, and the
    first token's counts within five standard errors of the renormalised nucleus."""
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(4, tiny_model.config.vocab_size, (1, 6), generator=g)
    rows, temperature, top_p = 4000, 1.5, 0.3
    with torch.no_grad():
        logits = tiny_model(input_ids=prompt).logits[0, -1].double() / temperature
    probs = logits.softmax(-1)
    order = probs.argsort(descending=True)
    before = probs[order].cumsum(0) - probs[order]
    nucleus = order[before < top_p]
    assert 2 <= len(nucleus) < len(probs)  # the cut matters on this prompt
    torch.manual_seed(0)
    first = sample(
        tiny_model,
        prompt,
        torch.ones_like(prompt),
        rows,
        1,
        temperature=temperature,
        top_p=top_p,
        eos_token_id=tiny_model.config.eos_token_id,
        pad_token_id=0,
    )[:, 0]
    counts = torch.bincount(first, minlength=len(probs)).double()
    outside = torch.ones(len(probs), dtype=torch.bool)
    outside[nucleus] = False
    assert counts[outside].sum() == 0
    expected = probs[nucleus] / probs[nucleus].sum()
    err = (expected * (1 - expected) / rows).sqrt()
    assert ((counts[nucleus] / rows - expected).abs() <= 5 * err).all()


def test_a_row_ends_at_any_eos_id_and_what_follows_is_padding(tiny_model):
    """Two EOS ids: every row ends at the first of either (its length counts it), and only padding follows."""
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(4, tiny_model.config.vocab_size, (2, 5), generator=g)
    torch.manual_seed(1)
    free = sample(tiny_model, prompt, torch.ones_like(prompt), 3, 16, eos_token_id=[], pad_token_id=0)
    ends = [int(free[0, 2]), int(free[1, 5])]  # two tokens the model samples early in some rows
    torch.manual_seed(1)
    ids, lengths = sample(
        tiny_model, prompt, torch.ones_like(prompt), 3, 16, eos_token_id=ends, pad_token_id=0, with_lengths=True
    )
    for r in range(ids.shape[0]):
        hits = [t for t in range(free.shape[1]) if int(free[r, t]) in ends]
        expected = hits[0] + 1 if hits else ids.shape[1]
        assert int(lengths[r]) == expected
        assert torch.equal(ids[r, :expected], free[r, :expected])
        assert bool((ids[r, expected:] == 0).all())
    assert int(lengths[0]) <= 3 and int(lengths[1]) <= 6


def test_stop_strings_end_a_row_with_the_token_that_completes_them(tiny_model_dir, tiny_model):
    """A stop string (two tokens' text, 8 to 20 tokens into the first row) ends each row at the first token whose
    text so far contains it, as the free-running row has it; rows without it run to the cap; padding follows."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    g = torch.Generator().manual_seed(6)
    prompt = torch.randint(4, tiny_model.config.vocab_size, (2, 5), generator=g)
    torch.manual_seed(3)
    free = sample(tiny_model, prompt, torch.ones_like(prompt), 4, 24, eos_token_id=[], pad_token_id=0)
    first_text = (
        lambda r, stop: next(  # noqa: E731
            (
                t + 1
                for t in range(free.shape[1])
                if stop in tokenizer.decode(free[r, : t + 1], skip_special_tokens=True)
            ),
            free.shape[1],
        )
    )
    special = set(tokenizer.all_special_ids)
    t = next(t for t in range(8, 20) if int(free[0, t]) not in special and int(free[0, t + 1]) not in special)
    stop = tokenizer.decode(free[0, t : t + 2])
    torch.manual_seed(3)
    ids, lengths = sample(
        tiny_model,
        prompt,
        torch.ones_like(prompt),
        4,
        24,
        eos_token_id=[],
        pad_token_id=0,
        stops=StopStrings(tokenizer, [stop]),
        with_lengths=True,
    )
    ended = 0
    for r in range(free.shape[0]):
        expected = first_text(r, stop)
        ended += expected < free.shape[1]
        assert int(lengths[r]) == expected, (r, stop)
        assert torch.equal(ids[r, :expected], free[r, :expected])
        assert bool((ids[r, expected:] == 0).all())
    assert int(lengths[0]) <= t + 2 and ended >= 1


def test_every_eos_id_of_the_generation_config_ends_a_completion(tiny_model_dir):
    """An instruct model's generation config may list several EOS ids (end of turn, end of text): each ends a
    completion, with the tokenizer's own."""
    from trainer.rollout import eos_ids

    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.generation_config.eos_token_id = [7, tokenizer.eos_token_id, 9]
    assert eos_ids(model, tokenizer) == sorted({7, 9, tokenizer.eos_token_id})
    model.generation_config.eos_token_id = None
    assert eos_ids(model, tokenizer) == [tokenizer.eos_token_id]
