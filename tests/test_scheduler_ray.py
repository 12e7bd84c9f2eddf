"""HybridScheduler on real Ray: one local node (ray.init) and several raylets (ray.cluster_utils.Cluster).

Ray starts once per class; the 2-core budget keeps every cluster small and every actor light.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import ray
import ray.cloudpickle
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group_table

from hybridflow.api.spec import Scheduling
from hybridflow.graph import ColocationGroup, DataflowGraph, Edge, Node
from hybridflow.scheduler import HybridScheduler, PlacementError

# the host class travels to workers by value: tests/ is not on the workers' path
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

OBJECT_STORE = 120 * 1024 * 1024
RENDEZVOUS_S = 20.0
"""The ranks' rendezvous limit here: short, so a test of a rank dying mid rendezvous waits little."""
COLLECTIVE_S = 600.0
"""Far above it: a survivor that waited for this instead would fail the test."""


class TinyHost:
    """The host contract, with gloo ranks and a sleeping method to play a slow consumer."""

    def __init__(self, index: int, members: list[str]) -> None:
        self.index = index
        self.members = members
        self.rank = -1
        self.die_in_setup = False
        self.held: float | None = None

    def node_info(self) -> dict[str, Any]:
        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
                "pid": os.getpid(), "gpu_ids": ray.get_gpu_ids()}

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return int(s.getsockname()[1])

    def setup_distributed(self, master_addr: str, master_port: int, rank: int, world_size: int,
                          backend: str) -> None:
        from hybridflow.workers import distributed

        if self.die_in_setup:
            os._exit(1)  # the way a SIGKILL mid rendezvous looks to the others: no store, no peer
        distributed.setup(master_addr, master_port, rank, world_size, backend, timeout_s=COLLECTIVE_S,
                          rendezvous_s=RENDEZVOUS_S)
        self.rank = rank

    def hold_copies(self) -> bool:
        """A collective of the group as it stands, as a sharded role's gather is: it returns only when every
        live rank is asked."""
        self.held = self.all_reduce_rank()
        return True

    def last_hold(self) -> float | None:
        return self.held

    def die_in_next_setup(self) -> None:
        self.die_in_setup = True

    def all_reduce_rank(self) -> float:
        """sum over ranks of (rank + 1): n(n+1)/2 when every rank took part."""
        import torch
        import torch.distributed as dist

        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t)
        return float(t.item())

    def slow(self, x: int, seconds: float) -> int:
        time.sleep(seconds)
        return x

    def crash(self) -> None:
        os._exit(1)

    def whoami(self) -> tuple[int, list[str]]:
        return self.index, self.members


def host_kwargs(group: ColocationGroup, index: int) -> dict[str, Any]:
    return {"index": index, "members": [n.name for n in group.nodes]}


def ppo_like(actor_res: dict[str, float], critic_res: dict[str, float], critic_par: int,
             actor_par: int = 2) -> DataflowGraph:
    g = DataflowGraph("ppo-test")
    actor = g.node(Node("actor_rollout", "actor_rollout", actor_res, actor_par))
    reward = g.node(Node("reward_score", "reward", {}, actor_par))
    ref = g.node(Node("reference", "reference", {}, actor_par))
    critic = g.node(Node("critic", "critic", critic_res, critic_par))
    g.edge(Edge(actor, reward, co_locate=True))
    g.edge(Edge(actor, ref, co_locate=True))
    g.edge(Edge(actor, critic, data_type="rollout_batch"))
    g.edge(Edge(critic, actor, data_type="updated_policy", control=True))
    return g


