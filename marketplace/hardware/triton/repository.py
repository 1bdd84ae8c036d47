"""The model repository on disk: ``write_repository`` (staged, renamed into place, a no-op when the bytes match),
``remove_model``, and the demo text models (python backend, CPU) with ``demo_generate``, which the simulator
runs too."""


from __future__ import annotations

import inspect
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import NamedTuple

from .spec import CONFIG_FILE, MODEL_NAME_RE, DynamicBatching, InstanceGroup, ModelSpec, TensorSpec, render_config

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
