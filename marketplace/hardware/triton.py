"""Triton Inference Server: model specs, repository writer, and one backend interface (real or simulated).

Pure Python (Django is only consulted lazily for settings). Pieces:

* ``ModelSpec`` (+ ``TensorSpec``, ``InstanceGroup``, ``DynamicBatching``): a validated description of
  one model; ``render_config(spec)`` gives its ``config.pbtxt`` (protobuf text format).
* ``write_repository(repo_dir, spec)`` writes ``<repo>/<model>/config.pbtxt`` and
  ``<repo>/<model>/<version>/<files>``: staged in a hidden sibling folder then renamed into place
  (the model folder is replaced whole), and a no-op when the bytes on disk already match.
  ``remove_model(repo_dir, name)`` removes one model folder the same way.
* ``TritonBackend``: the calls provisioning and metering make. ``HttpTritonBackend`` talks to a real
  server with ``tritonclient.http`` (server started with ``--model-control-mode=explicit``);
  ``SimTritonBackend`` reads the same repository folder and answers the same way, raising
  ``tritonclient.utils.InferenceServerException`` with the real server's messages and statuses
  (observed on tritonserver 2.51, the one bundled with nvidia-pytriton 0.7.0).
* ``demo_text_model()``: a tiny python-backend text model (``DEMO_TEXT_MODEL_PY``) that runs on CPU;
  the simulator runs the very same ``demo_generate`` function, so both give identical answers.

The declared memory of a model (``ModelSpec.memory_mb``) travels in ``config.pbtxt`` as the model
parameter ``tessera_memory_mb`` (Triton passes unknown parameters through), which the simulator
checks against the slice's memory.
"""

from __future__ import annotations

import inspect
import os
import re
import shutil
import tempfile
import threading
import time
import urllib.request
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, NamedTuple

from tritonclient.utils import InferenceServerException

from marketplace.hardware import setting

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
        if not isinstance(self.name, str) or not MODEL_NAME_RE.match(self.name):
            raise ValueError(f"model name {self.name!r} is invalid: 1 to 64 characters from a-z A-Z 0-9 _ -")
        if self.backend not in BACKENDS:
            raise ValueError(f"model {self.name!r}: backend {self.backend!r} is not one of {', '.join(BACKENDS)}")
        if not _is_int(self.max_batch_size) or self.max_batch_size < 0:
            raise ValueError(f"model {self.name!r}: max_batch_size must be an integer >= 0 (0 = no batching), "
                             f"got {self.max_batch_size!r}")
        for attr, where in (("inputs", "input"), ("outputs", "output")):
            items = getattr(self, attr)
            if not isinstance(items, list | tuple):
                raise ValueError(f"model {self.name!r}: {attr} must be a list")
            items = [_coerce(TensorSpec, t, f"model {self.name!r} {where}") for t in items]
            if not items and self.backend not in AUTOCOMPLETE_BACKENDS:
                raise ValueError(f"model {self.name!r}: at least one {where} is required for backend {self.backend!r}")
            names = set()
            for t in items:
                t.validate(f"model {self.name!r} {where}")
                if t.name in names:
                    raise ValueError(f"model {self.name!r}: duplicate {where} name {t.name!r}")
                if where == "output" and t.optional:
                    raise ValueError(f"model {self.name!r}: output {t.name!r} cannot be optional")
                names.add(t.name)
            setattr(self, attr, items)
        self.instance_group = _coerce(InstanceGroup, self.instance_group, f"model {self.name!r} instance_group")
        self.instance_group.validate()
        if self.dynamic_batching is not None:
            self.dynamic_batching = _coerce(DynamicBatching, self.dynamic_batching,
                                            f"model {self.name!r} dynamic_batching")
            self.dynamic_batching.validate(self.max_batch_size)
        if not _is_int(self.version) or self.version < 1:
            raise ValueError(f"model {self.name!r}: version must be an integer >= 1 (Triton ignores folder '0'), "
                             f"got {self.version!r}")
        if not isinstance(self.files, dict):
            raise ValueError(f"model {self.name!r}: files must be a dict of relative path -> bytes or str")
        for path, content in self.files.items():
            _check_relative_path(self.name, path)
            if not isinstance(content, bytes | str):
                raise ValueError(f"model {self.name!r}: file {path!r} content must be bytes or str, "
                                 f"got {type(content).__name__}")
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
        self.parameters = params
        if not _is_int(self.memory_mb) or self.memory_mb < 0:
            raise ValueError(f"model {self.name!r}: memory_mb must be an integer >= 0, got {self.memory_mb!r}")
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
    from tritonclient.grpc import model_config_pb2  # noqa: PLC0415 - imports grpc; only where configs are parsed

    return model_config_pb2


