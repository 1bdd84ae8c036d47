"""The backend interface provisioning and metering call (``TritonBackend``) and ``HttpTritonBackend``, a real
server over ``tritonclient.http`` (started with ``--model-control-mode=explicit``)."""


from __future__ import annotations

import re
import time
import urllib.request
from abc import ABC, abstractmethod
from typing import Any

from tritonclient.utils import InferenceServerException

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
    def loaded_models(self) -> set[str]:
        """Every model the server has loaded: the repository index's READY ones and those it serves without a
        folder in the repository (loaded with the repository API's file overrides), which the index does not
        list but the statistics do."""

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
        import tritonclient.http as httpclient  # heavy (gevent); only when used

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
        except Exception:  # connection refused, timeouts, gevent errors: all mean "not ready"
            return False

    def repository_index(self) -> list[dict[str, Any]]:
        return list(self.client.get_model_repository_index(headers=self.admin_headers))

    def loaded_models(self) -> set[str]:
        stats = self.client.get_inference_statistics("", headers=self.admin_headers).get("model_stats") or []
        return ({m["name"] for m in self.repository_index() if m.get("state") == "READY"}
                | {str(m["name"]) for m in stats if m.get("name")})

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
        import numpy as np  # tritonclient's own dependency

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
        with urllib.request.urlopen(self.metrics_url, timeout=self.timeout) as resp:  # operator URL
            return resp.read().decode("utf-8")
