"""Placement engine: which GPU, and which MIG start slot, gets a new GPU instance.

Pure Python (no Django). The Django services build :class:`GpuState` objects from the database,
load them into a :class:`Fleet`, ask :meth:`Fleet.place` (or :meth:`Fleet.choose`, which records
nothing) and persist the :class:`Decision` inside their own transaction.

Geometry (``marketplace.hardware.geometry``, NVIDIA MIG User Guide): 8 memory slices, 7 compute
slices; a GPU instance is a placement ``(start, size)`` in memory slices. A set of instances is
valid iff (1) every start is in its profile's start list, (2) no two instances share a memory slice,
(3) no profile exceeds its max count (at most one ``+me``). Compute slices (<= 7) are checked too,
although for H100/H200 rules 1-3 already imply it.

Policy ``"best"`` (the default), for a request of profile *p*:

* the *placeability value* of a GPU state is ``sum_q w(q) * free(q)`` over the profiles *q*, where
  ``free(q)`` is how many more *q* instances the GPU could take on its own (free non-overlapping
  starts, capped by the max count and by the free compute slices) and ``w(q) = memory_slices**2``
  (big profiles are the ones fragmentation kills, so they weigh more than linearly);
* every legal (GPU, start) is scored by the value it destroys (``value before - value after``);
  the smallest loss wins, then the fullest GPU (best fit), then the lowest start, then the lowest
  GPU id. Putting anything on an empty GPU destroys its 7g placement, so partly used GPUs are
  always preferred; on an empty H100 a 1g.10gb goes to start 6 (keeping 4g@0, 3g@0 and 2g@0/2/4),
  as the driver's own automatic placement does;
* tenancy: a GPU dedicated to a tenant never receives another tenant's instance; a dedicated
  request goes to a GPU already dedicated to that tenant with room, else to an empty shared GPU,
  which becomes dedicated to it (until it is empty again, unless the dedication is sticky); a
  whole-GPU request needs an empty GPU.

Two texts per answer: ``reason`` is the operator's diagnostic (GPU and node ids, fill, candidates,
fleet size, GPUs dedicated to other tenants) and must never reach a tenant; ``summary`` is what the
tenant may read: its own request and outcome only, no id, no fleet figure, no other tenant.

Policy ``"first_fit"`` is the baseline for the benchmark: the lowest GPU id that may legally host
the request (same tenancy rules), at its first legal start.

Whole-GPU groups of multi-GPU tiers (and whole GPUs of tiers that are not dedicated) are placed by
``marketplace.placement_groups`` (one node, one NVLink domain, NUMA-aware, buddy-style blocks).

Speed: GPUs are kept in buckets by (geometry, dedicated tenant, occupancy state) where the state is
(memory-slice bitmask, compute slices used, counts of count-limited profiles); every
(state, profile) pair has its best start, loss and rank precomputed, so a placement costs
O(number of distinct states), never O(number of GPUs).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import cache
from typing import NamedTuple

from marketplace.hardware.geometry import GpuGeometry, geometry

__all__ = [
    "BEST_FIT",
    "FIRST_FIT",
    "POLICIES",
    "WHOLE_GPU",
    "Decision",
    "Fleet",
    "GpuState",
    "Instance",
    "NoCapacity",
    "Released",
    "Request",
    "layout_problems",
    "legal_starts",
    "no_capacity_summary",
    "placed_summary",
    "valid_layout",
]

BEST_FIT = "best"
FIRST_FIT = "first_fit"
POLICIES = (BEST_FIT, FIRST_FIT)

#: ``profile_id`` used for a whole GPU (all memory and compute slices, nothing else on it).
WHOLE_GPU = None


# --------------------------------------------------------------------------------------------
# Plain data in and out
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Instance:
    """One GPU instance on a GPU: its profile id (``None`` = the whole GPU), start and tenant."""

    profile_id: int | None
    start: int
    tenant_id: int


@dataclass
class GpuState:
    """A GPU as the database knows it. ``instances`` holds :class:`Instance` objects or plain
    ``(profile_id, start, tenant_id)`` tuples. ``dedicated_tenant_id``: the GPU is dedicated to
    that tenant; ``dedication_sticky``: the dedication outlives the GPU's last instance (an
    operator's reservation) instead of ending when the GPU is empty (the engine's own dedication)."""

    gpu_id: int
    geometry: str
    node_id: int
    instances: Iterable[Instance | tuple[int | None, int, int]] = ()
    dedicated_tenant_id: int | None = None
    dedication_sticky: bool = False
    label: str = ""  # how people name this GPU (models.Gpu.label); empty: "GPU <id> (node <id>)"


@dataclass(frozen=True)
class Request:
    """``profile_id`` (the GPU-instance profile id, e.g. 19 for 1g.10gb/1g.18gb) or
    ``whole_gpu=True``; ``dedicated``: the tenant wants GPUs no other tenant shares."""

    geometry: str
    tenant_id: int
    profile_id: int | None = None
    whole_gpu: bool = False
    dedicated: bool = False


@dataclass(frozen=True)
class Decision:
    gpu_id: int
    node_id: int
    geometry: str
    profile_id: int | None  # None for a whole GPU
    start: int
    size: int  # memory slices
    tenant_id: int
    dedicated: bool  # the GPU is dedicated to this tenant (after this placement)
    newly_dedicated: bool  # this placement made the GPU dedicated to the tenant
    candidates: int  # GPUs that could have hosted the request (including this one)
    reason: str  # operators only: names GPU and node ids and fleet figures
    summary: str = ""  # tenant-safe: the request and its outcome, nothing about the fleet
    ok = True

    def __bool__(self) -> bool:
        return True


@dataclass(frozen=True)
class NoCapacity:
    geometry: str
    profile_id: int | None
    tenant_id: int
    dedicated: bool
    gpus_of_model: int
    dedicated_to_others: int
    reason: str  # operators only: fleet size, GPUs dedicated to other tenants, the tenant's id
    summary: str = ""  # tenant-safe: what was asked for and what to try, nothing about the fleet
    ok = False

    def __bool__(self) -> bool:
        return False


@dataclass(frozen=True)
class Released:
    gpu_id: int
    instance: Instance
    dedication_ended: bool  # the GPU went back to the shared pool


def placed_summary(model_name: str, profile_name: str | None, dedicated: bool) -> str:
    """The tenant-safe account of a placement: what the tenant got, on which kind of GPU.
    ``profile_name`` None: a whole GPU. Never an id, a count or another tenant."""
    if profile_name is None:
        return f"a whole {model_name} GPU is reserved for you"
    kind = "dedicated (no other tenant shares it)" if dedicated else "shared"
    return f"{profile_name} slice placed on a {kind} {model_name} GPU"


def no_capacity_summary(model_name: str, profile_name: str | None, dedicated: bool) -> str:
    """The tenant-safe refusal: what was asked for and what to try. It says the same whether the
    fleet has no GPU of the model, all of them are full or other tenants hold them."""
    what = f"a whole {model_name} GPU" if profile_name is None else f"{model_name} {profile_name}"
    if dedicated:
        return (f"No capacity for {what} right now: no room on your dedicated GPUs and no free GPU to "
                f"dedicate; try another tier or later")
    return f"No capacity for {what} right now; try another tier or later"


# --------------------------------------------------------------------------------------------
# Per-geometry tables (computed once per geometry key)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Shape:
    pid: int | None
    name: str
    size: int
    compute: int
    max_count: int
    masks: tuple[tuple[int, int], ...]  # (start, mask) in start order


def _weight(shape: _Shape) -> int:
    return shape.size * shape.size


class _Key(NamedTuple):
    """One occupancy state: the memory-slice mask, compute slices used, counts of binding profiles."""

    mask: int
    compute: int
    counts: tuple[int, ...]


class _Choice(NamedTuple):
    """The best start of a profile in a state and the rank of that (state, start) across all states."""

    rank: int
    start: int


class _Slot(NamedTuple):
    """A state and the start at which a profile goes into it (an entry of :attr:`_Tables.order`)."""

    sid: int
    start: int


def _shapes(geo: GpuGeometry) -> dict[int | None, _Shape]:
    """Every GPU-instance profile of ``geo`` as a :class:`_Shape`, plus the whole GPU."""
    shapes: dict[int | None, _Shape] = {}
    for p in geo.profiles:
        masks = tuple((s, ((1 << p.memory_slices) - 1) << s) for s in sorted(p.starts))
        shapes[p.profile_id] = _Shape(p.profile_id, p.name, p.memory_slices, p.compute_slices, p.max_count, masks)
    full = (1 << geo.memory_slices) - 1
    shapes[WHOLE_GPU] = _Shape(WHOLE_GPU, "whole GPU", geo.memory_slices, geo.compute_slices, 1, ((0, full),))
    return shapes


_Hit = tuple[int, int, int, bool]  # (state, gpu id, start, _) found by Fleet._find


class _Tables:
    """Occupancy states of one geometry and everything precomputed on them.

    States are interned as ints (``sid``); every per-state table is a list indexed by sid.
    """

    def __init__(self, geo: GpuGeometry) -> None:
        self.geo = geo
        self.n_mem = geo.memory_slices
        self.n_compute = geo.compute_slices
        self.shapes = _shapes(geo)
        self.mig_shapes = [s for pid, s in self.shapes.items() if pid is not WHOLE_GPU]
        # Profiles whose max count is below their number of starts: the mask alone cannot tell
        # whether another one fits, so their counts are part of the state.
        self.binding = [s.pid for s in self.mig_shapes if s.max_count < len(s.masks)]
        self.binding_index = {pid: i for i, pid in enumerate(self.binding)}

        self.state_key: list[_Key] = []
        self.state_id: dict[_Key, int] = {}
        self.add: list[dict[tuple[int | None, int], int]] = []  # sid -> {(pid, start): new sid}
        self.empty = self._intern(_Key(0, 0, (0,) * len(self.binding)))
        self._enumerate_states()
        n = len(self.state_key)
        self.used = [bin(self.state_key[s].mask).count("1") for s in range(n)]
        self.value = [self._value(s) for s in range(n)]

        self.starts: list[dict[int | None, tuple[int, ...]]] = []  # sid -> pid -> legal starts, sorted
        self.first: list[dict[int | None, int]] = []  # sid -> pid -> first legal start
        self._legal_starts()
        self.best: list[dict[int | None, _Choice]] = [{} for _ in range(n)]  # sid -> pid -> best start
        self.loss: list[dict[int | None, int]] = [{} for _ in range(n)]  # sid -> pid -> value lost by it
        self.order: dict[int | None, list[_Slot]] = {}  # pid -> every (sid, start), best first
        for pid in self.shapes:
            self._rank_profile(pid)
        self.hostable = [frozenset(self.starts[s]) for s in range(n)]

        self.largest = self._largest_placeable()
        self.frag_shape = self._fragmentation_shape()
        self.free_slices = [self.n_mem - self.used[s] for s in range(n)]
        self.stranded = [self._stranded(s) for s in range(n)]

    def _enumerate_states(self) -> None:
        """Every state reachable from the empty GPU (breadth first), filling :attr:`add`."""
        frontier = [self.empty]
        while frontier:
            nxt = []
            for sid in frontier:
                for key, pid, start in self._successors(self.state_key[sid]):
                    known = key in self.state_id
                    new = self._intern(key)
                    self.add[sid][(pid, start)] = new
                    if not known:
                        nxt.append(new)
            frontier = nxt

    def _successors(self, key: _Key) -> Iterator[tuple[_Key, int | None, int]]:
        """``(next state, profile id, start)`` for every instance that fits into ``key``."""
        mask, comp, counts = key
        for shape in self.shapes.values():
            bi = self.binding_index.get(shape.pid)
            if bi is not None and counts[bi] >= shape.max_count:
                continue
            if comp + shape.compute > self.n_compute:
                continue
            nc = counts if bi is None else counts[:bi] + (counts[bi] + 1,) + counts[bi + 1 :]
            for start, m in shape.masks:
                if not mask & m:
                    yield _Key(mask | m, comp + shape.compute, nc), shape.pid, start

    def _legal_starts(self) -> None:
        """:attr:`starts` and :attr:`first` from :attr:`add`."""
        for transitions in self.add:
            st: dict[int | None, list[int]] = {}
            for pid, start in transitions:
                st.setdefault(pid, []).append(start)
            starts = {pid: tuple(sorted(v)) for pid, v in st.items()}
            self.starts.append(starts)
            self.first.append({pid: v[0] for pid, v in starts.items()})

    def _rank_profile(self, pid: int | None) -> None:
        """For one profile: its best start in each state (least value lost), and all states ranked by
        that loss, fullest first on ties (:attr:`best`, :attr:`loss`, :attr:`order`)."""
        cands: list[tuple[int, int, int, int]] = []  # (loss, -used, start, sid): the sort order
        for sid, starts in enumerate(self.starts):
            legal = starts.get(pid)
            if not legal:
                continue
            loss, start = min((self.value[sid] - self.value[self.add[sid][(pid, s)]], s) for s in legal)
            self.loss[sid][pid] = loss
            cands.append((loss, -self.used[sid], start, sid))
        cands.sort()
        self.order[pid] = [_Slot(sid, start) for _l, _u, start, sid in cands]
        for rank, (sid, start) in enumerate(self.order[pid]):
            self.best[sid][pid] = _Choice(rank, start)

    def _largest_placeable(self) -> list[str | None]:
        """Per state, the name of the largest profile that still fits (for the human-readable reasons)."""
        by_size = sorted(self.mig_shapes, key=lambda s: (s.size, s.compute), reverse=True)
        return [next((s.name for s in by_size if s.pid in starts), None) for starts in self.starts]

    def _fragmentation_shape(self) -> _Shape:
        """The profile whose free placements define fragmentation: the 3g one (else the largest)."""
        three = [s for s in self.mig_shapes if s.compute == 3 and not s.name.endswith("+me")]
        return three[0] if three else max(self.mig_shapes, key=lambda s: s.size)

    def _stranded(self, sid: int) -> int:
        """Free memory slices of a state not covered by a free placement of :attr:`frag_shape`."""
        masks = dict(self.frag_shape.masks)
        covered = 0
        for start in self.starts[sid].get(self.frag_shape.pid, ()):
            covered |= masks[start]
        free = ~self.state_key[sid].mask & ((1 << self.n_mem) - 1)
        return bin(free & ~covered).count("1")

    def _intern(self, key: _Key) -> int:
        sid = self.state_id.get(key)
        if sid is None:
            sid = len(self.state_key)
            self.state_id[key] = sid
            self.state_key.append(key)
            self.add.append({})
        return sid

    def _value(self, sid: int) -> int:
        mask, comp, counts = self.state_key[sid]
        total = 0
        for shape in self.mig_shapes:
            free = sum(1 for _s, m in shape.masks if not mask & m)
            bi = self.binding_index.get(shape.pid)
            if bi is not None:
                free = min(free, shape.max_count - counts[bi])
            free = min(free, (self.n_compute - comp) // shape.compute)
            total += _weight(shape) * free
        return total

    def remove(self, sid: int, pid: int | None, start: int) -> int:
        mask, comp, counts = self.state_key[sid]
        shape = self.shapes[pid]
        m = dict(shape.masks)[start]
        bi = self.binding_index.get(pid)
        nc = counts if bi is None else counts[:bi] + (counts[bi] - 1,) + counts[bi + 1 :]
        return self.state_id[_Key(mask & ~m, comp - shape.compute, nc)]

    def shape(self, pid: int | None) -> _Shape:
        try:
            return self.shapes[pid]
        except KeyError:
            raise ValueError(f"{self.geo.name} has no GPU-instance profile id {pid!r}") from None


@cache
def _tables(geometry_key: str) -> _Tables:
    try:
        geo = geometry(geometry_key)
    except KeyError:
        raise ValueError(f"unknown GPU geometry {geometry_key!r}") from None
    return _Tables(geo)


# --------------------------------------------------------------------------------------------
# Validity rules (pure functions)
# --------------------------------------------------------------------------------------------


def layout_problems(geometry_key: str, placements: Iterable[tuple[int | None, int]]) -> list[str]:
    """Every broken rule in a layout given as ``(profile_id, start)`` pairs (empty list = valid)."""
    t = _tables(geometry_key)
    problems: list[str] = []
    occupied = 0
    compute = 0
    counts: dict[int | None, int] = {}
    for pid, start in placements:
        shape = t.shapes.get(pid)
        if shape is None:
            problems.append(f"unknown profile id {pid!r}")
            continue
        masks = dict(shape.masks)
        if start not in masks:
            problems.append(f"{shape.name} cannot start at slot {start} (starts {sorted(masks)})")
            continue
        if occupied & masks[start]:
            problems.append(f"{shape.name}@{start} overlaps another instance's memory slices")
        occupied |= masks[start]
        compute += shape.compute
        counts[pid] = counts.get(pid, 0) + 1
    for pid, c in counts.items():
        shape = t.shapes[pid]
        if c > shape.max_count:
            problems.append(f"{c} x {shape.name} exceeds its max count {shape.max_count}")
    if compute > t.n_compute:
        problems.append(f"{compute} compute slices exceed {t.n_compute}")
    return problems


def valid_layout(geometry_key: str, placements: Iterable[tuple[int | None, int]]) -> bool:
    """True iff every start is legal, no two instances share a memory slice and no profile exceeds
    its max count (and compute slices fit, which the first three imply on H100/H200)."""
    return not layout_problems(geometry_key, placements)


def legal_starts(geometry_key: str, placements: Iterable[tuple[int | None, int]], profile_id: int | None) -> list[int]:
    """Starts at which ``profile_id`` could be added to a valid layout."""
    placements = list(placements)
    t = _tables(geometry_key)
    return [s for s, _m in t.shape(profile_id).masks if valid_layout(geometry_key, [*placements, (profile_id, s)])]


# --------------------------------------------------------------------------------------------
# The fleet and its indexes
# --------------------------------------------------------------------------------------------


def _profile_of(request: Request) -> int | None:
    """The request's profile id (:data:`WHOLE_GPU` for a whole GPU); ValueError if it asks for both or neither."""
    if request.whole_gpu:
        if request.profile_id is not None:
            raise ValueError("a request is either whole_gpu or a profile_id, not both")
        return WHOLE_GPU
    if request.profile_id is None:
        raise ValueError("a request needs a profile_id or whole_gpu=True")
    return request.profile_id


