"""trainer.sampling: the token draw follows the tempered distribution; decoding with the key/value cache written
in place, and with a shared prompt prefix run once, gives the tokens and logits of the plain way (they are only
faster); a cache that runs out of reserved room keeps growing."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.cache_utils import DynamicLayer  # noqa: E402

from trainer.sampling import _InPlaceLayer, draw_tokens, sample  # noqa: E402

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
