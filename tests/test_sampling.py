"""trainer.sampling: decoding with the key/value cache written in place gives exactly the tokens of the
plain, concatenating cache (it is only faster), and a cache that runs out of reserved room keeps growing."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.cache_utils import DynamicLayer  # noqa: E402

from trainer.sampling import _InPlaceLayer, sample  # noqa: E402


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
