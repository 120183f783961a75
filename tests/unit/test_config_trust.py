"""Configuration trust: the operator's layers merge; a working directory's file only tightens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from devs_sandbox.config import DevsConfig
from devs_sandbox.config_trust import (
    RULES,
    Rule,
    is_tighter_or_equal,
    leaf_paths,
    load_config,
    load_layered_config,
)
from devs_sandbox.errors import ConfigError, UntrustedConfigError

pytestmark = pytest.mark.unit


def write(path: Path, data: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def places(tmp_path: Path) -> dict[str, Path]:
    return {
        "system": tmp_path / "etc" / "config.json",
        "user": tmp_path / "home" / "config.json",
        "repo": tmp_path / "repo",
    }


def load(places: dict[str, Path], explicit: Path | None = None, env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    places["repo"].mkdir(exist_ok=True)
    return load_layered_config(
        explicit,
        cwd=places["repo"],
        env=env or {},
        system_path=places["system"],
        user_path=places["user"],
    )


def test_every_leaf_of_the_model_has_a_rule_and_no_rule_is_stale() -> None:
    leaves = set(leaf_paths(DevsConfig))
    assert leaves - set(RULES) == set(), "classify the new field in config_trust.RULES"
    assert set(RULES) - leaves == set(), "a rule names a field that no longer exists"


def test_layers_merge_in_order_and_sources_name_them(places: dict[str, Path]) -> None:
    write(places["system"], {"sandbox": {"timeoutMs": 50_000, "quotas": {"memoryBytes": 1 << 30}}})
    write(places["user"], {"sandbox": {"timeoutMs": 40_000}})
    loaded = load(places)
    assert loaded.config.sandbox.timeout_ms == 40_000
    assert loaded.config.sandbox.quotas.memory_bytes == 1 << 30
    assert loaded.source("sandbox.timeoutMs") == str(places["user"])
    assert loaded.source("sandbox.quotas.memoryBytes") == str(places["system"])
    assert loaded.source("sandbox.quotas.diskBytes") == "default"
    explicit = write(places["repo"].parent / "op.json", {"sandbox": {"timeoutMs": 30_000}})
    assert load(places, explicit).config.sandbox.timeout_ms == 30_000
    env_file = write(places["repo"].parent / "env.json", {"sandbox": {"timeoutMs": 20_000}})
    via_env = load(places, env={"DEVS_SANDBOX_CONFIG": str(env_file)})
    assert via_env.config.sandbox.timeout_ms == 20_000
    assert via_env.source("sandbox.timeoutMs") == str(env_file)


@pytest.mark.parametrize(
    ("sandbox", "key"),
    [
        ({"isolation": {"runAsUser": "current"}}, "sandbox.isolation.runAsUser"),
        ({"isolation": {"useBwrap": False}}, "sandbox.isolation.useBwrap"),
        ({"isolation": {"namespaces": False}}, "sandbox.isolation.namespaces"),
        ({"isolation": {"seccomp": False}}, "sandbox.isolation.seccomp"),
        ({"isolation": {"useCgroups": False}}, "sandbox.isolation.useCgroups"),
        ({"isolation": {"tmpfsWorkspace": False}}, "sandbox.isolation.tmpfsWorkspace"),
        ({"isolation": {"allowWeakerIsolation": True}}, "sandbox.isolation.allowWeakerIsolation"),
        ({"isolation": {"hidePaths": []}}, "sandbox.isolation.hidePaths"),
        ({"network": True}, "sandbox.network"),
        ({"fallbackDriver": "docker"}, "sandbox.fallbackDriver"),
        ({"driver": "docker"}, "sandbox.driver"),
        ({"copyIn": "/root/.ssh"}, "sandbox.copyIn"),
        ({"image": "attacker/image"}, "sandbox.image"),
        ({"quotas": {"memoryBytes": 8 << 30}}, "sandbox.quotas.memoryBytes"),
        ({"quotas": {"cpuCores": None}}, "sandbox.quotas.cpuCores"),
        ({"timeoutMs": 86_400_000}, "sandbox.timeoutMs"),
        ({"quotas": {"growthLookaheadTicks": 0}}, "sandbox.quotas.growthLookaheadTicks"),
        # The models also accept Python names: the rule must hold for those too.
        ({"isolation": {"use_bwrap": False}}, "sandbox.isolation.useBwrap"),
        ({"quotas": {"memory_bytes": 8 << 30}}, "sandbox.quotas.memoryBytes"),
        ({"quotas": {"addressSpaceBytes": 1 << 40}}, "sandbox.quotas.addressSpaceBytes"),
    ],
)
def test_a_working_directory_file_that_weakens_is_refused_naming_key_and_file(
    places: dict[str, Path], sandbox: dict[str, Any], key: str
) -> None:
    repo_file = write(places["repo"] / "devs.config.json", {"sandbox": sandbox})
    with pytest.raises(UntrustedConfigError) as err:
        load(places)
    assert err.value.key == key and err.value.path == repo_file
    assert key in str(err.value) and str(repo_file) in str(err.value)
    assert err.value.path == repo_file
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"store": {"path": "/tmp/elsewhere.db"}}, "store.path"),
        ({"environment": {"extraAllow": ["DATABASE_URL"]}}, "environment.extraAllow"),
        ({"mcp": {"maxTimeoutS": 86_400}}, "mcp.maxTimeoutS"),
        ({"sandbox": {"ray": {"address": "10.0.0.9:6379"}}}, "sandbox.ray.address"),
        ({"sandbox": {"kubernetes": {"hostUsers": True, "appArmor": False}}}, None),
        ({"sandbox": {"kubernetes": {"namespace": "prod"}}}, "sandbox.kubernetes.namespace"),
    ],
)
def test_weakening_outside_the_sandbox_section_is_refused_too(
    places: dict[str, Path], data: dict[str, Any], key: str | None
) -> None:
    write(places["repo"] / "devs.config.json", data)
    if key is None:  # the defaults restated: nothing weakened
        load(places)
        return
    with pytest.raises(UntrustedConfigError) as err:
        load(places)
    assert err.value.key == key


def test_a_working_directory_file_may_lower_the_per_client_share_but_not_raise_it(
    places: dict[str, Path],
) -> None:
    """One HTTP client's share of the MCP sandboxes: a repository's file may set or lower
    it (tighter), never raise it above the operator's nor unset it (no share at all)."""
    repo_file = places["repo"] / "devs.config.json"
    write(repo_file, {"mcp": {"maxSessionsPerClient": 2}})
    assert load(places).config.mcp.max_sessions_per_client == 2  # unset (no share) -> 2
    write(places["user"], {"mcp": {"maxSessionsPerClient": 4}})
    write(repo_file, {"mcp": {"maxSessionsPerClient": 3}})
    assert load(places).config.mcp.max_sessions_per_client == 3
    for weaker in (5, None):
        write(repo_file, {"mcp": {"maxSessionsPerClient": weaker}})
        with pytest.raises(UntrustedConfigError) as err:
            load(places)
        assert err.value.key == "mcp.maxSessionsPerClient"


