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
  domain, NOT_SUPPORTED (5) otherwise (``nvmlGpuP2PStatus_t``). The simulator answers READ/WRITE the same way
  (P2P over NVLink); what a PCIe-only pair answers depends on the chipset, so it says NOT_SUPPORTED.
* T5 -- affinity (NVML API reference, "CPU and Memory Affinity",
  https://docs.nvidia.com/deploy/nvml-api/api/group__nvmlAffinity.html): ``nvmlDeviceGetCpuAffinity(device,
  cpuSetSize)`` fills ``cpuSetSize`` unsigned longs with a bitmask of the ideal CPUs, 64 per element (CPUs 0, 1, 32
  and 33 with cpuSetSize 2 on 32-bit: result[0] = 0x3, result[1] = 0x3); ``nvmlDeviceGetMemoryAffinity(device,
  nodeSetSize, scope)`` a bitmask of the ideal NUMA nodes (scope NVML_AFFINITY_SCOPE_NODE 0 / _SOCKET 1).
  ``nvmlDeviceGetNumaNodeId`` "only applies to platforms where the GPUs are NUMA nodes" (cuda-python's NVML
  binding docs): on these x86 HGX servers it is not supported, so the NUMA node comes from the memory affinity.
* T6 -- NVLink links: ``nvmlDeviceGetNvLinkState(device, link)`` is 1 (NVML_FEATURE_ENABLED) for each of the 18
  links of an H100/H200 SXM on NVSwitch (T1); links past 17 (up to NVML_NVLINK_MAX_LINKS) are not supported.
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

    def common_ancestor(self, a: int, b: int) -> int:
        """What nvmlDeviceGetTopologyCommonAncestor answers for GPUs a and b (T3)."""
        if a == b:
            return TOPOLOGY_INTERNAL
        return TOPOLOGY_NODE if self.gpus[a].numa_node == self.gpus[b].numa_node else TOPOLOGY_SYSTEM

    def nvlink_peers(self, a: int, b: int) -> bool:
        da, db = self.gpus[a].nvlink_domain, self.gpus[b].nvlink_domain
        return a != b and da is not None and da == db

    def p2p_status(self, a: int, b: int) -> int:
        """nvmlDeviceGetP2PStatus(a, b, NVML_P2P_CAPS_INDEX_NVLINK) (T4)."""
        return P2P_STATUS_OK if self.nvlink_peers(a, b) else P2P_STATUS_NOT_SUPPORTED

    def numa_cpus(self, indexes: tuple[int, ...] | list[int]) -> tuple[int, ...]:
        """The CPU cores local to a group's GPUs (its server's cpuset): the union of their NUMA nodes'."""
        out: set[int] = set()
        for i in indexes:
            out.update(self.gpus[i].cpus)
        return tuple(sorted(out))


def cpu_mask(cpus: tuple[int, ...], size: int) -> list[int]:
    """A CPU set as nvmlDeviceGetCpuAffinity returns it: ``size`` 64-bit words, CPU i in word i // 64 (T5)."""
    words = [0] * size
    for c in cpus:
        if c // 64 < size:
            words[c // 64] |= 1 << (c % 64)
    return words


def cpus_of_mask(words: list[int] | tuple[int, ...]) -> tuple[int, ...]:
    return tuple(w * 64 + b for w, word in enumerate(words) for b in range(64) if int(word) >> b & 1)


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
