"""The gateway's OpenAPI document (``GET /openapi.json``): its routes, bodies, answers and errors, for integrators
and for the schema fuzzing test (tests/security/test_gateway_schemathesis.py)."""

from __future__ import annotations

from typing import Any

from .protocol import MAX_STOP_CHARS, MAX_STOPS, NO_OP, SAMPLING

OPENAI_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": "string"},
                   "tessera_code": {"type": "string", "description": "Tessera's own reason where code is OpenAI's "
                                    "(insufficient_quota: spend_limit_reached, key_allowance_reached)"}}}}}
KSERVE_ERROR = {"type": "object", "required": ["error"],
                "properties": {"error": {"type": "string"}, "code": {"type": "string"}}}
USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
         "properties": {k: {"type": "integer", "minimum": 0} for k in ("prompt_tokens", "completion_tokens",
                                                                        "total_tokens")}}
MODEL = {"type": "object", "required": ["id", "object", "owned_by"],
         "properties": {"id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
                        "owned_by": {"type": "string"}}}
MAX_TOKENS = {"type": "integer", "minimum": 0, "maximum": 1_000_000}
STREAM = {"type": "boolean"}
STREAM_OPTIONS = {"type": "object", "properties": {"include_usage": {"type": "boolean"}}}
MESSAGE = {"type": "object", "required": ["role", "content"], "properties": {
    "role": {"enum": ["system", "developer", "user", "assistant", "tool"]}, "content": {"type": "string"}}}
COMPLETION = {"type": "object", "required": ["id", "object", "choices", "usage"], "properties": {
    "id": {"type": "string"}, "object": {"type": "string"}, "created": {"type": "integer"},
    "model": {"type": "string"}, "choices": {"type": "array"}, "usage": USAGE}}
EMBEDDINGS_REQUEST = {"type": "object", "required": ["model", "input"], "description": (
    "The model must declare a text input (prompt or text_input) and an output named embedding (floats), and not be "
    "decoupled (else 400 model_not_embedding); each input is one request to it. Input tokens: the model's "
    "input_tokens per input, else its words. dimensions, user and other fields are refused (400 "
    "unsupported_parameter)."), "properties": {
    "model": {"type": "string"},
    "input": {"anyOf": [{"type": "string", "minLength": 1}, {"type": "array", "minItems": 1, "maxItems": 2048,
                                                             "items": {"type": "string", "minLength": 1}}]},
    "encoding_format": {"enum": ["float", "base64", None], "description": "base64: little-endian float32"}}}
EMBEDDINGS = {"type": "object", "required": ["object", "data", "model", "usage"], "properties": {
    "object": {"const": "list"}, "model": {"type": "string"},
    "data": {"type": "array", "items": {"type": "object", "required": ["object", "index", "embedding"], "properties": {
        "object": {"const": "embedding"}, "index": {"type": "integer"},
        "embedding": {"anyOf": [{"type": "array", "items": {"type": "number"}}, {"type": "string"}]}}}},
    "usage": {"type": "object", "required": ["prompt_tokens", "total_tokens"], "properties": {
        "prompt_tokens": {"type": "integer", "minimum": 0}, "total_tokens": {"type": "integer", "minimum": 0}}}}}
MODEL_PARAM = {"name": "model", "in": "path", "required": True, "description": "your deployment's name",
               "schema": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}}
ANY_OBJECT = {"type": "object"}
# each event's data: a JSON object (a chunk, or an error as the stream's last event); OpenAI streams end "[DONE]"
SSE = {"text/event-stream": {"schema": {"type": ["object", "string"]}}}


PARAMETERS = (
    "Every field is delivered to the model or refused with 400 unsupported_parameter naming it (param is the "
    "field); none is ignored. The gateway handles model, messages/prompt, max_tokens (max_completion_tokens), "
    "stream, stream_options, n (1) and stop: it cuts the text it sends before the first stop sequence for every "
    "backend, finish_reason stop, and bills the output tokens of the text sent. Sampling fields (temperature, "
    "top_p, presence_penalty, frequency_penalty, seed; vLLM's top_k, min_p, repetition_penalty): vLLM library "
    "models get them, with max_tokens and stop, in sampling_parameters; other models (python, TensorRT-LLM "
    "ensembles) get each as the input tensor they declare (temperature, top_p or runtime_top_p, "
    "presence_penalty, frequency_penalty, seed or random_seed, top_k or runtime_top_k, min_p, "
    "repetition_penalty), in its declared type, and a field the model has no input for is refused. Not "
    "supported, refused unless null or OpenAI's no-op value: tools, tool_choice (none), parallel_tool_calls, "
    "response_format ({type: text}), logprobs (false), top_logprobs, logit_bias ({}), user, echo (false), "
    "best_of (1), suffix, and any other field; message fields other than role and content.")


