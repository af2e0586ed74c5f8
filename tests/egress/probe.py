"""Guest-side probes, run inside the stand-in guest namespace; prints one JSON object.

Usage: probe.py tcp HOST PORT | udp HOST PORT | dns SERVER NAME [tcp] | icmp HOST |
       ether ETHERTYPE_HEX IFACE
"""

from __future__ import annotations

import json
import socket
import struct
import sys


def tcp(host: str, port: int) -> dict[str, object]:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(1.5)
        try:
            s.connect((host, port))
            s.sendall(b"GET / HTTP/1.0\r\n\r\n")
            data = s.recv(4096)
        except OSError as exc:
            return {"ok": False, "detail": type(exc).__name__}
    return {"ok": b"200 OK" in data, "detail": data.split(b"\r\n\r\n")[-1].decode().strip()}


def udp(host: str, port: int) -> dict[str, object]:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(1.5)
        try:
            s.sendto(b"ping", (host, port))
            data, _ = s.recvfrom(4096)
        except OSError as exc:
            return {"ok": False, "detail": type(exc).__name__}
    return {"ok": True, "detail": data.decode()}


def dns(server: str, name: str, transport: str) -> dict[str, object]:
    from dnslib import QTYPE, RCODE, DNSRecord

    q = DNSRecord.question(name, "A")
    try:
        raw = q.send(server, 53, tcp=transport == "tcp", timeout=2)
    except OSError as exc:
        return {"ok": False, "detail": type(exc).__name__}
    reply = DNSRecord.parse(raw)
    answers = [str(r.rdata) for r in reply.rr if r.rtype == QTYPE.A]
    return {"ok": bool(answers), "detail": RCODE[reply.header.rcode], "answers": answers}


def icmp(host: str) -> dict[str, object]:
    with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP) as s:
        s.settimeout(1.5)
        body = struct.pack("!BBHHH", 8, 0, 0, 0x1234, 1) + b"deskvm"
        csum = 0
        for i in range(0, len(body), 2):
            csum += (body[i] << 8) + body[i + 1]
        csum = (csum >> 16) + (csum & 0xFFFF)
        csum = ~(csum + (csum >> 16)) & 0xFFFF
        packet = body[:2] + struct.pack("!H", csum) + body[4:]
        try:
            s.sendto(packet, (host, 0))
            while True:
                data, addr = s.recvfrom(4096)
                if addr[0] == host and data[20] == 0:
                    return {"ok": True, "detail": "echo reply"}
        except OSError as exc:
            return {"ok": False, "detail": type(exc).__name__}


def ether(ethertype: int, iface: str) -> dict[str, object]:
    with socket.socket(socket.AF_PACKET, socket.SOCK_RAW) as s:
        s.bind((iface, 0))
        mac = s.getsockname()[4]
        frame = b"\xff" * 6 + mac + struct.pack("!H", ethertype) + b"deskvm-nonip".ljust(46)
        s.send(frame)
    return {"ok": True, "detail": "sent"}


def main() -> None:
    kind, args = sys.argv[1], sys.argv[2:]
    if kind == "tcp":
        out = tcp(args[0], int(args[1]))
    elif kind == "udp":
        out = udp(args[0], int(args[1]))
    elif kind == "dns":
        out = dns(args[0], args[1], args[2] if len(args) > 2 else "udp")
    elif kind == "icmp":
        out = icmp(args[0])
    else:
        out = ether(int(args[0], 16), args[1])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
