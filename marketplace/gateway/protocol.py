"""Pure translation between the gateway's public protocols and Triton's generate extension, and the errors.

OpenAI-compatible routes are served from Triton's ``generate`` / ``generate_stream`` endpoints
(https://github.com/triton-inference-server/server/blob/main/docs/protocol/extension_generate.md): the JSON keys
of a generate request name the model's input tensors and the answer's keys its output tensors. Tessera's text
models take a ``prompt`` (or vLLM's ``text_input``) and an optional ``max_tokens`` and answer ``text`` (or
``text_output``) plus, when the model reports them, ``input_tokens`` and ``output_tokens`` (vLLM:
``num_input_tokens`` / ``num_output_tokens``).

Token counts (the metering rule): what the model reports wins. On a stream, a reported count is a running
total: the largest value seen so far is what was served. Of an answer the gateway cut at a stop sequence, the
output tokens of the text sent are billed (``Served``). A model that reports no counts is metered by
Tessera's fallback rule, documented in the README: tokens are whitespace-separated words of the prompt and of
the text sent (the rule Tessera's demo models use themselves).
"""

from __future__ import annotations

import base64
import json
import struct
import time
from dataclasses import dataclass, field
from typing import Any

MAX_TOKENS_LIMIT = 1_000_000
PROMPT_INPUTS = ("prompt", "text_input")
TEXT_OUTPUTS = ("text", "text_output")
EMBEDDING_OUTPUT = "embedding"
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


def insufficient_quota(message: str, reason: str = "spend_limit_reached") -> GatewayError:
    """A spent quota — the tenant's spend limit (``spend_limit_reached``) or the key's monthly token allowance
    (``key_allowance_reached``): OpenAI's answer for a spent quota (429 ``insufficient_quota``, which OpenAI's SDKs
    map to ``RateLimitError``), not retried (``x-should-retry: false``, which the SDKs honour), with Tessera's reason
    in ``tessera_code``."""
    return GatewayError(429, "insufficient_quota", message, kind="insufficient_quota",
                        headers={"x-should-retry": "false"}, tessera_code=reason)


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
    inputs: tuple[tuple[str, str], ...] = ()  # every declared input: (name, data type, e.g. TYPE_FP32)
    embedding: str | None = None  # an output "embedding" (floats): the model serves /v1/embeddings

    @property
    def generative(self) -> bool:
        return self.prompt is not None and self.text is not None

    def input_type(self, name: str) -> str | None:
        return next((dtype for n, dtype in self.inputs if n == name), None)

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> ModelIO:
        declared = tuple((str(t["name"]), str(t.get("data_type") or "")) for t in spec.get("inputs") or []
                         if isinstance(t, dict) and t.get("name"))
        inputs = {name for name, _ in declared}
        outputs = {t.get("name") for t in spec.get("outputs") or [] if isinstance(t, dict)}
        return cls(prompt=next((n for n in PROMPT_INPUTS if n in inputs), None),
                   text=next((n for n in TEXT_OUTPUTS if n in outputs), None),
                   max_tokens="max_tokens" if "max_tokens" in inputs else None,
                   input_count=next((n for n in INPUT_COUNTS if n in outputs), None),
                   output_count=next((n for n in OUTPUT_COUNTS if n in outputs), None),
                   decoupled=bool(spec.get("decoupled")), sampling="sampling_parameters" in inputs,
                   stream_flag="stream" in inputs, inputs=declared,
                   embedding=EMBEDDING_OUTPUT if EMBEDDING_OUTPUT in outputs else None)


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
    sampling: dict[str, Any] = field(default_factory=dict)  # OpenAI name -> checked value (see SAMPLING)
    stop: tuple[str, ...] = ()


# --- OpenAI request fields ----------------------------------------------------------------------------------
# Every field of a chat or completion request is either delivered to the model or refused with 400
# ``unsupported_parameter`` naming it; none is dropped. The gateway itself handles model, messages / prompt,
# max_tokens / max_completion_tokens, stream, stream_options, n (1 only) and stop (it truncates what it sends at
# the first stop sequence whatever the backend; vLLM also gets it, so generation ends there). The sampling
# fields below reach the model:
# - vLLM (Triton's vLLM backend): as keys of the JSON string input ``sampling_parameters``, which the backend
#   turns into vLLM's SamplingParams (https://github.com/triton-inference-server/vllm_backend, README "Sending
#   sampling parameters"; https://docs.vllm.ai/en/latest/api/vllm/sampling_params.html);
# - any other model (python, TensorRT-LLM ensembles): as the input tensor of that name when the model declares
#   one (NVIDIA's TensorRT-LLM ensemble names them temperature, top_p, top_k, random_seed, presence_penalty,
#   frequency_penalty, repetition_penalty: https://github.com/triton-inference-server/tensorrtllm_backend,
#   docs "model_config"), converted to the declared data type; else the request is refused naming the field.