def until_dead(actor: Any, timeout: float = 30.0) -> None:
    """ray.kill only sends the kill: wait until calls on the actor fail."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ray.get(actor.node_info.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            continue
        time.sleep(0.1)
    raise AssertionError(f"{actor} still answers {timeout:g}s after ray.kill")


def live_pgs(prefix: str) -> list[str]:
    return [pg["name"] for pg in placement_group_table().values()
            if pg["name"].startswith(prefix) and pg["state"] != "REMOVED"]


# -- one node ------------------------------------------------------------------------------------


@pytest.fixture(scope="class")
def local_ray() -> Iterator[None]:
    ray.init(num_cpus=4, num_gpus=0, include_dashboard=False, object_store_memory=OBJECT_STORE,
             logging_level=logging.WARNING)
    yield
    ray.shutdown()


@pytest.fixture(scope="class")
def local_sched(local_ray: None) -> Iterator[HybridScheduler]:
    g = ppo_like({"CPU": 1}, {"CPU": 0.5}, critic_par=2)
    s = HybridScheduler(g, Scheduling(placement_timeout_seconds=60), name_prefix="hf-local")
    s.start(TinyHost, host_kwargs)
    yield s
    s.shutdown()


class TestSingleNode:
    def test_one_host_per_instance_and_colocation_logged(self, local_sched: HybridScheduler) -> None:
        s = local_sched
        actor_hosts = s.hosts("actor_rollout")
        assert len(actor_hosts) == 2 and s.instance_count("critic") == 2
        # co-located nodes share the very same actors
        assert s.hosts("reward_score") == actor_hosts == s.hosts("reference")
        assert ray.get([h.whoami.remote() for h in actor_hosts]) == [
            (0, ["actor_rollout", "reward_score", "reference"]),
            (1, ["actor_rollout", "reward_score", "reference"]),
        ]
        st = s.get_status()
        for i in range(2):
            node = st["nodes"]["actor_rollout"]["workers"][i]["node_id"]
            assert f"Scheduling decision: co-located actor_rollout_{i} and reward_score_{i} and reference_{i} " \
                   f"on node {node}" in s.decisions
        assert st["nodes"]["critic"]["parallelism"] == 2
        assert st["nodes"]["critic"]["workers"][1]["bundle"] == {"CPU": 0.5}
        assert st["nodes"]["reward_score"]["workers"][0]["bundle"] == {"CPU": 1.0}
        assert set(st["edges"]) == {"actor_rollout->reward_score", "actor_rollout->reference",
                                    "actor_rollout->critic"}

    def test_critic_and_actor_ranks_all_reduce_over_gloo(self, local_sched: HybridScheduler) -> None:
        assert ray.get([h.all_reduce_rank.remote() for h in local_sched.hosts("critic")]) == [3.0, 3.0]
        assert ray.get([h.all_reduce_rank.remote() for h in local_sched.hosts("actor_rollout")]) == [3.0, 3.0]
        assert any(d.startswith("Scheduling decision: data-parallel critic: world size 2")
                   for d in local_sched.decisions)

    def test_channel_latency_and_drain(self, local_sched: HybridScheduler) -> None:
        s = local_sched
        ch = s.channel("actor_rollout->critic")
        host = s.hosts("critic")[0]
        for i in range(4):
            ch.put(host.slow.remote(i, 0.05))
        assert ch.pending() == 4
        assert s.get_status()["nodes"]["critic"]["queue_len"] == 4
        assert ch.drain() == [0, 1, 2, 3] and ch.pending() == 0
        lat = s.get_status()["edges"]["actor_rollout->critic"]["latency"]
        assert lat["count"] == 4 and 0.05 <= lat["mean_s"] <= lat["p95_s"]
        assert ch.drain() == []
        with pytest.raises(KeyError):
            s.channel("critic->actor_rollout")  # control edges carry no queue

    def test_restarted_worker_rejoins_ranks(self, local_sched: HybridScheduler) -> None:
        s = local_sched
        victim = s.hosts("critic")[1]
        name = s.get_status()["nodes"]["critic"]["workers"][1]["actor"]
        old_pid = s.get_status()["nodes"]["critic"]["workers"][1]["pid"]
        assert s.lost_hosts(timeout=30) == []
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(victim.crash.remote(), timeout=60)
        assert s.lost_hosts(timeout=30) == [name]  # restarted by Ray: a new process answers
        s.wait_ready(timeout=60)
        assert s.lost_hosts(timeout=30) == []
        assert s.get_status()["nodes"]["critic"]["workers"][1]["pid"] != old_pid
        s.setup_distributed_all()
        assert ray.get([h.all_reduce_rank.remote() for h in s.hosts("critic")]) == [3.0, 3.0]

    def test_a_rank_dying_while_the_group_forms_is_reported_as_lost_and_the_group_forms_again(
            self, local_sched: HybridScheduler) -> None:
        s = local_sched
        ray.get(s.hosts("critic")[0].die_in_next_setup.remote())  # rank 0: the store's server goes with it
        t0 = time.monotonic()
        with pytest.raises(ray.exceptions.RayActorError):
            s.setup_distributed_all()
        # the survivor gave up after the rendezvous limit (and the store client's backoff), not the collectives'
        assert time.monotonic() - t0 < COLLECTIVE_S / 2
        name = s.get_status()["nodes"]["critic"]["workers"][0]["actor"]
        assert name in s.lost_hosts(timeout=30)
        s.wait_ready(timeout=60)
        s.setup_distributed_all()  # the restarted rank 0 starts without the flag
        assert ray.get([h.all_reduce_rank.remote() for h in s.hosts("critic")]) == [3.0, 3.0]

    def test_rejoin_waits_again_for_a_host_that_dies_after_answering(self, local_sched: HybridScheduler) -> None:
        """A recovery's rejoin: every host answers, then rank 0 dies as the ranks form (as a host killed just
        before it answered does); rejoin waits for its restart and forms the group."""
        s = local_sched
        ray.get(s.hosts("critic")[0].die_in_next_setup.remote())
        s.rejoin(timeout=120)
        assert ray.get([h.all_reduce_rank.remote() for h in s.hosts("critic")]) == [3.0, 3.0]

    def test_wait_ready_names_a_host_that_stays_dead(self, local_sched: HybridScheduler) -> None:
        # runs late in the class: it leaves critic instance 1 dead for good
        name = local_sched.get_status()["nodes"]["critic"]["workers"][1]["actor"]
        dead = local_sched.hosts("critic")[1]
        ray.kill(dead, no_restart=True)
        until_dead(dead)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=name):
            local_sched.wait_ready(timeout=2)
        assert time.monotonic() - t0 < 2 + 5

    def test_impossible_plan_fails_fast_naming_gpus(self, local_ray: None) -> None:
        g = ppo_like({"CPU": 1}, {"GPU": 4}, critic_par=1)
        s = HybridScheduler(g, Scheduling(placement_timeout_seconds=5), name_prefix="hf-impossible")
        t0 = time.monotonic()
        with pytest.raises(PlacementError) as err:
            s.start(TinyHost, host_kwargs)
        assert time.monotonic() - t0 < 5 + 5
        assert err.value.missing == {"GPU": 4.0}
        assert "GPU" in str(err.value) and "missing 4" in str(err.value)
        assert live_pgs("hf-impossible") == []

    def test_placement_timeout_names_missing_and_cleans_up(self, local_sched: HybridScheduler) -> None:
        # local_sched holds 3 of the 4 CPUs: 2 CPUs exist in total, but only 1 is free
        g = DataflowGraph("late")
        g.node(Node("critic", "critic", {"CPU": 1}, 2))
        s = HybridScheduler(g, Scheduling(placement_timeout_seconds=2), name_prefix="hf-late")
        t0 = time.monotonic()
        with pytest.raises(PlacementError) as err:
            s.start(TinyHost, host_kwargs)
        elapsed = time.monotonic() - t0
        assert 2 <= elapsed < 2 + 8
        assert err.value.missing == {"CPU": pytest.approx(1.0)}
        assert "not ready after 2s" in str(err.value)
        assert "CPU: need 2, cluster has 4, 1 free (missing 1)" in str(err.value)
        assert live_pgs("hf-late") == []

    def test_backpressure_off_observes_nothing(self, local_ray: None) -> None:
        g = ppo_like({"CPU": 1}, {"CPU": 1}, critic_par=1)
        s = HybridScheduler(g, Scheduling(placement_timeout_seconds=5, queue_high_watermark=1,
                                          backpressure=False, backpressure_window=1))
        for _ in range(5):
            s.channel("actor_rollout->critic").put(ray.put(1))
        assert s.observe() == [] and s.observe() == []


# -- several raylets -----------------------------------------------------------------------------


@pytest.fixture(scope="class")
def cluster() -> Iterator[dict[str, str]]:
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                      "object_store_memory": OBJECT_STORE})
    a = c.add_node(num_cpus=2, num_gpus=2, resources={"node_a": 1, "scorer": 1}, object_store_memory=OBJECT_STORE)
    b = c.add_node(num_cpus=2, num_gpus=2, resources={"node_b": 1, "scorer": 1}, object_store_memory=OBJECT_STORE)
    c.wait_for_nodes()
    ray.init(address=c.address, logging_level=logging.WARNING)
    yield {"a": a.node_id, "b": b.node_id, "head": c.head_node.node_id}
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="class")
def gpu_sched(cluster: dict[str, str]) -> Iterator[HybridScheduler]:
    g = ppo_like({"CPU": 0.5}, {"GPU": 1}, critic_par=4)
    s = HybridScheduler(g, Scheduling(placement_timeout_seconds=60), name_prefix="hf-gpu", dp_roles=("critic",))
    s.start(TinyHost, host_kwargs)
    yield s
    s.shutdown()


@pytest.mark.cluster
class TestCluster:
    def test_colocated_instances_share_a_node(self, gpu_sched: HybridScheduler) -> None:
        nodes = gpu_sched.get_status()["nodes"]
        for i in range(2):
            ids = {nodes[n]["workers"][i]["node_id"] for n in ("actor_rollout", "reward_score", "reference")}
            assert len(ids) == 1
            assert f"Scheduling decision: co-located actor_rollout_{i} and reward_score_{i} and reference_{i} " \
                   f"on node {ids.pop()}" in gpu_sched.decisions

    def test_critic_ranks_are_staged_two_per_gpu_node(self, gpu_sched: HybridScheduler,
                                                      cluster: dict[str, str]) -> None:
        workers = gpu_sched.get_status()["nodes"]["critic"]["workers"]
        per_node = Counter(w["node_id"] for w in workers)
        assert per_node == {cluster["a"]: 2, cluster["b"]: 2}
        # ranks on one node are contiguous, and each node hands out both of its logical GPUs
        assert workers[0]["node_id"] == workers[1]["node_id"] != workers[2]["node_id"] == workers[3]["node_id"]
        for node in (cluster["a"], cluster["b"]):
            assert sorted(g for w in workers if w["node_id"] == node for g in w["gpu_ids"]) == [0, 1]
        stages = [d for d in gpu_sched.decisions if d.startswith("Scheduling decision: stage ")]
        assert len(stages) == 2 and all(d.endswith("(GPU ids [0, 1])") for d in stages)
        assert any("critic: 4 x {GPU: 1} with PACK" in d and "planned stages [2, 2]" in d
                   for d in gpu_sched.decisions)
        assert not any("landed in stages" in d for d in gpu_sched.decisions)
        assert ray.get([h.all_reduce_rank.remote() for h in gpu_sched.hosts("critic")]) == [10.0] * 4

    def test_adjust_parallelism_down_and_up(self, gpu_sched: HybridScheduler,
                                            caplog: pytest.LogCaptureFixture) -> None:
        s = gpu_sched
        caplog.set_level(logging.INFO, logger="hybridflow.scheduler")
        assert s.adjust_parallelism("critic", 3, "test shrink") == 3
        assert "Backpressure: critic parallelism 4 -> 3 (test shrink)" in caplog.text
        assert s.get_status()["nodes"]["critic"]["parallelism"] == 3
        assert ray.get([h.all_reduce_rank.remote() for h in s.hosts("critic")]) == [6.0] * 3
        # the four ranks held their copies together before one of them went
        assert ray.get([h.last_hold.remote() for h in s.hosts("critic")]) == [10.0] * 3
        # the idle bundle stayed reserved, so growing back always fits
        assert s.adjust_parallelism("critic", 4, "test grow") == 4
        assert ray.get([h.all_reduce_rank.remote() for h in s.hosts("critic")]) == [10.0] * 4
        assert ray.get([h.last_hold.remote() for h in s.hosts("critic")]) == [6.0] * 3 + [None]
        t0 = time.monotonic()
        assert s.adjust_parallelism("critic", 5, "test no room") == 4
        assert time.monotonic() - t0 < 5
        assert "cannot raise critic parallelism 4 -> 5: GPU: need 1" in caplog.text
        assert s.get_status()["nodes"]["critic"]["parallelism"] == 4
        # a refused raise gathers nothing: the ranks hold what the last change left them
        assert ray.get([h.last_hold.remote() for h in s.hosts("critic")]) == [6.0] * 3 + [None]

    def test_backpressure_raises_consumer_then_slows_producer_then_relaxes(
            self, gpu_sched: HybridScheduler, cluster: dict[str, str]) -> None:
        g = DataflowGraph("bp")
        ref = g.node(Node("ref", "reference", {"CPU": 0.25}, 2))
        score = g.node(Node("score", "reward", {"CPU": 0.25, "scorer": 1}, 1))
        g.edge(Edge(ref, score))
        s = HybridScheduler(g, Scheduling(placement_timeout_seconds=30, queue_high_watermark=2,
                                          backpressure_window=2), name_prefix="hf-bp")
        s.start(TinyHost, host_kwargs)
        try:
            ch = s.channel("ref->score")
            slow = s.hosts("score")[0]

            def flood() -> None:
                """Five items on one busy scorer: the last finds the four before it unfinished."""
                for i in range(5):
                    ch.put(slow.slow.remote(i, 0.2))

            flood()
            assert s.observe() == []
            flood()
            (d,) = s.observe()
            assert (d.action, d.node, d.old, d.new, d.applied) == ("raise_downstream", "score", 1, 2, True)
            assert d.reason.startswith("queue ref->score at ") and d.reason.endswith(" > 2 for 2 observations")
            assert f"Backpressure: score parallelism 1 -> 2 ({d.reason})" in s.decisions
            st = s.get_status()
            assert st["nodes"]["score"]["parallelism"] == 2 and len(st["nodes"]["score"]["workers"]) == 2
            assert st["nodes"]["score"]["queue_len"] == 10 and st["edges"]["ref->score"]["queue_len"] == 10
            # both scorer slots are taken now: the producer slows down instead
            flood()
            assert s.observe() == []
            flood()
            (d,) = s.observe()
            assert (d.action, d.node, d.old, d.new, d.applied) == ("lower_upstream", "ref", 2, 1, True)
            assert "no room to raise score" in d.reason
            assert s.get_status()["nodes"]["ref"]["parallelism"] == 1
            assert ch.drain() == [0, 1, 2, 3, 4] * 4
            lat = s.get_status()["edges"]["ref->score"]["latency"]
            assert lat["count"] == 20 and lat["p95_s"] >= lat["mean_s"] > 0
            # an empty queue walks both back to the plan, one step per window
            assert s.observe() == []
            (d,) = s.observe()
            assert (d.action, d.node, d.new, d.applied) == ("relax_downstream", "score", 1, True)
            assert s.observe() == []
            (d,) = s.observe()
            assert (d.action, d.node, d.new, d.applied) == ("relax_upstream", "ref", 2, True)
            assert s.observe() == [] and s.observe() == []
            st = s.get_status()
            assert (st["nodes"]["ref"]["parallelism"], st["nodes"]["score"]["parallelism"]) == (2, 1)
            assert [e["action"] for e in st["backpressure"]] == [
                "raise_downstream", "lower_upstream", "relax_downstream", "relax_upstream"]
        finally:
            s.shutdown()
        assert live_pgs("hf-bp") == []


GCS_KILLED = """
import os, signal, time
import ray
from hybridflow.scheduler.head import gcs_answers
ray.init(num_cpus=1, include_dashboard=False, configure_logging=False)
before = gcs_answers()
os.kill(ray._private.worker._global_node.all_processes["gcs_server"][0].process.pid, signal.SIGKILL)
t = time.monotonic()
after = gcs_answers(timeout_s=1.0)
print("probe", before, after, round(time.monotonic() - t, 1), flush=True)
os._exit(0)  # the rest of this Ray cannot shut down cleanly without its GCS
"""


def test_the_gcs_probe_reports_a_killed_gcs_within_its_timeout() -> None:
    """The head watch's probe against a real GCS, answering and then killed (in a process of its own, which
    Ray ends once it gives up on the GCS)."""
    env = {**os.environ, "RAY_gcs_rpc_server_reconnect_timeout_s": "10"}
    out = subprocess.run([sys.executable, "-c", GCS_KILLED], env=env, capture_output=True, text=True, timeout=180)
    probe = [line.split() for line in out.stdout.splitlines() if line.startswith("probe")]
    assert probe, out.stdout + out.stderr
    _, before, after, took = probe[0]
    assert (before, after) == ("True", "False"), out.stderr
    assert float(took) < 5, took
