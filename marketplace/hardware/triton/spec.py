"""Model specs and config.pbtxt: ``ModelSpec`` (+ ``TensorSpec``, ``InstanceGroup``, ``DynamicBatching``), validated
one check per field; ``render_config`` writes config.pbtxt, ``parse_model_config`` / ``parse_config`` read one with
Triton's own protobuf schema."""


from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

BACKEND_ENV = "TESSERA_TRITON_BACKEND"
BACKEND_KINDS = ("sim", "http")
MEMORY_PARAMETER = "tessera_memory_mb"
CONFIG_FILE = "config.pbtxt"

MODEL_NAME_RE = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
TENSOR_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:/-]{0,127}$")
PARAMETER_KEY_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")

# Triton backend names (``backend: "..."`` in config.pbtxt).
BACKENDS = ("python", "onnxruntime", "pytorch", "tensorrt", "tensorflow", "openvino", "vllm", "tensorrtllm",
            "fil", "dali", "identity")
AUTOCOMPLETE_BACKENDS = ("vllm", "tensorrtllm")  # may omit input/output (the backend fills them in)
DATA_TYPES = ("TYPE_BOOL", "TYPE_UINT8", "TYPE_UINT16", "TYPE_UINT32", "TYPE_UINT64", "TYPE_INT8", "TYPE_INT16",
              "TYPE_INT32", "TYPE_INT64", "TYPE_FP16", "TYPE_FP32", "TYPE_FP64", "TYPE_BF16", "TYPE_STRING")
INSTANCE_KINDS = ("KIND_GPU", "KIND_CPU", "KIND_MODEL", "KIND_AUTO")
MAX_DEMO_TOKENS = 1024  # demo_generate spells these out itself: it is copied into model.py verbatim
DEFAULT_DEMO_TOKENS = 16


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# --------------------------------------------------------------------------------------------------
# Model spec
# --------------------------------------------------------------------------------------------------

@dataclass
class TensorSpec:
    name: str
    data_type: str  # TYPE_STRING, TYPE_FP32, TYPE_INT32, ...
    dims: list[int]
    optional: bool = False  # inputs only

    def validate(self, where: str) -> None:
        if not isinstance(self.name, str) or not TENSOR_NAME_RE.match(self.name):
            raise ValueError(f"{where}: tensor name {self.name!r} is invalid (letters, digits, _ . : / -; "
                             f"starts with a letter or _; at most 128 characters)")
        if self.data_type not in DATA_TYPES:
            raise ValueError(f"{where} {self.name!r}: data_type {self.data_type!r} is not one of "
                             f"{', '.join(DATA_TYPES)}")
        dims = list(self.dims) if isinstance(self.dims, list | tuple) else None
        if not dims:
            raise ValueError(f"{where} {self.name!r}: dims must be a non-empty list of integers (use [1] for a scalar)")
        for d in dims:
            if not _is_int(d) or (d < 1 and d != -1):
                raise ValueError(f"{where} {self.name!r}: dims {dims!r} must be positive integers or -1 (variable)")
        if not isinstance(self.optional, bool):
            raise ValueError(f"{where} {self.name!r}: optional must be a bool")
        self.dims = dims


@dataclass
class InstanceGroup:
    count: int = 1
    kind: str = "KIND_GPU"
    gpus: list[int] | None = None  # CUDA ordinals visible to the server (a MIG slice is always 0)

    def validate(self) -> None:
        if not _is_int(self.count) or not 1 <= self.count <= 64:
            raise ValueError(f"instance_group.count must be an integer from 1 to 64, got {self.count!r}")
        if self.kind not in INSTANCE_KINDS:
            raise ValueError(f"instance_group.kind {self.kind!r} is not one of {', '.join(INSTANCE_KINDS)}")
        if self.gpus is not None:
            if self.kind != "KIND_GPU":
                raise ValueError("instance_group.gpus is only allowed with kind KIND_GPU")
            if not isinstance(self.gpus, list | tuple) or not all(_is_int(g) and g >= 0 for g in self.gpus):
                raise ValueError(f"instance_group.gpus must be a list of non-negative integers, got {self.gpus!r}")
            self.gpus = list(self.gpus)


