"""Timing, peak memory, bandwidth floor and reporting shared by the benchmarks.

Times are medians over repetitions, every implementation measured side by side in the same process
(the machines are noisy; only ratios within one run mean anything).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import threading
import time
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, List, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from gtpo_kernels import GTPOConfig
from gtpo_kernels.backends.cpu_extension import extension_error
from gtpo_kernels.backends.torch_backend import conflict_weights as torch_conflict_weights
from gtpo_kernels.objective import loss_from_token_stats
from gtpo_kernels.reference import token_logprobs_and_entropy
from gtpo_kernels.rows import LossRows

# Where tables go: bench/results/local/ (ignored by git: a user's figures never overwrite the committed ones in
# bench/results/), or GTPO_BENCH_OUT (the GPU check writes only there; maintainers refreshing the committed
# tables set it to bench/results).
RESULTS = Path(os.environ.get("GTPO_BENCH_OUT", Path(__file__).resolve().parent / "results" / "local"))


def cpu_kernels_available() -> bool:
    return extension_error() is None


def plain_pytorch_gtpo_loss(
    logits,
    completion_ids,
    completion_mask,
    advantages,
    *,
    group_size: int,
    config: GTPOConfig,
    temperature: float = 1.0,
):
    """The GTPO loss as a typical trainer writes it in PyTorch: ``log_softmax`` over the whole ``[N, L, V]``
    logits and plain autograd through everything (the baseline of the benchmarks, eager and compiled)."""
    valid = completion_mask.bool()
    logp, entropy = token_logprobs_and_entropy(logits / temperature, torch.where(valid, completion_ids, 0))
    conflict = (
        torch_conflict_weights(completion_ids, valid, advantages, group_size, config.conflict_weight)
        if config.use_conflict_weights
        else None
    )
    return loss_from_token_stats(logp, entropy, LossRows(completion_ids, valid, advantages, conflict), config)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mmap_threshold(nbytes: int) -> None:
    """glibc only: allocations of at least ``nbytes`` get their own mapping (returned on free), and
    freed heap memory is handed back first (else new allocations reuse it unseen)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, nbytes)  # M_MMAP_THRESHOLD
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


# Timing runs use a fixed 32 MiB threshold (where glibc's dynamic one settles), the same for every
# implementation. The memory run uses 64 KiB: otherwise glibc serves allocations up to 32 MiB from
# freed heap pages without growing the resident set, hiding them from the sampler.
TIMING_MMAP_THRESHOLD = 32 * 2**20
MEMORY_MMAP_THRESHOLD = 64 * 2**10


def status_bytes(field: str) -> int:
    """A memory figure of this process from /proc/self/status (``VmRSS``, ``VmHWM``), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(field)


class ResidentPeak:
    """Peak resident memory of this process while active, above what it held on entry (CPU runs).

    Linux keeps the exact high-water mark (VmHWM), which /proc/self/clear_refs resets; where that is
    not available, the resident set is sampled every millisecond instead.
    """

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self):
        self.start = status_bytes("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset the high-water mark to the current resident set
            self._hwm = True
        except OSError:
            self._hwm = False
            self.peak = self.start
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, status_bytes("VmRSS"))
            time.sleep(0.001)

    def __exit__(self, *exc) -> None:
        if self._hwm:
            self.peak = status_bytes("VmHWM")
        else:
            self._stop.set()
            self._thread.join()

    @property
    def extra(self) -> int:
        return self.peak - self.start

    @property
    def exact(self) -> bool:
        """Whether ``peak`` is the kernel's high-water mark (else the highest of the samples)."""
        return self._hwm


def resident_peak(call) -> ResidentPeak:
    """The resident peak of ``call()`` above its start, with glibc handing large frees back at once during it (the
    timing threshold restored after): it sees every allocation, an operator's internal buffers too."""
    mmap_threshold(MEMORY_MMAP_THRESHOLD)
    try:
        with ResidentPeak() as peak:
            call()
    finally:
        mmap_threshold(TIMING_MMAP_THRESHOLD)
    return peak