def parse_model_config(text: str):
    """Parse a config.pbtxt with Triton's own schema (``tritonclient.grpc.model_config_pb2.ModelConfig``,
    ``google.protobuf.text_format``): an unknown field, a wrong type or an unknown enum is a ``PbtxtError``
    naming the line, as Triton itself refuses it."""
    from google.protobuf import text_format  # noqa: PLC0415

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


# --------------------------------------------------------------------------------------------------
# Repository writer
# --------------------------------------------------------------------------------------------------

class WriteResult(NamedTuple):
    path: Path  # <repo>/<model>
    changed: bool  # False: the folder already held exactly these bytes (nothing written)


def model_files(spec: ModelSpec) -> dict[str, bytes]:
    """Every file of the model folder, relative to ``<repo>/<model>/``, as bytes."""
    out = {CONFIG_FILE: render_config(spec).encode()}
    for path, content in spec.files.items():
        out[f"{spec.version}/{path}"] = content.encode() if isinstance(content, str) else bytes(content)
    return out


def _read_tree(root: Path) -> dict[str, bytes] | None:
    """All regular files under ``root`` (relative POSIX path -> bytes); None if anything else is there."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        base = Path(dirpath)
        for d in dirnames:
            if (base / d).is_symlink():
                return None
        for f in filenames:
            p = base / f
            if p.is_symlink() or not p.is_file():
                return None
            out[p.relative_to(root).as_posix()] = p.read_bytes()
    return out


def _staging_prefix(name: str) -> str:
    return f".{name}.tessera-"


def _clean_stale(repo: Path, name: str) -> None:
    for p in repo.glob(_staging_prefix(name) + "*"):
        shutil.rmtree(p, ignore_errors=True)


def write_repository(repo_dir: str | os.PathLike, spec: ModelSpec) -> WriteResult:
    """Write ``<repo>/<model>/config.pbtxt`` and ``<repo>/<model>/<version>/<files>``.

    Idempotent: when the folder already holds exactly these files, nothing is touched
    (``changed=False``). Otherwise the new folder is built in a hidden staging folder
    (``<repo>/.<model>.tessera-*``) and renamed into place, replacing the old folder whole (older
    versions and stray files go). A reader sees the old folder or the new one, never a half-written one
    (the swap has a sub-millisecond window where the model folder is absent). Note that a real Triton
    lists hidden folders in its repository index too, while the staging folder exists.
    """
    spec.validate()
    repo = Path(repo_dir)
    repo.mkdir(parents=True, exist_ok=True)
    target = repo / spec.name
    desired = model_files(spec)
    if target.is_dir() and not target.is_symlink() and _read_tree(target) == desired:
        return WriteResult(target, False)
    _clean_stale(repo, spec.name)
    staging = Path(tempfile.mkdtemp(prefix=_staging_prefix(spec.name) + "new-", dir=repo))
    old: Path | None = None
    try:
        for rel, content in desired.items():
            path = staging / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as fh:
                fh.write(content)
                fh.flush()
                os.fsync(fh.fileno())
            path.chmod(0o644)
        for dirpath, _dirs, _files in os.walk(staging):
            Path(dirpath).chmod(0o755)  # mkdtemp makes 0700; a server running as another user must read it
        if target.exists() or target.is_symlink():
            old = repo / f"{_staging_prefix(spec.name)}old-{uuid.uuid4().hex}"
            os.rename(target, old)
        os.rename(staging, target)
    except BaseException:
        if old is not None and not target.exists():
            os.rename(old, target)
            old = None
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)
    return WriteResult(target, True)


def remove_model(repo_dir: str | os.PathLike, name: str) -> bool:
    """Remove ``<repo>/<name>`` (renamed aside first, so it disappears at once). False if it was not there."""
    if not isinstance(name, str) or not MODEL_NAME_RE.match(name):
        raise ValueError(f"model name {name!r} is invalid: 1 to 64 characters from a-z A-Z 0-9 _ -")
    repo = Path(repo_dir)
    target = repo / name
    if not (target.exists() or target.is_symlink()):
        return False
    old = repo / f"{_staging_prefix(name)}old-{uuid.uuid4().hex}"
    os.rename(target, old)
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old, ignore_errors=True)
    else:
        old.unlink(missing_ok=True)
    return True


# --------------------------------------------------------------------------------------------------
# Demo text model (python backend, KIND_CPU)
# --------------------------------------------------------------------------------------------------

def demo_generate(prompt, max_tokens=16):
    """Deterministic "generation": the prompt's words in reverse order, cycled to ``max_tokens`` words.

    Tokens are whitespace-split words. Returns ``(text, input_tokens, output_tokens)``. This function
    is copied verbatim into DEMO_TEXT_MODEL_PY, so it uses no imports and no module globals.
    """
    if max_tokens is None:
        max_tokens = 16
    max_tokens = int(max_tokens)
    if max_tokens < 0 or max_tokens > 1024:
        raise ValueError(f"max_tokens must be between 0 and 1024, got {max_tokens}")
    words = str(prompt).split()
    if not words:
        return "", 0, 0
    pool = words[::-1]
    out = [pool[i % len(pool)] for i in range(max_tokens)]
    return " ".join(out), len(words), len(out)


DEMO_TEXT_MODEL_PY = '''"""Tessera demo text model (Triton python backend). Generated by marketplace.hardware.triton."""

import numpy as np
import triton_python_backend_utils as pb_utils


''' + inspect.getsource(demo_generate) + '''

class TritonPythonModel:
    def initialize(self, args):
        self.model_name = args.get("model_name", "")

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                prompts = pb_utils.get_input_tensor_by_name(request, "prompt").as_numpy()
                limit = pb_utils.get_input_tensor_by_name(request, "max_tokens")
                limits = limit.as_numpy().reshape(-1) if limit is not None else None
                texts, ins, outs = [], [], []
                for i, raw in enumerate(prompts.reshape(-1)):
                    prompt = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
                    if limits is None or len(limits) == 0:
                        n = None
                    else:
                        n = int(limits[i] if i < len(limits) else limits[0])
                    text, n_in, n_out = demo_generate(prompt, n)
                    texts.append(text.encode("utf-8"))
                    ins.append(n_in)
                    outs.append(n_out)
                shape = prompts.shape
                responses.append(pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor("text", np.array(texts, dtype=np.object_).reshape(shape)),
                    pb_utils.Tensor("input_tokens", np.array(ins, dtype=np.int32).reshape(shape)),
                    pb_utils.Tensor("output_tokens", np.array(outs, dtype=np.int32).reshape(shape)),
                ]))
            except Exception as exc:  # reported to the client as a failed request
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(exc))))
        return responses

    def finalize(self):
        pass
'''


def demo_text_model(name: str = "tiny-gen", *, memory_mb: int = 64, version: int = 1, instance_count: int = 1,
                    max_batch_size: int = 8) -> ModelSpec:
    """The demo text model: TYPE_STRING "prompt" (+ optional INT32 "max_tokens") -> "text", token counts."""
    return ModelSpec(
        name=name,
        backend="python",
        max_batch_size=max_batch_size,
        inputs=[TensorSpec("prompt", "TYPE_STRING", [1]), TensorSpec("max_tokens", "TYPE_INT32", [1], optional=True)],
        outputs=[TensorSpec("text", "TYPE_STRING", [1]), TensorSpec("input_tokens", "TYPE_INT32", [1]),
                 TensorSpec("output_tokens", "TYPE_INT32", [1])],
        instance_group=InstanceGroup(count=instance_count, kind="KIND_CPU"),
        dynamic_batching=DynamicBatching(preferred_batch_size=[max_batch_size],
                                         max_queue_delay_microseconds=100) if max_batch_size > 0 else None,
        version=version,
        files={"model.py": DEMO_TEXT_MODEL_PY},
        memory_mb=memory_mb,
    )


DEMO_CHAT_MODEL_PY = '''"""Tessera demo streaming text model (Triton python backend, decoupled). Generated by
marketplace.hardware.triton: one response per generated word, then the final flag."""

import numpy as np
import triton_python_backend_utils as pb_utils


''' + inspect.getsource(demo_generate) + '''

class TritonPythonModel:
    def initialize(self, args):
        self.model_name = args.get("model_name", "")

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                raw = pb_utils.get_input_tensor_by_name(request, "prompt").as_numpy().reshape(-1)[0]
                prompt = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
                limit = pb_utils.get_input_tensor_by_name(request, "max_tokens")
                n = int(limit.as_numpy().reshape(-1)[0]) if limit is not None else None
                text, n_in, n_out = demo_generate(prompt, n)
                for i, word in enumerate(text.split()):
                    piece = word if i == 0 else " " + word
                    sender.send(pb_utils.InferenceResponse(output_tensors=[
                        pb_utils.Tensor("text", np.array([piece.encode("utf-8")], dtype=np.object_)),
                        pb_utils.Tensor("input_tokens", np.array([n_in], dtype=np.int32)),
                        pb_utils.Tensor("output_tokens", np.array([i + 1], dtype=np.int32)),
                    ]))
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except Exception as exc:  # reported to the client as a failed request
                sender.send(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(exc))),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    def finalize(self):
        pass
'''


def demo_chat_model(name: str = "tiny-chat", *, memory_mb: int = 64, version: int = 1,
                    instance_count: int = 1) -> ModelSpec:
    """The demo streaming model (decoupled): the words of ``demo_generate`` one response each; every response
    carries the prompt's ``input_tokens`` and the running ``output_tokens``."""
    return ModelSpec(
        name=name,
        backend="python",
        max_batch_size=0,
        inputs=[TensorSpec("prompt", "TYPE_STRING", [1]), TensorSpec("max_tokens", "TYPE_INT32", [1], optional=True)],
        outputs=[TensorSpec("text", "TYPE_STRING", [1]), TensorSpec("input_tokens", "TYPE_INT32", [1]),
                 TensorSpec("output_tokens", "TYPE_INT32", [1])],
        instance_group=InstanceGroup(count=instance_count, kind="KIND_CPU"),
        version=version,
        files={"model.py": DEMO_CHAT_MODEL_PY},
        memory_mb=memory_mb,
        decoupled=True,
    )


