"""trainer.sampling: the token draw follows the tempered distribution; decoding with the key/value cache written
in place, and with a shared prompt prefix run once, gives the tokens and logits of the plain way (they are only
faster); a cache that runs out of reserved room keeps growing."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.cache_utils import DynamicLayer  # noqa: E402

from trainer.sampling import DRAW_BLOCK, _InPlaceLayer, draw_tokens, sample  # noqa: E402

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
                in_place_cache=in_place,
            )
        )
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
    g = torch.Generator().manual_seed(4)
    prefix = torch.randint(4, tiny_model.config.vocab_size, (24,), generator=g)
    ids = torch.stack(
        [
            torch.cat([torch.zeros(2, dtype=torch.long), prefix, torch.tensor([7, 8])]),
            torch.cat([prefix, torch.tensor([9, 10, 11, 12])]),
        ]
    )
    mask = (torch.arange(ids.shape[1]) >= torch.tensor([[2], [0]])).long()
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
