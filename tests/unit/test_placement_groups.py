"""Whole-GPU group placement (marketplace.placement_groups): one node, one NVLink domain, one NUMA node
when the group fits in it, buddy-aligned blocks so that small groups do not strand the 4- and 8-GPU shapes."""

from __future__ import annotations

import random

import pytest

from marketplace.hardware.topology import hgx_8gpu, pcie_server
from marketplace.placement_groups import FIRST_FIT, GroupFleet, GroupRequest, NodeState

H100 = "h100-sxm-80gb"


def node(nid: int, busy=(), ineligible=(), topo=None) -> NodeState:
    return NodeState(nid, H100, tuple(None if i in ineligible else nid * 8 + i for i in range(8)), busy,
                     topo or hgx_8gpu())


def req(n: int) -> GroupRequest:
    return GroupRequest(H100, 1, n)


def test_small_groups_fill_a_broken_block_before_touching_a_whole_one():
    f = GroupFleet([node(0), node(1, busy=(0,))])
    d = f.place(req(1))
    assert d and d.node_id == 1 and d.indexes == (1,)  # the free buddy of the taken GPU
    d = f.place(req(2))
    assert d and d.node_id == 1 and d.indexes == (2, 3)  # completes NUMA node 0 of node 1
    assert f.place(req(8)).node_id == 0  # node 0 is still whole


def test_a_group_stays_inside_one_numa_node_when_it_fits():
    f = GroupFleet([node(0, busy=(0, 1, 4))])
    d = f.place(req(4))
    assert not d  # 2,3 and 5,6,7 are free but no NUMA node has four free GPUs
    d = f.place(req(2))
    assert d and d.indexes == (2, 3) and d.numa_nodes == (0,)
    d = f.place(req(2))
    assert d and set(d.indexes) <= {5, 6, 7} and d.numa_nodes == (1,)


def test_an_eight_gpu_group_spans_both_numa_nodes_of_one_board_but_never_two_nodes():
    f = GroupFleet([node(0, busy=(7,)), node(1, busy=(0,))])
    assert not f.place(req(8))  # 14 free GPUs, but no node has 8
    f = GroupFleet([node(0)])
    d = f.place(req(8))
    assert d and d.indexes == tuple(range(8)) and d.numa_nodes == (0, 1)


def test_mig_gpus_never_join_a_group():
    f = GroupFleet([node(0, ineligible=(0, 2, 4, 6))])
    assert not f.place(req(4))  # four free GPUs, but no NUMA node has four eligible ones
    d = f.place(req(2))  # NVSwitch is all-to-all: 1 and 3 are NVLink peers on one socket
    assert d and d.indexes == (1, 3) and not ({0, 2, 4, 6} & set(d.gpu_ids))


def test_a_pcie_server_sells_single_gpus_only():
    f = GroupFleet([NodeState(0, H100, tuple(range(8)), (), pcie_server(8))])
    assert not f.place(req(2))
    assert f.place(req(1))


def test_value_function_takes_a_non_aligned_pair_to_keep_a_whole_numa_node():
    f = GroupFleet([node(0, busy=(0, 3))])
    d = f.place(req(2))
    assert d and d.indexes == (1, 2)  # strict buddy would break 4-7
    assert f.place(req(4)).indexes == (4, 5, 6, 7)


def test_first_fit_takes_the_lowest_node_and_indexes():
    f = GroupFleet([node(0, busy=(0,)), node(1)], policy=FIRST_FIT)
    assert f.place(req(2)).indexes == (1, 2) and f.place(req(4)).indexes == (4, 5, 6, 7)
    assert f.place(req(1)).indexes == (3,) and f.place(req(1)).node_id == 1


@pytest.mark.parametrize("seed", range(5))
def test_random_streams_never_break_the_rules(seed):
    rng = random.Random(seed)
    f = GroupFleet([node(i) for i in range(6)])
    held = []
    for _ in range(400):
        if held and rng.random() < 0.45:
            nid, idx = held.pop(rng.randrange(len(held)))
            f.release(nid, idx)
            continue
        n = rng.choice((1, 1, 2, 2, 4, 8))
        d = f.place(req(n))
        if not d:
            continue
        topo = hgx_8gpu()
        assert len(d.indexes) == n and len(set(d.indexes)) == n
        if 1 < n <= 4:
            assert len({topo.gpus[i].numa_node for i in d.indexes}) == 1
        held.append((d.node_id, d.indexes))
    seen = set()
    for nid, idx in held:
        for i in idx:
            assert (nid, i) not in seen
            seen.add((nid, i))
