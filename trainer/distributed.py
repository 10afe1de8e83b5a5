"""Several processes under ``torchrun``: the process group, collectives, and wrapping the policy.

One process (no ``torchrun``) is world size 1 and every collective is a no-op, so the loop in
`trainer.train` reads the same either way. Data parallel by default (DDP); ``--fsdp`` shards the
parameters with FSDP2 (``fully_shard`` on each decoder layer and on the root). gloo on the CPU, NCCL on
CUDA (one GPU per process, ``LOCAL_RANK``); several nodes through torchrun's own rendezvous.
"""

from __future__ import annotations

import os
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Distributed:
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def start(cls, device_setting: str) -> Distributed:
        """From torchrun's environment (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``), or one process."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        cuda = device_setting == "cuda" or (device_setting == "auto" and torch.cuda.is_available())
        if world == 1:
            return cls(0, 1, torch.device("cuda" if cuda else "cpu"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if cuda:
            torch.cuda.set_device(local_rank)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if cuda else "gloo")
        return cls(
            dist.get_rank(), dist.get_world_size(), torch.device("cuda", local_rank) if cuda else torch.device("cpu")
        )

    def close(self) -> None:
        if self.world > 1 and dist.is_initialized():
            # Every process reaches this point before any tears the group down: a process that destroys
            # it while a peer still finishes a collective (FSDP2's state-dict gathers run asynchronously)
            # can abort inside gloo ("terminate called without an active exception", seen once in ~30
            # two-process runs).
            dist.barrier()
            dist.destroy_process_group()

    def all_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over processes, in place (float64 stays float64: counts and metric sums are exact)."""
        if self.world > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def any(self, flag: bool) -> bool:
        """Whether any process says yes (a stop request seen by one process stops them all together)."""
        if self.world == 1:
            return flag
        value = torch.tensor([1.0 if flag else 0.0], device=self.device)
        return bool(self.all_sum(value) > 0)

    def gather_objects(self, obj) -> list:
        """Every process's ``obj`` (picklable), in rank order, on every process."""
        if self.world == 1:
            return [obj]
        gathered = [None] * self.world
        dist.all_gather_object(gathered, obj)
        return gathered

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


def wrap(module: torch.nn.Module, decoder_layers, dist_: Distributed, fsdp: bool) -> torch.nn.Module:
    """``module`` (whose forward computes the loss) as the processes train it: itself for one process (there
    is nothing to shard or synchronise), DDP by default, FSDP2 with ``fsdp``."""
    if dist_.world == 1:
        if fsdp:
            warnings.warn(
                "gtpo-train: --fsdp has no effect in one process (FSDP2 shards the parameters across processes: "
                "start the run with torchrun --nproc_per_node N); training the model unsharded",
                RuntimeWarning,
                stacklevel=2,
            )
        return module
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in decoder_layers:
            fully_shard(layer)
        fully_shard(module)
        return module
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(module, device_ids=[dist_.device.index] if dist_.device.type == "cuda" else None)


@contextmanager
def full_parameters(wrapped: torch.nn.Module):
    """Inside, the root's parameters are whole (FSDP2 shards them between forwards): for sampling, which runs the
    unwrapped model's decoder and head step by step (`sampling.sample`) rather than the wrapped forward."""
    unshard = getattr(wrapped, "unshard", None)
    if unshard is None:
        yield
        return
    # The root must be initialised as the root before any sharded layer runs on its own (generation calls
    # the layers directly); FSDP2 otherwise takes the first layer that runs for a root. No public call does it.
    state = getattr(wrapped, "_get_fsdp_state", lambda: None)()
    if state is not None and getattr(state, "_is_root", True) is None:
        state._lazy_init()
    unshard()
    try:
        yield
    finally:
        wrapped.reshard()


def no_sync(wrapped: torch.nn.Module, last: bool):
    """DDP: skip the gradient all-reduce on every micro-batch but the last."""
    if last or not hasattr(wrapped, "no_sync"):
        return nullcontext()
    return wrapped.no_sync()


def full_state(wrapped: torch.nn.Module, optimizer=None):
    """``(model_state, optimizer_state)`` gathered whole on the CPU, keys as in the unwrapped module (every
    process must call this: under FSDP it is a collective). ``optimizer``: the run's `PolicyOptimizer`, or None."""
    if not dist.is_initialized():
        model_state = {k: v.detach().cpu() for k, v in wrapped.state_dict().items()}
        return model_state, None if optimizer is None else optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_state_dict(wrapped, optimizer.adamw if optimizer is not None else [], options=options)


def load_optimizer_state(wrapped: torch.nn.Module, optimizer, optimizer_state: dict) -> None:
    """The run's `PolicyOptimizer` from a state `full_state` gathered (the model's weights come with the model)."""
    if not dist.is_initialized():
        optimizer.load_state_dict(optimizer_state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(
        wrapped, optimizer.adamw, optim_state_dict=optimizer_state, options=StateDictOptions(full_state_dict=True)
    )
