"""A vLLM library model's generated Triton repository (config.pbtxt, model.json from the fit, multi_lora.json)
loaded by a real tritonserver with NVIDIA's vLLM backend on a real GPU, then asked for text.

It needs what these machines lack, and skips naming what is missing: a GPU (NVML), a ``tritonserver`` with the
``vllm`` backend (NVIDIA's ``nvcr.io/nvidia/tritonserver:<yy.mm>-vllm-python-py3`` image has both; found at
``$TESSERA_TEST_TRITONSERVER`` or /opt/tritonserver/bin/tritonserver), the ``vllm`` package, and local weights
of a small Llama-architecture model (``$TESSERA_TEST_VLLM_WEIGHTS``: a folder with config.json and safetensors;
nothing is fetched from a model hub). Its architecture is read from that config.json."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from marketplace import fit
from marketplace.models import LibraryModel
from marketplace.services import models as model_svc
from tests.gateway_fixtures import free_port

BINARY = Path(os.environ.get("TESSERA_TEST_TRITONSERVER", "/opt/tritonserver/bin/tritonserver"))
WEIGHTS = os.environ.get("TESSERA_TEST_VLLM_WEIGHTS", "")


def _missing() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        if pynvml.nvmlDeviceGetCount() < 1:
            return "no GPU: NVML sees no device"
    except Exception as exc:  # no driver, no library
        return f"no GPU: NVML unavailable ({exc.__class__.__name__})"
    if not BINARY.is_file():
        return f"no tritonserver at {BINARY} (set TESSERA_TEST_TRITONSERVER)"
    if not (BINARY.parent.parent / "backends" / "vllm" / "model.py").is_file():
        return f"no vllm backend next to {BINARY} (backends/vllm/model.py)"
    if importlib.util.find_spec("vllm") is None:
        return "the vllm package is not installed"
    if not WEIGHTS or not (Path(WEIGHTS) / "config.json").is_file():
        return "no local weights (set TESSERA_TEST_VLLM_WEIGHTS to a folder with config.json)"
    return None


MISSING = _missing()
pytestmark = [pytest.mark.triton, pytest.mark.skipif(MISSING is not None, reason=f"vLLM on a GPU: {MISSING}")]


def _library_model(weights: Path) -> LibraryModel:
    cfg = json.loads((weights / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    params = sum(p.stat().st_size for p in weights.glob("*.safetensors")) // 2  # BF16/FP16 checkpoints
    return LibraryModel(key="test-vllm", name="test", family=cfg.get("model_type", "llama"), params=params,
                        layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"], attention_heads=heads,
                        kv_heads=cfg.get("num_key_value_heads", heads),
                        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, weight_dtype="BF16",
                        kv_dtype="BF16", max_context=min(cfg.get("max_position_embeddings", 2048), 4096),
                        backend="vllm", store_path=weights.name)


def test_a_generated_vllm_repository_loads_and_generates(tmp_path, settings):
    import pynvml

    weights = Path(WEIGHTS).resolve()
    settings.TESSERA_MODEL_STORE_ROOT = weights.parent
    m = _library_model(weights)
    pynvml.nvmlInit()
    device_mib = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total // 2**20
    result = fit.fit(model_svc.library_shape(m), device_mib, context=m.max_context, concurrency=2)
    assert result.fits, result.reason
    _serve_and_generate(tmp_path, model_svc.vllm_files("llm", m, result, concurrency=2), None)


def test_a_tp2_repository_on_two_gpus_loads_and_generates(tmp_path, settings):
    """A 2-GPU group's server: CUDA_VISIBLE_DEVICES lists two GPUs, model.json says tensor_parallel_size 2."""
    import pynvml

    pynvml.nvmlInit()
    if pynvml.nvmlDeviceGetCount() < 2:
        pytest.skip("tensor parallelism needs two GPUs; this machine has fewer")
    weights = Path(WEIGHTS).resolve()
    settings.TESSERA_MODEL_STORE_ROOT = weights.parent
    m = _library_model(weights)
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(2)]
    device_mib = min(pynvml.nvmlDeviceGetMemoryInfo(h).total for h in handles) // 2**20
    result = fit.fit(model_svc.library_shape(m), device_mib, context=m.max_context, concurrency=2, tensor_parallel=2)
    files = model_svc.vllm_files("llm", m, result, concurrency=2)
    assert json.loads(files["llm/1/model.json"])["tensor_parallel_size"] == 2
    uuids = [pynvml.nvmlDeviceGetUUID(h) for h in handles]
    _serve_and_generate(tmp_path, files, ",".join(u.decode() if isinstance(u, bytes) else u for u in uuids))


def _serve_and_generate(tmp_path: Path, files: dict[str, str], devices: str | None) -> None:
    repo = tmp_path / "repo"
    for rel, text in files.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    env = None if devices is None else {**os.environ, "CUDA_VISIBLE_DEVICES": devices}
    port = free_port()
    log = (tmp_path / "tritonserver.log").open("wb")
    proc = subprocess.Popen([str(BINARY), f"--model-repository={repo}", "--model-control-mode=explicit",
                             "--load-model=llm", f"--http-port={port}", f"--grpc-port={free_port()}",
                             f"--metrics-port={free_port()}"], stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 540
        while True:
            assert proc.poll() is None, (tmp_path / "tritonserver.log").read_text()[-4000:]
            try:
                with urllib.request.urlopen(f"{url}/v2/models/llm/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the vLLM model did not become ready"
            time.sleep(2)
        body = json.dumps({"text_input": "The capital of France is", "stream": False,
                           "sampling_parameters": json.dumps({"max_tokens": 8, "temperature": 0})}).encode()
        req = urllib.request.Request(f"{url}/v2/models/llm/generate_stream", data=body,  # the model is decoupled
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            events = [json.loads(line[5:]) for line in r.read().decode().splitlines() if line.startswith("data:")]
        assert events and not any("error" in e for e in events), events
        assert "".join(e.get("text_output", "") for e in events).strip()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        shutil.rmtree(repo, ignore_errors=True)