class _ModelOutput(torch.autograd.Function):
    """Stands for the model: hands ``data`` on as a non-leaf tensor (no copy), drops its gradient."""

    @staticmethod
    def forward(ctx, anchor, data):
        return data

    @staticmethod
    def backward(ctx, grad):
        return None, None


def model_output(data: torch.Tensor) -> torch.Tensor:
    """``data`` as if a model had produced it: a non-leaf tensor that requires grad (what the in-place
    modes need), whose gradient goes nowhere (so no leaf accumulates a ``.grad`` buffer)."""
    return _ModelOutput.apply(torch.zeros((), device=data.device, requires_grad=True), data)


@dataclass
class Timing:
    forward_ms: float
    backward_ms: float
    total_ms: float
    peak_extra_mib: float


def measure(
    make_input: Callable[[], object],
    forward: Callable[[object], torch.Tensor],
    device: torch.device,
    reps: int,
    warmup: int = 1,
) -> Timing:
    """Median forward, backward and forward+backward times of ``forward(make_input()).backward()``.

    ``make_input`` runs outside the timed region (fresh inputs each repetition, as the in-place
    modes destroy theirs). Peak memory is what the loss adds on top of its inputs: on a GPU the
    allocator's peak during the timed runs, on the CPU the resident set's peak during one extra run
    (allocation slows down while it is measured, so it is not timed).
    """
    cpu = device.type != "cuda"
    if cpu:
        mmap_threshold(TIMING_MMAP_THRESHOLD)
    fwd, bwd, tot = [], [], []
    for _ in range(warmup):
        forward(make_input()).backward()
    sync(device)
    peak_extra = 0
    for _ in range(reps):
        x = make_input()
        sync(device)
        if not cpu:
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        t0 = time.perf_counter()
        loss = forward(x)
        sync(device)
        t1 = time.perf_counter()
        loss.backward()
        sync(device)
        t2 = time.perf_counter()
        if not cpu:
            peak_extra = max(peak_extra, torch.cuda.max_memory_allocated(device) - base)
        del x, loss
        fwd.append(t1 - t0)
        bwd.append(t2 - t1)
        tot.append(t2 - t0)
    if cpu:
        mmap_threshold(MEMORY_MMAP_THRESHOLD)
        x = make_input()
        with ResidentPeak() as tracker:
            forward(x).backward()
        peak_extra = tracker.extra
        del x
        mmap_threshold(TIMING_MMAP_THRESHOLD)
    med = lambda xs: 1e3 * statistics.median(xs)
    return Timing(med(fwd), med(bwd), med(tot), peak_extra / 2**20)