@dataclass
class DynamicBatching:
    preferred_batch_size: list[int] = field(default_factory=list)
    max_queue_delay_microseconds: int = 0

    def validate(self, max_batch_size: int) -> None:
        if max_batch_size < 1:
            raise ValueError("dynamic_batching needs max_batch_size >= 1")
        sizes = self.preferred_batch_size
        if not isinstance(sizes, list | tuple) or not all(_is_int(s) for s in sizes):
            raise ValueError(f"dynamic_batching.preferred_batch_size must be a list of integers, got {sizes!r}")
        for s in sizes:
            if not 1 <= s <= max_batch_size:
                raise ValueError(f"dynamic_batching.preferred_batch_size {s} must be between 1 and "
                                 f"max_batch_size ({max_batch_size})")
        if len(set(sizes)) != len(sizes):
            raise ValueError(f"dynamic_batching.preferred_batch_size has duplicates: {list(sizes)!r}")
        if not _is_int(self.max_queue_delay_microseconds) or self.max_queue_delay_microseconds < 0:
            raise ValueError("dynamic_batching.max_queue_delay_microseconds must be an integer >= 0, "
                             f"got {self.max_queue_delay_microseconds!r}")
        self.preferred_batch_size = list(sizes)


def _coerce(cls: type, value: Any, where: str) -> Any:
    if isinstance(value, cls):
        return value
    if isinstance(value, dict):
        try:
            return cls(**value)
        except TypeError as exc:
            raise ValueError(f"{where}: {exc}") from None
    raise ValueError(f"{where} must be a {cls.__name__} or a dict, got {type(value).__name__}")