def test_a_tightening_working_directory_file_is_honoured(places: dict[str, Path]) -> None:
    write(
        places["repo"] / "devs.config.json",
        {
            "sandbox": {
                "timeoutMs": 1000,
                "env": {"FROM_REPO": "1"},
                "preflightCommands": ["true"],
                "quotas": {"memoryBytes": 64 << 20, "cpuCores": 0.5},
                "isolation": {
                    "hidePaths": ["/home", "/root", "/run/user", "/var/run/docker.sock", "/srv"],
                    "required": ["seccomp"],
                },
            },
            "environment": {"extraDeny": ["INTERNAL_*"]},
        },
    )
    loaded = load(places)
    sb = loaded.config.sandbox
    assert sb.timeout_ms == 1000 and sb.quotas.memory_bytes == 64 << 20
    assert "/srv" in sb.isolation.hide_paths and sb.isolation.required == ("seccomp",)
    assert loaded.source("sandbox.timeoutMs").endswith("devs.config.json")
    assert loaded.untrusted is not None


def test_the_working_directory_file_is_judged_against_the_operators_not_the_defaults(
    places: dict[str, Path],
) -> None:
    write(places["user"], {"sandbox": {"quotas": {"memoryBytes": 256 << 20}}})
    write(places["repo"] / "devs.config.json", {"sandbox": {"quotas": {"memoryBytes": 512 << 20}}})
    with pytest.raises(UntrustedConfigError, match="memoryBytes"):
        load(places)  # the built-in default (2 GiB) is higher, but the operator said 256 MiB