class _Bucket:
    """GPU ids in one (pool, state); ``peek`` returns the lowest id (lazy-deletion heap)."""

    __slots__ = ("members", "heap")

    def __init__(self) -> None:
        self.members: set[int] = set()
        self.heap: list[int] = []

    def add(self, gpu_id: int) -> None:
        self.members.add(gpu_id)
        heapq.heappush(self.heap, gpu_id)
        if len(self.heap) > 2 * len(self.members) + 16:
            self.heap = sorted(self.members)

    def discard(self, gpu_id: int) -> None:
        self.members.discard(gpu_id)

    def peek(self) -> int:
        heap, members = self.heap, self.members
        while heap[0] not in members:
            heapq.heappop(heap)
        return heap[0]


class _Pool:
    """The GPUs of one geometry that are shared (owner None) or dedicated to one tenant."""

    __slots__ = ("buckets", "hostable", "size")

    def __init__(self) -> None:
        self.buckets: dict[int, _Bucket] = {}  # non-empty buckets only
        self.hostable: dict[int | None, int] = {}  # pid -> GPUs whose state can host it
        self.size = 0

    def add(self, t: _Tables, sid: int, gpu_id: int) -> None:
        b = self.buckets.get(sid)
        if b is None:
            b = self.buckets[sid] = _Bucket()
        b.add(gpu_id)
        h = self.hostable
        for pid in t.hostable[sid]:
            h[pid] = h.get(pid, 0) + 1
        self.size += 1

    def remove(self, t: _Tables, sid: int, gpu_id: int) -> None:
        b = self.buckets[sid]
        b.discard(gpu_id)
        if not b.members:
            del self.buckets[sid]
        h = self.hostable
        for pid in t.hostable[sid]:
            h[pid] -= 1
        self.size -= 1


