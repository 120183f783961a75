"""SandboxSessions over FakeDriver with a manual clock: limits, reaping, closing, exec, and
ownership (one owner cannot find, use, kill or destroy another's sandbox, nor learn why
one ended)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from devs_sandbox.base import ExecRequest
from devs_sandbox.config import McpConfig, SandboxLifecycleConfig
from devs_sandbox.drivers.fake import FakeDriver, FakeSandbox, killed_result, ok_result
from devs_sandbox.errors import (
    ExecTimeoutError,
    QuotaExceededError,
    ResourceLimitExceededError,
    SandboxNotFoundError,
    SessionLimitError,
)
from devs_sandbox.lifecycle import SandboxLifecycleManager
from devs_sandbox.lifecycle.sampling import ScriptedProcessStats
from devs_sandbox.lifecycle.timeout import SandboxTimeoutEnforcer
from devs_sandbox.models import DetectionRule, ExecResult, TreeSample, Violation, ViolationType
from devs_sandbox.scheduler import FakeScheduler
from devs_sandbox.tools.sessions import (
    ENDED_MEMORY,
    OWNED_MEMORY,
    OwnerLimitError,
    SandboxSessions,
    ServerClosingError,
)
from devs_sandbox.tools.shell import MonitoredShellOptions

pytestmark = pytest.mark.unit
CFG = SandboxLifecycleConfig(driver="fake")
PRIME = TreeSample(rss_bytes=1 << 20, cpu_percent=None)


class PidDriver(FakeDriver):
    def provision(self, config: SandboxLifecycleConfig, **kw: Any) -> Any:
        ctx = super().provision(config, **kw)
        self.sandboxes[ctx.id].pid = 777
        return ctx


def make(
    *,
    idle: float = 60.0,
    total: float = 600.0,
    most: int = 3,
    per_owner: int | None = None,
    handler: Any = None,
) -> tuple[SandboxSessions, FakeDriver, FakeScheduler]:
    sched = FakeScheduler()
    driver = PidDriver(exec_handler=handler or (lambda _sb, _cmd: ok_result("ok\n")))
    manager = SandboxLifecycleManager(
        driver, store=None, enforcer=SandboxTimeoutEnforcer(scheduler=sched)
    )
    sessions = SandboxSessions(
        manager,
        idle_timeout_s=idle,
        total_timeout_s=total,
        max_sandboxes=most,
        max_per_owner=per_owner,
        scheduler=sched,
    )
    return sessions, driver, sched


def test_create_use_destroy_and_a_second_destroy_says_why() -> None:
    sessions, driver, _ = make()
    sb = sessions.create(CFG)
    assert sessions.ids() == [sb.id] and len(sessions) == 1
    assert sb.config.timeout_ms == 600_000  # the session's lifetime is its total timeout
    with sessions.use(sb.id) as same:
        assert same is sb
    sessions.destroy(sb.id)
    assert driver.destroyed == [sb.id] and len(sessions) == 0
    with pytest.raises(SandboxNotFoundError) as err:
        sessions.destroy(sb.id)
    assert err.value.detail == "destroyed by sandbox_destroy"
    assert "destroyed by sandbox_destroy" in str(err.value)


def test_an_unknown_id_is_not_found_without_a_story() -> None:
    sessions, _, _ = make()
    with pytest.raises(SandboxNotFoundError) as err, sessions.use("sb-never"):
        pass
    assert err.value.detail == "" and str(err.value) == "no such sandbox: 'sb-never'"


def test_idle_sessions_are_reaped_busy_ones_are_not() -> None:
    sessions, driver, sched = make(idle=10.0)
    quiet = sessions.create(CFG)
    busy = sessions.create(CFG)
    with sessions.use(busy.id):
        sched.advance(30.0)  # a long call: busy is not idle
        assert quiet.id in driver.destroyed and busy.id not in driver.destroyed
    sched.advance(9.0)
    assert busy.id not in driver.destroyed  # idle counts from the end of its last call
    sched.advance(2.0)
    assert busy.id in driver.destroyed and len(sessions) == 0
    with pytest.raises(SandboxNotFoundError) as err, sessions.use(quiet.id):
        pass
    assert "10 s without a call (mcp.sessionIdleTimeoutS)" in str(err.value)
    assert sched.pending() == 0  # the reaper sleeps while there is nothing to reap


def test_the_total_timeout_reaps_even_a_busy_session() -> None:
    sessions, driver, sched = make(idle=1_000.0, total=100.0)
    sb = sessions.create(CFG)
    with sessions.use(sb.id):
        sched.advance(101.0)
    assert driver.destroyed == [sb.id]
    with pytest.raises(SandboxNotFoundError, match=r"100 s lifetime \(mcp.sessionTimeoutS\)"):
        sessions.remaining_s(sb.id)


def test_max_sandboxes_counts_sessions_and_one_shot_runs() -> None:
    sessions, driver, _ = make(most=2)
    a = sessions.create(CFG)
    with sessions.slot():
        with pytest.raises(SessionLimitError) as err:
            sessions.create(CFG)
        assert "mcp.maxSessions" in str(err.value) and err.value.limit == 2
        with pytest.raises(SessionLimitError), sessions.slot():
            pass
    b = sessions.create(CFG)  # the slot was given back
    sessions.destroy(a.id)
    sessions.create(CFG)
    assert len(driver.provisioned) == 3 and b.id in sessions.ids()


def test_a_failed_provision_gives_its_slot_back() -> None:
    sessions, driver, _ = make(most=1)
    driver.fail_provision = True
    for _ in range(3):
        with pytest.raises(Exception, match="scripted provision failure"):
            sessions.create(CFG)
    driver.fail_provision = False
    sessions.create(CFG)


def test_close_destroys_everything_and_refuses_new_work() -> None:
    sessions, driver, sched = make()
    ids = {sessions.create(CFG).id for _ in range(3)}
    sessions.close()
    assert set(driver.destroyed) == ids and len(sessions) == 0 and sched.pending() == 0
    sessions.close()  # idempotent
    with pytest.raises(ServerClosingError):
        sessions.create(CFG)
    with pytest.raises(ServerClosingError), sessions.slot():
        pass
    with pytest.raises(SandboxNotFoundError, match="when the server stopped"):
        sessions.destroy(next(iter(ids)))


def test_a_create_that_finishes_after_close_is_destroyed() -> None:
    sessions, driver, _ = make()
    real = driver.provision

    def provision_then_close(config: SandboxLifecycleConfig, **kw: Any) -> Any:
        ctx = real(config, **kw)
        sessions.close()  # the server stops while this sandbox is being made
        return ctx

    driver.provision = provision_then_close  # type: ignore[method-assign]
    with pytest.raises(ServerClosingError):
        sessions.create(CFG)
    assert len(driver.destroyed) == 1


def test_ended_reasons_are_remembered_for_a_while() -> None:
    sessions, _, _ = make(most=1)
    first = sessions.create(CFG).id
    sessions.destroy(first)
    for _ in range(ENDED_MEMORY):
        sessions.destroy(sessions.create(CFG).id)
    with pytest.raises(SandboxNotFoundError) as err:
        sessions.destroy(first)
    assert err.value.detail == ""  # forgotten: the memory is bounded


def test_bad_construction_is_refused() -> None:
    manager = SandboxLifecycleManager(FakeDriver(), store=None)
    with pytest.raises(ValueError, match="positive"):
        SandboxSessions(manager, idle_timeout_s=0, total_timeout_s=1, max_sandboxes=1)
    s = SandboxSessions.from_config(manager, McpConfig(max_sessions=5))
    assert (s.max_sandboxes, s.idle_timeout_s, s.total_timeout_s) == (5, 900.0, 3_600.0)
    s.close()


# -- exec -------------------------------------------------------------------------------------
OPTS = MonitoredShellOptions(rss_limit_bytes=10 << 20)


def test_exec_runs_in_the_session_and_keeps_it() -> None:
    sessions, driver, sched = make()
    sb = sessions.create(CFG)
    r = sessions.exec(
        sb.id, "echo ok", OPTS, timeout_s=5, stats=ScriptedProcessStats([PRIME]), scheduler=sched
    )
    assert r.stdout.text == "ok\n"
    assert driver.sandboxes[sb.id].commands == [["/bin/sh", "-c", "echo ok"]]
    assert sessions.ids() == [sb.id]


def test_a_kill_in_a_session_raises_and_the_session_survives() -> None:
    def runs(sb: FakeSandbox, _cmd: Sequence[str]) -> ExecResult:
        return killed_result() if sb.stopped.is_set() else ok_result()

    sessions, driver, sched = make(handler=runs)
    sb = sessions.create(CFG)
    hog = ScriptedProcessStats([TreeSample(rss_bytes=20 << 20, cpu_percent=None)])
    with pytest.raises(ResourceLimitExceededError) as err:
        sessions.exec(sb.id, "hog", OPTS, timeout_s=5, stats=hog, scheduler=sched)
    assert err.value.pid == 777 and err.value.reason == "rss"
    assert sessions.ids() == [sb.id] and driver.sandboxes[sb.id].force_stops == 1


def test_an_exec_timeout_raises_with_the_partial_result() -> None:
    def slow(_sb: FakeSandbox, _cmd: Sequence[str]) -> ExecResult:
        r = ok_result("partial\n")
        return ExecResult(137, r.stdout, r.stderr, 5.0, timed_out=True, signal=9)

    sessions, _driver, sched = make(handler=slow)
    sb = sessions.create(CFG)
    with pytest.raises(ExecTimeoutError) as err:
        sessions.exec(
            sb.id,
            "sleep 9",
            OPTS,
            timeout_s=5,
            stats=ScriptedProcessStats([PRIME]),
            scheduler=sched,
        )
    assert err.value.timeout_s == pytest.approx(5.0)
    assert err.value.result is not None and err.value.result.stdout.text == "partial\n"
    assert sessions.ids() == [sb.id]


def test_the_exec_timeout_is_capped_by_the_sessions_remaining_life() -> None:
    seen: list[float | None] = []
    sessions, driver, sched = make(idle=1_000.0, total=100.0)
    real_exec = driver.exec

    def spy(ctx: Any, request: ExecRequest) -> ExecResult:
        seen.append(request.timeout_s)
        return real_exec(ctx, request)

    driver.exec = spy  # type: ignore[method-assign]
    sb = sessions.create(CFG)
    sched.advance(70.0)
    sessions.exec(
        sb.id, "x", OPTS, timeout_s=300, stats=ScriptedProcessStats([PRIME]), scheduler=sched
    )
    assert seen == [pytest.approx(30.0)]


def test_a_quota_violation_ends_the_session() -> None:
    sessions, driver, sched = make()
    sb = sessions.create(CFG)
    v = Violation(sb.id, ViolationType.FILE_COUNT_EXCEEDED, 11, 10, DetectionRule.THRESHOLD)
    sessions.manager.detector.enforce_quota(v)
    with pytest.raises(QuotaExceededError) as err:
        sessions.exec(
            sb.id, "x", OPTS, timeout_s=5, stats=ScriptedProcessStats([PRIME]), scheduler=sched
        )
    assert err.value.violation.type == ViolationType.FILE_COUNT_EXCEEDED
    assert sb.id in driver.destroyed and len(sessions) == 0
    with pytest.raises(SandboxNotFoundError, match="terminated for FILE_COUNT_EXCEEDED"):
        sessions.destroy(sb.id)


def test_reaching_the_lifetime_during_a_call_ends_the_session() -> None:
    sessions, driver, sched = make(total=10.0)

    def long_call(sb: FakeSandbox, _cmd: Sequence[str]) -> ExecResult:
        sched.advance(11.0)  # the session's total timeout fires meanwhile
        return killed_result() if sb.stopped.is_set() else ok_result()

    driver.exec_handler = long_call
    sb = sessions.create(CFG)
    with pytest.raises(SandboxNotFoundError, match="lifetime"):
        sessions.exec(
            sb.id, "x", OPTS, timeout_s=60, stats=ScriptedProcessStats([PRIME]), scheduler=sched
        )
    assert sb.id in driver.destroyed


def test_kill_stops_the_processes_but_keeps_the_session() -> None:
    sessions, driver, _ = make()
    sb = sessions.create(CFG)
    sessions.kill(sb.id)
    sessions.kill("sb-unknown")  # nothing to do
    assert driver.sandboxes[sb.id].force_stops == 1 and sessions.ids() == [sb.id]
    sessions.end(sb.id, "test over")
    sessions.end(sb.id, "again")  # no-op
    with pytest.raises(SandboxNotFoundError, match="test over"):
        sessions.destroy(sb.id)


# -- ownership --------------------------------------------------------------------------------
def _not_found(call: Any) -> SandboxNotFoundError:
    with pytest.raises(SandboxNotFoundError) as err:
        call()
    return err.value


def test_another_owner_finds_nothing_and_learns_nothing() -> None:
    sessions, driver, sched = make()
    mine = sessions.create(CFG, owner="alice")
    stats = ScriptedProcessStats([PRIME])
    attempts = {
        "use": lambda: sessions.use(mine.id, owner="mallory").__enter__(),
        "exec": lambda: sessions.exec(
            mine.id, "ls", OPTS, timeout_s=5, owner="mallory", stats=stats, scheduler=sched
        ),
        "remaining_s": lambda: sessions.remaining_s(mine.id, owner="mallory"),
        "destroy": lambda: sessions.destroy(mine.id, owner="mallory"),
    }
    never = _not_found(lambda: sessions.destroy("sb-000000000000", owner="mallory"))
    for name, attempt in attempts.items():
        err = _not_found(attempt)
        # Word for word what an id that never existed gets.
        assert (err.detail, str(err)) == ("", str(never).replace("sb-000000000000", mine.id)), name
    sessions.kill(mine.id, owner="mallory")
    assert driver.sandboxes[mine.id].force_stops == 0 and driver.sandboxes[mine.id].commands == []
    assert sessions.ids(owner="mallory") == [] and sessions.ids(owner="alice") == [mine.id]
    # Still alice's, untouched.
    r = sessions.exec(
        mine.id, "echo", OPTS, timeout_s=5, owner="alice", stats=stats, scheduler=sched
    )
    assert r.stdout.text == "ok\n"
    # Why it ended is alice's to know, not mallory's.
    sessions.destroy(mine.id, owner="alice")
    assert _not_found(lambda: sessions.destroy(mine.id, owner="mallory")).detail == ""
    assert _not_found(lambda: sessions.destroy(mine.id, owner="alice")).detail == (
        "destroyed by sandbox_destroy"
    )


def test_end_owner_destroys_only_that_owners_sandboxes_and_refuses_it_more() -> None:
    sessions, driver, _ = make(most=5)
    a1, a2 = sessions.create(CFG, owner="a"), sessions.create(CFG, owner="a")
    b1 = sessions.create(CFG, owner="b")
    assert sorted(sessions.end_owner("a", "its MCP session ended")) == sorted([a1.id, a2.id])
    assert sorted(driver.destroyed) == sorted([a1.id, a2.id]) and sessions.ids() == [b1.id]
    assert sessions.owned_ids("a") == [] and sessions.owned_ids("b") == [b1.id]
    assert sessions.end_owner("a", "again") == []  # idempotent
    with pytest.raises(ServerClosingError):
        sessions.create(CFG, owner="a")
    with pytest.raises(ServerClosingError), sessions.slot(owner="a"):
        pass
    sessions.create(CFG, owner="b")  # the others carry on


def test_a_create_that_finishes_after_its_owner_ended_is_destroyed() -> None:
    sessions, driver, _ = make()
    real = driver.provision

    def provision_then_end(config: SandboxLifecycleConfig, **kw: Any) -> Any:
        ctx = real(config, **kw)
        sessions.end_owner("a", "its MCP session ended")  # the client left meanwhile
        return ctx

    driver.provision = provision_then_end  # type: ignore[method-assign]
    with pytest.raises(ServerClosingError):
        sessions.create(CFG, owner="a")
    assert len(driver.destroyed) == 1 and len(sessions) == 0


def test_owned_ids_name_sessions_and_one_shot_runs_newest_last() -> None:
    sessions, _, _ = make(most=5)
    s1 = sessions.create(CFG, owner="a")
    with sessions.slot(owner="a", sandbox_id="sb-oneshot0001"):
        pass
    with sessions.slot(owner="b", sandbox_id="sb-oneshot0002"):
        pass
    sessions.destroy(s1.id, owner="a")  # a destroyed sandbox's rows are still the owner's
    assert sessions.owned_ids("a") == [s1.id, "sb-oneshot0001"]
    assert sessions.owned_ids("b") == ["sb-oneshot0002"] and sessions.owned_ids("c") == []
    for i in range(OWNED_MEMORY):
        with sessions.slot(owner="a", sandbox_id=f"sb-{i:012d}"):
            pass
    owned = sessions.owned_ids("a")
    assert len(owned) == OWNED_MEMORY and owned[-1] == f"sb-{OWNED_MEMORY - 1:012d}"


def test_one_owner_cannot_take_every_slot() -> None:
    sessions, _, _ = make(most=4, per_owner=2)
    sessions.create(CFG, owner="a")
    with sessions.slot(owner="a"):
        with pytest.raises(OwnerLimitError) as err:
            sessions.create(CFG, owner="a")
        assert err.value.limit == 2 and "mcp.maxSessionsPerClient" in str(err.value)
        assert isinstance(err.value, SessionLimitError)  # the MCP tool error is the same kind
        sessions.create(CFG, owner="b")  # another client still gets in
    sessions.create(CFG, owner="a")  # the one-shot slot came back
    sessions.create(CFG, owner="c")
    with pytest.raises(SessionLimitError) as glob:
        sessions.create(CFG, owner="d")  # the global cap still holds
    assert not isinstance(glob.value, OwnerLimitError)
