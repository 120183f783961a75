"""run_code hands back the images its program left in outputs/ (issue 13), for real: the
process driver runs the program, the MCP Python SDK client talks to ``devs-sandbox mcp``
over stdio, the CLI runs as a user runs it.

One program covers the cases: a valid PNG (written by hand with zlib and struct) and an
SVG are returned; ``x.png`` holding text, ``leak.png`` a symlink to /etc/passwd and an
image over the per-image limit are reported as skipped with their reasons; a PNG in a
subdirectory and a text file are not looked at; the program exits 3, and its images
still come back.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

pytest.importorskip("mcp")

from mcp import Client

from devs_sandbox.mcp_server.schemas import RunCodeOutput, ShellOutput, inline_refs
from devs_sandbox.tools.code import run_code
from devs_sandbox.tools.outputs import MAX_IMAGE_BYTES, OUTPUT_DIR_ENV, image_type
from tests.conftest import run_cli
from tests.contracts import SHELL_OUTPUT_KEYS, tool_answer
from tests.integration.test_mcp_stdio import Server, error_text

pytestmark = [pytest.mark.integration, pytest.mark.mcp]

PROGRAM = f"""
import os, struct, sys, zlib

out = os.environ[{OUTPUT_DIR_ENV!r}]
assert os.path.realpath(out) == os.path.realpath("outputs") and not os.listdir(out)


def chunk(kind, body):
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


# A 2x1 RGB PNG: signature, IHDR, one IDAT (filter byte 0 and two pixels), IEND.
png = (
    b"\\x89PNG\\r\\n\\x1a\\n"
    + chunk(b"IHDR", struct.pack(">IIBBBBB", 2, 1, 8, 2, 0, 0, 0))
    + chunk(b"IDAT", zlib.compress(b"\\x00\\xff\\x00\\x00\\x00\\x00\\xff"))
    + chunk(b"IEND", b"")
)
with open(os.path.join(out, "plot.png"), "wb") as f:
    f.write(png)
with open(os.path.join(out, "chart.svg"), "w") as f:
    f.write('<?xml version="1.0"?>\\n<!-- a chart -->\\n'
            '<svg xmlns="http://www.w3.org/2000/svg" width="4" height="4"><rect/></svg>\\n')
with open(os.path.join(out, "x.png"), "w") as f:
    f.write("this is text, not a PNG\\n")
os.symlink("/etc/passwd", os.path.join(out, "leak.png"))
with open(os.path.join(out, "huge.png"), "wb") as f:
    f.write(png + b"\\0" * {MAX_IMAGE_BYTES})
os.mkdir(os.path.join(out, "sub"))
with open(os.path.join(out, "sub", "inner.png"), "wb") as f:
    f.write(png)
with open(os.path.join(out, "notes.txt"), "w") as f:
    f.write("not an image name\\n")