@dataclass
class ModelSpec:
    """One Triton model. Construct, then it validates itself (``ValueError`` with a clear message).

    ``files`` maps a path relative to the version folder (e.g. ``"model.py"``) to its content.
    ``inputs``/``outputs``/``instance_group``/``dynamic_batching`` also accept plain dicts.
    """

    name: str
    backend: str
    max_batch_size: int = 0
    inputs: list[TensorSpec] = field(default_factory=list)
    outputs: list[TensorSpec] = field(default_factory=list)
    instance_group: InstanceGroup = field(default_factory=InstanceGroup)
    dynamic_batching: DynamicBatching | None = None
    version: int = 1
    files: dict[str, bytes | str] = field(default_factory=dict)
    parameters: dict[str, str] = field(default_factory=dict)
    memory_mb: int = 0  # declared memory need (0 = not declared)
    decoupled: bool = False  # model_transaction_policy { decoupled: true }: any number of responses per request

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """One check per field, in this order (the first problem is the one reported); the coercing checks
        replace dicts with their spec objects and parameter values with strings."""
        self._check_name()
        self._check_backend()
        self._check_max_batch_size()
        self.inputs = self._checked_tensors("inputs", "input")
        self.outputs = self._checked_tensors("outputs", "output")
        self.instance_group = self._checked_instance_group()
        self.dynamic_batching = self._checked_dynamic_batching()
        self._check_version()
        self._check_files()
        self.parameters = self._checked_parameters()
        self._check_memory_mb()
        self._check_decoupled()

    def _check_name(self) -> None:
        if not isinstance(self.name, str) or not MODEL_NAME_RE.match(self.name):
            raise ValueError(f"model name {self.name!r} is invalid: 1 to 64 characters from a-z A-Z 0-9 _ -")

    def _check_backend(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"model {self.name!r}: backend {self.backend!r} is not one of {', '.join(BACKENDS)}")

    def _check_max_batch_size(self) -> None:
        if not _is_int(self.max_batch_size) or self.max_batch_size < 0:
            raise ValueError(f"model {self.name!r}: max_batch_size must be an integer >= 0 (0 = no batching), "
                             f"got {self.max_batch_size!r}")

    def _checked_tensors(self, attr: str, where: str) -> list[TensorSpec]:
        items = getattr(self, attr)
        if not isinstance(items, list | tuple):
            raise ValueError(f"model {self.name!r}: {attr} must be a list")
        tensors = [_coerce(TensorSpec, t, f"model {self.name!r} {where}") for t in items]
        if not tensors and self.backend not in AUTOCOMPLETE_BACKENDS:
            raise ValueError(f"model {self.name!r}: at least one {where} is required for backend {self.backend!r}")
        names = set()
        for t in tensors:
            t.validate(f"model {self.name!r} {where}")
            if t.name in names:
                raise ValueError(f"model {self.name!r}: duplicate {where} name {t.name!r}")
            if where == "output" and t.optional:
                raise ValueError(f"model {self.name!r}: output {t.name!r} cannot be optional")
            names.add(t.name)
        return tensors

    def _checked_instance_group(self) -> InstanceGroup:
        group = _coerce(InstanceGroup, self.instance_group, f"model {self.name!r} instance_group")
        group.validate()
        return group

    def _checked_dynamic_batching(self) -> DynamicBatching | None:
        if self.dynamic_batching is None:
            return None
        batching = _coerce(DynamicBatching, self.dynamic_batching, f"model {self.name!r} dynamic_batching")
        batching.validate(self.max_batch_size)
        return batching

    def _check_version(self) -> None:
        if not _is_int(self.version) or self.version < 1:
            raise ValueError(f"model {self.name!r}: version must be an integer >= 1 (Triton ignores folder '0'), "
                             f"got {self.version!r}")

    def _check_files(self) -> None:
        if not isinstance(self.files, dict):
            raise ValueError(f"model {self.name!r}: files must be a dict of relative path -> bytes or str")
        for path, content in self.files.items():
            _check_relative_path(self.name, path)
            if not isinstance(content, bytes | str):
                raise ValueError(f"model {self.name!r}: file {path!r} content must be bytes or str, "
                                 f"got {type(content).__name__}")

    def _checked_parameters(self) -> dict[str, str]:
        if not isinstance(self.parameters, dict):
            raise ValueError(f"model {self.name!r}: parameters must be a dict of str -> str")
        params = {}
        for key, value in self.parameters.items():
            if not isinstance(key, str) or not PARAMETER_KEY_RE.match(key):
                raise ValueError(f"model {self.name!r}: parameter key {key!r} is invalid (letters, digits, _ . : -)")
            if key == MEMORY_PARAMETER:
                raise ValueError(f"model {self.name!r}: parameter {MEMORY_PARAMETER!r} is reserved; set memory_mb")
            if not isinstance(value, str | int | float | bool):
                raise ValueError(f"model {self.name!r}: parameter {key!r} must be a string, got {type(value).__name__}")
            params[key] = str(value).lower() if isinstance(value, bool) else str(value)
        return params

    def _check_memory_mb(self) -> None:
        if not _is_int(self.memory_mb) or self.memory_mb < 0:
            raise ValueError(f"model {self.name!r}: memory_mb must be an integer >= 0, got {self.memory_mb!r}")

    def _check_decoupled(self) -> None:
        if not isinstance(self.decoupled, bool):
            raise ValueError(f"model {self.name!r}: decoupled must be true or false, got {self.decoupled!r}")

def _check_relative_path(model: str, path: Any) -> None:
    if not isinstance(path, str) or not path or "\\" in path or "\x00" in path:
        raise ValueError(f"model {model!r}: file path {path!r} must be a non-empty relative POSIX path")
    p = PurePosixPath(path)
    if p.is_absolute() or any(part in ("", ".", "..") for part in path.split("/")):
        raise ValueError(f"model {model!r}: file path {path!r} must stay inside the version folder "
                         "(relative, no '.', '..' or empty parts)")


# --------------------------------------------------------------------------------------------------
# config.pbtxt: render and parse (protobuf text format)
# --------------------------------------------------------------------------------------------------

def _quote(value: str) -> str:
    out = []
    for ch in value:
        if ch == "\\":
            out.append("\\\\")
        elif ch == '"':
            out.append('\\"')
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\{ord(ch):03o}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _dims(dims: list[int]) -> str:
    return "[ " + ", ".join(str(d) for d in dims) + " ]"


def _tensors(label: str, tensors: list[TensorSpec]) -> list[str]:
    lines = [f"{label} ["]
    for i, t in enumerate(tensors):
        lines += ["  {", f"    name: {_quote(t.name)}", f"    data_type: {t.data_type}", f"    dims: {_dims(t.dims)}"]
        if t.optional:
            lines.append("    optional: true")
        lines.append("  }," if i < len(tensors) - 1 else "  }")
    lines.append("]")
    return lines


