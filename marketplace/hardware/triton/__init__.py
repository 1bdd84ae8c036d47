"""Triton Inference Server: model specs, repository writer, and one backend interface (real or simulated).

Pure Python (Django is only consulted lazily for settings). One module per job, their names re-exported here
(two dozen callers use them): ``spec`` (specs, config.pbtxt), ``repository`` (writing model folders, the demo
models), ``client`` (the interface and the HTTP client), ``sim`` (the simulator), ``factory``. Pieces:

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

from .client import (
    STAT_KEYS,
    HttpTritonBackend,
    TritonBackend,
    flatten_statistics,
)
from .factory import (
    get_triton_backend,
    reset_sim_backends,
)
from .repository import (
    DEMO_CHAT_MODEL_PY,
    DEMO_TEXT_MODEL_PY,
    WriteResult,
    demo_chat_model,
    demo_generate,
    demo_text_model,
    model_files,
    remove_model,
    write_repository,
)
from .sim import (
    SimTritonBackend,
)
from .spec import (
    AUTOCOMPLETE_BACKENDS,
    BACKEND_ENV,
    BACKEND_KINDS,
    BACKENDS,
    CONFIG_FILE,
    DATA_TYPES,
    DEFAULT_DEMO_TOKENS,
    INSTANCE_KINDS,
    MAX_DEMO_TOKENS,
    MEMORY_PARAMETER,
    MODEL_NAME_RE,
    PARAMETER_KEY_RE,
    TENSOR_NAME_RE,
    DynamicBatching,
    InstanceGroup,
    ModelSpec,
    ParsedConfig,
    PbtxtError,
    TensorSpec,
    parse_config,
    parse_model_config,
    render_config,
)

__all__ = [
    "AUTOCOMPLETE_BACKENDS",
    "BACKENDS",
    "BACKEND_ENV",
    "BACKEND_KINDS",
    "CONFIG_FILE",
    "DATA_TYPES",
    "DEFAULT_DEMO_TOKENS",
    "DEMO_CHAT_MODEL_PY",
    "DEMO_TEXT_MODEL_PY",
    "DynamicBatching",
    "HttpTritonBackend",
    "INSTANCE_KINDS",
    "InstanceGroup",
    "MAX_DEMO_TOKENS",
    "MEMORY_PARAMETER",
    "MODEL_NAME_RE",
    "ModelSpec",
    "PARAMETER_KEY_RE",
    "ParsedConfig",
    "PbtxtError",
    "STAT_KEYS",
    "SimTritonBackend",
    "TENSOR_NAME_RE",
    "TensorSpec",
    "TritonBackend",
    "WriteResult",
    "demo_chat_model",
    "demo_generate",
    "demo_text_model",
    "flatten_statistics",
    "get_triton_backend",
    "model_files",
    "parse_config",
    "parse_model_config",
    "remove_model",
    "render_config",
    "reset_sim_backends",
    "write_repository",
]