print("saved")
sys.exit(3)
"""
RETURNED = {"chart.svg": "image/svg+xml", "plot.png": "image/png"}
SKIPPED = {
    "huge.png": "larger than",
    "leak.png": "symbolic link",
    "x.png": "content is not an image",
}


def check_skipped(skipped: list[dict[str, Any]]) -> None:
    by_name = {s["name"]: s["reason"] for s in skipped}
    assert set(by_name) == set(SKIPPED), skipped
    for name, words in SKIPPED.items():
        assert words in by_name[name], (name, by_name[name])


def test_the_library_returns_the_images() -> None:
    got = run_code(PROGRAM, "python")
    assert got.exit_code == 3 and got.result.stdout.text == "saved\n", got.result.stderr.text
    assert {i.name: i.mime_type for i in got.images.images} == RETURNED
    for image in got.images.images:
        assert image_type(image.data) == image.mime_type
    check_skipped([s.to_json() for s in got.images.skipped])


def test_the_library_without_images_returns_none() -> None:
    got = run_code("print('hi')", "python")
    assert got.exit_code == 0 and not got.images
    assert got.images.to_json() == {"images": [], "skipped_images": []}


def test_a_text_file_named_svg_is_reported() -> None:
    """SVG is judged by its root element; a DOCTYPE with entity definitions is refused."""
    code = (
        'import os\nd = os.environ["DEVS_SANDBOX_OUTPUT_DIR"]\n'
        'open(d + "/page.svg", "w").write("<html><svg/></html>")\n'
        'open(d + "/bomb.svg", "w").write(\'<!DOCTYPE svg [<!ENTITY a "x">]><svg/>\')\n'
        'open(d + "/ok.svg", "w").write("<svg/>")\n'
    )
    got = run_code(code, "python")
    assert [i.name for i in got.images.images] == ["ok.svg"]
    assert sorted(s.name for s in got.images.skipped) == ["bomb.svg", "page.svg"]


def test_the_cli_lists_and_saves_the_images(tmp_path: Path) -> None:
    program = tmp_path / "plot.py"
    program.write_text(PROGRAM)
    saved = tmp_path / "saved"
    r = run_cli(
        "run", "--json", "--code", str(program), "--language", "python", "--outputs", str(saved)
    )
    assert r.returncode == 3, r.stderr
    out = json.loads(r.stdout)
    assert {i["name"]: i["mime_type"] for i in out["images"]} == RETURNED
    for image in out["images"]:
        path = Path(image["path"])
        assert path.parent == saved and path.name == image["name"]
        assert image_type(path.read_bytes()) == image["mime_type"]
        assert path.stat().st_size == image["size_bytes"]
    assert sorted(p.name for p in saved.iterdir()) == sorted(RETURNED)
    check_skipped(out["skipped_images"])
    # Without --outputs: listed, not saved; --outputs without --code is refused.
    r = run_cli("run", "--json", "--code", str(program), "--language", "python")
    out = json.loads(r.stdout)
    assert r.returncode == 3 and all("path" not in i for i in out["images"])
    r = run_cli("run", "--outputs", str(saved), "--", "true")
    assert r.returncode == 125 and "--outputs DIR goes with --code" in r.stderr


def test_mcp_run_code_answers_images_as_image_content(tmp_path: Path) -> None:
    server = Server(tmp_path)
    listed_schema = inline_refs(RunCodeOutput.model_json_schema())
    plain_schema = inline_refs(ShellOutput.model_json_schema())

    async def scenario(client: Client) -> None:
        tools = {t.name: t for t in (await client.list_tools()).tools}
        # No outputSchema (the output goes once, in the text): nothing for a client to
        # hold structuredContent against, and none is sent.
        assert tools["run_code"].output_schema is None
        r = await server.call(client, "run_code", {"language": "python", "code": PROGRAM})
        assert not r.is_error and r.structured_content is None
        data = tool_answer(r)
        jsonschema.validate(data, listed_schema)
        assert data["exit_code"] == 3 and data["stdout"] == "saved\n"
        text, *images = r.content
        assert text.type == "text" and len(images) == 2
        assert [i["name"] for i in data["images"]] == ["chart.svg", "plot.png"]
        for block, listing in zip(images, data["images"], strict=True):
            assert block.type == "image" and block.mime_type == listing["mime_type"]
            raw = base64.b64decode(block.data, validate=True)
            assert len(raw) == listing["size_bytes"] and image_type(raw) == block.mime_type
        assert block.data not in r.content[0].text  # the bytes go once
        check_skipped(data["skipped_images"])

        # No images: the answer of before, one JSON text block with the shell keys.
        r = await server.call(client, "run_code", {"language": "python", "code": "print(1)"})
        assert len(r.content) == 1 and set(tool_answer(r)) == SHELL_OUTPUT_KEYS
        jsonschema.validate(tool_answer(r), plain_schema)

        # Killed by the monitor after saving a plot: the error carries it too.
        code = (
            PROGRAM.replace("sys.exit(3)", "")
            + "\nimport time\nhog = bytearray(256 << 20)\ntime.sleep(60)\n"
        )
        r = await server.call(
            client,
            "run_code",
            {
                "language": "python",
                "code": code,
                "rss_limit_bytes": 96 << 20,
                "poll_interval_ms": 50,
            },
        )
        assert "exceeded rss limit" in error_text(r)
        details = tool_answer(r)
        assert details["error"] == "resource_limit_exceeded"
        assert [i["name"] for i in details["images"]] == ["chart.svg", "plot.png"]
        assert [b.mime_type for b in r.content[2:]] == ["image/svg+xml", "image/png"]

    server.run(scenario)
    server.assert_nothing_left()


def test_outputs_is_not_written_through_a_link_planted_in_it(tmp_path: Path) -> None:
    """A link in DIR named like an image the program leaves (say, planted by an earlier
    run's workload copied out) is not followed: the run is refused (125), the target kept."""
    program = tmp_path / "plot.py"
    program.write_text(PROGRAM)
    saved = tmp_path / "saved"
    saved.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    for name in RETURNED:
        (saved / name).symlink_to(victim)
    r = run_cli(
        "run", "--json", "--code", str(program), "--language", "python", "--outputs", str(saved)
    )
    assert r.returncode == 125, r.stderr
    assert "--outputs" in r.stderr
    assert victim.read_text() == "keep me\n"
