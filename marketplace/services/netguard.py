"""Outbound requests to addresses tenants choose (webhooks) must not reach the MSP's own network.

`resolve_public(url)` parses an http(s) URL, resolves its host and returns the addresses it may
connect to; it refuses (``AddressRefused``) when any address is loopback, private, link-local (the
cloud metadata service 169.254.169.254 included), multicast, reserved, unspecified or otherwise not
globally routable, IPv6 included (IPv4-mapped and NAT64 forms are checked as the IPv4 they carry).
The caller then connects to exactly the checked address (no second lookup, so no DNS rebinding).
`TESSERA_WEBHOOK_ALLOW_NETWORKS` (CIDRs) lists internal networks an MSP deliberately allows.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from django.conf import settings

IP = ipaddress.IPv4Address | ipaddress.IPv6Address
METADATA = {ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254"),
            ipaddress.ip_address("100.100.100.200")}  # AWS/GCP/Azure, AWS IPv6, Alibaba
NAT64 = ipaddress.ip_network("64:ff9b::/96")


class AddressRefused(Exception):
    """The URL is not one Tessera will send to; the message says why (operators' detail)."""


@dataclass(frozen=True)
class Target:
    scheme: str
    host: str
    port: int
    path: str  # path + query
    addresses: tuple[str, ...]


def allowed_networks() -> list:
    return [ipaddress.ip_network(n, strict=False) for n in getattr(settings, "TESSERA_WEBHOOK_ALLOW_NETWORKS", [])]


def _embedded_v4(ip: IP) -> ipaddress.IPv4Address | None:
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return ip.ipv4_mapped
        if ip in NAT64:
            return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if ip.sixtofour is not None:
            return ip.sixtofour
    return None


def refusal(ip: IP) -> str | None:
    """Why `ip` may not be a webhook target, or None when it may."""
    if any(ip in n for n in allowed_networks() if n.version == ip.version):
        return None
    inner = _embedded_v4(ip)
    if inner is not None:
        why = refusal(inner)
        return f"{why} (as {ip})" if why else None
    for test, what in ((ip in METADATA, "a cloud metadata address"), (ip.is_loopback, "a loopback address"),
                       (ip.is_link_local, "a link-local address"), (ip.is_multicast, "a multicast address"),
                       (ip.is_private, "a private address"), (ip.is_unspecified, "the unspecified address"),
                       (ip.is_reserved, "a reserved address"), (not ip.is_global, "not a public address")):
        if test:
            return f"{ip} is {what}"
    return None


def parse(url: str) -> tuple[str, str, int, str]:
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise AddressRefused(f"not a valid URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise AddressRefused("must be an http(s) URL with a host")
    if parts.username or parts.password:
        raise AddressRefused("credentials in the URL are not allowed")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return parts.scheme, parts.hostname, port or (443 if parts.scheme == "https" else 80), path


def resolve_public(url: str) -> Target:
    scheme, host, port, path = parse(url)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise AddressRefused(f"{host} does not resolve: {exc}") from None
    addresses = []
    for *_, sockaddr in infos:
        address = sockaddr[0]
        if not isinstance(address, str):  # (int, bytes): an IPv6 address from a Python built without IPv6
            raise AddressRefused(f"{host} resolves to an address this Python cannot read")
        ip = ipaddress.ip_address(address.split("%", 1)[0])
        why = refusal(ip)
        if why:
            raise AddressRefused(f"{host} resolves to {why}")
        if str(ip) not in addresses:
            addresses.append(str(ip))
    if not addresses:
        raise AddressRefused(f"{host} has no address")
    return Target(scheme, host, port, path, tuple(addresses))
