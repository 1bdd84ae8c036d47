"""GPU topology of the catalog's server platforms: NVLink domains, NUMA nodes, CPU affinity.

Pure Python (no Django, no NVML): the placement engine, the simulated NVML and the benchmarks use it.
The real NVML backend reports the same facts from the hardware (``NodeTopology.from_nvml``-style
readers live in ``nvml.py``); this table is what the simulator answers and what placement assumes
for a node whose worker has not reported its topology.

Sources of each fact (all catalog platforms are HGX H100/H200 8-GPU baseboards, catalog.json P1-P7):

* T1 -- NVLink: every GPU of an HGX H100/H200 8-GPU board reaches every other through the board's
  NVSwitch chips (18 fourth-generation NVLinks per GPU, 900 GB/s), so the 8 GPUs form one NVLink
  domain, all-to-all (NVIDIA NVLink/NVSwitch product text, https://www.nvidia.com/en-us/data-center/nvlink/
  and the NVSwitch platform list, catalog.json P1/P2; ``nvidia-smi topo -m`` on a DGX H100 shows NV18
  between every pair).
* T2 -- NUMA: the boards sit in two-socket servers (catalog.json P3/P4: 2x Xeon 8480C / 8470); GPUs 0-3
  hang off socket 0 and GPUs 4-7 off socket 1, so ``nvidia-smi topo -m`` on a DGX H100 gives NUMA
  affinity 0 for GPU0-3 and 1 for GPU4-7 and CPU affinity "0-51" / "52-103" (52-core sockets).
* T3 -- NVML's ``nvmlDeviceGetTopologyCommonAncestor`` answers a PCIe level
  (``nvmlGpuTopologyLevel_t``: INTERNAL 0, SINGLE 10, MULTIPLE 20, HOSTBRIDGE 30, NODE 40, SYSTEM 50,
  NVML API reference / cuda-python ``device_get_topology_common_ancestor``): two GPUs under the same
  socket are at most NODE apart, GPUs under different sockets are SYSTEM apart. The exact PCIe switch
  layout under a socket is not published per platform, so the table says NODE (the conservative
  same-socket answer), never SINGLE/MULTIPLE.
* T4 -- ``nvmlDeviceGetP2PStatus`` with ``NVML_P2P_CAPS_INDEX_NVLINK``: OK (0) between GPUs of one NVLink
  domain; with ``NVML_P2P_CAPS_INDEX_READ``/``WRITE``: OK over NVLink as well.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

# nvmlGpuTopologyLevel_t (T3)
TOPOLOGY_INTERNAL = 0
TOPOLOGY_SINGLE = 10
TOPOLOGY_MULTIPLE = 20
TOPOLOGY_HOSTBRIDGE = 30
TOPOLOGY_NODE = 40
TOPOLOGY_SYSTEM = 50

# nvmlGpuP2PStatus_t: NVML_P2P_STATUS_OK = 0, ..._NOT_SUPPORTED = 5 (NVML API reference)
P2P_STATUS_OK = 0
P2P_STATUS_NOT_SUPPORTED = 5

# NVLink 4 on H100/H200 SXM: 18 links per GPU (T1)
NVLINKS_PER_GPU = 18


@dataclass(frozen=True)
class GpuTopo:
    index: int
    numa_node: int
    nvlink_domain: int | None  # None: no NVLink peer (a PCIe-only GPU)
    cpus: tuple[int, ...]  # the CPU cores local to the GPU (nvmlDeviceGetCpuAffinity)


@dataclass(frozen=True)
class NodeTopology:
    gpus: tuple[GpuTopo, ...]

    def gpu(self, index: int) -> GpuTopo:
        return self.gpus[index]

    def numa_size(self, index: int) -> int:
        """GPUs in the NUMA node of GPU ``index``."""
        n = self.gpus[index].numa_node
        return sum(1 for g in self.gpus if g.numa_node == n)


def hgx_8gpu(cores_per_socket: int = 52) -> NodeTopology:
    """HGX H100/H200 8-GPU board in a two-socket server: one NVSwitch domain (T1), 4+4 NUMA (T2)."""
    gpus = []
    for i in range(8):
        numa = i // 4
        cpus = tuple(range(numa * cores_per_socket, (numa + 1) * cores_per_socket))
        gpus.append(GpuTopo(i, numa, 0, cpus))
    return NodeTopology(tuple(gpus))


def pcie_server(gpu_count: int, sockets: int = 2, cores_per_socket: int = 32) -> NodeTopology:
    """A PCIe server without NVLink bridges: no NVLink domain; GPUs split evenly over the sockets."""
    per = max(1, gpu_count // sockets)
    gpus = []
    for i in range(gpu_count):
        numa = min(i // per, sockets - 1)
        cpus = tuple(range(numa * cores_per_socket, (numa + 1) * cores_per_socket))
        gpus.append(GpuTopo(i, numa, None, cpus))
    return NodeTopology(tuple(gpus))


# Cores per socket where the catalog names the CPUs (catalog.json P3: 8480C 56 cores; P4: 8470 52 cores).
_CORES = {"hgx-h200-8": 56, "dell-xe9680-h100": 52}


@cache
def platform_topology(platform_key: str, gpu_count: int = 8, interconnect: str = "") -> NodeTopology:
    """The topology of a catalog platform. Every catalog platform is an HGX 8-GPU board (NVSwitch); a
    platform whose interconnect names no NVLink is a PCIe server."""
    if gpu_count == 8 and ("nvlink" in interconnect.lower() or not interconnect):
        return hgx_8gpu(_CORES.get(platform_key, 52))
    return pcie_server(gpu_count)
