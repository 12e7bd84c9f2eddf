"""Pure scheduler logic: backpressure decisions, latency statistics, placement plans and capacity errors."""

from __future__ import annotations

import pytest

from hybridflow.graph import DataflowGraph, Edge, Node
from hybridflow.scheduler.backpressure import BackpressurePolicy, QueueSignal, high_watermark
from hybridflow.scheduler.edges import EdgeChannel, EdgeSizeError, LatencyStats, percentile, size_problem
from hybridflow.scheduler.group import HostGroup
from hybridflow.scheduler.head import HeadLost, HeadWatch
from hybridflow.scheduler.placement import (
    EMPTY_BUNDLE_CPU,
    actor_options,
    bundle_for,
    capacity_error,
    describe_missing,
    fits,
    missing_resources,
    order_bundles_by_node,
    plan_placement,
    real_resources,
    stages_of,
    torch_threads,
)

# -- backpressure --------------------------------------------------------------------------------


def test_signal_needs_a_full_window_above_the_watermark() -> None:
    p = BackpressurePolicy(high_watermark=100, window=3)
    assert p.observe("a->b", 140) is None
    assert p.observe("a->b", 140) is None
    sig = p.observe("a->b", 140)
    assert sig == QueueSignal("a->b", "high", 140)
    assert p.reason(sig) == "queue a->b at 140 > 100 for 3 observations"
    # the count restarts after a signal, so a change gets a full window to take effect
    assert p.observe("a->b", 140) is None


def test_a_dip_resets_the_streak_and_edges_count_separately() -> None:
    p = BackpressurePolicy(high_watermark=10, window=2)
    assert p.observe("a->b", 11) is None
    assert p.observe("a->b", 10) is None  # at the watermark is not above it
    assert p.observe("c->d", 11) is None
    assert p.observe("a->b", 11) is None
    assert p.observe("c->d", 11) is not None
    assert p.observe("a->b", 11) is not None


def test_low_signal_below_half_the_watermark() -> None:
    p = BackpressurePolicy(high_watermark=10, window=2)
    assert p.observe("a->b", 5) is None  # half is not below half
    assert p.observe("a->b", 4) is None
    sig = p.observe("a->b", 0)
    assert sig is not None and sig.kind == "low"
    assert p.reason(sig) == "queue a->b at 0 < 5 for 2 observations"


def test_high_raises_downstream_first_then_lowers_upstream() -> None:
    p = BackpressurePolicy(high_watermark=100, window=3)
    sig = QueueSignal("actor_rollout->reward_score", "high", 140)
    cur = {"actor_rollout": 4, "reward_score": 2}
    cands = p.candidates(sig, "actor_rollout", "reward_score", cur, cur, lambda n: True)
    assert [(c.action, c.node, c.old, c.new) for c in cands] == [
        ("raise_downstream", "reward_score", 2, 3),
        ("lower_upstream", "actor_rollout", 4, 3),
    ]
    assert cands[0].reason == "queue actor_rollout->reward_score at 140 > 100 for 3 observations"
    assert not any(c.applied for c in cands)

    cands = p.candidates(sig, "actor_rollout", "reward_score", cur, cur, lambda n: False)
    assert [(c.action, c.node, c.new) for c in cands] == [("lower_upstream", "actor_rollout", 3)]
    assert "no room to raise reward_score" in cands[0].reason


def test_upstream_never_goes_below_one() -> None:
    p = BackpressurePolicy(high_watermark=1, window=1)
    sig = QueueSignal("a->b", "high", 5)
    assert p.candidates(sig, "a", "b", {"a": 1, "b": 1}, {"a": 1, "b": 1}, lambda n: False) == []


def test_low_relaxes_toward_the_plan_one_step_at_a_time() -> None:
    p = BackpressurePolicy(high_watermark=10, window=1)
    sig = QueueSignal("a->b", "low", 0)
    planned = {"a": 4, "b": 2}
    cands = p.candidates(sig, "a", "b", {"a": 3, "b": 4}, planned, lambda n: True)
    assert [(c.action, c.node, c.old, c.new) for c in cands] == [("relax_downstream", "b", 4, 3)]
    assert "back toward planned 2" in cands[0].reason
    cands = p.candidates(sig, "a", "b", {"a": 3, "b": 2}, planned, lambda n: True)
    assert [(c.action, c.node, c.new) for c in cands] == [("relax_upstream", "a", 4)]
    assert p.candidates(sig, "a", "b", {"a": 3, "b": 2}, planned, lambda n: False) == []
    assert p.candidates(sig, "a", "b", planned, planned, lambda n: True) == []


def test_policy_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        BackpressurePolicy(0, 3)


