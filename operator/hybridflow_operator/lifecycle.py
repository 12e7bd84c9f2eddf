"""What kopf does for the operator: start and stop it (signals, start-up and clean-up), log in, and serve
the liveness probe (the process's own health: see `alive`).

Watching is not kopf's here. kopf runs its whole per-event machinery (cause detection, handler
invocation, per-object memories) for every event of a watched resource, even with a handler that does
nothing and storages that keep nothing: 1.09 ms of CPU per RLTrainingJob event (1.28 ms with a
kopf.index on top), against 0.26 ms for the informer, which reads the same events as JSON lines and
only records them (benchmarks/operator/watch_cost.py, medians of 3 runs of 1,500 events; see
benchmarks/README.md). A burst of N jobs brings about 10 events per job across the three kinds, so
RLTrainingJobs, RayJobs and Ray pods all come through the informers (watches.py), and kopf is started
with no resource handler and no scanning of CRDs or namespaces: it has nothing to watch. Without a
resource handler kopf's Event poster is out of reach too (events.py posts them).
"""

from __future__ import annotations

import asyncio
from typing import Any

import kopf

from hybridflow_operator.events import EventPoster
from hybridflow_operator.machinery.client import Kube, load_configuration
from hybridflow_operator.metrics import OperatorMetrics
from hybridflow_operator.reconciler import Reconciler
from hybridflow_operator.settings import OperatorSettings
from hybridflow_operator.watches import informers

LIVENESS_PROBE = "operator"
"""The key of the liveness endpoint's answer: `{"operator": true}`."""


def registry() -> kopf.OperatorRegistry:
    """kopf's handlers for the operator; `memo.settings` carries its OperatorSettings."""
    handlers = kopf.OperatorRegistry()
    # kopf's own registry adds this login for itself; a registry of ours has to name it (in-cluster or kubeconfig)
    kopf.on.login(registry=handlers)(kopf.login_via_client)
    kopf.on.startup(registry=handlers)(start)
    kopf.on.cleanup(registry=handlers)(stop)
    kopf.on.probe(id=LIVENESS_PROBE, registry=handlers)(alive)
    return handlers


async def start(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Build the reconciler and start its informers and resync on kopf's event loop."""
    ours: OperatorSettings = memo.settings
    settings.scanning.disabled = True  # no resource handlers: no CRD or namespace watch either
    metrics: OperatorMetrics = memo.get("metrics") or OperatorMetrics()
    kube = Kube(load_configuration(), ours.max_requests, on_request=metrics.request)
    memo.events = events = EventPoster(kube, ours.event_level_number)
    reconciler = Reconciler(kube, ours, events, metrics)
    metrics.observe(lambda: reconciler.queue.depth,
                    lambda: [job.status for job in list(reconciler.observed.jobs.values())])
    loop = asyncio.get_running_loop()
    memo.reconciler = reconciler
    memo.tasks = [loop.create_task(reconciler.resync_forever(), name="resync")]
    memo.tasks += [loop.create_task(informer.run(), name=informer.name)
                   for informer in informers(reconciler, ours.watch_namespaces)]


async def stop(memo: kopf.Memo, **_: Any) -> None:
    for task in memo.get("tasks", ()):
        task.cancel()
    reconciler: Reconciler | None = memo.get("reconciler")
    if reconciler is not None:
        reconciler.queue.close()
        await memo.events.close()
        await reconciler.kube.close()


async def alive(memo: kopf.Memo, **_: Any) -> bool:
    """Liveness: this process's own health, never the API server's.

    The answer comes from the event loop every watch and reconciliation runs on, so an answer means the loop
    is not stuck; and the operator's long-running tasks (informers, resync) must all still run: they retry
    API errors themselves, so one that ended met a bug, which a restart cures. An unreachable API server
    fails neither: a restart cannot bring it back, and operators restarting in a loop through an outage
    only add load when it returns. (The chart has no readiness probe: nothing sends traffic to the pod.)
    """
    ended = [task.get_name() for task in memo.get("tasks", ()) if task.done()]
    if ended:  # permanent: kopf must not retry the probe, the endpoint must fail now
        raise kopf.PermanentError(f"operator tasks ended: {', '.join(ended)}")
    return True