@dataclass(eq=False)
class _Gpu:
    gpu_id: int
    geometry: str
    node_id: int
    owner: int | None
    sticky: bool
    state: int
    instances: dict[int, Instance] = field(default_factory=dict)  # start -> instance
    label: str = ""

    @property
    def name(self) -> str:
        return self.label or f"GPU {self.gpu_id} (node {self.node_id})"


class Fleet:
    """GPUs, what is on them, and the placement indexes. Not thread-safe; build one per request
    (from the database) or guard it with a lock."""

    def __init__(self, gpus: Iterable[GpuState] = (), policy: str = BEST_FIT) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose one of {POLICIES}")
        self.policy = policy
        self._gpus: dict[int, _Gpu] = {}
        self._pools: dict[tuple[str, int | None], _Pool] = {}
        self._model_count: dict[str, int] = {}
        self._model_dedicated: dict[str, int] = {}
        for g in gpus:
            self.add_gpu(g)

    # ---- building -------------------------------------------------------------------------

    def add_gpu(self, gpu: GpuState) -> None:
        """Add a GPU with its current instances; raises ValueError on an invalid layout or on a
        dedicated GPU that holds another tenant's instance."""
        if gpu.gpu_id in self._gpus:
            raise ValueError(f"GPU {gpu.gpu_id} is already in the fleet")
        t = _tables(gpu.geometry)
        insts = [i if isinstance(i, Instance) else Instance(*i) for i in gpu.instances]
        problems = layout_problems(gpu.geometry, [(i.profile_id, i.start) for i in insts])
        if problems:
            raise ValueError(f"GPU {gpu.gpu_id}: invalid layout: {'; '.join(problems)}")
        owner = gpu.dedicated_tenant_id
        if owner is not None:
            strangers = sorted({i.tenant_id for i in insts if i.tenant_id != owner})
            if strangers:
                raise ValueError(f"GPU {gpu.gpu_id} is dedicated to tenant {owner} but hosts tenants {strangers}")
            if not insts and not gpu.dedication_sticky:
                owner = None  # an engine dedication ends when the GPU is empty
        sid = t.empty
        for i in insts:
            sid = t.add[sid][(i.profile_id, i.start)]
        g = _Gpu(gpu.gpu_id, gpu.geometry, gpu.node_id, owner, gpu.dedication_sticky, sid)
        g.instances = {i.start: i for i in insts}
        g.label = gpu.label
        self._gpus[gpu.gpu_id] = g
        self._pool(gpu.geometry, owner).add(t, sid, gpu.gpu_id)
        self._model_count[gpu.geometry] = self._model_count.get(gpu.geometry, 0) + 1
        if owner is not None:
            self._model_dedicated[gpu.geometry] = self._model_dedicated.get(gpu.geometry, 0) + 1

    def remove_gpu(self, gpu_id: int) -> GpuState:
        """Take a GPU out of the fleet (drain, failure); returns its last state."""
        snap = self.snapshot(gpu_id)
        g = self._gpus.pop(gpu_id)
        self._pools[(g.geometry, g.owner)].remove(_tables(g.geometry), g.state, gpu_id)
        self._model_count[g.geometry] -= 1
        if g.owner is not None:
            self._model_dedicated[g.geometry] -= 1
        return snap

    def dedicate(self, gpu_id: int, tenant_id: int | None, sticky: bool = True) -> None:
        """Dedicate a GPU to a tenant (``None``: back to the shared pool)."""
        g = self._gpus[gpu_id]
        if tenant_id is not None and any(i.tenant_id != tenant_id for i in g.instances.values()):
            raise ValueError(f"GPU {gpu_id} hosts other tenants' instances")
        self._set_owner(g, tenant_id)
        g.sticky = sticky and tenant_id is not None

    def _pool(self, geometry_key: str, owner: int | None) -> _Pool:
        key = (geometry_key, owner)
        p = self._pools.get(key)
        if p is None:
            p = self._pools[key] = _Pool()
        return p

    def _set_owner(self, g: _Gpu, owner: int | None) -> None:
        if owner == g.owner:
            return
        t = _tables(g.geometry)
        self._pools[(g.geometry, g.owner)].remove(t, g.state, g.gpu_id)
        if g.owner is not None and not self._pools[(g.geometry, g.owner)].size:
            del self._pools[(g.geometry, g.owner)]
        d = (owner is not None) - (g.owner is not None)
        self._model_dedicated[g.geometry] = self._model_dedicated.get(g.geometry, 0) + d
        g.owner = owner
        self._pool(g.geometry, owner).add(t, g.state, g.gpu_id)

    # ---- queries --------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._gpus)

    def __contains__(self, gpu_id: object) -> bool:
        return gpu_id in self._gpus

    def gpu_ids(self) -> list[int]:
        return sorted(self._gpus)

    def snapshot(self, gpu_id: int) -> GpuState:
        g = self._gpus[gpu_id]
        return GpuState(
            g.gpu_id,
            g.geometry,
            g.node_id,
            tuple(g.instances[s] for s in sorted(g.instances)),
            g.owner,
            g.sticky,
        )

    def states(self) -> Iterator[GpuState]:
        for gpu_id in sorted(self._gpus):
            yield self.snapshot(gpu_id)

    def instances(self, gpu_id: int) -> list[Instance]:
        g = self._gpus[gpu_id]
        return [g.instances[s] for s in sorted(g.instances)]

    def dedicated_tenant(self, gpu_id: int) -> int | None:
        return self._gpus[gpu_id].owner

    def used_mask(self, gpu_id: int) -> int:
        """Bit i set = memory slice i is taken."""
        g = self._gpus[gpu_id]
        return _tables(g.geometry).state_key[g.state][0]

    def free_mask(self, gpu_id: int) -> int:
        """Bit i set = memory slice i is free."""
        g = self._gpus[gpu_id]
        t = _tables(g.geometry)
        return ~t.state_key[g.state][0] & ((1 << t.n_mem) - 1)

    def compute_used(self, gpu_id: int) -> int:
        g = self._gpus[gpu_id]
        return _tables(g.geometry).state_key[g.state][1]

    def free_starts(self, gpu_id: int, profile_id: int | None) -> tuple[int, ...]:
        """Starts where ``profile_id`` could be created now (geometry rules only)."""
        g = self._gpus[gpu_id]
        t = _tables(g.geometry)
        t.shape(profile_id)
        return t.starts[g.state].get(profile_id, ())

    def free_places(self, request: Request) -> int:
        """How many (GPU, start) places could take ``request`` now, by :meth:`choose`'s tenancy rule: the
        GPUs dedicated to the tenant, and the shared ones (for a dedicated request only the empty ones);
        never a GPU dedicated to another tenant. Counted per occupancy state, not per GPU."""
        t = _tables(request.geometry)
        pid = _profile_of(request)
        t.shape(pid)
        own = self._pools.get((request.geometry, request.tenant_id))
        shared = self._pools.get((request.geometry, None))
        buckets = list(own.buckets.items()) if own is not None else []
        if shared is not None:
            if not request.dedicated:
                buckets += shared.buckets.items()
            elif t.empty in shared.buckets:
                buckets.append((t.empty, shared.buckets[t.empty]))
        return sum(len(b.members) * len(t.starts[sid].get(pid, ())) for sid, b in buckets)

    def can_place(self, gpu_id: int, profile_id: int | None, start: int) -> bool:
        """Pure validity check by the MIG rules (start list, no shared slice, max counts, compute);
        tenancy is not considered."""
        g = self._gpus[gpu_id]
        t = _tables(g.geometry)
        return start in t.starts[g.state].get(profile_id, ())

    def fragmentation(self) -> float:
        """Share of free memory slices (all GPUs) that no free 3g placement covers."""
        free = stranded = 0
        for (geo, _owner), pool in self._pools.items():
            t = _tables(geo)
            for sid, b in pool.buckets.items():
                n = len(b.members)
                free += n * t.free_slices[sid]
                stranded += n * t.stranded[sid]
        return stranded / free if free else 0.0

    def utilization(self) -> float:
        """Share of memory slices in use."""
        used = total = 0
        for (geo, _owner), pool in self._pools.items():
            t = _tables(geo)
            for sid, b in pool.buckets.items():
                used += len(b.members) * t.used[sid]
                total += len(b.members) * t.n_mem
        return used / total if total else 0.0

    # ---- placing --------------------------------------------------------------------------

    def place(self, request: Request) -> Decision | NoCapacity:
        """Choose a GPU and start for the request and record the new instance."""
        d = self.choose(request)
        if isinstance(d, Decision):
            self._commit(d)
        return d

    def choose(self, request: Request) -> Decision | NoCapacity:
        """Choose without recording anything."""
        t = _tables(request.geometry)
        pid = _profile_of(request)
        shape = t.shape(pid)
        tenant = request.tenant_id
        own = self._pools.get((request.geometry, tenant))
        shared = self._pools.get((request.geometry, None))
        first_fit = self.policy == FIRST_FIT
        newly = False
        if request.dedicated:
            hit = self._find(t, own, pid, first_fit)
            candidates = own.hostable.get(pid, 0) if own else 0
            if hit is None and shared is not None and t.empty in shared.buckets:
                b = shared.buckets[t.empty]
                sid = t.empty
                start = t.first[sid][pid] if first_fit else t.best[sid][pid][1]
                hit = (sid, b.peek(), start, False)
                candidates = len(b.members)
                newly = True
        else:
            a = self._find(t, own, pid, first_fit)
            b_ = self._find(t, shared, pid, first_fit)
            candidates = (own.hostable.get(pid, 0) if own else 0) + (shared.hostable.get(pid, 0) if shared else 0)
            if a is None or b_ is None:
                hit = a or b_
            elif first_fit:
                hit = a if a[1] < b_[1] else b_
            else:
                hit = a if t.best[a[0]][pid][0] <= t.best[b_[0]][pid][0] else b_
        if hit is None:
            return self._no_capacity(t, request, shape, own)
        sid, gpu_id, start, _ = hit
        g = self._gpus[gpu_id]
        dedicated = request.dedicated or g.owner == tenant
        reason = self._reason(t, g, sid, pid, start, shape, candidates, newly)
        return Decision(
            gpu_id,
            g.node_id,
            request.geometry,
            pid,
            start,
            shape.size,
            tenant,
            dedicated,
            newly,
            candidates,
            reason,
            placed_summary(t.geo.name, None if pid is WHOLE_GPU else shape.name, dedicated),
        )

    def _find(self, t: _Tables, pool: _Pool | None, pid: int | None, first_fit: bool) -> _Hit | None:
        """(state, gpu id, start, _) of the pool's best GPU for pid, or None."""
        if pool is None or not pool.hostable.get(pid):
            return None
        buckets = pool.buckets
        if first_fit:
            first: tuple[int, int] | None = None  # (gpu id, sid)
            for sid, b in buckets.items():
                if pid in t.hostable[sid]:
                    gid = b.peek()
                    if first is None or gid < first[0]:
                        first = (gid, sid)
            assert first is not None  # hostable said there is one
            gid, sid = first
            return (sid, gid, t.first[sid][pid], False)
        order = t.order[pid]
        if len(buckets) < len(order):
            best: _Choice | None = None
            best_sid = -1
            for sid in buckets:
                e = t.best[sid].get(pid)
                if e is not None and (best is None or e[0] < best[0]):
                    best, best_sid = e, sid
            assert best is not None  # hostable said there is one
            return (best_sid, buckets[best_sid].peek(), best[1], False)
        for sid, start in order:
            hit = buckets.get(sid)
            if hit is not None:
                return (sid, hit.peek(), start, False)
        return None  # pragma: no cover - hostable said there is one

    def _reason(
        self,
        t: _Tables,
        g: _Gpu,
        sid: int,
        pid: int | None,
        start: int,
        shape: _Shape,
        candidates: int,
        newly: bool,
    ) -> str:
        used = t.used[sid]
        if used == 0:
            fill = "empty"
        else:
            fill = f"partly used ({used}/{t.n_mem} memory slices)"
        if g.owner is not None:
            fill += f", dedicated to tenant {g.owner}"
        elif newly:
            fill += ", now dedicated to the tenant"
        after = t.add[sid][(pid, start)]
        nxt = t.largest[after]
        others = candidates - 1
        tail = f"{others} other candidate{'s' if others != 1 else ''}"
        if self.policy == FIRST_FIT:
            return f"{t.geo.name} {g.name}: {fill}; first fit, start {start}; {tail}"
        if pid is WHOLE_GPU:
            what = "whole GPU"
        elif nxt is None:
            what = f"start {start} fills the GPU"
        else:
            what = f"start {start} keeps {nxt} placeable"
        loss = t.loss[sid][pid]
        return f"{t.geo.name} {g.name}: {fill}; {what} (fragmentation cost {loss}); {tail}"

    def _no_capacity(self, t: _Tables, request: Request, shape: _Shape, own: _Pool | None) -> NoCapacity:
        geo = request.geometry
        total = self._model_count.get(geo, 0)
        own_n = own.size if own else 0
        others = self._model_dedicated.get(geo, 0) - own_n
        tail = f"{total} GPUs of this model, {others} dedicated to other tenants"
        if total == 0:
            reason = f"no {t.geo.name} GPUs in the fleet"
        elif request.dedicated:
            reason = (
                f"no {t.geo.name} GPU dedicated to tenant {request.tenant_id} has room for {shape.name} "
                f"({own_n} dedicated to it) and no empty shared GPU is left; {tail}"
            )
        elif shape.pid is WHOLE_GPU:
            reason = f"no {t.geo.name} GPU is empty (a whole GPU needs one); {tail}"
        else:
            reason = f"no {t.geo.name} GPU has a free {shape.name} placement; {tail}"
        summary = no_capacity_summary(t.geo.name, None if shape.pid is WHOLE_GPU else shape.name,
                                      request.dedicated)
        return NoCapacity(geo, shape.pid, request.tenant_id, request.dedicated, total, others, reason, summary)

    def _commit(self, d: Decision) -> None:
        g = self._gpus[d.gpu_id]
        t = _tables(g.geometry)
        if d.newly_dedicated:
            self._set_owner(g, d.tenant_id)
        pool = self._pools[(g.geometry, g.owner)]
        new = t.add[g.state][(d.profile_id, d.start)]
        pool.remove(t, g.state, g.gpu_id)
        g.state = new
        pool.add(t, new, g.gpu_id)
        g.instances[d.start] = Instance(d.profile_id, d.start, d.tenant_id)

    def record(self, gpu_id: int, profile_id: int | None, start: int, tenant_id: int) -> None:
        """Record an instance chosen elsewhere (e.g. replayed from the database); the GPU's
        tenancy rules are checked as for :meth:`place`."""
        g = self._gpus[gpu_id]
        if not self.can_place(gpu_id, profile_id, start):
            raise ValueError(f"GPU {gpu_id}: {profile_id}@{start} does not fit")
        if g.owner is not None and g.owner != tenant_id:
            raise ValueError(f"GPU {gpu_id} is dedicated to tenant {g.owner}")
        t = _tables(g.geometry)
        pool = self._pools[(g.geometry, g.owner)]
        new = t.add[g.state][(profile_id, start)]
        pool.remove(t, g.state, gpu_id)
        g.state = new
        pool.add(t, new, gpu_id)
        g.instances[start] = Instance(profile_id, start, tenant_id)

    def release(self, gpu_id: int, start: int) -> Released:
        """Free the instance that starts at ``start``; an engine dedication ends with the GPU's
        last instance. Raises KeyError if there is none."""
        g = self._gpus[gpu_id]
        inst = g.instances.pop(start)
        t = _tables(g.geometry)
        pool = self._pools[(g.geometry, g.owner)]
        new = t.remove(g.state, inst.profile_id, start)
        pool.remove(t, g.state, gpu_id)
        g.state = new
        pool.add(t, new, gpu_id)
        ended = False
        if not g.instances and g.owner is not None and not g.sticky:
            self._set_owner(g, None)
            ended = True
        return Released(gpu_id, inst, ended)

    # ---- self-check (tests) ---------------------------------------------------------------

    def check_invariants(self) -> None:
        """Recompute every index from the GPUs and compare (AssertionError on a mismatch)."""
        seen: dict[tuple[str, int | None], dict[int, set[int]]] = {}
        for g in self._gpus.values():
            t = _tables(g.geometry)
            sid = t.empty
            for s in sorted(g.instances):
                sid = t.add[sid][(g.instances[s].profile_id, s)]
            assert sid == g.state, f"GPU {g.gpu_id}: state drift"
            if g.owner is not None:
                assert all(i.tenant_id == g.owner for i in g.instances.values()), g.gpu_id
            seen.setdefault((g.geometry, g.owner), {}).setdefault(sid, set()).add(g.gpu_id)
        for key, pool in self._pools.items():
            got = {sid: set(b.members) for sid, b in pool.buckets.items()}
            assert got == seen.get(key, {}), f"pool {key}: buckets drift"
            assert pool.size == sum(len(v) for v in got.values())
            t = _tables(key[0])
            for pid in t.shapes:
                n = sum(len(v) for sid, v in got.items() if pid in t.hostable[sid])
                assert pool.hostable.get(pid, 0) == n, f"pool {key}: hostable drift for {pid}"
        for key in seen:
            assert key in self._pools
