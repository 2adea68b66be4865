"""A server URL that cannot be parsed is a typed configuration error, and its scheme reads in any case.

``Channel.connect`` used to let urllib's ValueError through for a port out of range or an unclosed IPv6
bracket (a traceback from the CLI, which reports only splitspec's errors), and took ``WSS://`` for a URL
without TLS, which websockets (reading the scheme in any case) then refused with a ValueError too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from splitspec.exceptions import ConfigError, TransportError
from splitspec.transport.client import Channel


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("ws://127.0.0.1:99999", "Port out of range"),
        ("ws://[::1", "Invalid IPv6 URL"),
        ("ws://127.0.0.1:-1", "Port could not be cast"),
        ("http://127.0.0.1:8765", "scheme isn't ws or wss"),
        ("ws://:8765", "hostname isn't provided"),
    ],
)
async def test_an_unparsable_url_is_a_config_error(url: str, why: str) -> None:
    with pytest.raises(ConfigError, match=f"invalid server URL .*{why}"):
        await Channel.connect(url, max_message_bytes=1 << 20, timeout_s=2.0)


async def test_an_upper_case_wss_url_uses_tls(tmp_path: Path) -> None:
    missing = tmp_path / "missing-ca.pem"
    # the CA file is read for a WSS:// URL (it used to be refused: "not a wss:// URL")
    with pytest.raises(ConfigError, match="cannot load TLS CA file"):
        await Channel.connect("WSS://127.0.0.1:1", max_message_bytes=1 << 20, timeout_s=2.0, ca_file=missing)
    # and without one, the connection is attempted with TLS (no server listens on port 1: refused)
    with pytest.raises(TransportError, match=r"cannot connect to WSS://127\.0\.0\.1:1"):
        await Channel.connect("WSS://127.0.0.1:1", max_message_bytes=1 << 20, timeout_s=2.0)
