"""The "internet" of the egress test world: a DNS server and TCP/UDP servers.

Run inside the test's internet namespace (``ip netns exec NS python3 internet_server.py
CONFIG.json``). It appends one JSON line per DNS query, per TCP/UDP contact and per HTTP
request (``kind: http`` with its path) to the log file named in the config, so tests can
prove what reached the outside. ``GET /colour/RRGGBB`` answers an HTML page filled with
that colour (for browsers in a guest); any other request a line of text.

DNS zone (synthetic, enough for the bypass table):
    * names listed in ``config["a"]`` / ``config["aaaa"]`` answer those addresses;
    * ``ip-A-B-C-D.<anything>`` answers ``A.B.C.D`` (names that resolve where a test wants);
    * everything else is NXDOMAIN.
"""

from __future__ import annotations

import contextlib
import json
import socket
import socketserver
import sys
import threading
import time
from typing import Any

from dnslib import AAAA, QTYPE, RCODE, RR, A, DNSRecord

CONFIG: dict[str, Any] = {}
LOCK = threading.Lock()


def log(event: dict[str, Any]) -> None:
    event["t"] = time.time()
    with LOCK, open(CONFIG["log"], "a") as fh:
        fh.write(json.dumps(event) + "\n")


def answer(data: bytes, transport: str, peer: str) -> bytes:
    request = DNSRecord.parse(data)
    qname = str(request.q.qname).rstrip(".").lower()
    qtype = QTYPE[request.q.qtype]
    log({"kind": "dns", "name": qname, "qtype": qtype, "transport": transport, "peer": peer})
    reply = request.reply()
    first = qname.split(".")[0]
    if qtype == "A" and first.startswith("ip-") and first.count("-") == 4:
        reply.add_answer(RR(qname, QTYPE.A, rdata=A(first[3:].replace("-", ".")), ttl=60))
    elif qtype == "A" and qname in CONFIG["a"]:
        reply.add_answer(RR(qname, QTYPE.A, rdata=A(CONFIG["a"][qname]), ttl=60))
    elif qtype == "AAAA" and qname in CONFIG["aaaa"]:
        reply.add_answer(RR(qname, QTYPE.AAAA, rdata=AAAA(CONFIG["aaaa"][qname]), ttl=60))
    elif qname not in CONFIG["a"] and qname not in CONFIG["aaaa"]:
        reply.header.rcode = RCODE.NXDOMAIN
    return reply.pack()


class DnsUdp(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        data, sock = self.request
        sock.sendto(answer(data, "udp", self.client_address[0]), self.client_address)


class DnsTcp(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        head = self.request.recv(2)
        data = self.request.recv(int.from_bytes(head, "big"))
        out = answer(data, "tcp", self.client_address[0])
        self.request.sendall(len(out).to_bytes(2, "big") + out)


class Http(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        addr, port = self.server.server_address[:2]
        peer = self.client_address[0]
        log({"kind": "tcp", "addr": addr, "port": port, "peer": peer})
        self.request.settimeout(2)
        try:
            head = self.request.recv(4096)
        except OSError:
            head = b""
        words = head.split(b"\r\n", 1)[0].split()
        path = words[1].decode("ascii", "replace") if len(words) >= 2 else ""
        if path:
            log({"kind": "http", "addr": addr, "port": port, "peer": peer, "path": path})
        body, content_type = page(addr, port, path)
        with contextlib.suppress(OSError):
            self.request.sendall(
                b"HTTP/1.0 200 OK\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s"
                % (content_type.encode(), len(body), body)
            )


def page(addr: str, port: int, path: str) -> tuple[bytes, str]:
    """The reply body and its type: ``/colour/RRGGBB`` is an HTML page filled with that
    colour (no favicon request, no other resource); anything else a line of text."""
    colour = path.removeprefix("/colour/")
    if (
        path.startswith("/colour/")
        and len(colour) == 6
        and all(c in "0123456789abcdefABCDEF" for c in colour)
    ):
        html = (
            f"<!DOCTYPE html><html><head><title>deskvm colour {colour}</title>"
            '<link rel="icon" href="data:,"></head>'
            f'<body style="margin:0;background:#{colour}"><div style="height:100vh"></div>'
            "</body></html>"
        )
        return html.encode(), "text/html; charset=utf-8"
    return f"hello from {addr}:{port}\n".encode(), "text/plain"


class Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        data, sock = self.request
        addr, port = self.server.server_address[:2]
        log({"kind": "udp", "addr": addr, "port": port, "peer": self.client_address[0]})
        sock.sendto(data, self.client_address)


def serve(cls: type[socketserver.BaseServer], addr: str, port: int, handler: Any) -> None:
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET

    class Server(cls):  # type: ignore[misc,valid-type]
        address_family = family
        allow_reuse_address = True
        daemon_threads = True

    server = Server((addr, port), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()


def main() -> None:
    with open(sys.argv[1]) as fh:
        CONFIG.update(json.load(fh))
    for addr in CONFIG["dns"]:
        serve(socketserver.ThreadingUDPServer, addr, 53, DnsUdp)
        serve(socketserver.ThreadingTCPServer, addr, 53, DnsTcp)
    for addr, port in CONFIG["tcp"]:
        serve(socketserver.ThreadingTCPServer, addr, port, Http)
    for addr, port in CONFIG["udp"]:
        serve(socketserver.ThreadingUDPServer, addr, port, Echo)
    log({"kind": "ready"})
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
