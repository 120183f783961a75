"""Helpers for tests that run real sandboxes on this host."""

from __future__ import annotations

import time
from typing import Any

import psutil

from tests.helpers import config, manager

__all__ = ["config", "manager", "processes_with", "wait_for"]


def processes_with(marker: str) -> list[psutil.Process]:
    """Host processes whose argv[0] starts with ``marker`` (set with ``exec -a``), so the
    shell or CLI that merely mentions the marker in its arguments does not count."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            argv = p.info["cmdline"] or ()
            if argv and argv[0].startswith(marker):
                found.append(p)
        except psutil.Error:
            continue
    return found


def wait_for(predicate: Any, timeout: float = 10.0, interval: float = 0.02) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


# Every combination of layers this host can offer, for "each layer alone kills everything".
WEAKER = {"allow_weaker_isolation": True}
LAYERS = {
    "full": {},
    "unshare": {"use_bwrap": False},
    "cgroup-only": {"namespaces": False, **WEAKER},
    "pidns-only": {"use_cgroups": False},
    "unshare-pidns-only": {"use_bwrap": False, "use_cgroups": False},
}
# The namespace launchers, for attacker tests that must hold at every isolation level.
LAUNCHERS = {"bwrap": {}, "unshare": {"use_bwrap": False}}
