"""The simulated Triton server's HTTP front: the part of Triton's HTTP/REST protocol the gateway uses.

With ``TESSERA_SIM_TRITON_HTTP=1`` (the demo sets it), ``SimRuntime`` starts one of these per slice on the
server's address and HTTP port, so the inference gateway reaches simulated slices over real HTTP exactly as it
reaches real ones. Answers follow a real tritonserver's (seen on nvidia-pytriton 0.7.0's tritonserver with
Tessera's text models): every API needs the secret header (all APIs are restricted), an unknown model is
404 ``{"error": "Request for unknown model: '<m>' is not found"}``, ``generate`` on a decoupled model answers
200 with an ``error`` key, ``infer`` on one answers 501, ``generate_stream`` frames each response as one
``data: {...}`` server-sent event and a non-decoupled model's answer as a single event.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tritonclient.utils import InferenceServerException

from .triton import SimTritonBackend, demo_generate

_FRONTS: dict[tuple[str, int], _Server] = {}
# vLLM's SamplingParams fields (https://docs.vllm.ai/en/latest/api/vllm/sampling_params.html)
VLLM_SAMPLING_KEYS = frozenset({
    "n", "best_of", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k",
    "min_p", "seed", "stop", "stop_token_ids", "bad_words", "ignore_eos", "max_tokens", "min_tokens", "logprobs",
    "prompt_logprobs", "detokenize", "skip_special_tokens", "spaces_between_special_tokens",
    "include_stop_str_in_output", "truncate_prompt_tokens", "logit_bias", "allowed_token_ids"})
_LOCK = threading.Lock()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _reply(self, status: int, body: Any = None, *, content_type: str = "application/json") -> None:
        data = b"" if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _allowed(self) -> bool:
        key, value = self.server.secret
        if self.headers.get(key) != value:
            self._reply(403, {"error": f"This API is restricted, expecting header '{key}'"})
            return False
        if not self.server.backend.server_ready:
            self.close_connection = True
            self._reply(503, {"error": "Server not ready"})
            return False
        return True

    def _json(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        try:
            return json.loads(self.rfile.read(length) or b"null")
        except ValueError:
            return None

    def do_GET(self) -> None:  # http.server's naming
        if not self._allowed():
            return
        parts = self.path.strip("/").split("/")
        backend = self.server.backend
        if parts[:2] == ["v2", "health"]:
            self._reply(200)
            return
        if len(parts) >= 3 and parts[:2] == ["v2", "models"]:
            name = parts[2]
            model = backend._models.get(name)
            if model is None or model.state != "READY":
                self._reply(404 if parts[3:] != ["ready"] else 400,
                            {"error": f"Request for unknown model: '{name}' is not found"})
                return
            if parts[3:] == ["ready"]:
                self._reply(200)
                return
            if parts[3:] == []:
                c = model.config
                tensors = lambda ts: [{"name": t.name, "datatype": t.data_type.replace("TYPE_", "").replace(  # noqa: E731
                    "STRING", "BYTES"), "shape": list(t.dims)} for t in ts]
                self._reply(200, {"name": name, "versions": [str(model.version)], "platform": c.backend or "",
                                  "inputs": tensors(c.inputs), "outputs": tensors(c.outputs)})
                return
        self._reply(404, {"error": "Not Found"})

    def do_POST(self) -> None:
        if not self._allowed():
            return
        parts = self.path.strip("/").split("/")
        body = self._json()
        if len(parts) != 4 or parts[:2] != ["v2", "models"] or parts[3] not in ("generate", "generate_stream",
                                                                               "infer"):
            self._reply(404, {"error": "Not Found"})
            return
        name, action = parts[2], parts[3]
        backend = self.server.backend
        model = backend._models.get(name)
        if not isinstance(body, dict):
            self._reply(400, {"error": "failed to parse the request JSON buffer"})
            return
        if action == "infer":
            self._infer(name, body)
            return
        if model is not None and model.config.backend == "vllm":
            self._vllm(name, model, action, body)
            return
        prompt, limit = body.get("prompt", body.get("text_input")), body.get("max_tokens")
        if model is not None and model.config.decoupled and action == "generate":
            self._reply(200, {"error": "generate expects model to produce exactly 1 response, use generate stream "
                                       "for model that generates various number of responses"})
            return
        try:
            out = backend.run_text(name, str(prompt if prompt is not None else ""), limit)
        except InferenceServerException as exc:
            status = int(exc.status() or 500) if str(exc.status() or "").isdigit() else 500
            self._reply(status, {"error": exc.message()})
            return
        except ValueError as exc:
            self._reply(400, {"error": str(exc)})
            return
        head = {"model_name": name, "model_version": str(model.version if model else 1)}
        if action == "generate":
            self._reply(200, {**head, **out})
            return
        if model is not None and model.config.decoupled:
            pieces = out["text"].split()
            events = [{**head, "text": (w if i == 0 else " " + w), "input_tokens": out["input_tokens"],
                       "output_tokens": i + 1} for i, w in enumerate(pieces)]
        else:
            events = [{**head, **out}]
        data = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
        self._reply(200, data, content_type="text/event-stream")

    def _vllm(self, name: str, model: Any, action: str, body: dict[str, Any]) -> None:
        """Triton's vLLM backend's generate protocol: ``text_input``, ``sampling_parameters`` (a JSON string; else
        the request's ``parameters``) with ``max_tokens`` and ``lora_name`` (checked against the model's
        ``multi_lora.json`` as the backend does), answered as ``text_output`` pieces, no token counts. The other
        keys are vLLM's SamplingParams: an unknown one is an error (vLLM's constructor refuses it), ``stop`` ends
        the text before the first stop string (vLLM's default: not included); sampling itself is the demo's
        deterministic rule, so the keys each request carried are recorded (``served_sampling``)."""
        sampling = body.get("sampling_parameters")
        params = json.loads(sampling) if isinstance(sampling, str) else (body.get("parameters") or {})
        unknown = sorted(set(params) - VLLM_SAMPLING_KEYS - {"lora_name"})
        if unknown:
            self._reply(400, {"error": f"SamplingParams got an unexpected keyword argument '{unknown[0]}'"})
            return
        lora = params.get("lora_name")
        if lora is not None:
            index = self.server.backend.repo_dir / name / str(model.version) / "multi_lora.json"
            loras = json.loads(index.read_text()) if index.is_file() else {}
            if lora not in loras:
                self._reply(400, {"error": f"LoRA {lora} is not supported, we currently support {list(loras)}"})
                return
        if action == "generate":
            self._reply(200, {"error": "generate expects model to produce exactly 1 response, use generate stream "
                                       "for model that generates various number of responses"})
            return
        text, _n_in, _n_out = demo_generate(str(body.get("text_input") or ""), params.get("max_tokens"))
        stops = params.get("stop") or []
        for stop in [stops] if isinstance(stops, str) else stops:
            text = text.split(stop, 1)[0]
        self.server.backend.served_loras.append((name, lora))
        self.server.backend.served_sampling.append((name, {k: v for k, v in params.items() if k != "lora_name"}))
        pieces = [w if i == 0 else " " + w for i, w in enumerate(text.split())]
        if text[len("".join(pieces)):]:  # a stop cut after a space: the space is part of the text
            pieces.append(text[len("".join(pieces)):])
        events = [{"model_name": name, "model_version": str(model.version), "text_output": piece} for piece in pieces]
        self._reply(200, b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events),
                    content_type="text/event-stream")

    def _infer(self, name: str, body: dict[str, Any]) -> None:
        inputs = {i.get("name"): i for i in body.get("inputs") or [] if isinstance(i, dict)}
        prompt = inputs.get("prompt", {}).get("data")
        limit = inputs.get("max_tokens", {}).get("data")
        flat = lambda v: v[0] if isinstance(v, list) and v else v  # noqa: E731
        while isinstance(prompt, list):
            prompt = flat(prompt)
        while isinstance(limit, list):
            limit = flat(limit)
        try:
            out = self.server.backend.run_text(name, str(prompt or ""), limit, via_infer=True)
        except InferenceServerException as exc:
            status = int(exc.status()) if str(exc.status() or "").isdigit() else 500
            self._reply(status, {"error": exc.message()})
            return
        shape = inputs.get("prompt", {}).get("shape") or [1]
        self._reply(200, {"model_name": name, "model_version": "1", "outputs": [
            {"name": "text", "datatype": "BYTES", "shape": shape, "data": [out["text"]]},
            {"name": "input_tokens", "datatype": "INT32", "shape": shape, "data": [out["input_tokens"]]},
            {"name": "output_tokens", "datatype": "INT32", "shape": shape, "data": [out["output_tokens"]]}]})


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], backend: SimTritonBackend, secret: tuple[str, str]) -> None:
        self.backend, self.secret = backend, secret
        super().__init__(address, _Handler)


def serve(backend: SimTritonBackend, address: str, port: int, secret: tuple[str, str]) -> None:
    """Start (or re-key) the HTTP front of one simulated server."""
    with _LOCK:
        front = _FRONTS.get((address, port))
        if front is not None:
            front.backend, front.secret = backend, secret
            return
        front = _Server((address, port), backend, secret)
        _FRONTS[(address, port)] = front
    threading.Thread(target=front.serve_forever, name=f"sim-triton-{port}", daemon=True).start()


def stop(address: str, port: int) -> None:
    with _LOCK:
        front = _FRONTS.pop((address, port), None)
    if front is not None:
        front.shutdown()
        front.server_close()


def stop_all() -> None:
    for address, port in list(_FRONTS):
        stop(address, port)

