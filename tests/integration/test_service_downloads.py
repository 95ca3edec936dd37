"""A folder downloaded through the service (``GET /v1/sandboxes/{id}/archive``): the tar the
service packs again is on disk and streamed, never held in its memory (nor in the client's),
and its cap counts the whole tar, headers included, not only the files' contents.

The folder that shows it costs almost nothing in the sandbox: one 1-byte file 15 folders of
250 characters deep and thousands of hard links to it with 246-character names. Each link is
~9 KB of tar headers (its name and its target's, as pax records) for no content at all."""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest

from stockade import Limits
from stockade import exceptions as exc
from stockade.client import Client, RemoteSandbox
from tests.conftest import require_tier
from tests.integration.service_env import Server, Tokens, embedded_server

pytestmark = [pytest.mark.process]

MiB = 1024 * 1024
CAP = 64 * MiB  # the service's max_upload_bytes, as shipped
LINK_HEADERS = 9 * 1024  # at least, for one hard link below


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Tokens, Path]]:
    require_tier("process")
    with embedded_server(tmp_path_factory.mktemp("service"), storage_mb=64) as running:
        yield running


@pytest.fixture
def sbx(service: tuple[Server, Tokens, Path]) -> Iterator[RemoteSandbox]:
    server, tokens, _ = service
    limits = Limits(memory_mb=512, timeout_s=120)
    with (
        Client(server.url, tokens.acme) as client,
        RemoteSandbox.create(tier="process", limits=limits, client=client) as made,
    ):
        yield made


def hard_links(sbx: RemoteSandbox, count: int) -> None:
    """``deep/.../f`` (1 byte) and ``count`` hard links to it beside it, under ``links/``."""
    script = (
        "import os\n"
        "d = 'links/' + '/'.join(c * 250 for c in 'abcdefghijklmno')\n"
        "os.makedirs(d); os.chdir(d); open('f', 'w').write('x')\n"
        f"for i in range({count}): os.link('f', ('%06d' % i) * 41)\n"
    )
    made = sbx.commands.run(f'cd /workspace && python3 -c "{script}"', timeout_s=120)
    assert made.exit_code == 0, made.stderr


def peak_rss(server: Server) -> int:
    """The server process's peak resident memory so far (VmHWM), in bytes."""
    status = Path(f"/proc/{server.pid}/status").read_text()
    line = next(line for line in status.splitlines() if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def test_an_archive_whose_headers_pass_the_cap_is_refused(
    service: tuple[Server, Tokens, Path], sbx: RemoteSandbox, tmp_path: Path
) -> None:
    count = 8_000
    assert count * LINK_HEADERS > CAP  # 8,000 bytes of content, ~75 MB of tar
    hard_links(sbx, count)
    with pytest.raises(exc.FileTooLarge) as refused:
        sbx.files.download_dir(tmp_path / "down", "links", max_entries=count + 100)
    assert "headers count" in str(refused.value)
    assert not (tmp_path / "down").exists()  # all or nothing
    # on the wire: the API's typed problem for oversize, as an upload over its cap gets
    server, tokens, _ = service
    response = httpx2.get(
        f"{server.url}/v1/sandboxes/{sbx.id}/archive",
        params={"path": "links", "max_entries": count + 100},
        headers={"Authorization": f"Bearer {tokens.acme}"},
        timeout=120,
    )
    assert response.status_code == 413
    assert response.headers["content-type"] == "application/problem+json"
    assert response.json()["title"] == "File too large"


def test_a_downloaded_archive_is_streamed_from_disk_not_held_in_memory(
    service: tuple[Server, Tokens, Path], sbx: RemoteSandbox, tmp_path: Path
) -> None:
    count = 6_000
    assert 48 * MiB < count * LINK_HEADERS < CAP  # a tar of ~55 MB, under the cap
    hard_links(sbx, count)
    server, _, _ = service
    before = peak_rss(server)
    tracemalloc.start()  # the client's side, in this process
    try:
        got = sbx.files.download_dir(tmp_path / "down", "links", max_entries=count + 100)
        client_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got.hard_links == count and got.bytes_written == 1
    # the client unpacks the tar as it arrives: it never holds the whole of it either
    assert client_peak < 16 * MiB, f"the client held {client_peak / MiB:.0f} MiB"
    # Held in memory, the tar alone would raise the peak by its ~55 MB (it was ~14 KB an
    # entry: 84 MB here); packed to disk and streamed, the peak barely moves.
    grown = peak_rss(server) - before
    assert grown < 24 * MiB, f"the server's peak memory grew by {grown / MiB:.0f} MiB"


def test_a_file_read_through_the_service_is_held_once_on_each_side(
    service: tuple[Server, Tokens, Path], sbx: RemoteSandbox
) -> None:
    # A sparse file: nothing in the sandbox, 128 MiB to read. Gathered and joined, it was held
    # twice by the server's sandbox, once more as the server framed it whole, and twice by the
    # client (its pieces, then joined); once on each side now, and the pieces in transit.
    size = 128 * MiB
    made = sbx.commands.run(f"truncate -s {size - 1} sparse && printf a >> sparse")
    assert made.exit_code == 0, made.stderr
    server, _, _ = service
    Path(f"/proc/{server.pid}/clear_refs").write_text("5")  # its peak, from here on
    before = peak_rss(server)
    tracemalloc.start()  # the client's side, in this process
    try:
        data = sbx.files.read("sparse", format="bytes")
        client_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(data) == size and data[-1:] == b"a"
    del data
    assert client_peak < size + 8 * MiB, f"the client held {client_peak / MiB:.0f} MiB"
    grown = peak_rss(server) - before
    assert grown < size + 32 * MiB, f"the server's peak memory grew by {grown / MiB:.0f} MiB"


def test_a_download_of_more_entries_than_fit_under_the_cap_stops_at_that_many(
    service: tuple[Server, Tokens, Path], tmp_path: Path
) -> None:
    # A tar entry is 512 bytes at least: 64 MiB holds 131,070 of them. Asked for a million,
    # the service unpacks no more than that many before refusing, not a million.
    server, tokens, _ = service
    limits = Limits(memory_mb=2048, inodes=150_000, timeout_s=120)
    with (
        Client(server.url, tokens.acme) as client,
        RemoteSandbox.create(tier="process", limits=limits, client=client) as sbx,
    ):
        made = sbx.commands.run("mkdir many && cd many && seq 1 140000 | xargs touch", timeout_s=120)
        assert made.exit_code == 0, made.stderr
        with pytest.raises(exc.FileTooLarge) as refused:
            sbx.files.download_dir(tmp_path / "down", "many", max_entries=1_000_000)
    assert "at most 131,070" in str(refused.value) and "no more fit" in str(refused.value)
    assert not (tmp_path / "down").exists()