def render_config(spec: ModelSpec) -> str:
    """The model's ``config.pbtxt`` (deterministic: the same spec always gives the same text)."""
    spec.validate()
    lines = [f"name: {_quote(spec.name)}", f"backend: {_quote(spec.backend)}", f"max_batch_size: {spec.max_batch_size}"]
    if spec.decoupled:
        lines.append("model_transaction_policy { decoupled: true }")
    if spec.inputs:
        lines += _tensors("input", spec.inputs)
    if spec.outputs:
        lines += _tensors("output", spec.outputs)
    g = spec.instance_group
    lines += ["instance_group [", "  {", f"    count: {g.count}", f"    kind: {g.kind}"]
    if g.gpus is not None:
        lines.append(f"    gpus: {_dims(g.gpus)}")
    lines += ["  }", "]"]
    if spec.dynamic_batching is not None:
        db = spec.dynamic_batching
        lines.append("dynamic_batching {")
        if db.preferred_batch_size:
            lines.append(f"  preferred_batch_size: {_dims(db.preferred_batch_size)}")
        lines += [f"  max_queue_delay_microseconds: {db.max_queue_delay_microseconds}", "}"]
    params = dict(spec.parameters)
    if spec.memory_mb:
        params[MEMORY_PARAMETER] = str(spec.memory_mb)
    for key in sorted(params):
        lines += ["parameters {", f"  key: {_quote(key)}", f"  value: {{ string_value: {_quote(params[key])} }}", "}"]
    return "\n".join(lines) + "\n"


class PbtxtError(ValueError):
    """config.pbtxt is not a valid Triton ModelConfig in protobuf text format."""


def _model_config_pb2():
    from tritonclient.grpc import model_config_pb2  # imports grpc; only where configs are parsed

    return model_config_pb2


def parse_model_config(text: str):
    """Parse a config.pbtxt with Triton's own schema (``tritonclient.grpc.model_config_pb2.ModelConfig``,
    ``google.protobuf.text_format``): an unknown field, a wrong type or an unknown enum is a ``PbtxtError``
    naming the line, as Triton itself refuses it."""
    from google.protobuf import text_format

    pb2 = _model_config_pb2()
    try:
        return text_format.Parse(text, pb2.ModelConfig())
    except text_format.ParseError as exc:
        raise PbtxtError(str(exc)) from None


@dataclass(frozen=True)
class ParsedConfig:
    """The fields of a config.pbtxt that Tessera and the simulator use (``message``: the whole ModelConfig)."""

    name: str | None
    backend: str | None
    platform: str | None
    max_batch_size: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    instance_kind: str | None
    instance_count: int
    parameters: dict[str, str]
    memory_mb: int
    default_model_filename: str | None
    decoupled: bool = False
    message: Any = field(repr=False, compare=False, default=None)


def parse_config(text: str) -> ParsedConfig:
    """Parse a config.pbtxt with Triton's protobuf schema (``PbtxtError`` if Triton would refuse it)."""
    msg = parse_model_config(text)
    pb2 = _model_config_pb2()
    dtype = pb2.DataType.Name
    kind = pb2.ModelInstanceGroup.Kind.Name

    def tensors(items) -> tuple[TensorSpec, ...]:
        return tuple(TensorSpec(name=t.name, data_type=dtype(t.data_type), dims=list(t.dims),
                                optional=bool(getattr(t, "optional", False))) for t in items)

    params = {k: v.string_value for k, v in msg.parameters.items()}
    mem = params.get(MEMORY_PARAMETER, "0")
    try:
        memory_mb = int(mem)
    except ValueError:
        raise PbtxtError(f"parameter {MEMORY_PARAMETER} must be an integer, got {mem!r}") from None
    groups = list(msg.instance_group)
    return ParsedConfig(
        name=msg.name or None, backend=msg.backend or None, platform=msg.platform or None,
        max_batch_size=msg.max_batch_size, inputs=tensors(msg.input), outputs=tensors(msg.output),
        instance_kind=kind(groups[0].kind) if groups else None,
        instance_count=sum(g.count or 1 for g in groups) if groups else 0,
        parameters=params, memory_mb=memory_mb, default_model_filename=msg.default_model_filename or None,
        decoupled=bool(msg.model_transaction_policy.decoupled), message=msg)