def _sampling_fields() -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for key, rule in SAMPLING.items():
        high = rule.high if rule.high < 2**53 else 2**53  # JSON numbers beyond 2^53 lose precision
        fields[key] = {"type": ["integer" if rule.integer else "number", "null"], "minimum": rule.low,
                       "maximum": high, "description": "model inputs: " + " or ".join(rule.tensors)
                       + "; vLLM: sampling_parameters"}
    fields["stop"] = {"description": f"up to {MAX_STOPS} stop sequences, honoured by the gateway", "anyOf": [
        {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}, {"type": "null"},
        {"type": "array", "minItems": 1, "maxItems": MAX_STOPS,
         "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}}]}
    for key, value in NO_OP.items():
        fields[key] = {"enum": [value, None], "description": "only its no-op value: not supported"}
    return fields


def _errors(schema: dict, *codes: int) -> dict[str, Any]:
    why = {400: "invalid request, a parameter the model does not take (unsupported_parameter, naming it), or "
           "the model refused it", 401: "missing, unknown, revoked or expired key",
           403: "the key lacks the inference scope, or the tenant is suspended",
           404: "unknown model, or another tenant's (the same answer)", 413: "body too large",
           429: "request, token or concurrency limit (Retry-After); or the tenant's monthly spend limit or the key's "
                "monthly token allowance is reached: OpenAI's insufficient_quota (type and code), tessera_code "
                "spend_limit_reached or key_allowance_reached, x-should-retry: false",
           500: "the gateway failed", 502: "the model failed", 503: "the model is not answering, or metering is "
           "unavailable (Retry-After)"}
    return {str(c): {"description": why[c], "content": {"application/json": {"schema": schema}}} for c in codes}


ALL = (400, 401, 403, 404, 413, 429, 500, 502, 503)


def _op(summary: str, ok: dict[str, Any], errors: dict, body: dict | None = None, params: list | None = None
        ) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "responses": {"200": ok, **errors}, "security": [{"bearer": []}]}
    if body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    if params:
        op["parameters"] = params
    return op


def document(server_url: str = "") -> dict[str, Any]:
    oe, ke = _errors(OPENAI_ERROR, *ALL), _errors(KSERVE_ERROR, *ALL)
    json_or_sse = lambda schema: {"description": "the answer (server-sent events when stream is true)",  # noqa: E731
                                  "content": {"application/json": {"schema": schema}, **SSE}}
    sampling = _sampling_fields()
    not_chat, not_completion = {"echo", "best_of"}, {"tools", "tool_choice", "response_format"}
    chat = {"type": "object", "required": ["model", "messages"], "description": PARAMETERS, "properties": {
        "model": {"type": "string"}, "messages": {"type": "array", "minItems": 1, "items": MESSAGE},
        "max_tokens": MAX_TOKENS, "max_completion_tokens": MAX_TOKENS, "stream": STREAM,
        "stream_options": STREAM_OPTIONS, "n": {"const": 1},
        **{k: v for k, v in sampling.items() if k not in not_chat}}}
    completion = {"type": "object", "required": ["model", "prompt"], "description": PARAMETERS, "properties": {
        "model": {"type": "string"}, "prompt": {"type": "string"}, "max_tokens": MAX_TOKENS, "stream": STREAM,
        "stream_options": STREAM_OPTIONS, "n": {"const": 1},
        **{k: v for k, v in sampling.items() if k not in not_completion}}}
    generate = {"type": "object", "description": "keys name the model's input tensors (Tessera's text models: "
                "prompt, max_tokens)", "properties": {"prompt": {"type": "string"}, "max_tokens": MAX_TOKENS}}
    paths = {
        "/v1/models": {"get": _op("List your models", {"description": "your ready models", "content": {
            "application/json": {"schema": {"type": "object", "required": ["object", "data"], "properties": {
                "object": {"const": "list"}, "data": {"type": "array", "items": MODEL}}}}}}, oe)},
        "/v1/models/{model}": {"get": _op("One of your models", {"description": "the model", "content": {
            "application/json": {"schema": MODEL}}}, oe, params=[MODEL_PARAM])},
        "/v1/chat/completions": {"post": _op("Chat completion (OpenAI-compatible)", json_or_sse(COMPLETION), oe,
                                             chat)},
        "/v1/completions": {"post": _op("Text completion (OpenAI-compatible)", json_or_sse(COMPLETION), oe,
                                        completion)},
        "/v1/embeddings": {"post": _op("Embeddings (OpenAI-compatible), for models that declare an embedding "
                                       "output", {"description": "one vector per input", "content": {
                                           "application/json": {"schema": EMBEDDINGS}}}, oe, EMBEDDINGS_REQUEST)},
        "/v2/models/{model}": {"get": _op("Model metadata (KServe v2)", {"description": "metadata", "content": {
            "application/json": {"schema": ANY_OBJECT}}}, ke, params=[MODEL_PARAM])},
        "/v2/models/{model}/ready": {"get": _op("Model readiness (KServe v2)", {"description": "ready"}, ke,
                                                params=[MODEL_PARAM])},
        "/v2/models/{model}/infer": {"post": _op("Inference (KServe v2; JSON or binary tensors)", {
            "description": "the output tensors", "content": {"application/json": {"schema": ANY_OBJECT}}}, ke,
            {"type": "object", "required": ["inputs"], "properties": {"inputs": {"type": "array"}}},
            [MODEL_PARAM])},
        "/v2/models/{model}/generate": {"post": _op("Generate (Triton's generate extension)", {
            "description": "the output tensors", "content": {"application/json": {"schema": ANY_OBJECT}}}, ke,
            generate, [MODEL_PARAM])},
        "/v2/models/{model}/generate_stream": {"post": _op("Generate, streamed", {
            "description": "one event per response", "content": SSE}, ke, generate, [MODEL_PARAM])},
    }
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "Tessera inference gateway", "version": "1",
                 "description": "Call your models with an API key that has the inference scope. Every answer "
                                "carries x-request-id, the id of the usage event Tessera bills."},
        "paths": paths,
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
    if server_url:
        doc["servers"] = [{"url": server_url}]
    return doc
