"""GPU topology: the simulated NVML answers the topology calls as an HGX H100/H200 8-GPU board in a two-socket
server does, and NvmlClient.topology() reads it back through pynvml names only.

The table below is written from NVIDIA's public documentation (sources T1-T6 in marketplace/hardware/topology.py):
NVSwitch all-to-all with 18 NVLinks per GPU (NVLink/NVSwitch product text, HGX NVSwitch platform list), GPUs 0-3
on socket 0 and 4-7 on socket 1 (``nvidia-smi topo -m`` on a DGX H100: NUMA affinity 0 / 1, CPU affinity
0-51 / 52-103), nvmlGpuTopologyLevel_t and nvmlGpuP2PStatus_t values from the NVML API reference.
"""

from __future__ import annotations

import pynvml
import pytest

from marketplace.hardware.nvml import NvmlClient
from marketplace.hardware.nvml_sim import SimNvml
from marketplace.hardware.topology import cpus_of_mask, hgx_8gpu, platform_topology

NODE, SYSTEM, OK, NOT_SUPPORTED = 40, 50, 0, 5
SOCKET_OF = {i: 0 if i < 4 else 1 for i in range(8)}  # T2
CPUS_OF_SOCKET = {0: tuple(range(0, 52)), 1: tuple(range(52, 104))}  # T2 (DGX H100, 52-core sockets)


@pytest.fixture
def nv():
    sim = SimNvml(fleet="h100-sxm-80gb*8", node="topo-test")
    sim.nvmlInit()
    yield sim
    sim.nvmlShutdown()


def test_hgx_common_ancestor_and_p2p_match_the_table(nv):
    h = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(8)]
    for i in range(8):
        for j in range(8):
            if i == j:
                continue
            want = NODE if SOCKET_OF[i] == SOCKET_OF[j] else SYSTEM  # T3
            assert nv.nvmlDeviceGetTopologyCommonAncestor(h[i], h[j]) == want, (i, j)
            assert nv.nvmlDeviceGetP2PStatus(h[i], h[j], pynvml.NVML_P2P_CAPS_INDEX_NVLINK) == OK  # T1/T4: NVSwitch


def test_hgx_nvlinks_affinity_and_numa_match_the_table(nv):
    for i in range(8):
        h = nv.nvmlDeviceGetHandleByIndex(i)
        assert [nv.nvmlDeviceGetNvLinkState(h, link) for link in range(18)] == [1] * 18  # T6
        with pytest.raises(pynvml.NVMLError_NotSupported):
            nv.nvmlDeviceGetNvLinkState(h, 18)
        assert cpus_of_mask(nv.nvmlDeviceGetCpuAffinity(h, 2)) == CPUS_OF_SOCKET[SOCKET_OF[i]]  # T5
        assert nv.nvmlDeviceGetMemoryAffinity(h, 1, pynvml.NVML_AFFINITY_SCOPE_NODE) == [1 << SOCKET_OF[i]]
        with pytest.raises(pynvml.NVMLError_NotSupported):
            nv.nvmlDeviceGetNumaNodeId(h)  # the GPU is not a NUMA node on x86 HGX


def test_a_server_without_nvlink_has_no_peers():
    sim = SimNvml(fleet="h100-sxm-80gb*2", node="pcie")
    sim.nvmlInit()
    a, b = sim.nvmlDeviceGetHandleByIndex(0), sim.nvmlDeviceGetHandleByIndex(1)
    assert sim.nvmlDeviceGetP2PStatus(a, b, pynvml.NVML_P2P_CAPS_INDEX_NVLINK) == NOT_SUPPORTED
    with pytest.raises(pynvml.NVMLError_NotSupported):
        sim.nvmlDeviceGetNvLinkState(a, 0)


def test_the_client_reads_back_the_platform_topology(nv):
    with NvmlClient(nv) as c:
        topo = c.topology(cpu_words=2)
    assert topo == hgx_8gpu() == platform_topology("hgx-h100-8", 8, "NVLink 4 through NVSwitch")
    assert topo.numa_cpus([0, 1]) == CPUS_OF_SOCKET[0] and topo.numa_cpus([6, 7]) == CPUS_OF_SOCKET[1]


def test_real_nvml_reports_a_topology_when_a_gpu_is_lent():
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pytest.skip("no NVIDIA driver here: the real NVML probe runs only on a GPU machine")
    try:
        with NvmlClient(pynvml) as c:
            topo = c.topology()
    finally:
        pynvml.nvmlShutdown()
    assert len(topo.gpus) >= 1 and all(g.cpus for g in topo.gpus)
