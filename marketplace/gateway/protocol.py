"""Pure translation between the gateway's public protocols and Triton's generate extension, and the errors.

OpenAI-compatible routes are served from Triton's ``generate`` / ``generate_stream`` endpoints
(https://github.com/triton-inference-server/server/blob/main/docs/protocol/extension_generate.md): the JSON keys
of a generate request name the model's input tensors and the answer's keys its output tensors. Tessera's text
models take a ``prompt`` (or vLLM's ``text_input``) and an optional ``max_tokens`` and answer ``text`` (or
``text_output``) plus, when the model reports them, ``input_tokens`` and ``output_tokens`` (vLLM:
``num_input_tokens`` / ``num_output_tokens``).

Token counts (the metering rule): what the model reports wins. On a stream, a reported count is a running
total: the largest value seen so far is what was served. A model that reports no counts is metered by
Tessera's fallback rule, documented in the README: tokens are whitespace-separated words of the prompt and of
the text sent (the rule Tessera's demo models use themselves).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

MAX_TOKENS_LIMIT = 1_000_000
PROMPT_INPUTS = ("prompt", "text_input")
TEXT_OUTPUTS = ("text", "text_output")
INPUT_COUNTS = ("input_tokens", "num_input_tokens")
OUTPUT_COUNTS = ("output_tokens", "num_output_tokens")


class GatewayError(Exception):
    """An answer other than success: HTTP status, a stable machine code, a message a person can act on."""

    def __init__(self, status: int, code: str, message: str, *, kind: str = "invalid_request_error",
                 param: str | None = None, headers: dict[str, str] | None = None,
                 tessera_code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.kind, self.param = status, code, message, kind, param
        self.headers = headers or {}
        # Tessera's own reason where ``code`` is OpenAI's (429 insufficient_quota: spend_limit_reached)
        self.tessera_code = tessera_code

    def openai_body(self) -> dict[str, Any]:
        """OpenAI's error JSON (``{"error": {"message", "type", "param", "code"}}``), plus ``tessera_code`` when
        ``code`` is OpenAI's rather than Tessera's own."""
        error: dict[str, Any] = {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}
        if self.tessera_code:
            error["tessera_code"] = self.tessera_code
        return {"error": error}

    def kserve_body(self) -> dict[str, Any]:
        """KServe v2's error JSON (``{"error": "<message>"}``), with Tessera's code beside it."""
        return {"error": self.message, "code": self.tessera_code or self.code}


def insufficient_quota(message: str) -> GatewayError:
    """The tenant's spend limit is reached: OpenAI's answer for a spent quota (429 ``insufficient_quota``, which
    OpenAI's SDKs map to ``RateLimitError``), not retried (``x-should-retry: false``, which the SDKs honour), with
    Tessera's reason in ``tessera_code``."""
    return GatewayError(429, "insufficient_quota", message, kind="insufficient_quota",
                        headers={"x-should-retry": "false"}, tessera_code="spend_limit_reached")


def unknown_model(name: str) -> GatewayError:
    """The one answer for a model that does not exist *and* for another tenant's model (no oracle)."""
    return GatewayError(404, "model_not_found", f"The model '{name}' does not exist or you do not have access to it.",
                        param="model")


def bad_request(message: str, param: str | None = None, code: str = "invalid_request") -> GatewayError:
    return GatewayError(400, code, message, param=param)


@dataclass(frozen=True)
class ModelIO:
    """Which tensors of a deployed model carry the prompt, the limit, the text and the token counts."""

    prompt: str | None = "prompt"
    text: str | None = "text"
    max_tokens: str | None = "max_tokens"
    input_count: str | None = None
    output_count: str | None = None
    decoupled: bool = False
    sampling: bool = False  # vLLM: max_tokens goes in the JSON string input sampling_parameters
    stream_flag: bool = False  # vLLM: a BOOL input "stream" asks for one response per new piece of text

    @property
    def generative(self) -> bool:
        return self.prompt is not None and self.text is not None

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> ModelIO:
        inputs = {t.get("name") for t in spec.get("inputs") or [] if isinstance(t, dict)}
        outputs = {t.get("name") for t in spec.get("outputs") or [] if isinstance(t, dict)}
        return cls(prompt=next((n for n in PROMPT_INPUTS if n in inputs), None),
                   text=next((n for n in TEXT_OUTPUTS if n in outputs), None),
                   max_tokens="max_tokens" if "max_tokens" in inputs else None,
                   input_count=next((n for n in INPUT_COUNTS if n in outputs), None),
                   output_count=next((n for n in OUTPUT_COUNTS if n in outputs), None),
                   decoupled=bool(spec.get("decoupled")), sampling="sampling_parameters" in inputs,
                   stream_flag="stream" in inputs)


@dataclass
class TextRequest:
    """One text-generation request, whichever public protocol it came in by."""

    model: str
    prompt: str
    max_tokens: int | None = None
    stream: bool = False
    include_usage: bool = False
    chat: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw or b"null")
    except (ValueError, UnicodeDecodeError):
        raise bad_request("The body is not valid JSON.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("The body must be a JSON object.", code="invalid_json")
    return body


def _max_tokens(body: dict[str, Any]) -> int | None:
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOKENS_LIMIT:
            raise bad_request(f"'{key}' must be an integer between 0 and {MAX_TOKENS_LIMIT}.", param=key)
        return value
    return None


def _content(message: dict[str, Any], i: int) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only text parts are understood by text models
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{i}].content: only text parts are supported.", param="messages")
            parts.append(part["text"])
        return "\n".join(parts)
    if content is None and message.get("role") == "assistant":
        return ""
    raise bad_request(f"messages[{i}].content must be a string or a list of text parts.", param="messages")


