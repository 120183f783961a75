"""Runtime gating: which runtime a command needs, the checker, and the lifecycle's fallback
from the process driver to Docker. Scripted drivers stand in for the backends."""

from __future__ import annotations

import pytest

from devs_sandbox.config import SandboxLifecycleConfig, override
from devs_sandbox.drivers.fake import FakeDriver
from devs_sandbox.errors import UnsupportedRuntimeError
from devs_sandbox.lifecycle import SandboxLifecycleManager
from devs_sandbox.runtimes import RuntimeCompatibilityChecker, required_runtime

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("argv", "runtime"),
    [
        (["python3", "-c", "1"], "python"),
        (["/usr/bin/python3.11", "x.py"], "python"),
        (["pip", "install", "x"], "python"),
        (["node", "x.js"], "node"),
        (["npm", "test"], "node"),
        (["go", "build"], "go"),
        (["cargo", "build"], "rust"),
        (["/bin/sh", "-c", "FOO=1 cargo test --all"], "rust"),
        (["sh", "-c", "exec env -i PATH=/bin npx jest"], "node"),
        (["env", "A=1", "python", "x.py"], "python"),
        (["sh", "-c", "echo hi"], None),
        (["true"], None),
        (["gofmtx"], None),
        (["sh", "-c", "'unbalanced"], None),
    ],
)
def test_required_runtime(argv: list[str], runtime: str | None) -> None:
    assert required_runtime(argv) == runtime


class _RuntimeDriver(FakeDriver):
    def __init__(self, name: str, runtimes: frozenset[str] | None) -> None:
        super().__init__()
        self.name = name
        self.runtimes = runtimes
        self.asked = 0

    def provided_runtimes(self, config: SandboxLifecycleConfig) -> frozenset[str] | None:
        self.asked += 1
        return self.runtimes


def test_checker_gates_by_runtime_and_suggests_the_other_driver() -> None:
    checker = RuntimeCompatibilityChecker()
    process = _RuntimeDriver("process", frozenset({"python"}))
    cfg = SandboxLifecycleConfig()
    assert checker.check(process, cfg, ["python3", "-c", "1"]) == "python"
    assert checker.check(process, cfg, ["ls"]) is None
    with pytest.raises(UnsupportedRuntimeError) as err:
        checker.check(process, cfg, ["cargo", "build"])
    assert err.value.runtime == "rust" and err.value.suggested_driver == "docker"
    assert "fallbackDriver" in str(err.value)
    assert process.asked == 1  # cached per driver and image
    unknown = _RuntimeDriver("docker", None)
    assert checker.check(unknown, cfg, ["cargo"]) == "rust"  # cannot tell: not gated
    assert checker.check(FakeDriver(), cfg, ["cargo"]) == "rust"  # no RuntimeProvider


def _manager(process: FakeDriver, docker: FakeDriver) -> SandboxLifecycleManager:
    manager = SandboxLifecycleManager(store=None, reap_orphans=False)
    manager._drivers.update({"process": process, "docker": docker})
    return manager


def test_lifecycle_falls_back_to_docker_only_when_configured() -> None:
    process = _RuntimeDriver("process", frozenset({"python"}))
    docker = _RuntimeDriver("docker", frozenset({"python", "node"}))
    manager = _manager(process, docker)
    plain = SandboxLifecycleConfig()
    with pytest.raises(UnsupportedRuntimeError):
        manager.config_for(plain, ["node", "x.js"])
    chosen = manager.config_for(override(plain, fallback_driver="docker"), ["node", "x.js"])
    assert chosen.driver == "docker"
    assert manager.config_for(plain, ["python3"]).driver == "process"
    with pytest.raises(UnsupportedRuntimeError) as err:  # the fallback lacks it too
        manager.config_for(override(plain, fallback_driver="docker"), ["go", "build"])
    assert err.value.runtime == "go"


def test_run_in_sandbox_uses_the_fallback_driver() -> None:
    process = _RuntimeDriver("process", frozenset())
    docker = _RuntimeDriver("docker", frozenset({"node"}))
    manager = _manager(process, docker)
    out = manager.run_in_sandbox(
        ["node", "-e", "1"], override(SandboxLifecycleConfig(), fallback_driver="docker")
    )
    assert out.driver == "docker"
    manager.shutdown()
