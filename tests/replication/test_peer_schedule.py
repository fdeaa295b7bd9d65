"""Who sends what to whom in the peer tier: pure functions every rank computes alike."""

from __future__ import annotations

from dcp_safe.replication.peer_schedule import (
    Fetch,
    buddies,
    copy_plan,
    fetch_plan,
    node_leaders,
)

TWO_BY_TWO = (0, 0, 1, 1)  # the node of each rank


def test_a_node_is_led_by_its_lowest_rank() -> None:
    assert node_leaders(TWO_BY_TWO) == {0: 0, 1: 2}
    assert node_leaders((3, 1, 3, 1)) == {3: 0, 1: 1}


def test_buddies_are_the_next_nodes_so_no_node_holds_every_copy() -> None:
    nodes = (0, 1, 2, 3)
    assert buddies(0, nodes, 2) == [1]
    assert buddies(3, nodes, 3) == [0, 1]
    assert buddies(1, nodes, 1) == []
    for node in nodes:  # each node's copies are on distinct other nodes
        held = buddies(node, nodes, 4)
        assert node not in held and len(set(held)) == 3


def test_each_node_leader_sends_its_files_to_each_buddy_leader() -> None:
    files = [("__0_0.distcp", 10), ("__1_0.distcp", 11)]
    offers = [files, None, [("__2_0.distcp", 12)], None]
    plan = copy_plan(TWO_BY_TWO, offers, 2)
    assert [(t.tag, t.src, t.dst, t.node, t.files) for t in plan] == [
        (0, 0, 2, 0, tuple(files)),
        (1, 2, 0, 1, (("__2_0.distcp", 12),)),
    ]


def test_a_node_that_offered_nothing_sends_nothing() -> None:
    # None: its leader could not read its cache; []: the cache holds nothing of the checkpoint.
    for nothing in (None, []):
        plan = copy_plan(TWO_BY_TWO, [nothing, None, [("f", 1)], None], 2)
        assert [(t.src, t.dst) for t in plan] == [(2, 0)]


def test_fetches_spread_over_the_holders_and_skip_what_a_rank_holds() -> None:
    # Node B was replaced: ranks 2 and 3 need their files; ranks 0 and 1 (node A) hold both.
    held = {"__2_0.distcp", "__3_0.distcp"}
    needs = [{}, {}, {"__2_0.distcp": 100}, {"__3_0.distcp": 100}]
    plan = fetch_plan(needs, [held, held, set(), set()])
    assert plan == [
        Fetch(0, "__2_0.distcp", 100, holder=0, requester=2),
        Fetch(1, "__3_0.distcp", 100, holder=1, requester=3),
    ]
    # A file on the requester's own disk, or on nobody's, needs no transfer.
    assert fetch_plan([{"a": 1, "b": 1}], [{"a"}]) == []


def test_a_rejected_copy_is_never_asked_for_again_from_the_same_disk() -> None:
    needs = [{"f": 5}, {}, {}]
    offers = [set(), {"f"}, {"f"}]
    disks = ["n0", "n1", "n1"]  # ranks 1 and 2 share node 1's disk: one copy
    assert [f.holder for f in fetch_plan(needs, offers, [{}, {}, {}], disks)] == [1]
    assert fetch_plan(needs, offers, [{"f": ["n1"]}, {}, {}], disks) == []
    disks = ["n0", "n1", "n2"]
    assert [f.holder for f in fetch_plan(needs, offers, [{"f": ["n1"]}, {}, {}], disks)] == [2]