def chat_prompt(messages: Any) -> str:
    """The prompt a text model sees for a chat: one ``role: content`` line per message, then ``assistant:``."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list.", param="messages")
    lines = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise bad_request(f"messages[{i}] must be an object with a role of system, developer, user, assistant "
                              f"or tool.", param="messages")
        lines.append(f"{m['role']}: {_content(m, i)}")
    lines.append("assistant:")
    return "\n".join(lines)


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be true or false.", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object.", param="stream_options")
    return stream, bool(options.get("include_usage")) and stream


def _model_name(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required: the name of one of your deployed models (GET /v1/models).",
                          param="model")
    return model


def _check_n(body: dict[str, Any]) -> None:
    if body.get("n", 1) != 1:
        raise bad_request("Only n=1 is supported.", param="n")


def parse_chat(raw: bytes) -> TextRequest:
    body = _json_object(raw)
    _check_n(body)
    stream, usage = _stream_flags(body)
    return TextRequest(model=_model_name(body), prompt=chat_prompt(body.get("messages")), max_tokens=_max_tokens(body),
                       stream=stream, include_usage=usage, chat=True)


def parse_completion(raw: bytes) -> TextRequest:
    body = _json_object(raw)
    _check_n(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise bad_request("'prompt' must be a string (one prompt per request).", param="prompt")
    stream, usage = _stream_flags(body)
    return TextRequest(model=_model_name(body), prompt=prompt, max_tokens=_max_tokens(body), stream=stream,
                       include_usage=usage)


def parse_generate(raw: bytes, model: str, stream: bool) -> tuple[dict[str, Any], TextRequest | None]:
    """A Triton generate body (forwarded as it is) and, for a text model's keys, the text request in it."""
    body = _json_object(raw)
    prompt = next((body[k] for k in PROMPT_INPUTS if isinstance(body.get(k), str)), None)
    text = None
    if prompt is not None:
        limit = body.get("max_tokens")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)):
            raise bad_request("'max_tokens' must be an integer.", param="max_tokens")
        text = TextRequest(model=model, prompt=prompt, max_tokens=limit, stream=stream)
    return body, text


