"""The hardware a node worker talks to: its NVML (real or simulated) and, later, its Triton servers.

Real backend: the worker runs on the GPU host and `TESSERA_NODE_HOSTNAME` names it; asking for
another node's NVML is refused. Simulated backend: one simulator per node, its state in
var/sim/<hostname>.json, so one demo worker can serve several simulated nodes and a restarted
worker finds the instances it left (as a real GPU keeps them).
"""

from __future__ import annotations

import threading
from pathlib import Path

from django.conf import settings

from marketplace.hardware.nvml import NvmlClient, get_backend
from marketplace.hardware.nvml_sim import SimNvml
from marketplace.models import Node, ServerPlatform
from marketplace.services import fleet

_lock = threading.Lock()
_sims: dict[tuple, SimNvml] = {}


def sim_state_path(hostname: str):
    path = Path(settings.TESSERA_SIM_DIR)
    path.mkdir(parents=True, exist_ok=True)
    return path / f"{hostname}.json"


def nvml_backend(node: Node):
    if settings.TESSERA_NVML_BACKEND == "sim":
        gpus = list(node.gpus.select_related("gpu_model").order_by("index"))
        fleet = [g.gpu_model.key for g in gpus] or [node.platform.gpu_model.key] * node.platform.gpu_count
        mig = {g.index: g.mig_mode for g in gpus}
        key = (node.hostname, tuple(fleet), tuple(sorted(mig.items())), str(sim_state_path(node.hostname)))
        with _lock:
            sim = _sims.get(key)
            if sim is None:
                sim = _sims[key] = SimNvml(fleet=fleet, node=node.hostname, state_path=key[3], mig_enabled=mig,
                                           create_latency_s=settings.TESSERA_NVML_SIM_CREATE_LATENCY_S)
        return sim
    local = getattr(settings, "TESSERA_NODE_HOSTNAME", "")
    if local and local != node.hostname:
        raise RuntimeError(f"this worker drives {local}; it cannot reach {node.hostname}'s GPUs")
    return get_backend("pynvml")


def nvml_client(node: Node) -> NvmlClient:
    """An opened client for the node's NVML; use it as a context manager."""
    return NvmlClient(nvml_backend(node))


def sim_discovery(hostname: str, platform: ServerPlatform, mig_off: set[int] | frozenset[int] = frozenset()):
    """What a node worker with the simulated backend reports for this node (the same UUIDs, which derive
    from the node's registered name): `platform`'s GPUs, MIG on except on the GPU indexes in `mig_off`."""
    hostname = fleet.normalize_hostname(hostname)
    backend = SimNvml(fleet=[platform.gpu_model.key] * platform.gpu_count, node=hostname,
                      mig_enabled={i: i not in mig_off for i in range(platform.gpu_count)})
    with NvmlClient(backend) as client:
        return fleet.discover(client)
