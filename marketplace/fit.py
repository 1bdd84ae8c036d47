"""Memory-aware fit: does a model fit a slice, at which context length and concurrency, with what headroom.

Pure Python (no Django, no database): ordering, deploying, the portal and the "find a tier" API all call
``fit()`` with the slice's memory from the catalog (``MigProfile.memory_mib``, or the whole GPU's).

The memory a transformer needs on a GPU while serving:

* **weights** = parameters x bytes per weight (FP32 4, FP16/BF16 2, FP8/INT8 1, INT4 0.5);
* **KV cache** = tokens cached x (2 x layers x KV heads x head dimension x bytes per KV element): the 2 is
  one key and one value vector per layer and KV head; tokens cached = context length x concurrent sequences
  (every sequence may grow to the full context);
* **runtime overhead**: the CUDA context, the framework's activation workspace and, for vLLM, CUDA graphs
  (``RUNTIME_OVERHEAD_MIB`` below, one figure per Triton backend, documented in the README);
* **LoRA adapters** (vLLM multi-LoRA): each adapter's size, summed.

A model without an architecture (an uploaded python or ONNX repository) has a fixed need: its declared
memory (or the size of its files) plus the backend's overhead, and no KV cache.

Several models on one slice are summed: ``fit(..., other_mib=...)`` takes what the slice already holds.

**Tensor parallelism** (a tier of N whole GPUs, vLLM ``tensor_parallel_size`` = N): ``fit(..., tensor_parallel=N)``
answers per GPU. Each rank holds 1/N of the weights (and of the LoRA adapters) and the KV cache of
ceil(KV heads / N) heads -- 1/N of it when N divides the KV heads, more when the heads are fewer than the ranks
(vLLM then replicates them) -- and pays the runtime overhead in full (its own process, CUDA context,
activations and graphs). ``slice_mib`` is then one GPU's memory, and every memory figure of the answer is
per GPU; the cache room (``max_cached_tokens``) counts tokens, which are spread over all N GPUs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MIB = 1024 * 1024

# Bytes per element of each weight / KV-cache data type.
DTYPE_BYTES: dict[str, float] = {"FP32": 4, "FP16": 2, "BF16": 2, "FP8": 1, "INT8": 1, "INT4": 0.5}
WEIGHT_DTYPES = ("FP16", "BF16", "FP8", "INT8", "INT4")
KV_DTYPES = ("FP16", "BF16", "FP8", "INT8")

# Runtime overhead per Triton backend, MiB: what the server needs on the slice beyond the weights and the KV
# cache. The CUDA context on a Hopper GPU takes about 0.5 GiB per process; vLLM adds its activation peak
# (measured at start-up by profiling a max-length batch) and CUDA graphs; TensorRT-LLM its activation
# workspace; onnxruntime's CUDA execution provider its arena and cuDNN/cuBLAS workspaces; the python backend
# a stub process with the CUDA context of whatever it imports. Conservative round figures, not measurements.
RUNTIME_OVERHEAD_MIB: dict[str, int] = {
    "vllm": 3072,
    "tensorrtllm": 2048,
    "onnxruntime": 1024,
    "python": 512,
    "ensemble": 0,  # its steps are models of their own, each counted with its backend
}
DEFAULT_OVERHEAD_MIB = 1024


def overhead_mib(backend: str) -> int:
    return RUNTIME_OVERHEAD_MIB.get(backend, DEFAULT_OVERHEAD_MIB)


@dataclass(frozen=True)
class ModelShape:
    """What the fit needs to know about a model.

    A transformer: ``params``, ``layers``, ``kv_heads``, ``head_dim``, dtypes. A model without an architecture:
    ``fixed_mib`` only (its declared memory or the size of its files).
    """

    name: str
    backend: str = "vllm"
    params: int = 0
    layers: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    weight_dtype: str = "BF16"
    kv_dtype: str = "BF16"
    max_context: int = 0  # 0: no limit (or no KV cache)
    fixed_mib: int = 0
    adapters_mib: tuple[int, ...] = field(default_factory=tuple)  # LoRA adapters held with the model
    overhead_included: bool = False  # fixed_mib is the whole need (a spec's declared memory)

    def __post_init__(self) -> None:
        if self.weight_dtype not in DTYPE_BYTES:
            raise ValueError(f"weight dtype {self.weight_dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
        if self.kv_dtype not in DTYPE_BYTES:
            raise ValueError(f"KV-cache dtype {self.kv_dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
        for attr in ("params", "layers", "kv_heads", "head_dim", "max_context", "fixed_mib"):
            if getattr(self, attr) < 0:
                raise ValueError(f"{attr} must be >= 0")

    @property
    def has_kv_cache(self) -> bool:
        return self.layers > 0 and self.kv_heads > 0 and self.head_dim > 0

    @property
    def weights_bytes(self) -> int:
        return math.ceil(self.params * DTYPE_BYTES[self.weight_dtype]) + self.fixed_mib * MIB

    @property
    def kv_bytes_per_token(self) -> int:
        """2 (K and V) x layers x KV heads x head dimension x bytes per KV element."""
        if not self.has_kv_cache:
            return 0
        return math.ceil(2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES[self.kv_dtype])

    @property
    def adapters_bytes(self) -> int:
        return sum(self.adapters_mib) * MIB

    @property
    def overhead_mib(self) -> int:
        return 0 if self.overhead_included else overhead_mib(self.backend)

    @property
    def overhead_bytes(self) -> int:
        return self.overhead_mib * MIB


@dataclass(frozen=True)
class Fit:
    """The answer for one model on one slice (every memory figure in MiB, rounded up where it is a need)."""

    slice_mib: int  # the slice's memory (catalog)
    other_mib: int  # taken by other models already on the slice
    weights_mib: float
    overhead_mib: int
    adapters_mib: int
    kv_per_token_bytes: int
    context: int  # asked for
    concurrency: int
    kv_mib: float  # cache for context x concurrency
    needed_mib: int  # weights + overhead + adapters + cache
    fits: bool
    headroom_mib: int  # slice - others - needed (negative: short by that much)
    max_cached_tokens: int  # tokens of KV cache room once the model is loaded (0 if the weights do not fit)
    max_context: int  # the longest context for `concurrency` sequences (capped by the model's max context)
    max_concurrency: int  # sequences of `context` tokens that fit at once
    reason: str  # one sentence, with the numbers
    tensor_parallel: int = 1  # GPUs the model is split over; memory figures are per GPU

    def as_dict(self) -> dict[str, object]:
        return {k: (round(v, 1) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def kv_bytes_per_token_per_gpu(model: ModelShape, tensor_parallel: int = 1) -> int:
    """A token's KV cache on one of ``tensor_parallel`` ranks: ceil(KV heads / N) of the heads."""
    if not model.has_kv_cache or tensor_parallel == 1:
        return model.kv_bytes_per_token
    heads = math.ceil(model.kv_heads / tensor_parallel)
    return math.ceil(2 * model.layers * heads * model.head_dim * DTYPE_BYTES[model.kv_dtype])