def generate_body(io: ModelIO, req: TextRequest, adapter: str | None = None) -> dict[str, Any]:
    """The generate request for a text model (the model's own tensor names)."""
    prompt = io.prompt
    if not io.generative or prompt is None:  # generative: it has a prompt input
        raise bad_request(f"The model '{req.model}' is not a text-generation model (it has no prompt input and "
                          f"text output); call it with /v2/models/{req.model}/infer.", param="model",
                          code="model_not_generative")
    body: dict[str, Any] = {prompt: req.prompt}
    if io.stream_flag:
        body["stream"] = req.stream
    if req.max_tokens is not None:
        if io.sampling:
            body["sampling_parameters"] = json.dumps({"max_tokens": req.max_tokens})
        elif io.max_tokens is None:
            raise bad_request(f"The model '{req.model}' takes no max_tokens.", param="max_tokens")
        else:
            body[io.max_tokens] = req.max_tokens
    return select_adapter(body, adapter, req.model)


def select_adapter(body: dict[str, Any], adapter: str | None, model: str) -> dict[str, Any]:
    """A generate body for a vLLM model with its LoRA adapter selected as Triton's vLLM backend reads it
    (https://github.com/triton-inference-server/vllm_backend, ``src/model.py`` ``_verify_loras``): ``lora_name`` in
    the JSON string input ``sampling_parameters`` when the request has that input, else in the request's
    ``parameters``. The gateway decides the adapter (the model name called); a ``lora_name`` sent by the
    caller is refused, so every request is metered as the adapter that served it."""
    sampling = body.get("sampling_parameters")
    params = body.get("parameters")
    if sampling is not None:
        try:
            parsed = json.loads(sampling) if isinstance(sampling, str) else None
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            raise bad_request("'sampling_parameters' must be a JSON object in a string.", param="sampling_parameters")
        sampling = parsed
    if params is not None and not isinstance(params, dict):
        raise bad_request("'parameters' must be an object.", param="parameters")
    if "lora_name" in (sampling or {}) or "lora_name" in (params or {}):
        raise bad_request("Select a LoRA adapter by calling it by its model name (GET /v1/models), not with "
                          "'lora_name'.", param="lora_name")
    if adapter is None:
        return body
    if sampling is not None:
        return {**body, "sampling_parameters": json.dumps({**sampling, "lora_name": adapter})}
    return {**body, "parameters": {**(params or {}), "lora_name": adapter}}


def words(text: str) -> int:
    return len(text.split())


@dataclass
class Served:
    """What was sent back for one request: the text so far and the token counts the model reported."""

    text: str = ""
    input_tokens: int | None = None
    output_tokens: int | None = None
    chunks: int = 0

    def add(self, io: ModelIO, out: dict[str, Any]) -> str:
        """Fold one generate answer (or stream chunk) in; returns its text."""
        piece = out.get(io.text) if io.text else None
        piece = piece if isinstance(piece, str) else ("" if piece is None else str(piece))
        self.text += piece
        self.chunks += 1
        for attr, name in (("input_tokens", io.input_count), ("output_tokens", io.output_count)):
            value = _count(out.get(name)) if name else None
            if value is not None:
                current = getattr(self, attr)
                setattr(self, attr, value if current is None else max(current, value))
        return piece

    def usage(self, prompt: str) -> tuple[int, int]:
        """(input, output) tokens: the model's counts, else the fallback rule (words)."""
        n_in = self.input_tokens if self.input_tokens is not None else words(prompt)
        n_out = self.output_tokens if self.output_tokens is not None else words(self.text)
        return n_in, n_out


def _count(value: Any) -> int | None:
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        return None
    return int(value)


def usage_block(n_in: int, n_out: int) -> dict[str, int]:
    return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}


def completion_object(req: TextRequest, request_id: str, text: str, n_in: int, n_out: int,
                      finish: str = "stop") -> dict[str, Any]:
    created = int(time.time())
    if req.chat:
        return {"id": f"chatcmpl-{request_id}", "object": "chat.completion", "created": created, "model": req.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                             "finish_reason": finish}],
                "usage": usage_block(n_in, n_out)}
    return {"id": f"cmpl-{request_id}", "object": "text_completion", "created": created, "model": req.model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
            "usage": usage_block(n_in, n_out)}


