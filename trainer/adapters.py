"""LoRA adapters through peft, and the frozen reference policy of ``--beta``'s KL term."""

from __future__ import annotations

import copy
import warnings
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Optional

from torch import nn

from .config import ConfigError, TrainConfig


def add_lora(model: nn.Module, config: TrainConfig, resume_from: Optional[Path] = None, say=print) -> nn.Module:
    """``model`` with LoRA adapters (a ``PeftModel``): new ones from ``--lora-*``, or a checkpoint's
    (``resume_from``). Every other weight is frozen. The head stays a plain matrix that the fused loss reads
    (frozen); naming it in ``--lora-target-modules`` trains it whole instead (peft's ``modules_to_save``): a LoRA
    product on the head would not be one matrix."""
    try:
        from peft import LoraConfig, PeftModel, get_peft_model
    except ImportError:
        raise ConfigError("--lora-r needs peft: pip install 'gtpo_kernels[peft]' (or pip install peft)") from None
    if resume_from is not None:
        from .model import check_weight_files

        check_weight_files(resume_from)
        try:
            with _quiet_peft():
                return PeftModel.from_pretrained(model, resume_from, is_trainable=True)
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(f"--resume: could not load the adapter in {resume_from}: {exc}".splitlines()[0]) from None
    head = _head_name(model)
    targets = config.lora_target_modules or "all-linear"  # peft's "all-linear" leaves the output layer out
    to_save = None
    if isinstance(targets, list) and head in targets:
        targets = [t for t in targets if t != head] or "all-linear"
        to_save = [head]
        say(f"--lora-target-modules names the head ({head}): it is trained whole (peft's modules_to_save)")
    lora = LoraConfig(
        r=config.lora_r,
        lora_alpha=config.lora_alpha if config.lora_alpha is not None else 2 * config.lora_r,
        lora_dropout=config.lora_dropout,
        target_modules=targets,
        modules_to_save=to_save,
        task_type="CAUSAL_LM",
    )
    try:
        with _quiet_peft():
            return get_peft_model(model, lora)
    except ValueError as exc:  # e.g. a target module the model does not have
        raise ConfigError(f"--lora-target-modules: {exc}".splitlines()[0]) from None


@contextmanager
def _quiet_peft():
    """peft asks transformers >= 5.2x for ``is_gradient_checkpointing``, which warns that v6 renames it: peft's call,
    not one the user can act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def _head_name(model: nn.Module) -> Optional[str]:
    head = model.get_output_embeddings()
    return next((name for name, module in model.named_modules() if module is head), None)


def frozen_reference(model: nn.Module) -> nn.Module:
    """The starting policy for ``--beta``'s KL term without LoRA: a frozen copy of ``model``'s weights (one more
    model in memory, in --model-dtype). Under LoRA the reference is the same model with its adapters switched off
    (`reference_weights`): no copy."""
    reference = copy.deepcopy(model).eval()
    reference.requires_grad_(False)
    return reference


def reference_weights(model: nn.Module, reference: Optional[nn.Module]):
    """A context in which the returned model computes the starting policy's logits: the frozen copy, or ``model``
    with its LoRA adapters switched off."""
    if reference is not None:
        return nullcontext(reference)
    return _adapters_off(model)


@contextmanager
def _adapters_off(model):
    with model.disable_adapter():
        yield model