@dataclass(frozen=True)
class Sampling:
    """One sampling field: its range and the model input tensors that may carry it, in order of preference."""

    low: float
    high: float
    integer: bool
    tensors: tuple[str, ...]

    def check(self, key: str, value: Any) -> float | int:
        if (isinstance(value, bool) or not isinstance(value, int if self.integer else int | float)
                or not self.low <= value <= self.high):
            span = (f"an integer between {int(self.low)} and {int(self.high)}" if self.integer
                    else f"a number between {self.low:g} and {self.high:g}")
            raise bad_request(f"'{key}' must be {span}.", param=key)
        return value if self.integer else float(value)


# OpenAI name (also vLLM's SamplingParams key) -> its rule. top_k, min_p and repetition_penalty are not OpenAI's
# but vLLM's (and TensorRT-LLM's) extensions: the openai package sends them with extra_body.
SAMPLING: dict[str, Sampling] = {
    "temperature": Sampling(0, 2, False, ("temperature",)),
    "top_p": Sampling(0, 1, False, ("top_p", "runtime_top_p")),
    "presence_penalty": Sampling(-2, 2, False, ("presence_penalty",)),
    "frequency_penalty": Sampling(-2, 2, False, ("frequency_penalty",)),
    "seed": Sampling(0, 2**63 - 1, True, ("seed", "random_seed")),
    "top_k": Sampling(-1, 1_000_000, True, ("top_k", "runtime_top_k")),
    "min_p": Sampling(0, 1, False, ("min_p",)),
    "repetition_penalty": Sampling(0.01, 2, False, ("repetition_penalty",)),
}
MAX_STOPS = 4
MAX_STOP_CHARS = 256  # each stop sequence: bounds the gateway's scan of every piece of text it sends
COMMON_FIELDS = frozenset({"model", "max_tokens", "stream", "stream_options", "n", "stop", *SAMPLING})
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt"}
# A field sent with the value that asks for nothing (OpenAI's own default) is what the gateway does anyway. null
# is "not given" for every field.
NO_OP = {"logprobs": False, "echo": False, "best_of": 1, "tools": [], "logit_bias": {},
         "response_format": {"type": "text"}, "tool_choice": "none"}


def unsupported(key: str, why: str) -> GatewayError:
    return bad_request(f"'{key}' is not supported: {why}. Supported fields: see GET /openapi.json or the README "
                       f"(Inference gateway).", param=key, code="unsupported_parameter")


def _check_fields(body: dict[str, Any], allowed: frozenset[str]) -> None:
    for key, value in body.items():
        if key in allowed or value is None:
            continue
        default = NO_OP.get(key, _NOT_SET)
        if type(default) is type(value) and default == value:
            continue
        raise unsupported(key, "the gateway neither passes it to models nor implements it")


_NOT_SET = object()


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    return {key: rule.check(key, body[key]) for key, rule in SAMPLING.items() if body.get(key) is not None}


def _stops(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if (not isinstance(stops, list) or not 1 <= len(stops) <= MAX_STOPS
            or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops)):
        raise bad_request(f"'stop' must be a string or a list of 1 to {MAX_STOPS} strings, each of 1 to "
                          f"{MAX_STOP_CHARS} characters.", param="stop")
    return tuple(dict.fromkeys(stops))


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
        extra = next((k for k, v in m.items() if k not in ("role", "content") and v is not None), None)
        if extra is not None:  # name, tool_calls, tool_call_id, audio...: text models get role and content only
            raise unsupported(f"messages[{i}].{extra}", "text models are given each message's role and content only")
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
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise bad_request("Only n=1 is supported.", param="n")


