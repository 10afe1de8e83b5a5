"""Runs the Triton kernels on the CPU through Triton's interpreter (set before triton is imported), and the
tiny model the trainer tests share.

On a CUDA machine set GTPO_TEST_CUDA=1 to run the kernels compiled, on the GPU, instead.
"""

import os

if os.environ.get("GTPO_TEST_CUDA", "0") == "0":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A 2-layer Llama with a character-level tokenizer and a chat template, saved like a hub model."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    specials = ["<pad>", "<|im_start|>", "<|im_end|>", "<unk>"]
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<|im_end|>",
        unk_token="<unk>",
        additional_special_tokens=specials[1:3],
    )
    fast.chat_template = CHAT_TEMPLATE
    config = transformers.LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=vocab["<|im_end|>"],
        pad_token_id=vocab["<pad>"],
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    path = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return str(path)


# --- tests that need the C++ CPU kernels ------------------------------------------------------------------------------
# Marked `cpu_kernels` by hand, or by their `backend` parameter being "cpu": where the kernels did not build (no
# compiler, a torch whose headers they do not compile against) they skip with the reason instead of failing.
# test_cpu_backend.py::test_extension_is_built fails then, unless GTPO_ALLOW_NO_EXTENSION=1 says it is expected.


def pytest_collection_modifyitems(config, items):
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("backend") == "cpu":
            item.add_marker(pytest.mark.cpu_kernels)


def pytest_runtest_setup(item):
    if item.get_closest_marker("cpu_kernels") is not None:
        from gtpo_kernels.backends.cpu_extension import extension_error

        why = extension_error()
        if why is not None:
            pytest.skip(f"needs the C++ CPU kernels, which did not build here: {why[:300]}")


# --- the no-signal audit: `python -m pytest --no-signal-is-error` -------------------------------------------------
# A loss call without signal has loss and gradient exactly 0, so a comparison of it with a reference compares zeros.
# With this option every such call fails its test (the warning, once per process by design, is reset per test);
# tests whose point is a call without signal pass warn_no_signal=False or catch the warning.


def pytest_addoption(parser):
    parser.addoption(
        "--no-signal-is-error",
        action="store_true",
        help="fail every test whose loss call has no learning signal (its comparisons would be of zeros)",
    )


def pytest_configure(config):
    if config.getoption("--no-signal-is-error", default=False):
        config.addinivalue_line("filterwarnings", "error:gtpo_kernels. this loss call has no learning signal")


@pytest.fixture(autouse=True)
def _no_signal_warned_afresh(request):
    if request.config.getoption("--no-signal-is-error"):
        from gtpo_kernels import validation

        validation._WARNED.discard("no_signal")
    yield