def test_an_explicit_config_is_trusted_and_the_working_directory_file_then_ignored(
    places: dict[str, Path], tmp_path: Path
) -> None:
    write(places["repo"] / "devs.config.json", {"sandbox": {"isolation": {"runAsUser": "current"}}})
    op = write(tmp_path / "op.json", {"sandbox": {"network": True}})
    loaded = load(places, op)
    assert loaded.config.sandbox.network is True
    assert loaded.config.sandbox.isolation.run_as_user == "auto"
    assert loaded.untrusted is None


def test_each_file_is_validated_on_its_own_and_named(places: dict[str, Path]) -> None:
    write(places["user"], {"sandbox": {"timeoutMs": "soon"}})
    with pytest.raises(ConfigError, match=str(places["user"])):
        load(places)
    places["user"].unlink()
    missing = places["repo"].parent / "nope.json"
    with pytest.raises(ConfigError, match="not found"):
        load(places, missing)


def test_load_config_applies_the_trust_rule_for_library_users(tmp_path: Path) -> None:
    (tmp_path / "devs.config.json").write_text(
        json.dumps({"sandbox": {"isolation": {"useBwrap": False}}})
    )
    with pytest.raises(UntrustedConfigError):
        load_config(cwd=tmp_path)
    assert load_config(tmp_path / "devs.config.json").sandbox.isolation.use_bwrap is False


@pytest.mark.parametrize(
    ("rule", "old", "new", "ok"),
    [
        (Rule.LOWER, 10, 5, True),
        (Rule.LOWER, 10, 11, False),
        (Rule.LOWER, None, 5, True),
        (Rule.LOWER, 5, None, False),
        (Rule.HIGHER, 2, 3, True),
        (Rule.HIGHER, 2, 0, False),
        (Rule.SUPERSET, ["a"], ["a", "b"], True),
        (Rule.SUPERSET, ["a", "b"], ["b"], False),
        (Rule.SUBSET, ["a", "b"], ["a"], True),
        (Rule.SUBSET, [], ["X"], False),
        (Rule.TRUE_TIGHT, False, True, True),
        (Rule.TRUE_TIGHT, True, False, False),
        (Rule.FALSE_TIGHT, True, False, True),
        (Rule.FALSE_TIGHT, False, True, False),
        (Rule.OPERATOR, "auto", "auto", True),
        (Rule.OPERATOR, "auto", "nobody", False),
        (Rule.FREE, {"A": "1"}, {"B": "2"}, True),
    ],
)
def test_rules(rule: Rule, old: Any, new: Any, ok: bool) -> None:
    assert is_tighter_or_equal(rule, old, new) is ok


NUMERIC = [k for k, r in RULES.items() if r is Rule.LOWER and k.startswith("sandbox.quotas.")]


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    changes=st.dictionaries(
        st.sampled_from(NUMERIC), st.integers(min_value=1, max_value=1 << 34), max_size=4
    )
)
def test_whatever_an_implicit_file_gets_accepted_is_at_least_as_tight(
    tmp_path_factory: pytest.TempPathFactory, changes: dict[str, int]
) -> None:
    base = tmp_path_factory.mktemp("prop")
    quotas = {k.rsplit(".", 1)[1]: v for k, v in changes.items()}
    (base / "devs.config.json").write_text(json.dumps({"sandbox": {"quotas": quotas}}))
    defaults = DevsConfig().sandbox.quotas.model_dump(by_alias=True)
    try:
        loaded = load_layered_config(
            None, cwd=base, env={}, system_path=base / "none", user_path=base / "none2"
        )
    except ConfigError:
        return  # out of range for the model, or weakening: refused either way
    effective = loaded.config.sandbox.quotas.model_dump(by_alias=True)
    for key in quotas:
        old, new = defaults[key], effective[key]
        assert old is None or (new is not None and new <= old), (key, old, new)


def test_a_relative_config_path_in_the_environment_is_refused(places: dict[str, Path]) -> None:
    write(places["repo"] / "devs.config.json", {"sandbox": {"network": True}})
    with pytest.raises(ConfigError, match="absolute"):
        load(places, env={"DEVS_SANDBOX_CONFIG": "devs.config.json"})