def copy_bandwidth_gbs(device: torch.device, nbytes: int = 2**30, reps: int = 20) -> Optional[float]:
    """Measured device-to-device copy bandwidth (bytes read + written per second), GPU only."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * nbytes / statistics.median(times) / 1e9


def environment(device: torch.device) -> dict:
    info = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "device": str(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = props.name
        info["gpu_memory_gb"] = round(props.total_memory / 2**30, 1)
        info["cuda"] = torch.version.cuda
    else:
        # The trainer's record of the machine: /proc/cpuinfo's name, and its bf16 units (CPUs of one name differ:
        # some multiply bf16 natively, AVX-512 BF16 or AMX, which changes bf16 timings).
        from trainer.precision import Machine

        machine = Machine.this(device)
        info["cpu"] = machine.cpu
        info["cpu_bf16_units"] = ", ".join(machine.bf16_units) or "none"
    return info


@dataclass
class Row:
    impl: str
    tokens: int
    vocab: int
    dtype: str
    forward_ms: Optional[float] = None
    backward_ms: Optional[float] = None
    total_ms: Optional[float] = None
    peak_extra_mib: Optional[float] = None
    extra: dict = field(default_factory=dict)
    error: Optional[str] = None


def measure_into(row: Row, make_input, forward, device: torch.device, reps: int) -> Optional[Timing]:
    """Times ``forward`` into ``row`` (or records why it failed, e.g. out of memory); returns the Timing."""
    try:
        t = measure(make_input, forward, device, reps)
    except Exception as exc:  # noqa: BLE001 (a failing implementation is a row, not the end of the run)
        row.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return None
    row.forward_ms, row.backward_ms, row.total_ms = t.forward_ms, t.backward_ms, t.total_ms
    row.peak_extra_mib = t.peak_extra_mib
    return t


def markdown_table(rows: List[Row], columns: List[str]) -> str:
    header = "| impl | T | V | dtype | fwd ms | bwd ms | fwd+bwd ms | peak extra MiB | " + " | ".join(columns) + " |"
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    fmt = lambda v: "" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))
    for r in rows:
        if r.error:
            cells = [r.impl, r.tokens, r.vocab, r.dtype, f"error: {r.error}", "", "", ""] + [""] * len(columns)
        else:
            cells = [r.impl, r.tokens, r.vocab, r.dtype, r.forward_ms, r.backward_ms, r.total_ms, r.peak_extra_mib] + [
                r.extra.get(c) for c in columns
            ]
        lines.append("| " + " | ".join(fmt(c) for c in cells) + " |")
    return "\n".join(lines)


def save(name: str, env: dict, rows: List[Row], table: str, notes: str = "") -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps({"environment": env, "rows": [asdict(r) for r in rows]}, indent=1))
    env_lines = "\n".join(f"- {k}: {v}" for k, v in env.items())
    (RESULTS / f"{name}.md").write_text(f"# {name}\n\n{env_lines}\n\n{notes}\n\n{table}\n")
    return RESULTS / f"{name}.md"


def write_markdown(name: str, lines: List[str]) -> Path:
    """``RESULTS/name.md``: a heading, this CPU's environment, then ``lines``; printed as well."""
    env = "\n".join(f"- {k}: {v}" for k, v in environment(torch.device("cpu")).items())
    text = f"# {name}\n\n{env}\n\n" + "\n".join(lines) + "\n"
    print(text)
    path = RESULTS / f"{name}.md"
    path.parent.mkdir(parents=True, exist_ok=True)  # a name may hold a folder: a study's tables kept together
    path.write_text(text)
    print(f"written: {path}")
    return path


def plot_time_vs_vocab(name: str, rows: List[Row], title: str) -> Optional[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install -e '.[bench]')")
        return None
    panels = sorted({(r.tokens, r.dtype) for r in rows if r.total_ms is not None})
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (tokens, dtype) in zip(axes[0], panels):
        impls = sorted({r.impl for r in rows if r.tokens == tokens and r.dtype == dtype})
        for impl in impls:
            pts = sorted(
                (r.vocab, r.total_ms)
                for r in rows
                if r.impl == impl and r.tokens == tokens and r.dtype == dtype and r.total_ms
            )
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
        ax.set_title(f"T = {tokens}, {dtype}")
        ax.set_xlabel("vocabulary size V")
        ax.set_ylabel("forward + backward (ms)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path = RESULTS / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


class PeakTensorMemory(TorchDispatchMode):
    """Bytes of tensor storage created inside the ``with`` block and alive at once, at the peak.

    Every op's outputs are counted once per new storage (outputs that share an input's storage, such as
    views and in-place results, are not new) and uncounted when the storage is freed. ``largest`` is the
    largest single new storage. Exact and deterministic, unlike the resident set."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = self.largest = 0
        self._tracked = set()

    def _free(self, key, nbytes):
        self._tracked.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            id(t.untyped_storage())
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor) and t.device.type != "meta"
        }
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = id(storage)
            if key in inputs or key in self._tracked or storage.nbytes() == 0:
                continue
            self._tracked.add(key)
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            self.largest = max(self.largest, storage.nbytes())
            weakref.finalize(storage, self._free, key, storage.nbytes())
        return out