def fit(model: ModelShape, slice_mib: int, *, context: int = 0, concurrency: int = 1, other_mib: int = 0,
        tensor_parallel: int = 1) -> Fit:
    """Fit ``model`` with ``concurrency`` sequences of ``context`` tokens on a slice of ``slice_mib`` MiB of
    which ``other_mib`` are taken. ``context`` 0 means the model's max context (or none without a KV cache).
    ``tensor_parallel`` N: the model is split over N GPUs of ``slice_mib`` each; the answer is per GPU."""
    if tensor_parallel < 1:
        raise ValueError("tensor_parallel must be >= 1")
    if slice_mib <= 0:
        raise ValueError("slice memory must be > 0 MiB")
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    if context < 0:
        raise ValueError("context must be >= 0")
    if not model.has_kv_cache:
        context = 0
    elif context == 0:
        context = model.max_context
    if model.has_kv_cache and model.max_context and context > model.max_context:
        raise ValueError(f"context {context} exceeds {model.name}'s max context of {model.max_context} tokens")
    free = (slice_mib - other_mib) * MIB
    tp = tensor_parallel
    weights = math.ceil(model.weights_bytes / tp)
    adapters = math.ceil(model.adapters_bytes / tp)
    static = weights + model.overhead_bytes + adapters
    per_token = kv_bytes_per_token_per_gpu(model, tp)
    kv = per_token * context * concurrency
    needed = static + kv
    room = free - static
    max_tokens = room // per_token if per_token and room > 0 else 0
    if per_token:
        max_context = min(max_tokens // concurrency, model.max_context or max_tokens // concurrency)
        max_concurrency = max_tokens // context if context else 0
    else:
        max_context = 0
        max_concurrency = 10**6 if room >= 0 else 0  # no cache: concurrency costs no memory in this model
    fits = needed <= free
    needed_mib = math.ceil(needed / MIB)
    headroom = math.floor((free - needed) / MIB)
    where = "" if tp == 1 else f" per GPU (tensor parallel over {tp} GPUs)"
    if fits:
        reason = (f"{model.name} fits: {needed_mib:,} MiB needed of {slice_mib - other_mib:,} MiB free{where} "
                  f"({headroom:,} MiB headroom)")
    elif room < 0:
        reason = (f"{model.name} does not fit: weights and runtime alone need {math.ceil(static / MIB):,} MiB{where}, "
                  f"{slice_mib - other_mib:,} MiB are free on this slice" + ("" if tp == 1 else " (per GPU)"))
    else:
        reason = (f"{model.name} does not fit at {context:,} tokens x {concurrency} sequences: "
                  f"{needed_mib:,} MiB needed{where}, {slice_mib - other_mib:,} MiB free; "
                  f"at most {max_tokens:,} cached tokens fit (e.g. {max_context:,} tokens x {concurrency})")
    return Fit(slice_mib=slice_mib, other_mib=other_mib, weights_mib=weights / MIB,
               overhead_mib=model.overhead_mib, adapters_mib=math.ceil(adapters / MIB),
               kv_per_token_bytes=per_token, context=context, concurrency=concurrency, kv_mib=kv / MIB,
               needed_mib=needed_mib, fits=fits, headroom_mib=headroom, max_cached_tokens=int(max_tokens),
               max_context=int(max_context), max_concurrency=int(max_concurrency), reason=reason,
               tensor_parallel=tp)


def vllm_memory_utilization(needed_mib: int, slice_mib: int, free_mib: int | None = None) -> float:
    """vLLM's ``gpu_memory_utilization``: the share of the device this model may take (weights, activations,
    KV cache). Rounded up to 0.01 so vLLM's KV budget holds what the fit sized (``max_model_len`` x
    ``max_num_seqs``), unless that would reach past the slice's free memory (other models): then rounded down.
    Between 0.05 and 0.99."""
    share = needed_mib / slice_mib
    up = math.ceil(share * 100) / 100
    if free_mib is not None and up * slice_mib > free_mib:
        up = math.floor(share * 100) / 100
    return max(0.05, min(up, 0.99))
