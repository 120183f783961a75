"""devs.config.json: defaults, camelCase keys, errors that name the key, schema drift."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from devs_sandbox.config import (
    SCHEMA_FILE_NAME,
    DevsConfig,
    SandboxLifecycleConfig,
    override,
    parse_config,
    render_schema,
)
from devs_sandbox.config_trust import load_config
from devs_sandbox.errors import ConfigError

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def test_defaults_match_the_specification() -> None:
    cfg = DevsConfig()
    s = cfg.sandbox
    assert s.driver == "process"
    assert s.timeout_ms == 300_000
    assert s.quotas.file_count_limit == 10_000
    assert s.quotas.process_count_limit == 512
    assert s.quotas.directory_depth_limit == 20
    assert s.quotas.poll_interval_ms == 2_000
    assert s.max_output_bytes == 1024 * 1024
    assert s.network is False


def test_camel_case_keys_are_read() -> None:
    cfg = parse_config(
        {"sandbox": {"timeoutMs": 5000, "quotas": {"fileCountLimit": 42, "memoryBytes": 2**26}}}
    )
    assert cfg.sandbox.timeout_ms == 5000
    assert cfg.sandbox.quotas.file_count_limit == 42
    assert cfg.sandbox.quotas.memory_bytes == 2**26


@pytest.mark.parametrize(
    ("data", "key", "words"),
    [
        (
            {"sandbox": {"quotas": {"fileCountLimit": -5}}},
            "sandbox.quotas.fileCountLimit",
            "greater",
        ),
        ({"sandbox": {"timeoutMs": "300"}}, "sandbox.timeoutMs", "integer"),
        ({"sandbox": {"timeoutMs": 1.5}}, "sandbox.timeoutMs", "integer"),
        ({"sandbox": {"quotas": {"bogus": 1}}}, "sandbox.quotas.bogus", "unknown key"),
        ({"sandbox": {"network": "yes"}}, "sandbox.network", "boolean"),
        ({"sandbox": {"sandboxId": "../etc"}}, "sandbox.sandboxId", "invalid sandbox id"),
        ({"sandbox": {"driver": "vm"}}, "sandbox.driver", "process"),
        ({"sbx": {}}, "sbx", "unknown key"),
    ],
)
def test_bad_values_name_the_key(data: dict, key: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(data, source="devs.config.json")
    assert info.value.key == key
    assert key in str(info.value)
    assert words in str(info.value)


def test_top_level_must_be_object() -> None:
    with pytest.raises(ConfigError, match="JSON object"):
        parse_config([1, 2])


def test_load_reports_invalid_json_with_position(tmp_path: Path) -> None:
    p = tmp_path / "devs.config.json"
    p.write_text('{"sandbox": {"timeoutMs": 5,}}')
    with pytest.raises(ConfigError, match="line 1 column"):
        load_config(p)


def test_explicit_missing_file_is_an_error_implicit_is_not(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.json")
    assert load_config(cwd=tmp_path) == DevsConfig()


def test_file_in_working_directory_is_found(tmp_path: Path) -> None:
    (tmp_path / "devs.config.json").write_text(json.dumps({"sandbox": {"timeoutMs": 1234}}))
    assert load_config(cwd=tmp_path).sandbox.timeout_ms == 1234


def test_override_revalidates_and_merges_nested() -> None:
    base = SandboxLifecycleConfig()
    cfg = override(base, timeout_ms=10, quotas={"memory_bytes": 64 * 2**20})
    assert cfg.timeout_ms == 10
    assert cfg.quotas.memory_bytes == 64 * 2**20
    assert cfg.quotas.file_count_limit == base.quotas.file_count_limit
    with pytest.raises(ConfigError, match="processCountLimit"):
        override(base, quotas={"process_count_limit": 0})


def test_config_is_frozen() -> None:
    cfg = SandboxLifecycleConfig()
    with pytest.raises(Exception, match="frozen"):
        cfg.timeout_ms = 5  # type: ignore[misc]


def test_committed_schema_matches_the_model() -> None:
    committed = (ROOT / SCHEMA_FILE_NAME).read_text()
    assert committed == render_schema(), (
        "devs.config.json.schema drifted from the model: run "
        "`devs-sandbox config schema > devs.config.json.schema`"
    )


def test_schema_documents_defaults_and_ranges() -> None:
    schema = json.loads(render_schema())
    quotas = schema["$defs"]["QuotaConfig"]["properties"]
    assert quotas["fileCountLimit"]["default"] == 10_000
    assert quotas["fileCountLimit"]["minimum"] == 1
    assert quotas["processCountLimit"]["default"] == 512
    assert quotas["directoryDepthLimit"]["default"] == 20
    assert "description" in quotas["pollIntervalMs"]