# -- latency and queues --------------------------------------------------------------------------


def test_latency_stats_count_mean_p95() -> None:
    s = LatencyStats()
    assert s.as_dict() == {"count": 0, "mean_s": 0.0, "p50_s": 0.0, "p95_s": 0.0, "max_s": 0.0}
    for i in range(1, 101):
        s.add(float(i))
    assert s.count == 100
    assert s.mean_s == pytest.approx(50.5)
    assert s.p95_s == 95.0  # nearest rank: sorted[ceil(0.95 * 100) - 1]
    assert s.p50_s == 50.0
    assert s.max_s == 100.0


def test_p95_follows_the_recent_window_mean_covers_all() -> None:
    s = LatencyStats(window=10)
    for _ in range(100):
        s.add(10.0)
    for _ in range(10):
        s.add(1.0)
    assert s.p95_s == 1.0
    assert s.mean_s == pytest.approx((100 * 10 + 10) / 110)


def test_percentile_nearest_rank() -> None:
    assert percentile([], 95) == 0.0
    assert percentile([3.0], 95) == 3.0
    assert percentile([5.0, 1.0, 4.0, 2.0, 3.0], 50) == 3.0
    assert percentile([1.0, 2.0], 95) == 2.0


def test_channel_counts_pending_and_batch_sizes_without_ray() -> None:
    ch = EdgeChannel("a->b", high_watermark=2, max_size_bytes=100, finished=lambda refs: set())
    for ref in ("ref-1", "ref-2", "ref-3"):
        ch.put(ref)  # type: ignore[arg-type]
    ch.record_bytes(50)
    ch.record_bytes(100)  # at the limit is allowed
    st = ch.status()
    assert ch.pending() == 3 and st["queue_len"] == 3
    assert (st["batches"], st["bytes_total"], st["bytes_last"], st["bytes_max"]) == (2, 150, 100, 100)
    assert (st["transport"], st["max_size_bytes"], st["high_watermark"]) == ("object_store", 100, 2)
    assert st["latency"]["count"] == 0


def test_a_batch_over_the_limit_is_refused_naming_edge_size_and_limit() -> None:
    ch = EdgeChannel("actor_rollout->reward", high_watermark=2, max_size_bytes=1000)
    with pytest.raises(EdgeSizeError) as err:
        ch.record_bytes(4096)
    assert str(err.value).startswith(
        "edge actor_rollout->reward: a batch of 4096 bytes is over its maxSizeBytes 1000; ")
    assert ch.sizes.count == 0  # nothing was sent
    assert size_problem("a->b", 4096, None, "object_store") is None  # no limit


def test_an_in_process_edge_records_sizes_but_never_refuses() -> None:
    """Co-located nodes hand a batch over in place: nothing is copied, so the limit has nothing to bound."""
    assert size_problem("a->b", 4096, 1000, "in_process") is None
    ch = EdgeChannel("a->b", high_watermark=2, max_size_bytes=1000, transport="in_process")
    ch.record_bytes(4096)
    assert ch.status()["bytes_max"] == 4096 and ch.status()["transport"] == "in_process"


def test_backlog_counts_sequences_a_new_batch_finds_unfinished() -> None:
    finished: set[str] = set()
    ch = EdgeChannel("a->b", high_watermark=8, finished=lambda refs: {r for r in refs if r in finished})
    ch.put("c0", 16)  # type: ignore[arg-type]
    ch.put("c1", 16)  # type: ignore[arg-type]  # c0 unfinished: 16 queued
    finished.add("c0")
    ch.put("c2", 16)  # type: ignore[arg-type]  # c0 done but not taken: it no longer counts
    ch.put("c3", 16)  # type: ignore[arg-type]  # c1, c2 unfinished
    assert ch.take_backlog() == 32 and ch.status()["backlog"] == 32
    assert ch.take_backlog() == 0  # each observation sees only the batches put since the last
    finished.update({"c1", "c2", "c3"})
    ch.put("c4", 16)  # type: ignore[arg-type]  # a consumer that keeps up leaves an empty queue
    assert ch.take_backlog() == 0


def test_default_watermark_is_half_a_step_of_sequences() -> None:
    assert high_watermark(None, 64) == 32
    assert high_watermark(None, 1) == 1 and high_watermark(None, 0) == 1
    assert high_watermark(7, 64) == 7  # scheduling.queueHighWatermark wins


