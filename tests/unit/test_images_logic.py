"""The default image's recipe and the host mirror lookup: data in, data out, no engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from devs_sandbox.images import ImageRecipe, host_debian_mirror

pytestmark = pytest.mark.unit


def test_recipe_hash_is_stable_and_changes_with_content() -> None:
    a = ImageRecipe.load()
    assert a.reference == ImageRecipe.load().reference
    assert a.reference.startswith("devs-sandbox/default:") and len(a.tag) == 12
    b = ImageRecipe.from_json({"name": a.name, "suite": a.suite, "include": ["python3", "git"]})
    assert b.digest != a.digest
    assert any(c.startswith("LABEL devs.recipe.sha256=") for c in a.changes())
    assert "python" in a.runtimes


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.mark.parametrize(
    ("files", "mirror"),
    [
        (
            {
                "sources.list.d/debian.sources": "Types: deb\nURIs: http://m.example/debian\n"
                "Suites: bookworm bookworm-updates\nComponents: main\n\n"
                "Types: deb\nURIs: http://sec.example\nSuites: bookworm-security\n"
            },
            "http://m.example/debian",
        ),
        (
            {
                "sources.list.d/off.sources": "Enabled: no\nTypes: deb\nURIs: http://off\n"
                "Suites: bookworm\n",
                "sources.list": "# comment\n"
                "deb [arch=amd64] http://one.example/debian bookworm main\n",
            },
            "http://one.example/debian",
        ),
        ({"sources.list": "deb http://x/debian bullseye main\n"}, None),
    ],
)
def test_host_debian_mirror(tmp_path: Path, files: dict[str, str], mirror: str | None) -> None:
    for rel, text in files.items():
        _write(tmp_path / rel, text)
    assert host_debian_mirror("bookworm", tmp_path) == mirror
