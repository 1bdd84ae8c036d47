"""The Triton backend against a REAL tritonserver (the pytriton-bundled binary, CPU only).

One server for the module (explicit model control, auto-complete off so that a model without
config.pbtxt is refused as the simulator refuses it). Skipped, with the reason, where the binary
cannot run.
"""

from __future__ import annotations

import re
import time

import pytest
from tritonclient.utils import InferenceServerException

from marketplace.hardware.triton import (
    HttpTritonBackend,
    SimTritonBackend,
    demo_generate,
    demo_text_model,
    get_triton_backend,
    write_repository,
)
from tests.triton_server import running_tritonserver, tritonserver_available
from tests.worker_process import wait_for

AVAILABLE, REASON = tritonserver_available()

pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(not AVAILABLE, reason=f"tritonserver not available: {REASON}"),
]

MODEL = "tiny-gen"


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    path = tmp_path_factory.mktemp("triton-repo")
    write_repository(path, demo_text_model(MODEL))
    return path


@pytest.fixture(scope="module")
def server(repo):
    t0 = time.monotonic()
    with running_tritonserver(repo, extra_args=("--disable-auto-complete-config",)) as (http_url, metrics_url, proc):
        print(f"\ntritonserver ready in {time.monotonic() - t0:.2f}s at {http_url}")
        yield http_url, metrics_url, proc


@pytest.fixture(scope="module")
def triton(server):
    http_url, metrics_url, _proc = server
    backend = get_triton_backend("http", url=http_url, metrics_url=metrics_url)
    assert isinstance(backend, HttpTritonBackend)
    yield backend
    backend.close()


def _metric(text: str, name: str, model: str) -> float | None:
    m = re.search(rf'^{name}{{model="{re.escape(model)}",version="1"}} (\S+)$', text, re.MULTILINE)
    return float(m.group(1)) if m else None


def test_lifecycle_load_infer_statistics_metrics_unload(triton):
    assert triton.is_server_ready()
    assert {"name": MODEL} in triton.repository_index()
    assert not triton.is_model_ready(MODEL)

    t0 = time.monotonic()
    triton.load_model(MODEL)
    print(f"\nload_model took {time.monotonic() - t0:.2f}s")
    assert triton.is_model_ready(MODEL)
    assert {"name": MODEL, "version": "1", "state": "READY"} in triton.repository_index()

    before = triton.statistics(MODEL)
    prompts = [("hello big world", 5), ("one two three four", None), ("tessera", 3)]
    for text, max_tokens in prompts:
        out = triton.infer_text(MODEL, text, max_tokens)
        expected_text, n_in, n_out = demo_generate(text, max_tokens)
        assert out == {"text": expected_text, "input_tokens": n_in, "output_tokens": n_out}
    assert triton.infer_text(MODEL, "hello big world", 5)["text"] == "world big hello world big"
    sent = len(prompts) + 1

    # Triton records a request's statistics when it releases the request, which can be a moment after
    # the client has the response: wait (bounded) for the count to settle.
    wait_for(lambda: triton.statistics(MODEL)["inference_count"] - before["inference_count"] >= sent, 10,
             "Triton's statistics to count every request")
    after = triton.statistics(MODEL)
    assert after["name"] == MODEL and after["version"] == "1"
    assert after["inference_count"] - before["inference_count"] == sent
    assert after["execution_count"] - before["execution_count"] == sent  # batch 1, one request at a time
    assert after["success_count"] - before["success_count"] == sent
    assert after["fail_count"] == before["fail_count"] == 0
    assert after["compute_infer_ns"] > 0 and after["last_inference"] > 0

    metrics = triton.metrics_text()
    assert _metric(metrics, "nv_inference_count", MODEL) == after["inference_count"]
    assert _metric(metrics, "nv_inference_request_success", MODEL) == after["success_count"]
    assert _metric(metrics, "nv_inference_exec_count", MODEL) == after["execution_count"]

    triton.unload_model(MODEL)  # waits until the server has finished unloading
    assert not triton.is_model_ready(MODEL)
    assert {"name": MODEL, "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"} in triton.repository_index()
    with pytest.raises(InferenceServerException, match="has no available versions"):
        triton.infer_text(MODEL, "hello")
    with pytest.raises(InferenceServerException, match="is not available"):
        triton.statistics(MODEL)
    assert _metric(triton.metrics_text(), "nv_inference_count", MODEL) is None


def test_model_error_is_500_but_counted_as_success(triton):
    """Observed: an error the python model returns is HTTP 500 for the client, but Triton's statistics
    count the request as executed and successful (fail counts only requests that never ran)."""
    triton.load_model(MODEL)
    try:
        before = triton.statistics(MODEL)
        with pytest.raises(InferenceServerException, match="max_tokens must be between 0 and 1024") as info:
            triton.infer_text(MODEL, "hello", -1)
        assert info.value.status() == "500"
        wait_for(lambda: triton.statistics(MODEL)["inference_count"] > before["inference_count"], 10,
                 "the failed request to be counted")
        after = triton.statistics(MODEL)
        assert after["inference_count"] - before["inference_count"] == 1
        assert after["success_count"] - before["success_count"] == 1
        assert after["fail_count"] == before["fail_count"]
    finally:
        triton.unload_model(MODEL)


def test_missing_model_folder_fails_clearly(triton):
    with pytest.raises(InferenceServerException) as info:
        triton.load_model("no-such-model")
    assert "failed to load 'no-such-model'" in info.value.message()
    assert not triton.is_model_ready("no-such-model")
    with pytest.raises(InferenceServerException, match="is not found"):
        triton.infer_text("no-such-model", "hello")


def test_simulator_gives_the_same_answers_and_errors(triton, repo, tmp_path):
    """Differential check: the same calls on the real server and on the simulator."""
    (repo / "no-config" / "1").mkdir(parents=True)
    (repo / "no-config" / "1" / "model.py").write_text("# no config.pbtxt\n")
    sim = SimTritonBackend(repo)
    for backend in (triton, sim):
        backend.load_model(MODEL)
    try:
        for text, max_tokens in [("a b c", 7), ("", 4), ("x", 0)]:
            assert triton.infer_text(MODEL, text, max_tokens) == sim.infer_text(MODEL, text, max_tokens)
        wait_for(lambda: triton.statistics(MODEL)["inference_count"] >= 3, 10, "statistics to count 3")
        assert triton.statistics(MODEL)["inference_count"] == sim.statistics(MODEL)["inference_count"] == 3
        for name in ("no-such-model", "no-config"):
            errors = []
            for backend in (triton, sim):
                with pytest.raises(InferenceServerException) as info:
                    backend.load_model(name)
                errors.append((info.value.status(), info.value.message()))
            assert errors[0] == errors[1], errors
        for backend in (triton, sim):
            with pytest.raises(InferenceServerException) as info:
                backend.infer_text("never-loaded", "x")
            errors.append((info.value.status(), info.value.message()))
        assert errors[-1] == errors[-2]
    finally:
        for backend in (triton, sim):
            backend.unload_model(MODEL)
