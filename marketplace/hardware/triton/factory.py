"""``get_triton_backend``: the simulator for a repository folder (one per process) or a client of a real server."""


from __future__ import annotations

import os
import threading
from pathlib import Path

from marketplace.hardware import setting

from .client import HttpTritonBackend, TritonBackend
from .sim import SimTritonBackend
from .spec import BACKEND_ENV, BACKEND_KINDS

# --------------------------------------------------------------------------------------------------
# Factory
# --------------------------------------------------------------------------------------------------

_SIM_BACKENDS: dict[tuple[str, int | None], SimTritonBackend] = {}
_SIM_LOCK = threading.Lock()



def get_triton_backend(kind: str | None = None, url: str | None = None, repo_dir: str | os.PathLike | None = None,
                       *, metrics_url: str | None = None, memory_mb: int | None = None,
                       tokens_per_s: float | None = None, headers: dict[str, str] | None = None) -> TritonBackend:
    """``"sim"`` -> the process-wide simulator for ``repo_dir`` (same object for the same folder and memory,
    so a load in one task is seen by the next); ``"http"`` -> a new ``HttpTritonBackend(url, metrics_url)``.
    ``kind`` defaults to the ``TESSERA_TRITON_BACKEND`` setting, else "sim".
    """
    kind = (kind or setting(BACKEND_ENV) or "sim").strip().lower()
    if kind == "http":
        if not url:
            raise ValueError("the http Triton backend needs url (host:port of the server's HTTP endpoint)")
        return HttpTritonBackend(url, metrics_url, headers=headers)
    if kind == "sim":
        if repo_dir is None:
            raise ValueError("the sim Triton backend needs repo_dir (the model repository folder)")
        key = (str(Path(repo_dir).resolve()), memory_mb)
        with _SIM_LOCK:
            backend = _SIM_BACKENDS.get(key)
            if backend is None:
                backend = _SIM_BACKENDS[key] = SimTritonBackend(repo_dir, memory_mb, tokens_per_s=tokens_per_s)
            elif tokens_per_s is not None:
                backend.tokens_per_s = tokens_per_s
            return backend
    raise ValueError(f"unknown Triton backend {kind!r}; expected one of {', '.join(BACKEND_KINDS)}")


def reset_sim_backends() -> None:
    """Forget every process-wide simulator (tests)."""
    with _SIM_LOCK:
        _SIM_BACKENDS.clear()
