"""trainer.sampling: the token draw follows the tempered distribution; decoding with the key/value cache written
in place, and with a shared prompt prefix run once, gives the tokens and logits of the plain way (they are only
faster); a cache that runs out of reserved room keeps growing."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.cache_utils import DynamicLayer  # noqa: E402

from trainer.sampling import (_cache_kwarg, _InPlaceLayer, _prompt_pass, draw_tokens, sample,  # noqa: E402
                              shared_prefix_length)

inf = float("inf")


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("greedy", [False, True], ids=["sampled", "greedy"])
def test_in_place_cache_gives_the_same_tokens(tiny_model, greedy):
    g = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(4, tiny_model.config.vocab_size, (3, 7), generator=g)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[1, :3] = 0  # left padding
    runs = []
    for in_place in (False, True):
        torch.manual_seed(0)
        runs.append(sample(tiny_model, prompt_ids, prompt_mask, 4, 12, temperature=1.3, greedy=greedy,
                           eos_token_id=tiny_model.config.eos_token_id, pad_token_id=0, in_place_cache=in_place))
    assert runs[0].shape[0] == 12 and runs[0].shape[1] >= 2
    assert torch.equal(runs[0], runs[1])


def test_layer_grows_past_its_reserve():
    keys = [torch.randn(2, 3, n, 4) for n in (5, 1, 1, 2)]
    values = [torch.randn(2, 3, n, 4) for n in (5, 1, 1, 2)]
    plain, in_place = DynamicLayer(), DynamicLayer()
    plain.update(keys[0], values[0])
    in_place.update(keys[0], values[0])
    in_place.__class__ = _InPlaceLayer
    in_place.reserve(2)  # room for the next two positions, then two more than reserved
    for k, v in zip(keys[1:], values[1:]):
        expected = plain.update(k, v)
        got = in_place.update(k, v)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert in_place.get_seq_length() == 9


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


@pytest.mark.parametrize("rows,expected", [
    # left-padded rows (0 = padding): the prefix is counted from each row's first token
    ([[0, 0, 5, 6, 7, 8], [5, 6, 7, 9, 9, 9], [0, 5, 6, 7, 1, 2]], 3),
    ([[5, 6, 7], [5, 6, 7]], 2),  # identical prompts keep one token each of their own
    ([[0, 5, 6], [4, 5, 6]], 0),
    ([[5, 6, 7, 8]], 0),  # one prompt: nothing to share
])
def test_shared_prefix_length(rows, expected):
    ids = torch.tensor(rows)
    mask = (ids != 0).long()
    assert shared_prefix_length(ids, mask) == expected


def test_shared_prefix_pass_gives_each_prompts_own_logits(tiny_model):
    """Prompts of different lengths that share a 20-token prefix: the last-position logits of the prompt pass,
    and of the next token decoded on its cache, equal those of each prompt run alone, unpadded; the prefix
    path is the one taken."""
    g = torch.Generator().manual_seed(3)
    vocab = tiny_model.config.vocab_size
    prefix = torch.randint(4, vocab, (20,), generator=g)
    own = [torch.randint(4, vocab, (n,), generator=g) for n in (5, 1, 3)]
    prompts = [torch.cat([prefix, o]) for o in own]
    width = max(len(p) for p in prompts)
    ids = torch.stack([torch.cat([torch.zeros(width - len(p), dtype=torch.long), p]) for p in prompts])
    mask = torch.stack([torch.cat([torch.zeros(width - len(p)), torch.ones(len(p))]).long() for p in prompts])
    assert shared_prefix_length(ids, mask) == 20
    next_tokens = torch.randint(4, vocab, (3,), generator=g)
    with torch.no_grad():
        cache, logits, attention, positions = _prompt_pass(tiny_model, ids, mask, _cache_kwarg(tiny_model), 16)
        assert attention.shape[1] == 20 + 5  # the prefix once, then the longest prompt's own tokens
        attention = torch.cat([attention, torch.ones_like(attention[:, :1])], 1)
        step = tiny_model(input_ids=next_tokens[:, None], attention_mask=attention, position_ids=positions,
                          use_cache=True, **{_cache_kwarg(tiny_model): cache}).logits[:, -1]
        for b, p in enumerate(prompts):
            alone = tiny_model(input_ids=torch.cat([p, next_tokens[b:b + 1]])[None]).logits[0]
            torch.testing.assert_close(logits[b], alone[-2], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(step[b], alone[-1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("greedy", [False, True], ids=["sampled", "greedy"])
def test_shared_prefix_gives_the_same_tokens(tiny_model, greedy):
    g = torch.Generator().manual_seed(4)
    prefix = torch.randint(4, tiny_model.config.vocab_size, (24,), generator=g)
    ids = torch.stack([torch.cat([torch.zeros(2, dtype=torch.long), prefix, torch.tensor([7, 8])]),
                       torch.cat([prefix, torch.tensor([9, 10, 11, 12])])])
    mask = (torch.arange(ids.shape[1]) >= torch.tensor([[2], [0]])).long()
    runs = []
    for min_prefix in (0, 16):
        torch.manual_seed(0)
        runs.append(sample(tiny_model, ids, mask, 3, 10, temperature=1.1, greedy=greedy, min_shared_prefix=min_prefix,
                           eos_token_id=tiny_model.config.eos_token_id, pad_token_id=0))
    assert torch.equal(runs[0], runs[1])