def finish_reason(req: TextRequest, n_out: int) -> str:
    return "length" if req.max_tokens is not None and n_out >= req.max_tokens else "stop"


def chunk_object(req: TextRequest, request_id: str, created: int, *, text: str | None = None, role: bool = False,
                 finish: str | None = None, usage: dict[str, int] | None = None,
                 no_choices: bool = False) -> dict[str, Any]:
    """One server-sent event of a streamed completion (OpenAI's chunk objects)."""
    if req.chat:
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choices = [] if no_choices else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
        obj: dict[str, Any] = {"id": f"chatcmpl-{request_id}", "object": "chat.completion.chunk", "created": created,
                               "model": req.model, "choices": choices}
    else:
        choices = [] if no_choices else [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]
        obj = {"id": f"cmpl-{request_id}", "object": "text_completion", "created": created, "model": req.model,
               "choices": choices}
    if req.include_usage:
        obj["usage"] = usage
    return obj


def sse(obj: dict[str, Any] | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def parse_sse_lines(buffer: bytearray) -> list[dict[str, Any]]:
    """Complete ``data:`` events taken off the front of ``buffer`` (Triton's generate_stream framing)."""
    out: list[dict[str, Any]] = []
    while True:
        end = buffer.find(b"\n\n")
        if end < 0:
            return out
        block = bytes(buffer[:end])
        del buffer[:end + 2]
        for line in block.split(b"\n"):
            if line.startswith(b"data:"):
                try:
                    obj = json.loads(line[5:].strip() or b"null")
                except ValueError:
                    obj = {"error": "the model's server sent a malformed event"}
                if isinstance(obj, dict):
                    out.append(obj)


# --- KServe v2 infer responses: the token-count tensors, JSON or binary ----------------------------------

_SIZES = {"INT8": 1, "UINT8": 1, "INT16": 2, "UINT16": 2, "INT32": 4, "UINT32": 4, "INT64": 8, "UINT64": 8}


def infer_counts(body: bytes, header_length: int | None) -> tuple[int | None, int | None]:
    """(input, output) token counts from an infer response's ``input_tokens`` / ``output_tokens`` tensors,
    summed over the batch; ``None`` where the model has no such output. Handles the binary tensor extension
    (``Inference-Header-Content-Length``), which tritonclient asks for by default."""
    try:
        head = json.loads(body[:header_length] if header_length else body)
    except (ValueError, UnicodeDecodeError):
        return None, None
    if not isinstance(head, dict):
        return None, None
    offset = header_length or 0
    found: dict[str, int] = {}
    for out in head.get("outputs") or []:
        if not isinstance(out, dict):
            continue
        name, dtype = out.get("name"), out.get("datatype")
        size = (out.get("parameters") or {}).get("binary_data_size")
        values: list[int] = []
        if size is not None:
            chunk = body[offset:offset + int(size)]
            offset += int(size)
            width = _SIZES.get(dtype or "")
            if width and name in INPUT_COUNTS + OUTPUT_COUNTS:
                signed = not str(dtype).startswith("U")
                values = [int.from_bytes(chunk[i:i + width], "little", signed=signed)
                          for i in range(0, len(chunk) - width + 1, width)]
        elif name in INPUT_COUNTS + OUTPUT_COUNTS:
            values = [v for v in _flat(out.get("data")) if isinstance(v, int) and not isinstance(v, bool)]
        if name in INPUT_COUNTS + OUTPUT_COUNTS and values:
            found[name] = sum(max(0, v) for v in values)
    n_in = next((found[n] for n in INPUT_COUNTS if n in found), None)
    n_out = next((found[n] for n in OUTPUT_COUNTS if n in found), None)
    return n_in, n_out


def _flat(data: Any) -> list[Any]:
    if isinstance(data, list):
        return [x for item in data for x in _flat(item)]
    return [data]
