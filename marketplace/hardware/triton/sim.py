"""``SimTritonBackend``: a simulated tritonserver over a real repository folder, answering with the real server's
messages and statuses (observed on tritonserver 2.51, bundled with nvidia-pytriton 0.7.0)."""


from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tritonclient.utils import InferenceServerException

from .client import STAT_KEYS, TritonBackend
from .repository import demo_generate
from .spec import CONFIG_FILE, MODEL_NAME_RE, ParsedConfig, parse_config


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
        self.served_sampling: list[tuple[str, dict]] = []  # (model, sampling parameters) of each vLLM request
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

    def loaded_models(self) -> set[str]:
        self._check_up()
        self._check_key(None)
        with self._lock:
            return {n for n, m in self._models.items() if m.state == "READY"}

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
