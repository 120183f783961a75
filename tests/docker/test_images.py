"""Image resolution with no registry reachable, and the offline rebuild's cache."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pytest

from devs_sandbox.errors import ImageUnavailableError
from devs_sandbox.images import ImageRebuilder, ImageRecipe, ImageResolver
from tests.conftest import run_cli
from tests.docker.conftest import BUILT_THIS_SESSION, SESSION

pytestmark = pytest.mark.docker
ABSENT = "devs-test-absent/never-built:1"


def test_a_local_image_resolves_as_is(engine: Any, docker_image: str) -> None:
    got = ImageResolver(engine).resolve(docker_image)
    assert got.source == "local" and got.reference == docker_image
    assert got.runtimes == ("python",) and got.image_id.startswith("sha256:")


def test_the_default_image_resolves_from_the_cache(engine: Any, docker_image: str) -> None:
    rebuilder = ImageRebuilder(engine)
    hit = rebuilder.ensure()
    assert hit.cached and hit.build_s == 0 and hit.reference == docker_image
    assert ImageResolver(engine).resolve(None).reference == docker_image
    assert engine.images.get("devs-sandbox/default:latest").id == hit.image_id


def test_unreachable_registry_falls_back_to_the_rebuilt_default(
    engine: Any, docker_image: str
) -> None:
    got = ImageResolver(engine, pull_timeout_s=10).resolve(ABSENT)
    assert got.source == "rebuilt" and got.reference == docker_image
    assert got.requested == ABSENT


def test_configured_fallbacks_come_before_the_rebuild(engine: Any, docker_image: str) -> None:
    resolver = ImageResolver(engine, fallback_images=["devs-test-absent/other:2", docker_image])
    got = resolver.resolve(ABSENT)
    assert got.source == "fallback" and got.reference == docker_image


def test_every_failed_step_is_named(engine: Any, docker_image: str) -> None:
    resolver = ImageResolver(engine, fallback_images=["devs-test-absent/other:2"], rebuild=False)
    with pytest.raises(ImageUnavailableError) as err:
        resolver.resolve(ABSENT)
    message = str(err.value)
    assert "not present locally" in message and "pull" in message
    assert "devs-test-absent/other:2" in message and "image build" in message


def test_a_hanging_registry_is_abandoned_at_the_pull_timeout(engine: Any) -> None:
    """A registry address that drops packets: the pull either fails or is cut at 1 s."""
    resolver = ImageResolver(engine, pull_timeout_s=1, rebuild=False)
    with pytest.raises(ImageUnavailableError, match="pull"):
        resolver.resolve("10.255.255.1:5000/devs-test/blackholed:1")


def test_pull_can_be_disabled(engine: Any) -> None:
    with pytest.raises(ImageUnavailableError) as err:
        ImageResolver(engine, pull=False, rebuild=False).resolve(ABSENT)
    assert "pull" not in str(err.value).split("; ")[0]


def test_image_build_command_is_instant_when_cached(docker_image: str) -> None:
    r = run_cli("image", "build", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["cached"] is True and out["reference"] == docker_image
    human = run_cli("image", "build")
    assert "cached" in human.stdout
    bad = run_cli("image")
    assert bad.returncode == 2 and "build" in bad.stderr


def _recipe(**changes: Any) -> ImageRecipe:
    data = {
        "name": f"devs-test/rebuild-{SESSION}",
        "suite": "bookworm",
        "variant": "minbase",
        "include": [],
        "runtimes": [],
        "prune": ["var/cache/apt/archives/*.deb", "var/lib/apt/lists/*"],
        "mkdirs": ["workspace"],
        "cmd": ["/bin/sh"],
    }
    data.update(changes)
    return ImageRecipe.from_json(data)


@pytest.mark.slow
@pytest.mark.root
def test_the_offline_build_runs_end_to_end_and_caches(
    engine: Any, docker_image: str, tmp_path: Path
) -> None:
    """debootstrap, prune, import, tag; then the second ensure is a cache hit. Skipped when
    this session already built the default image (a fresh host: the path just ran)."""
    if BUILT_THIS_SESSION and BUILT_THIS_SESSION[0]:
        pytest.skip("the default image was built from scratch in this session")
    recipe = _recipe()
    rebuilder = ImageRebuilder(engine, recipe=recipe, work_root=tmp_path)
    phases: list[str] = []
    try:
        built = rebuilder.ensure(on_progress=lambda p: phases.append(p.phase))
        assert not built.cached and built.reference == recipe.reference
        assert phases[0] == "check" and phases[-1] == "done" and "import" in phases
        again = rebuilder.ensure()
        assert again.cached and again.image_id == built.image_id
        out = engine.containers.run(
            built.reference,
            ["cat", "/etc/devs-sandbox-image.json"],
            remove=True,
            network_mode="none",
            labels={"devs.test": SESSION},
        )
        assert recipe.digest.encode() in out
        assert not list(tmp_path.glob("devs-image-build.*"))  # the build dir is gone
    finally:
        for tag in (recipe.reference, f"{recipe.name}:latest"):
            with contextlib.suppress(Exception):
                engine.images.remove(tag, force=True)


@pytest.mark.root
def test_an_unreachable_mirror_fails_with_the_hint_and_leaves_nothing(
    engine: Any, tmp_path: Path
) -> None:
    rebuilder = ImageRebuilder(
        engine,
        recipe=_recipe(name=f"devs-test/broken-{SESSION}"),
        mirror="http://devs-test.invalid/debian",
        work_root=tmp_path,
    )
    with pytest.raises(ImageUnavailableError, match="DEVS_SANDBOX_DEBIAN_MIRROR"):
        rebuilder.build()
    assert not list(tmp_path.glob("devs-image-build.*"))
    assert rebuilder.cached() is None