# --------------------------------------------------------------------------------------------------
# Backends
# --------------------------------------------------------------------------------------------------

STAT_KEYS = ("inference_count", "execution_count", "success_count", "fail_count", "success_ns", "queue_ns",
             "compute_input_ns", "compute_infer_ns", "compute_output_ns", "execution_ns", "last_inference")


def flatten_statistics(model_stat: dict[str, Any]) -> dict[str, Any]:
    """One ``model_stats[]`` item of Triton's statistics extension -> a flat dict (STAT_KEYS + name, version)."""
    inf = model_stat.get("inference_stats") or {}

    def part(key: str, sub: str) -> int:
        return int((inf.get(key) or {}).get(sub, 0))

    # Time the model spent executing: per batch size, the executions' compute input + infer + output.
    # (inference_stats charge a batched execution's time to every request in it; batch_stats do not.)
    execution_ns = sum(int((b.get(k) or {}).get("ns", 0)) for b in model_stat.get("batch_stats") or []
                       for k in ("compute_input", "compute_infer", "compute_output"))

    return {
        "name": model_stat.get("name"),
        "version": str(model_stat.get("version", "")),
        "inference_count": int(model_stat.get("inference_count", 0)),
        "execution_count": int(model_stat.get("execution_count", 0)),
        "success_count": part("success", "count"),
        "fail_count": part("fail", "count"),
        "success_ns": part("success", "ns"),
        "queue_ns": part("queue", "ns"),
        "compute_input_ns": part("compute_input", "ns"),
        "compute_infer_ns": part("compute_infer", "ns"),
        "compute_output_ns": part("compute_output", "ns"),
        "execution_ns": execution_ns,
        "last_inference": int(model_stat.get("last_inference", 0)),  # ms since the epoch, 0 = never
    }


