"""Outbound requests to addresses tenants choose (webhooks) must not reach the MSP's own network.

`resolve_public(url)` parses an http(s) URL, resolves its host and returns the addresses it may
connect to; it refuses (``AddressRefused``) when any address is loopback, private, link-local (the
cloud metadata service 169.254.169.254 included), multicast, reserved, unspecified or otherwise not
globally routable, IPv6 included (IPv4-mapped and NAT64 forms are checked as the IPv4 they carry).
The caller then connects to exactly the checked address (no second lookup, so no DNS rebinding).
`TESSERA_WEBHOOK_ALLOW_NETWORKS` (CIDRs) lists internal networks an MSP deliberately allows.

What a refusal tells the requester (``AddressRefused.public``) never depends on DNS: a name that does not
resolve, one that resolves to an internal address, one whose lookup times out and an internal literal address
all read the same, so registering URLs cannot map the MSP's internal names. The detail (``str()``: which
address, what kind) is for operators only.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
from dataclasses import dataclass
from urllib.parse import urlsplit

from django.conf import settings

IP = ipaddress.IPv4Address | ipaddress.IPv6Address
METADATA = {ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254"),
            ipaddress.ip_address("100.100.100.200")}  # AWS/GCP/Azure, AWS IPv6, Alibaba
NAT64 = ipaddress.ip_network("64:ff9b::/96")


#: what a requester reads about every refusal that depends on the host's addresses
NOT_PUBLIC = "its host must resolve to public internet addresses only"


class AddressRefused(Exception):
    """The URL is not one Tessera will send to. ``str()`` says why (the operators' detail, which may name what
    the host resolved to); ``public`` is what the requester may read."""

    def __init__(self, detail: str, public: str = NOT_PUBLIC):
        super().__init__(detail)
        self.public = public


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
        raise AddressRefused(f"not a valid URL: {exc}", public=f"not a valid URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise AddressRefused("must be an http(s) URL with a host", public="it must be an http(s) URL with a host")
    if parts.username or parts.password:
        raise AddressRefused("credentials in the URL are not allowed",
                             public="credentials in the URL are not allowed")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return parts.scheme, parts.hostname, port or (443 if parts.scheme == "https" else 80), path


def resolve_public(url: str, timeout: float | None = None) -> Target:
    """The URL's target with its checked addresses. ``timeout``: the most seconds the name lookup may take (a
    tenant's name server may answer slowly on purpose); None: the resolver's own limits."""
    scheme, host, port, path = parse(url)
    try:
        infos = _getaddrinfo(host, port, timeout)
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


def _getaddrinfo(host: str, port: int, timeout: float | None) -> list:
    """socket.getaddrinfo, given up after ``timeout`` seconds. The lookup cannot be interrupted: it goes on in a
    daemon thread until the resolver's own timeout, and its answer is dropped."""
    if timeout is None:
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    infos: list = []
    errors: list[BaseException] = []

    def lookup() -> None:
        try:
            infos.extend(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except BaseException as exc:  # handed to the caller's thread
            errors.append(exc)

    worker = threading.Thread(target=lookup, name=f"resolve {host}"[:60], daemon=True)
    worker.start()
    worker.join(max(timeout, 0.0))
    if worker.is_alive():
        raise AddressRefused(f"{host} did not resolve within {timeout:.1f} s")
    if errors:
        raise errors[0]
    return infos