def parse_chat(raw: bytes) -> TextRequest:
    body = _json_object(raw)
    _check_fields(body, CHAT_FIELDS)
    _check_n(body)
    stream, usage = _stream_flags(body)
    return TextRequest(model=_model_name(body), prompt=chat_prompt(body.get("messages")), max_tokens=_max_tokens(body),
                       stream=stream, include_usage=usage, chat=True, sampling=_sampling(body), stop=_stops(body))


def parse_completion(raw: bytes) -> TextRequest:
    body = _json_object(raw)
    _check_fields(body, COMPLETION_FIELDS)
    _check_n(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise bad_request("'prompt' must be a string (one prompt per request).", param="prompt")
    stream, usage = _stream_flags(body)
    return TextRequest(model=_model_name(body), prompt=prompt, max_tokens=_max_tokens(body), stream=stream,
                       include_usage=usage, sampling=_sampling(body), stop=_stops(body))


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
    if io.sampling:  # vLLM: one JSON string of SamplingParams keys
        params: dict[str, Any] = {} if req.max_tokens is None else {"max_tokens": req.max_tokens}
        params.update(req.sampling)
        if req.stop:
            params["stop"] = list(req.stop)
        if params:
            body["sampling_parameters"] = json.dumps(params)
        return select_adapter(body, adapter, req.model)
    if req.max_tokens is not None:
        if io.max_tokens is None:
            raise bad_request(f"The model '{req.model}' takes no max_tokens.", param="max_tokens")
        body[io.max_tokens] = req.max_tokens
    for key, value in req.sampling.items():
        name = next((n for n in SAMPLING[key].tensors if io.input_type(n) is not None), None)
        if name is None:
            raise unsupported(key, f"the model '{req.model}' has no input for it (it declares "
                                   f"{', '.join(n for n, _ in io.inputs) or 'none'})")
        body[name] = _as_type(key, value, io.input_type(name) or "")
    return select_adapter(body, adapter, req.model)


def _as_type(key: str, value: Any, dtype: str) -> Any:
    """A checked value as the model's declared tensor type takes it (Triton's generate extension converts JSON
    numbers to the input's datatype; an integer tensor cannot take 0.7)."""
    kind = dtype.upper().removeprefix("TYPE_")
    if kind.startswith(("FP", "BF")):
        return float(value)
    if kind.startswith(("INT", "UINT")):
        if float(value) != int(value):
            raise unsupported(key, f"the model's '{key}' input is an integer ({dtype}) and {value} is not one")
        return int(value)
    return value


# --- embeddings ----------------------------------------------------------------------------------------------
# A model serves /v1/embeddings when it declares a text input (prompt or text_input) and an output named
# "embedding" (floats) and is not decoupled: each input string is one generate request, its answer's embedding
# the vector. Input tokens: the model's input_tokens (or num_input_tokens) per string, else its words.

MAX_EMBEDDING_INPUTS = 2048
EMBEDDING_FIELDS = frozenset({"model", "input", "encoding_format"})


@dataclass
class EmbeddingRequest:
    model: str
    inputs: list[str]
    base64: bool = False


def parse_embeddings(raw: bytes) -> EmbeddingRequest:
    body = _json_object(raw)
    _check_fields(body, EMBEDDING_FIELDS)  # dimensions, user: refused naming them
    value = body.get("input")
    inputs = [value] if isinstance(value, str) else value
    if (not isinstance(inputs, list) or not 1 <= len(inputs) <= MAX_EMBEDDING_INPUTS
            or not all(isinstance(x, str) and x for x in inputs)):
        raise bad_request(f"'input' must be a non-empty string or a list of 1 to {MAX_EMBEDDING_INPUTS:,} non-empty "
                          f"strings (token arrays are not supported).", param="input")
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise bad_request("'encoding_format' must be float or base64.", param="encoding_format")
    return EmbeddingRequest(model=_model_name(body), inputs=inputs, base64=encoding == "base64")


def embedding_body(io: ModelIO, model: str, text: str) -> dict[str, Any]:
    if io.embedding is None or io.prompt is None or io.decoupled or io.sampling:
        raise bad_request(f"The model '{model}' does not compute embeddings (it declares no '{EMBEDDING_OUTPUT}' "
                          f"output with a text input).", param="model", code="model_not_embedding")
    return {io.prompt: text}


def embedding_result(io: ModelIO, model: str, out: dict[str, Any], text: str) -> tuple[list[float], int]:
    """One input's vector and input tokens (the model's count, else the words rule)."""
    vector = _flat(out.get(io.embedding or EMBEDDING_OUTPUT))
    if not vector or not all(isinstance(x, int | float) and not isinstance(x, bool) for x in vector):
        raise GatewayError(502, "model_error", f"The model '{model}' answered no embedding.", kind="server_error")
    count = _count(out.get(io.input_count)) if io.input_count else None
    return [float(x) for x in vector], count if count is not None else words(text)


def embedding_object(req: EmbeddingRequest, vectors: list[list[float]], n_in: int) -> dict[str, Any]:
    """OpenAI's embeddings answer; base64 is the little-endian float32 bytes, as OpenAI encodes them."""
    data = [{"object": "embedding", "index": i, "embedding": base64.b64encode(
        struct.pack(f"<{len(v)}f", *v)).decode() if req.base64 else v} for i, v in enumerate(vectors)]
    return {"object": "list", "data": data, "model": req.model,
            "usage": {"prompt_tokens": n_in, "total_tokens": n_in}}


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
    """What was sent back for one request: the text so far and the token counts the model reported.

    With stop sequences, the text is cut before the first one the model produced (OpenAI's rule: the stop
    sequence is not sent) and, while streaming, text that may be the beginning of one is held back until the next
    piece shows it is not. Output tokens of a cut answer are those of the text sent: the model's running counts
    apportion tokens to the characters of each piece, and of the piece the cut falls in, the kept share of its
    tokens by characters, rounded down, is counted (a token cut by the stop sequence is not billed)."""

    text: str = ""
    input_tokens: int | None = None
    output_tokens: int | None = None
    chunks: int = 0
    stops: tuple[str, ...] = ()
    stopped: bool = False  # a stop sequence was found: nothing after it is sent or counted
    _produced: int = 0  # characters of text the model produced
    _marks: list[tuple[int, int]] = field(default_factory=list)  # (characters produced, output count) reported
    _held: str = ""

    def add(self, io: ModelIO, out: dict[str, Any]) -> str:
        """Fold one generate answer (or stream chunk) in; returns the text that may be sent now."""
        piece = out.get(io.text) if io.text else None
        if isinstance(piece, list):  # a text output of shape [-1] (TensorRT-LLM's ensemble): its elements
            piece = "".join(str(x) for x in _flat(piece))
        piece = piece if isinstance(piece, str) else ("" if piece is None else str(piece))
        self.chunks += 1
        if self.stopped:
            return ""
        self._produced += len(piece)
        for attr, name in (("input_tokens", io.input_count), ("output_tokens", io.output_count)):
            value = _count(out.get(name)) if name else None
            if value is not None:
                current = getattr(self, attr)
                setattr(self, attr, value if current is None else max(current, value))
                if attr == "output_tokens":
                    self._marks.append((self._produced, self.output_tokens or 0))
        if not self.stops:
            self.text += piece
            return piece
        text = self._held + piece
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, self._held = True, ""
            self.text += text[:cut]
            return text[:cut]
        hold = _stop_prefix(text, self.stops)
        sent, self._held = text[:len(text) - hold], text[len(text) - hold:]
        self.text += sent
        return sent

    def flush(self) -> str:
        """The model is done: text held back (it might have begun a stop sequence) is sent after all."""
        rest, self._held = self._held, ""
        self.text += rest
        return rest

    def usage(self, prompt: str) -> tuple[int, int]:
        """(input, output) tokens: the model's counts (of a cut answer, those of the text sent), else the
        fallback rule (words of the prompt and of the text sent)."""
        n_in = self.input_tokens if self.input_tokens is not None else words(prompt)
        if self.output_tokens is None:
            return n_in, words(self.text)
        if not self.stopped:
            return n_in, self.output_tokens
        kept, chars, tokens = len(self.text), 0, 0
        for produced, count in self._marks:
            if produced > kept:
                return n_in, tokens + (count - tokens) * (kept - chars) // (produced - chars)
            chars, tokens = produced, count
        return n_in, tokens


def _stop_prefix(text: str, stops: tuple[str, ...]) -> int:
    """How many characters at the end of ``text`` begin one of ``stops`` (to hold back until the next piece)."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


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


def finish_reason(req: TextRequest, served: Served, n_out: int) -> str:
    if served.stopped:
        return "stop"
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
