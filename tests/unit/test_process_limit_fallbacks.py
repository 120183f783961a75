"""What the memory and process limits become when no cgroup holds them, as each run's
warnings say it: pure decisions of the process driver's plan and spawn steps."""

from __future__ import annotations

import os
import resource
from pathlib import Path

import pytest

from devs_sandbox.drivers.process.plan import limit_fallbacks
from devs_sandbox.drivers.process.spawn import rlimits, tasks_of_uid
from devs_sandbox.drivers.process.state import Box
from devs_sandbox.isolation import SANDBOX_UID_BASE, SANDBOX_UID_SPAN, is_sandbox_uid
from tests.helpers import config

pytestmark = pytest.mark.unit


def test_memory_is_said_to_be_address_space_and_processes_per_uid() -> None:
    notes = limit_fallbacks(config(quotas={"process_count_limit": 7}), 1000)
    assert len(notes) == 2
    assert notes[0].startswith("memory:") and "RLIMIT_AS" in notes[0]
    assert "RLIMIT_NPROC of uid 1000" in notes[1] and "7 beyond" in notes[1]


def test_an_explicit_address_space_limit_needs_no_memory_note() -> None:
    notes = limit_fallbacks(config(quotas={"address_space_bytes": 1 << 30}), SANDBOX_UID_BASE)
    assert notes == ()  # and a uid of the sandbox's own holds RLIMIT_NPROC exactly


def test_root_is_told_it_has_no_process_limit() -> None:
    assert any("does not hold root" in n for n in limit_fallbacks(config(), 0))


def test_sandbox_uids_are_its_own_and_others_are_shared() -> None:
    assert is_sandbox_uid(SANDBOX_UID_BASE) and is_sandbox_uid(
        SANDBOX_UID_BASE + SANDBOX_UID_SPAN - 1
    )
    assert not is_sandbox_uid(SANDBOX_UID_BASE + SANDBOX_UID_SPAN)
    assert not is_sandbox_uid(65534) and not is_sandbox_uid(1000) and not is_sandbox_uid(0)


def test_tasks_of_uid_counts_our_threads() -> None:
    mine = tasks_of_uid(os.getuid())
    assert mine >= 1  # this process at least
    assert tasks_of_uid(SANDBOX_UID_BASE + SANDBOX_UID_SPAN - 2) == 0


def _nproc(uid: int) -> int:
    box = Box("sb-x", config(quotas={"process_count_limit": 5}), Path("/nonexistent"), uid, uid, ())
    return dict(rlimits(box))[resource.RLIMIT_NPROC]


def test_a_shared_uid_gets_the_limit_on_top_of_its_tasks_and_its_own_uid_gets_it_exactly() -> None:
    assert _nproc(SANDBOX_UID_BASE + 3) == 5
    assert _nproc(os.getuid()) >= 5 + 1
