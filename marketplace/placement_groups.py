"""Placement of whole-GPU groups (1, 2, 4 or 8 GPUs of one model on one node) for multi-GPU tiers.

Pure Python (no Django), like ``marketplace.placement`` (the MIG-slice engine); the service
``marketplace.services.groups`` builds :class:`NodeState` objects from the database, asks
:meth:`GroupFleet.choose` and reserves the chosen GPUs in its own transaction.

Rules (hard): a group's GPUs are *eligible* (MIG off, healthy, on a ready node, not held by anyone,
not dedicated to another tenant), on **one node**, inside **one NVLink domain** (a group of more than one
GPU needs NVLink peers: tensor parallelism over PCIe is not sold), and inside **one NUMA node** whenever
the group is not larger than that NUMA node (a 2- or 4-GPU group on an HGX board stays on one socket;
an 8-GPU group spans both). Topology comes from ``marketplace.hardware.topology`` (what NVML reports,
or the platform's table).

Policy ``"best"`` -- buddy-style, with a value function instead of strict buddy splitting:

* a node's GPUs are ordered by (NVLink domain, NUMA node, index), and a *block* of size s is an aligned
  run of s positions in that order (s = 1, 2, 4, 8), valid when all its GPUs are free and it obeys the
  rules above. On an HGX board the blocks are {0}..{7}, {0,1} {2,3} {4,5} {6,7}, {0-3} {4-7}, {0-7}:
  exactly the buddy system's blocks, and every 4-block is one NUMA node;
* the *value* of a node is ``sum over valid free blocks of s**2`` (large blocks weigh more than their
  GPU count: they are the shapes fragmentation kills, the same weighting as the slice engine's);
* every candidate set of GPUs (aligned blocks, and any other set that obeys the rules, which a strict
  buddy allocator would refuse) is scored by the value it destroys; the smallest loss wins, then the
  fullest node, then the lowest node id and GPU indexes.

Why not strict buddy: with releases in any order a strict buddy allocator refuses a 2-GPU group on a
node whose free GPUs are {1, 2} although they are NVLink peers on one socket; the value function takes
them (loss 2) and keeps an intact {4-7} block (loss 22) for a 4-GPU group. On the aligned blocks the
value function makes exactly the buddy choice (it splits the smallest free block that holds the
request), so small groups and GPUs opened for MIG slices fill broken blocks first and leave whole
4- and 8-GPU blocks to the shapes that need them. ``tests/bench/placement.py --groups`` measures it.

Policy ``"first_fit"`` (the benchmark's baseline): the lowest node id, then the lowest indexes that obey
the same hard rules.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cache
from itertools import combinations

from marketplace.hardware.geometry import geometry as _geometry
from marketplace.hardware.topology import NodeTopology, hgx_8gpu

BEST_FIT = "best"
FIRST_FIT = "first_fit"
GROUP_SIZES = (1, 2, 4, 8)

__all__ = [
    "GROUP_SIZES",
    "GroupDecision",
    "GroupFleet",
    "GroupNoCapacity",
    "GroupRequest",
    "NodeState",
    "group_no_capacity_summary",
    "group_placed_summary",
]


@dataclass
class NodeState:
    """A node as the database knows it. ``gpu_ids[i]``: the database id of the GPU with NVML index i, or
    None when that GPU may never take a group (MIG on, faulted, dedicated to another tenant).
    ``busy``: indexes already held by a whole GPU or a group."""

    node_id: int
    geometry: str
    gpu_ids: tuple[int | None, ...]
    busy: Iterable[int] = ()
    topology: NodeTopology = field(default_factory=hgx_8gpu)
    label: str = ""


@dataclass(frozen=True)
class GroupRequest:
    geometry: str
    tenant_id: int
    gpu_count: int


@dataclass(frozen=True)
class GroupDecision:
    node_id: int
    geometry: str
    indexes: tuple[int, ...]
    gpu_ids: tuple[int, ...]
    numa_nodes: tuple[int, ...]
    tenant_id: int
    candidates: int  # nodes that could have hosted the group
    reason: str  # operators only: node id, indexes, loss
    summary: str  # tenant-safe
    ok = True

    def __bool__(self) -> bool:
        return True


@dataclass(frozen=True)
class GroupNoCapacity:
    geometry: str
    gpu_count: int
    tenant_id: int
    reason: str
    summary: str
    ok = False

    def __bool__(self) -> bool:
        return False


def group_placed_summary(model_name: str, n: int) -> str:
    """Tenant-safe: what the tenant got, never an id or a fleet figure."""
    if n == 1:
        return f"a whole {model_name} GPU is reserved for you"
    return f"{n} whole {model_name} GPUs on one node, linked by NVLink, are reserved for you"


def group_no_capacity_summary(model_name: str, n: int) -> str:
    what = f"a whole {model_name} GPU" if n == 1 else f"{n} {model_name} GPUs on one node"
    return f"No capacity for {what} right now; try another tier or later"


# --------------------------------------------------------------------------------------------
# Per (topology, free mask) tables
# --------------------------------------------------------------------------------------------


@cache
def _order(topo: NodeTopology) -> tuple[int, ...]:
    """GPU indexes in block order: NVLink domain, NUMA node, index (no-NVLink GPUs last)."""
    return tuple(sorted((g.index for g in topo.gpus),
                        key=lambda i: (topo.gpus[i].nvlink_domain is None, topo.gpus[i].nvlink_domain or 0,
                                       topo.gpus[i].numa_node, i)))


def _legal(topo: NodeTopology, gpus: tuple[int, ...]) -> bool:
    """The hard rules for a set of GPUs of one node (freedom aside)."""
    if len(gpus) == 1:
        return True
    first = topo.gpus[gpus[0]]
    if first.nvlink_domain is None or any(topo.gpus[i].nvlink_domain != first.nvlink_domain for i in gpus):
        return False
    same_numa = all(topo.gpus[i].numa_node == first.numa_node for i in gpus)
    # inside one NUMA node whenever some NUMA node of the domain could hold the whole group
    fits_one = any(topo.numa_size(g.index) >= len(gpus) for g in topo.gpus if g.nvlink_domain == first.nvlink_domain)
    return same_numa or not fits_one


@cache
def _blocks(topo: NodeTopology) -> tuple[tuple[int, tuple[int, ...], int], ...]:
    """Every legal aligned block: (size, indexes, mask)."""
    order = _order(topo)
    out = []
    for s in GROUP_SIZES:
        for k in range(0, len(order) - s + 1, s):
            gpus = tuple(sorted(order[k:k + s]))
            if _legal(topo, gpus):
                out.append((s, gpus, _mask(gpus)))
    return tuple(out)


def _mask(indexes: Iterable[int]) -> int:
    m = 0
    for i in indexes:
        m |= 1 << i
    return m


@cache
def _value(topo: NodeTopology, free: int) -> int:
    return sum(s * s for s, _g, m in _blocks(topo) if free & m == m)


@cache
def _candidates(topo: NodeTopology, n: int) -> tuple[tuple[tuple[int, ...], int], ...]:
    """Every legal set of n GPUs of the node (indexes, mask), in first-fit order."""
    idx = range(len(topo.gpus))
    return tuple((c, _mask(c)) for c in combinations(idx, n) if _legal(topo, c))


@cache
def _best(topo: NodeTopology, free: int, n: int, first_fit: bool) -> tuple[int, tuple[int, ...]] | None:
    """(loss, indexes) of the best set of n free GPUs, or None."""
    before = _value(topo, free)
    best: tuple[int, tuple[int, ...]] | None = None
    for gpus, m in _candidates(topo, n):
        if free & m != m:
            continue
        if first_fit:
            return (0, gpus)
        loss = before - _value(topo, free & ~m)
        if best is None or loss < best[0]:
            best = (loss, gpus)
    return best


class _Node:
    __slots__ = ("busy", "eligible", "gpu_ids", "label", "node_id", "geometry", "topology")

    def __init__(self, s: NodeState) -> None:
        self.node_id = s.node_id
        self.geometry = s.geometry
        self.topology = s.topology
        self.gpu_ids = list(s.gpu_ids)
        self.eligible = _mask(i for i, g in enumerate(s.gpu_ids) if g is not None)
        self.busy = _mask(s.busy) & self.eligible
        self.label = s.label or f"node {s.node_id}"

    @property
    def free(self) -> int:
        return self.eligible & ~self.busy


class GroupFleet:
    """Whole-GPU groups on a fleet of nodes. ``choose`` records nothing; ``place`` records the decision."""

    def __init__(self, nodes: Iterable[NodeState] = (), policy: str = BEST_FIT) -> None:
        if policy not in (BEST_FIT, FIRST_FIT):
            raise ValueError(policy)
        self.policy = policy
        self._nodes: dict[int, _Node] = {}
        for s in nodes:
            self.add_node(s)

    def add_node(self, s: NodeState) -> None:
        self._nodes[s.node_id] = _Node(s)

    # ---- queries --------------------------------------------------------------------------

    def free_groups(self, geometry: str, n: int, cap: int | None = None) -> int:
        """How many groups of n GPUs could be placed now, one after another by this policy (what a tier of n
        GPUs still has), counting up to ``cap`` when given."""
        total = 0
        for node in self._nodes.values():
            if node.geometry != geometry:
                continue
            free = node.free
            while cap is None or total < cap:
                hit = _best(node.topology, free, n, self.policy == FIRST_FIT)
                if hit is None:
                    break
                free &= ~_mask(hit[1])
                total += 1
        return total

    def stranded(self, geometry: str | None = None) -> dict[int, int]:
        """Free GPUs that no free group of each size could use: ``{size: free GPUs outside every free
        legal set of that size}`` (the capacity a size has lost to fragmentation)."""
        out = {}
        for n in GROUP_SIZES:
            lost = 0
            for node in self._nodes.values():
                if geometry is not None and node.geometry != geometry:
                    continue
                free = node.free
                covered = 0
                for _g, m in _candidates(node.topology, n):
                    if free & m == m:
                        covered |= m
                lost += bin(free & ~covered).count("1")
            out[n] = lost
        return out

    def free_count(self, geometry: str | None = None) -> int:
        return sum(bin(n.free).count("1") for n in self._nodes.values()
                   if geometry is None or n.geometry == geometry)

    # ---- placing --------------------------------------------------------------------------

    def choose(self, request: GroupRequest) -> GroupDecision | GroupNoCapacity:
        n = request.gpu_count
        if n not in GROUP_SIZES:
            raise ValueError(f"a group is 1, 2, 4 or 8 GPUs, not {n}")
        first_fit = self.policy == FIRST_FIT
        best: tuple[tuple[int, int, int], _Node, tuple[int, ...]] | None = None
        candidates = 0
        for node in self._nodes.values():
            if node.geometry != request.geometry:
                continue
            free = node.free
            hit = _best(node.topology, free, n, first_fit)
            if hit is None:
                continue
            candidates += 1
            loss, gpus = hit
            key = (0, 0, node.node_id) if first_fit else (loss, bin(free).count("1"), node.node_id)
            if best is None or key < best[0]:
                best = (key, node, gpus)
        if best is None:
            model = _geometry(request.geometry).name
            reason = (f"no node has {n} free NVLink-connected whole {model} GPUs "
                      f"({self.free_count(request.geometry)} free whole GPUs of the model)")
            return GroupNoCapacity(request.geometry, n, request.tenant_id, reason,
                                   group_no_capacity_summary(model, n))
        (loss, _free, _nid), node, gpus = best
        topo = node.topology
        numa = tuple(sorted({topo.gpus[i].numa_node for i in gpus}))
        how = "first fit" if first_fit else f"fragmentation cost {loss}"
        reason = (f"{node.label}: GPUs {','.join(map(str, gpus))} (NUMA {','.join(map(str, numa))}); {how}; "
                  f"{candidates - 1} other candidate node{'s' if candidates != 2 else ''}")
        ids = tuple(node.gpu_ids[i] for i in gpus)
        assert all(g is not None for g in ids)
        return GroupDecision(node.node_id, request.geometry, gpus, ids, numa, request.tenant_id,  # type: ignore[arg-type]
                             candidates, reason, group_placed_summary(_geometry(request.geometry).name, n))

    def place(self, request: GroupRequest) -> GroupDecision | GroupNoCapacity:
        d = self.choose(request)
        if isinstance(d, GroupDecision):
            self.hold(d.node_id, d.indexes)
        return d

    def hold(self, node_id: int, indexes: Iterable[int]) -> None:
        node = self._nodes[node_id]
        m = _mask(indexes)
        if node.free & m != m:
            raise ValueError(f"node {node_id}: GPUs {sorted(indexes)} are not all free")
        node.busy |= m

    def release(self, node_id: int, indexes: Iterable[int]) -> None:
        node = self._nodes[node_id]
        node.busy &= ~_mask(indexes)
