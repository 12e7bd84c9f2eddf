"""Parallelism changes asked for from outside a running job, applied by its training loop between steps.

The controller actor answers calls on a second thread while `fit` runs on the first. A change must
not land while generation or an update is in flight, so a request is queued and the loop applies it at
its next safe point (`serve`); the caller waits for the outcome. Outside the loop (before the first
step, after the last) nothing is in flight and a request is applied at once. Accepted targets are kept
in a TargetStore so a restarted controller puts them back (`reapply`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hybridflow.control.errors import ControlError
from hybridflow.control.store import TargetStore

if TYPE_CHECKING:
    from hybridflow.scheduler import HybridScheduler

log = logging.getLogger(__name__)

Rule = Callable[[str, int], "str | None"]
"""(node, parallelism) -> why the job cannot take it, or None; asked before the scheduler's own checks
(roles, resources), and None for a node it does not know."""


@dataclass(eq=False)
class _Request:
    node: str
    parallelism: int
    reason: str
    action: Callable[[], dict[str, Any]] | None = None
    """Another change than parallelism, run as it is at the safe point."""
    done: threading.Event = field(default_factory=threading.Event)
    result: dict[str, Any] | None = None
    error: BaseException | None = None


class Steering:
    """The queue of outside requests, the checks they pass, and their persisted targets."""

    def __init__(self, scheduler: HybridScheduler, store: TargetStore, rules: Sequence[Rule] = (),
                 on_change: Callable[[], None] | None = None,
                 on_error: Callable[[BaseException], None] | None = None) -> None:
        self.scheduler = scheduler
        self.store = store
        self.rules = list(rules)
        self.on_change = on_change
        self.on_error = on_error
        """Told the original error of a request that failed at a safe point (its caller gets a ControlError):
        a host that died while ranks were rebuilt leaves them apart, and only the loop can recover that."""
        self._lock = threading.Lock()
        self._pending: list[_Request] = []
        self._looping = False

    # -- the caller's side (any thread) -----------------------------------------------------------

    def request(self, node: str, parallelism: int, reason: str, wait_s: float = 600.0) -> dict[str, Any]:
        """Set `node`'s parallelism; returns {node, old, parallelism, colocated}. Raises ControlError,
        having changed nothing, when the job cannot take it or no safe point comes within `wait_s`."""
        self._check(node, parallelism)
        return self._submit(_Request(node, int(parallelism), reason or "no reason given"), wait_s)

    def at_boundary(self, action: Callable[[], dict[str, Any]], wait_s: float = 600.0) -> dict[str, Any]:
        """Run `action` at the loop's next safe point (at once outside the loop) and return what it returns;
        its ControlError reaches the caller as raised, any other error as a ControlError."""
        return self._submit(_Request("", 0, "", action=action), wait_s)

    def _submit(self, req: _Request, wait_s: float) -> dict[str, Any]:
        with self._lock:
            if not self._looping:
                return self._run(req)
            self._pending.append(req)
        if not req.done.wait(wait_s):
            with self._lock:
                if req in self._pending:
                    self._pending.remove(req)
                    raise ControlError(f"no step boundary within {wait_s:g}s (a step is still running); "
                                       "nothing was changed")
            req.done.wait()
        if req.error is not None:
            raise req.error
        assert req.result is not None
        return req.result

    def pending(self) -> bool:
        """Whether a request waits for the next safe point."""
        with self._lock:
            return bool(self._pending)

    def status(self) -> dict[str, Any]:
        """What was asked for: the targets in force, the nodes with sequence parallelism off and the recent
        requests (oldest first)."""
        return self.store.read() | {"pending": len(self._pending), "store": str(self.store.path)}

    # -- the training loop's side -----------------------------------------------------------------

    def open(self) -> None:
        """The loop runs: from now on requests wait for `serve`."""
        with self._lock:
            self._looping = True

    def close(self) -> None:
        """The loop stopped: apply what is still queued, and apply later requests at once."""
        with self._lock:
            self._looping = False
            self._serve_locked()

    def serve(self) -> None:
        """A safe point: nothing is in flight. Apply every queued request in arrival order."""
        with self._lock:
            self._serve_locked()

    def reapply(self) -> None:
        """After the scheduler started: put back the stored targets (a restarted controller)."""
        with self._lock:
            saved = self.store.read()
            reasons = {h["node"]: h.get("reason", "") for h in saved["history"]
                       if h.get("kind", "parallelism") == "parallelism"}
            changed = False
            for node, n in saved["targets"].items():
                problem = self._problem(node, n)
                if problem:
                    log.warning("stored parallelism %d of %s not re-applied: %s", n, node, problem)
                    continue
                why = f"re-applied after a controller restart: {reasons.get(node, 'no reason given')}"
                old = self.scheduler.instance_count(node)
                try:
                    got = self.scheduler.adjust_parallelism(node, n, why, source="Manual")
                except Exception as e:  # train at the planned parallelism rather than not at all
                    log.warning("stored parallelism %d of %s not re-applied: %s", n, node, e)
                    continue
                if got != n:
                    log.warning("stored parallelism %d of %s not re-applied; it stays at %d", n, node, got)
                changed = changed or got != old
            if changed and self.on_change is not None:
                self.on_change()

    # -- internals --------------------------------------------------------------------------------

    def _problem(self, node: str, parallelism: int) -> str | None:
        for rule in self.rules:
            problem = rule(node, parallelism)
            if problem:
                return problem
        return self.scheduler.parallelism_problem(node, parallelism)

    def _check(self, node: str, parallelism: int) -> None:
        problem = self._problem(node, parallelism)
        if problem:
            raise ControlError(problem)

    def _serve_locked(self) -> None:
        queued, self._pending = self._pending, []
        for req in queued:
            try:
                req.result = self._run(req)
            except BaseException as e:
                req.error = e if isinstance(e, ControlError) else ControlError(f"{type(e).__name__}: {e}")
                if self.on_error is not None and not isinstance(e, ControlError):
                    self.on_error(e)
            req.done.set()

    def _run(self, req: _Request) -> dict[str, Any]:
        return req.action() if req.action is not None else self._apply(req)

    def _apply(self, req: _Request) -> dict[str, Any]:
        """Checked again (the job may have moved since the request came in), stored, then applied;
        a failure puts the stored targets back, so neither the job nor the store changes."""
        self._check(req.node, req.parallelism)
        colocated = [n for n in self.scheduler.colocated_with(req.node) if n != req.node]
        old = self.scheduler.instance_count(req.node)
        try:
            before = self.store.record(req.node, colocated, old, req.parallelism, req.reason)
        except OSError as e:
            raise ControlError(f"cannot store the requested parallelism in {self.store.path}: {e}") from None
        seen = len(self.scheduler.decisions)
        try:
            got = self.scheduler.adjust_parallelism(req.node, req.parallelism, req.reason, source="Manual")
        except BaseException:
            self.store.write(before)
            raise
        if got != req.parallelism:
            self.store.write(before)
            why = "; ".join(self.scheduler.decisions[seen:]) or "the scheduler kept it"
            raise ControlError(f"{req.node} stays at parallelism {got}: {why}")
        if got != old and self.on_change is not None:
            self.on_change()
        return {"node": req.node, "old": old, "parallelism": got, "colocated": colocated}