def test_a_slow_consumer_in_a_default_step_crosses_the_default_watermark() -> None:
    """64 sequences a step in 4 micro-batches of 16: a consumer that finishes nothing before the last arrives
    leaves it 48 queued, above the default 32; one that keeps up leaves 0, below the low mark (16)."""
    policy = BackpressurePolicy(high_watermark(None, 64), window=3)
    slow = EdgeChannel("a->b", policy.high_watermark, finished=lambda refs: set())
    fast = EdgeChannel("a->c", policy.high_watermark, finished=set)
    signals = []
    for _step in range(3):
        for i in range(4):
            slow.put(f"s{i}", 16)  # type: ignore[arg-type]
            fast.put(f"f{i}", 16)  # type: ignore[arg-type]
        signals += [policy.observe("a->b", slow.take_backlog()), policy.observe("a->c", fast.take_backlog())]
        slow.discard()
        fast.discard()
    assert signals[-2:] == [QueueSignal("a->b", "high", 48), QueueSignal("a->c", "low", 0)]
    assert signals[:-2] == [None] * 4


# -- placement -----------------------------------------------------------------------------------


def _graph(critic_gpu: float = 1, critic_par: int = 4, actor_res: dict[str, float] | None = None) -> DataflowGraph:
    g = DataflowGraph("t")
    actor = g.node(Node("actor_rollout", "actor_rollout", actor_res or {"CPU": 1}, 2))
    reward = g.node(Node("reward_score", "reward", {}, 2))
    critic = g.node(Node("critic", "critic", {"GPU": critic_gpu}, critic_par))
    g.edge(Edge(actor, reward, co_locate=True))
    g.edge(Edge(reward, critic))
    g.edge(Edge(critic, actor, control=True))
    return g.validate()


TWO_NODES = [{"CPU": 2, "GPU": 2, "node_a": 1}, {"CPU": 2, "GPU": 2, "node_b": 1}]


def test_whole_gpu_group_larger_than_a_node_packs_into_stages_first() -> None:
    plans = plan_placement(_graph(), TWO_NODES)
    assert [p.name for p in plans] == ["critic", "actor_rollout+reward_score"]
    critic, actor = plans
    assert critic.strategy == "PACK" and critic.staged and critic.planned_stages == (2, 2)
    assert critic.data_parallel
    assert actor.strategy == "PACK" and not actor.staged
    assert actor.data_parallel  # actor_rollout trains and runs 2 instances
    assert "planned stages [2, 2]" in critic.describe()


def test_whole_gpu_group_that_fits_one_node_is_strict_packed() -> None:
    critic = plan_placement(_graph(critic_par=2), TWO_NODES)[0]
    assert critic.strategy == "STRICT_PACK" and critic.planned_stages == (2,)


def test_fractional_gpus_are_not_staged_and_a_single_critic_still_gets_ranks() -> None:
    plans = {p.name: p for p in plan_placement(_graph(critic_gpu=0.5, critic_par=1), TWO_NODES)}
    assert not plans["critic"].staged and plans["critic"].strategy == "PACK"
    assert plans["critic"].data_parallel


def test_non_training_group_is_not_data_parallel() -> None:
    g = DataflowGraph("t")
    g.node(Node("reward_score", "reward", {"CPU": 1}, 3))
    assert not plan_placement(g, TWO_NODES)[0].data_parallel


def test_empty_bundle_gets_a_sliver_of_cpu() -> None:
    g = DataflowGraph("t")
    g.node(Node("reward_score", "reward", {}, 1))
    (group,) = g.colocation_groups()
    assert bundle_for(group) == {"CPU": EMPTY_BUNDLE_CPU}
    assert actor_options(bundle_for(group)) == {"num_cpus": EMPTY_BUNDLE_CPU, "num_gpus": 0.0}


def test_actor_asks_for_exactly_its_bundle() -> None:
    assert actor_options({"GPU": 1.0, "node_a": 1.0}) == {"num_cpus": 0.0, "num_gpus": 1.0,
                                                          "resources": {"node_a": 1.0}}


def test_torch_threads_are_the_bundles_whole_cpus() -> None:
    g = DataflowGraph("t")
    actor = g.node(Node("actor", "actor_rollout", {"CPU": 2}, 1))
    critic = g.node(Node("critic", "critic", {"CPU": 1.5}, 1))
    g.edge(Edge(actor, critic, co_locate=True))
    (group,) = g.colocation_groups()
    assert torch_threads(bundle_for(group)) == 3
    assert torch_threads({"GPU": 0.5}) == 1 and torch_threads({"CPU": 0.25}) == 1
    assert torch_threads({"CPU": 0.999999999999}) == 1 and torch_threads({"CPU": 4.0, "GPU": 1.0}) == 4


