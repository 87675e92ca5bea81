"""Who the client is behind proxies, and whose budget its failed authentications take
(issue "Security, round four", finding 7), without a server: FORWARDED_ALLOW_IPS refuses
every way of trusting every address (teamdesk/config.py); ``X-Forwarded-For`` never
makes text that is not an address the client, nor falls back to the entry the client
writes itself (api/middleware.py); and an IPv6 client's bucket is its /64, but a 6to4 or
Teredo client's its IPv4 address's (api/deps.py). The real server:
tests/process/test_api_forwarded_hops.py."""

from __future__ import annotations

import asyncio
import ipaddress
from typing import Any

import pytest
from starlette.types import Message, Receive, Scope, Send

from api import deps, middleware
from teamdesk import config
from teamdesk.config import ConfigError

LOCAL = tuple(map(ipaddress.ip_network, ["127.0.0.1/32", "::1/128"]))  # uvicorn's default
PROXIES = tuple(map(ipaddress.ip_network, ["10.0.0.0/8", "127.0.0.1/32"]))


# --- FORWARDED_ALLOW_IPS ---------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        "*",
        " * ",
        "10.0.0.1,*",
        "0.0.0.0/0",
        "::/0",
        "0.0.0.0/0,::/0",
        "127.0.0.1, 0.0.0.0/0",
        "0.0.0.0/1,128.0.0.0/1",  # together, every IPv4 address
        "::/1,8000::/1",
        "1.2.3.4/0",  # a host with prefix length 0: every address
    ],
)
def test_trusting_every_address_is_refused_like_a_star(value: str) -> None:
    with pytest.raises(ConfigError) as refused:
        config.trusted_proxies({"FORWARDED_ALLOW_IPS": value})
    assert str(refused.value) == config.MSG_TRUST_ALL
    assert "FORWARDED_ALLOW_IPS='*'" in config.MSG_TRUST_ALL and "0.0.0.0/0" in config.MSG_TRUST_ALL


@pytest.mark.parametrize("value", ["proxy.internal", "10.0.0.0/33", "10.0.0.0/8;1.2.3.4"])
def test_an_entry_that_is_no_address_is_refused(value: str) -> None:
    with pytest.raises(ConfigError, match="is not an IP address or network"):
        config.trusted_proxies({"FORWARDED_ALLOW_IPS": value})


def test_addresses_and_ranges_are_read_as_networks() -> None:
    assert config.trusted_proxies({}) == LOCAL
    assert config.trusted_proxies({"FORWARDED_ALLOW_IPS": " 10.1.2.3/8 ,, 2001:db8::/32 "}) == (
        ipaddress.ip_network("10.0.0.0/8"),
        ipaddress.ip_network("2001:db8::/32"),
    )


# --- X-Forwarded-For ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("peer", "forwarded_for", "client"),
    [
        # The reported case: a trusted hop appended, the client's own entry before it.
        ("127.0.0.1", "evil-1, 127.0.0.1", "127.0.0.1"),
        ("127.0.0.1", "evil-1", "127.0.0.1"),
        ("127.0.0.1", "203.0.113.5, evil-1, 127.0.0.1", "127.0.0.1"),
        ("127.0.0.1", "", "127.0.0.1"),
        ("127.0.0.1", " , ", "127.0.0.1"),
        # Every hop trusted: the hop the nearest proxy appended, not the leftmost.
        ("10.0.0.9", "10.6.6.6, 10.0.0.5", "10.0.0.5"),
        # The usual cases: the rightmost hop that is not a proxy.
        ("127.0.0.1", "203.0.113.5", "203.0.113.5"),
        ("127.0.0.1", "198.51.100.1, 203.0.113.5", "203.0.113.5"),
        ("10.0.0.9", "198.51.100.1, 203.0.113.5, 10.0.0.5", "203.0.113.5"),
        ("127.0.0.1", "[2001:db8::7]:4711", "2001:db8::7"),
        ("127.0.0.1", "203.0.113.5:4711", "203.0.113.5"),
        ("127.0.0.1", "::ffff:203.0.113.5", "203.0.113.5"),
        ("::ffff:127.0.0.1", "203.0.113.5", "203.0.113.5"),  # a dual-stack socket's peer
        # A peer that is not a trusted proxy: the header is the client's own text.
        ("203.0.113.9", "127.0.0.1", "203.0.113.9"),
        ("testclient", "127.0.0.1", "testclient"),
        (None, "127.0.0.1", None),
    ],
)
def test_the_client_behind_trusted_proxies(
    peer: str | None, forwarded_for: str, client: str | None
) -> None:
    assert middleware.forwarded_client(peer, forwarded_for, PROXIES) == client


def run(scope: Scope) -> dict[str, Any]:
    """``scope`` as the app behind :class:`api.middleware.ForwardedClient` sees it."""
    seen: dict[str, Any] = {}

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.update(scope)

    async def nothing() -> Message:
        return {"type": "http.disconnect"}

    async def drop(message: Message) -> None:
        pass

    asyncio.run(middleware.ForwardedClient(app, trusted=lambda: LOCAL)(scope, nothing, drop))
    return seen


def http(peer: str, *headers: tuple[bytes, bytes]) -> Scope:
    return {"type": "http", "client": (peer, 5000), "scheme": "http", "headers": list(headers)}


def test_the_middleware_sets_the_client_and_scheme_from_a_trusted_peer_only() -> None:
    forwarded = (b"x-forwarded-for", b"evil-1, 203.0.113.5")
    https = (b"x-forwarded-proto", b"https")
    seen = run(http("127.0.0.1", forwarded, https))
    assert (seen["client"], seen["scheme"]) == (("203.0.113.5", 0), "https")
    seen = run(http("203.0.113.9", forwarded, https))
    assert (seen["client"], seen["scheme"]) == (("203.0.113.9", 5000), "http")
    # Two X-Forwarded-For headers are one list, in order.
    two = run(http("127.0.0.1", (b"x-forwarded-for", b"198.51.100.1"), forwarded))
    assert two["client"] == ("203.0.113.5", 0)
    garbage = run(http("127.0.0.1", (b"x-forwarded-for", b"evil-1, 127.0.0.1")))
    assert garbage["client"][0] == "127.0.0.1"


# --- whose budget --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "subject"),
    [
        ("203.0.113.5", "203.0.113.5"),
        ("::ffff:203.0.113.5", "203.0.113.5"),
        ("2001:db8:1:2::1", "2001:db8:1:2::/64"),
        ("2001:db8:1:2:ffff::9", "2001:db8:1:2::/64"),
        # 6to4: 2002:WWXX:YYZZ::/48 is the IPv4 host WW.XX.YY.ZZ, 65,536 /64s of it.
        ("2002:cb00:7105::1", "203.0.113.5"),
        ("2002:cb00:7105:ffff:1::9", "203.0.113.5"),
        # Teredo: 2001:0::/32, the client's IPv4 address obfuscated in the last 32 bits.
        ("2001:0:4136:e378:8000:63bf:3fff:fdd2", "192.0.2.45"),
        ("2001:0:4136:e378:8000:1234:3fff:fdd2", "192.0.2.45"),
        ("evil-1", "unknown"),
        ("testclient", "unknown"),
        ("", "unknown"),
    ],
)
def test_whose_budget(address: str, subject: str) -> None:
    assert deps.auth_subject(address) == subject


def test_a_6to4_host_has_one_bucket_however_many_64s_it_holds() -> None:
    subjects = {deps.auth_subject(f"2002:cb00:7105:{n:x}::1") for n in range(0, 65536, 257)}
    assert subjects == {"203.0.113.5"}