class TritonBackend(ABC):
    """What provisioning, health checks and metering ask of one Triton server (explicit model control).

    Errors are ``tritonclient.utils.InferenceServerException`` (``.status()`` "400"/"404"/"500",
    ``.message()``), from the real server and the simulator alike.
    """

    kind: str = ""

    @abstractmethod
    def is_server_ready(self) -> bool:
        """True when the server answers ready (never raises; an unreachable server is not ready)."""

    #: headers sent with every call: the server's secret (Tessera's servers restrict all their APIs to it)
    admin_headers: dict[str, str] | None = None

    @abstractmethod
    def repository_index(self) -> list[dict[str, Any]]:
        """``[{"name", "version"?, "state"?, "reason"?}]`` for every folder in the repository."""

    @abstractmethod
    def load_model(self, name: str, *, headers: dict[str, str] | None = None) -> None:
        """Load (or reload) a model from the repository; raises on failure. ``headers`` default to
        ``admin_headers``."""

    @abstractmethod
    def unload_model(self, name: str) -> None:
        """Unload a model (a model that is not loaded is a no-op, as on the real server)."""

    @abstractmethod
    def is_model_ready(self, name: str) -> bool: ...

    @abstractmethod
    def infer_text(self, name: str, text: str, max_tokens: int | None = None) -> dict[str, Any]:
        """Run a text model (demo interface) -> ``{"text", "input_tokens", "output_tokens"}``."""

    @abstractmethod
    def statistics(self, name: str) -> dict[str, Any]:
        """Flat statistics (``STAT_KEYS`` + name, version); raises if the model is not loaded."""

    @abstractmethod
    def metrics_text(self) -> str:
        """The Prometheus exposition (``nv_inference_*`` lines)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""

    def __enter__(self) -> TritonBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _strip_scheme(url: str) -> str:
    return re.sub(r"^https?://", "", url).rstrip("/")


class HttpTritonBackend(TritonBackend):
    """A real tritonserver through ``tritonclient.http``.

    ``url`` is ``host:port`` or ``http://host:port`` (HTTP endpoint, default port 8000);
    ``metrics_url`` defaults to ``http://<host>:8002/metrics``.
    """

    kind = "http"

    def __init__(self, url: str, metrics_url: str | None = None, *, timeout: float = 60.0,
                 unload_timeout: float = 30.0, headers: dict[str, str] | None = None) -> None:
        import tritonclient.http as httpclient  # noqa: PLC0415 - heavy (gevent); only when used

        self._http = httpclient
        self.url = _strip_scheme(url)
        host = self.url.rsplit(":", 1)[0] if ":" in self.url else self.url
        self.metrics_url = metrics_url or f"http://{host}:8002/metrics"
        self.timeout = timeout
        self.unload_timeout = unload_timeout
        self.client = httpclient.InferenceServerClient(self.url, connection_timeout=timeout, network_timeout=timeout)
        self._batching: dict[str, bool] = {}
        self.admin_headers = dict(headers or {})

    def close(self) -> None:
        self.client.close()

    def is_server_ready(self) -> bool:
        try:
            return bool(self.client.is_server_ready(headers=self.admin_headers))
        except Exception:  # noqa: BLE001 - connection refused, timeouts, gevent errors: all mean "not ready"
            return False

    def repository_index(self) -> list[dict[str, Any]]:
        return list(self.client.get_model_repository_index(headers=self.admin_headers))

    def load_model(self, name: str, *, headers: dict[str, str] | None = None) -> None:
        self._batching.pop(name, None)
        self.client.load_model(name, headers=self.admin_headers if headers is None else headers)

    def unload_model(self, name: str, *, wait: bool = True) -> None:
        """Unload; with ``wait`` (default) also wait until the server has finished (state leaves UNLOADING)."""
        self._batching.pop(name, None)
        self.client.unload_model(name, headers=self.admin_headers)
        if not wait:
            return
        deadline = time.monotonic() + self.unload_timeout
        while time.monotonic() < deadline:
            states = [m.get("state") for m in self.repository_index() if m.get("name") == name]
            if "UNLOADING" not in states:
                return
            time.sleep(0.05)
        raise InferenceServerException(f"model '{name}' is still unloading after {self.unload_timeout:.0f}s")

    def is_model_ready(self, name: str) -> bool:
        return bool(self.client.is_model_ready(name, headers=self.admin_headers))

    def _batched(self, name: str) -> bool:
        if name not in self._batching:
            config = self.client.get_model_config(name, headers=self.admin_headers)
            self._batching[name] = int(config.get("max_batch_size", 0)) > 0
        return self._batching[name]

    def infer_text(self, name: str, text: str, max_tokens: int | None = None) -> dict[str, Any]:
        import numpy as np  # noqa: PLC0415 - tritonclient's own dependency

        shape = [1, 1] if self._batched(name) else [1]
        prompt = self._http.InferInput("prompt", shape, "BYTES")
        prompt.set_data_from_numpy(np.array([text.encode("utf-8")], dtype=np.object_).reshape(shape))
        inputs = [prompt]
        if max_tokens is not None:
            limit = self._http.InferInput("max_tokens", shape, "INT32")
            limit.set_data_from_numpy(np.array([max_tokens], dtype=np.int32).reshape(shape))
            inputs.append(limit)
        outputs = [self._http.InferRequestedOutput(n) for n in ("text", "input_tokens", "output_tokens")]
        result = self.client.infer(name, inputs, outputs=outputs, headers=self.admin_headers)
        raw = result.as_numpy("text").reshape(-1)[0]
        return {
            "text": raw.decode("utf-8") if isinstance(raw, bytes) else str(raw),
            "input_tokens": int(result.as_numpy("input_tokens").reshape(-1)[0]),
            "output_tokens": int(result.as_numpy("output_tokens").reshape(-1)[0]),
        }

    def statistics(self, name: str) -> dict[str, Any]:
        stats = self.client.get_inference_statistics(name, headers=self.admin_headers).get("model_stats") or []
        if not stats:
            raise InferenceServerException(f"requested model '{name}' is not available", status="400")
        latest = max(stats, key=lambda s: int(s.get("version") or 0))
        return flatten_statistics(latest)

    def metrics_text(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=self.timeout) as resp:  # noqa: S310 - operator URL
            return resp.read().decode("utf-8")


@dataclass
class _SimModel:
    name: str
    version: int
    config: ParsedConfig
    state: str = "READY"
    reason: str | None = None
    stats: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.stats:
            self.stats = dict.fromkeys(STAT_KEYS, 0)


def _load_error(name: str, detail: str) -> InferenceServerException:
    # The real server says exactly "failed to load '<name>', failed to poll from model repository" (500)
    # for a missing folder, missing config (without auto-complete) or unparsable config.pbtxt.
    return InferenceServerException(f"failed to load '{name}', failed to poll from model repository",
                                    status="500", debug_details=f"simulated Triton: {detail}")


class SimTritonBackend(TritonBackend):
    """A simulated tritonserver over a real repository folder (explicit model control).

    ``memory_mb``: the slice's memory; loading refuses a model whose declared memory (``tessera_memory_mb``)
    does not fit next to the models already loaded. None = unlimited. Statistics count like Triton's (one
    request of batch 1 = one inference, one execution); durations are deterministic. ``tokens_per_s``: the
    slice's throughput (the simulator's performance model; Tessera passes the tier's modelled capacity):
    an execution then takes (input + output tokens) / tokens_per_s; None: 200 µs + 10 µs per output token.
    """

    kind = "sim"

    def __init__(self, repo_dir: str | os.PathLike, memory_mb: int | None = None, *,
                 clock: Any = time.time, tokens_per_s: float | None = None) -> None:
        self.repo_dir = Path(repo_dir)
        self.memory_mb = memory_mb
        self.tokens_per_s = tokens_per_s
        self.clock = clock
        self.server_ready = True  # set False to simulate a server that is down
        self.restricted: tuple[str, str] | None = None  # (header, secret) the repository API requires
        self.served_loras: list[tuple[str, str | None]] = []  # (model, lora_name) of each vLLM request served
        self.exit_code: int | None = None
        self._log: list[str] = []
        self._models: dict[str, _SimModel] = {}
        self._lock = threading.RLock()

    # -- the server's own life (the serving runtime drives it) -----------------------------------
    def boot(self, *, restricted: tuple[str, str] | None = None) -> None:
        """A fresh server process: ready, nothing loaded (explicit model control), the repository API locked."""
        with self._lock:
            self._models.clear()
            self.server_ready, self.restricted, self.exit_code = True, restricted, None
            self.admin_headers = {restricted[0]: restricted[1]} if restricted else None
            self._log.append(f"simulated tritonserver started on {self.repo_dir}")

    def shut_down(self, *, exit_code: int = 0) -> None:
        """The process ended (stopped, or killed with ``exit_code`` -9): everything loaded is gone."""
        with self._lock:
            self._models.clear()
            self.server_ready, self.exit_code = False, exit_code
            self._log.append(f"simulated tritonserver exited with code {exit_code}")

    def log_text(self) -> str:
        return "\n".join(self._log[-200:])

    def _check_key(self, headers: dict[str, str] | None) -> None:
        if self.restricted is None:
            return
        key, value = self.restricted
        sent = headers if headers is not None else (self.admin_headers or {})
        if {k.lower(): v for k, v in sent.items()}.get(key.lower()) != value:
            raise InferenceServerException(f"This API is restricted, expecting header '{key}'", status="403")

    # -- server / repository --------------------------------------------------------------------
    def is_server_ready(self) -> bool:
        return self.server_ready

    def _check_up(self) -> None:
        if not self.server_ready:
            raise InferenceServerException("failed to connect to simulated Triton server (server is down)")

    def repository_index(self) -> list[dict[str, Any]]:
        self._check_up()
        self._check_key(None)
        with self._lock:
            names = sorted(p.name for p in self.repo_dir.iterdir() if p.is_dir()) if self.repo_dir.is_dir() else []
            out = []
            for name in names:
                m = self._models.get(name)
                if m is None:
                    out.append({"name": name})
                else:
                    entry = {"name": name, "version": str(m.version), "state": m.state}
                    if m.reason:
                        entry["reason"] = m.reason
                    out.append(entry)
            return out

    @property
    def used_memory_mb(self) -> int:
        with self._lock:
            return sum(m.config.memory_mb for m in self._models.values() if m.state == "READY")

    def _read_model(self, name: str) -> tuple[int, ParsedConfig]:
        folder = self.repo_dir / name
        if not MODEL_NAME_RE.match(name) or not folder.is_dir():
            raise _load_error(name, f"no model folder {folder}")
        config_path = folder / CONFIG_FILE
        if not config_path.is_file():
            raise _load_error(name, f"{config_path} is missing")
        try:
            config = parse_config(config_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise _load_error(name, f"{config_path} is not valid: {exc}") from None
        if config.name not in (None, "", name):
            raise InferenceServerException(
                f"load failed for model '{name}': unexpected model name '{config.name}' in {CONFIG_FILE} "
                f"(the folder is '{name}')", status="400")
        if not (config.backend or config.platform):
            raise InferenceServerException(f"load failed for model '{name}': must specify 'backend' or 'platform'",
                                           status="400")
        versions = sorted(int(p.name) for p in folder.iterdir()
                          if p.is_dir() and p.name.isdigit() and not p.name.startswith("0"))
        if not versions:
            raise InferenceServerException(f"load failed for model '{name}': at least one version must be "
                                           f"available under the version policy of model '{name}'", status="400")
        version = versions[-1]  # default version policy: latest 1
        if config.backend == "python":
            model_file = folder / str(version) / (config.default_model_filename or "model.py")
            if not model_file.is_file():
                raise InferenceServerException(
                    f"load failed for model '{name}': version {version} is at UNAVAILABLE state: "
                    f"Internal: {model_file} does not exist", status="400")
        return version, config

    def load_model(self, name: str, *, headers: dict[str, str] | None = None) -> None:
        self._check_up()
        self._check_key(headers)
        with self._lock:
            version, config = self._read_model(name)
            current = self._models.get(name)
            if self.memory_mb is not None:
                others = sum(m.config.memory_mb for n, m in self._models.items() if n != name and m.state == "READY")
                free = self.memory_mb - others
                if config.memory_mb > free:
                    raise InferenceServerException(
                        f"load failed for model '{name}': declared memory {config.memory_mb} MB exceeds the "
                        f"slice's free memory ({free} of {self.memory_mb} MB)", status="400")
            if current is not None and current.state == "READY" and current.version == version:
                current.config = config  # reload in place; counters keep running
                return
            self._models[name] = _SimModel(name=name, version=version, config=config)

    def unload_model(self, name: str) -> None:
        self._check_up()
        self._check_key(None)
        with self._lock:
            m = self._models.get(name)
            if m is not None and m.state == "READY":
                m.state, m.reason = "UNAVAILABLE", "unloaded"

    def is_model_ready(self, name: str) -> bool:
        self._check_up()
        with self._lock:
            m = self._models.get(name)
            return m is not None and m.state == "READY"

    def _ready_model(self, name: str, missing: str, status: str) -> _SimModel:
        m = self._models.get(name)
        if m is None:
            raise InferenceServerException(missing.format(name=name, why="is not found"), status=status)
        if m.state != "READY":
            raise InferenceServerException(missing.format(name=name, why="has no available versions"), status=status)
        return m

    # -- inference ------------------------------------------------------------------------------
    def infer_text(self, name: str, text: str, max_tokens: int | None = None) -> dict[str, Any]:
        self._check_up()
        self._check_key(None)
        return self.run_text(name, text, max_tokens, via_infer=True)

    def run_text(self, name: str, text: str, max_tokens: int | None = None, *,
                 via_infer: bool = False) -> dict[str, Any]:
        """One text request, as the infer or generate endpoint runs it (the caller checked the secret)."""
        self._check_up()
        with self._lock:
            m = self._ready_model(name, "Request for unknown model: '{name}' {why}", "404")
            if via_infer and m.config.decoupled:
                raise InferenceServerException("HTTP end point doesn't support models with decoupled transaction "
                                               "policy", status="501")
            inputs = {t.name: t for t in m.config.inputs}
            outputs = {t.name for t in m.config.outputs}
            if "prompt" not in inputs or not {"text", "input_tokens", "output_tokens"} <= outputs:
                raise InferenceServerException(f"[request id: <id_unknown>] unexpected inference input 'prompt' for "
                                               f"model '{name}'", status="400")
            if max_tokens is not None and "max_tokens" not in inputs:
                raise InferenceServerException(f"[request id: <id_unknown>] unexpected inference input "
                                               f"'max_tokens' for model '{name}'", status="400")
            s = m.stats
            s["last_inference"] = int(self.clock() * 1000)
            error = None
            try:
                out_text, n_in, n_out = demo_generate(text, max_tokens)
            except ValueError as exc:
                # As on the real server: an error the python model puts in its response is a status-500
                # error for the client, yet Triton counts the request as executed and *successful*.
                error, n_in, n_out = str(exc), len(text.split()), 0
            queue, c_in, c_out = 20_000, 5_000, 5_000
            if self.tokens_per_s:
                c_infer = max(1, round((n_in + n_out) / self.tokens_per_s * 1e9) - c_in - c_out)
            else:
                c_infer = 200_000 + 10_000 * n_out
            s["inference_count"] += 1
            s["execution_count"] += 1
            s["success_count"] += 1
            s["queue_ns"] += queue
            s["compute_input_ns"] += c_in
            s["compute_infer_ns"] += c_infer
            s["compute_output_ns"] += c_out
            s["execution_ns"] += c_in + c_infer + c_out
            s["success_ns"] += queue + c_in + c_infer + c_out + 10_000
            if error is not None:
                raise InferenceServerException(error, status="500")
            return {"text": out_text, "input_tokens": n_in, "output_tokens": n_out}

    def statistics(self, name: str) -> dict[str, Any]:
        self._check_up()
        with self._lock:
            m = self._models.get(name)
            if m is None or m.state != "READY":
                raise InferenceServerException(f"requested model '{name}' is not available", status="400")
            return {"name": name, "version": str(m.version), **m.stats}

    def metrics_text(self) -> str:
        self._check_up()
        with self._lock:
            loaded = sorted((m for m in self._models.values() if m.state == "READY"), key=lambda m: m.name)
            lines: list[str] = []

            def family(metric: str, kind: str, help_text: str, value: Any, reasons: bool = False) -> None:
                lines.append(f"# HELP {metric} {help_text}")
                lines.append(f"# TYPE {metric} {kind}")
                for m in loaded:
                    labels = f'model="{m.name}",version="{m.version}"'
                    if reasons:
                        for reason in ("OTHER", "CANCELED", "BACKEND", "REJECTED"):
                            n = m.stats["fail_count"] if reason == "BACKEND" else 0
                            lines.append(f'{metric}{{model="{m.name}",reason="{reason}",version="{m.version}"}} {n}')
                    else:
                        lines.append(f"{metric}{{{labels}}} {value(m)}")

            family("nv_inference_request_success", "counter",
                   "Number of successful inference requests, all batch sizes", lambda m: m.stats["success_count"])
            family("nv_inference_request_failure", "counter", "Number of failed inference requests, all batch sizes",
                   None, reasons=True)
            family("nv_inference_count", "counter",
                   "Number of inferences performed (does not include cached requests)",
                   lambda m: m.stats["inference_count"])
            family("nv_inference_exec_count", "counter",
                   "Number of model executions performed (does not include cached requests)",
                   lambda m: m.stats["execution_count"])
            family("nv_inference_request_duration_us", "counter",
                   "Cumulative inference request duration in microseconds (includes cached requests)",
                   lambda m: m.stats["success_ns"] // 1000)
            family("nv_inference_queue_duration_us", "counter",
                   "Cumulative inference queuing duration in microseconds (includes cached requests)",
                   lambda m: m.stats["queue_ns"] // 1000)
            family("nv_inference_compute_input_duration_us", "counter",
                   "Cumulative compute input duration in microseconds (does not include cached requests)",
                   lambda m: m.stats["compute_input_ns"] // 1000)
            family("nv_inference_compute_infer_duration_us", "counter",
                   "Cumulative compute inference duration in microseconds (does not include cached requests)",
                   lambda m: m.stats["compute_infer_ns"] // 1000)
            family("nv_inference_compute_output_duration_us", "counter",
                   "Cumulative inference compute output duration in microseconds (does not include cached requests)",
                   lambda m: m.stats["compute_output_ns"] // 1000)
            family("nv_inference_pending_request_count", "gauge",
                   "Instantaneous number of pending requests awaiting execution per-model.", lambda m: 0)
            return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------
# Factory
# --------------------------------------------------------------------------------------------------

_SIM_BACKENDS: dict[tuple[str, int | None], SimTritonBackend] = {}
_SIM_LOCK = threading.Lock()



def get_triton_backend(kind: str | None = None, url: str | None = None, repo_dir: str | os.PathLike | None = None,
                       *, metrics_url: str | None = None, memory_mb: int | None = None,
                       tokens_per_s: float | None = None, headers: dict[str, str] | None = None) -> TritonBackend:
    """``"sim"`` -> the process-wide simulator for ``repo_dir`` (same object for the same folder and memory,
    so a load in one task is seen by the next); ``"http"`` -> a new ``HttpTritonBackend(url, metrics_url)``.
    ``kind`` defaults to the ``TESSERA_TRITON_BACKEND`` setting/environment variable, else "sim".
    """
    kind = (kind or setting(BACKEND_ENV) or "sim").strip().lower()
    if kind == "http":
        if not url:
            raise ValueError("the http Triton backend needs url (host:port of the server's HTTP endpoint)")
        return HttpTritonBackend(url, metrics_url, headers=headers)
    if kind == "sim":
        if repo_dir is None:
            raise ValueError("the sim Triton backend needs repo_dir (the model repository folder)")
        key = (str(Path(repo_dir).resolve()), memory_mb)
        with _SIM_LOCK:
            backend = _SIM_BACKENDS.get(key)
            if backend is None:
                backend = _SIM_BACKENDS[key] = SimTritonBackend(repo_dir, memory_mb, tokens_per_s=tokens_per_s)
            elif tokens_per_s is not None:
                backend.tokens_per_s = tokens_per_s
            return backend
    raise ValueError(f"unknown Triton backend {kind!r}; expected one of {', '.join(BACKEND_KINDS)}")


def reset_sim_backends() -> None:
    """Forget every process-wide simulator (tests)."""
    with _SIM_LOCK:
        _SIM_BACKENDS.clear()