def test_resource_arithmetic() -> None:
    assert real_resources({"CPU": 2, "node:1.2.3.4": 1, "CPU_group_abc": 1, "bundle_group_0_abc": 1000,
                           "accelerator_type:A100": 1, "GPU": 1}) == {"CPU": 2.0, "GPU": 1.0}
    assert fits({"CPU": 1, "GPU": 0}, {"CPU": 1})
    assert not fits({"GPU": 1}, {"CPU": 8})
    assert missing_resources({"GPU": 4, "CPU": 1}, {"CPU": 2}) == {"GPU": 4}
    assert describe_missing({"GPU": 4}, {"GPU": 0}, {"GPU": 0}) == "GPU: need 4, cluster has 0, 0 free (missing 4)"


def test_capacity_error_names_the_missing_gpus() -> None:
    err = capacity_error(_graph(), plan_placement(_graph(), [{"CPU": 4}]), {"CPU": 4}, [{"CPU": 4}])
    assert err is not None
    assert err.missing == {"GPU": 4}
    assert "GPU" in str(err) and "missing 4" in str(err)


def test_capacity_error_when_no_single_node_holds_a_bundle() -> None:
    g = _graph(critic_gpu=4, critic_par=1)
    nodes = [{"CPU": 2, "GPU": 2}, {"CPU": 2, "GPU": 2}]
    err = capacity_error(g, plan_placement(g, nodes), {"CPU": 4, "GPU": 4}, nodes)
    assert err is not None and err.missing == {}
    assert "no node has more than 2" in str(err)


def test_capacity_counts_the_cpu_sliver_of_empty_bundles() -> None:
    g = DataflowGraph("t")
    g.node(Node("reward_score", "reward", {}, 2))
    err = capacity_error(g, plan_placement(g, [{"GPU": 1}]), {"GPU": 1}, [{"GPU": 1}])
    assert err is not None and err.missing == {"CPU": pytest.approx(2 * EMPTY_BUNDLE_CPU)}


def test_capacity_ok() -> None:
    assert capacity_error(_graph(), plan_placement(_graph(), TWO_NODES), {"CPU": 4, "GPU": 4}, TWO_NODES) is None


def test_bundles_are_ordered_by_node_so_ranks_on_a_node_are_contiguous() -> None:
    assert order_bundles_by_node({0: "a", 1: "b", 2: "a", 3: "b"}) == [0, 2, 1, 3]
    assert order_bundles_by_node({0: "b", 1: "b", 2: "a"}) == [0, 1, 2]


def test_stages_group_instances_by_node_and_gpu() -> None:
    stages = stages_of([("n1", [1]), ("n2", [1]), ("n1", [0]), ("n2", [0])])
    assert [(s.index, s.node_id, s.instances, s.gpu_ids) for s in stages] == [
        (0, "n1", (2, 0), (0, 1)),
        (1, "n2", (3, 1), (0, 1)),
    ]


# -- the head watch ------------------------------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_head_watch_stops_only_after_the_gcs_is_silent_long_enough() -> None:
    clock, answers = _Clock(), [True]
    watch = HeadWatch(probe=lambda: answers[-1], lost_after_s=10.0, every_s=1.0, clock=clock)
    watch.check()
    answers.append(False)
    for t in (1.0, 5.0, 9.0):  # silent, but not yet for 10 s
        clock.now = t
        watch.check()
    clock.now = 10.0
    with pytest.raises(HeadLost, match="has not answered for 10s"):
        watch.check()


def test_head_watch_forgives_a_gap_the_gcs_answers_after() -> None:
    clock, answers = _Clock(), [False]
    watch = HeadWatch(probe=lambda: answers[-1], lost_after_s=10.0, every_s=1.0, clock=clock)
    clock.now = 8.0
    watch.check()
    answers.append(True)
    clock.now = 9.0
    watch.check()
    answers.append(False)
    clock.now = 18.5
    watch.check()  # 9.5 s since the last answer
    clock.now = 19.5
    with pytest.raises(HeadLost):
        watch.check()


def test_head_watch_probes_at_most_once_per_interval() -> None:
    clock, calls = _Clock(), []
    watch = HeadWatch(probe=lambda: calls.append(clock.now) or True, every_s=1.0, clock=clock)
    for t in (0.0, 0.2, 0.9, 1.0, 1.5, 2.1):
        clock.now = t
        watch.check()
    assert calls == [0.0, 1.0, 2.1]


def test_results_per_host_come_back_in_the_order_deal_spread_the_calls() -> None:
    """Seven calls over three hosts: host 0 had calls 0, 3, 6, host 1 calls 1, 4, host 2 calls 2, 5."""
    per_host = [["c0", "c3", "c6"], ["c1", "c4"], ["c2", "c5"]]
    assert HostGroup.in_call_order(per_host) == [f"c{i}" for i in range(7)]
    assert HostGroup.in_call_order([[], []]) == []
