"""A UDP endpoint for the NAT lab tests, run inside a host's namespace: one socket bound to
a fixed port (WireGuard's, 51820), driven over stdin and reporting on stdout.

stdin, one command a line: ``send ADDRESS PORT TEXT`` (from the bound socket) or ``sendnew
ADDRESS PORT TEXT`` (from a new socket on an ephemeral port: a new flow for every NAT on
the way). stdout, one JSON object a line: ``{"ready": PORT}`` once bound, then ``{"from":
ADDRESS, "port": PORT, "data": TEXT}`` for every datagram the bound socket receives. It
answers two kinds of datagram itself, to their source: ``whoami TAG`` with ``you ADDRESS
PORT TAG`` (the source it saw: the sender's reflexive endpoint, a STUN server's answer),
and ``punch TAG`` with ``ack TAG`` (WireGuard's roaming: a peer answers wherever an
authenticated packet came from).
"""

from __future__ import annotations

import json
import select
import socket
import sys


def main() -> None:
    port = int(sys.argv[1])
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", port))
    print(json.dumps({"ready": port}), flush=True)
    while True:
        readable, _, _ = select.select([sock, sys.stdin], [], [])
        if sys.stdin in readable:
            line = sys.stdin.readline()
            if not line:
                return
            verb, address, dport, text = line.rstrip("\n").split(" ", 3)
            if verb == "send":
                sock.sendto(text.encode(), (address, int(dport)))
            elif verb == "sendnew":
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as fresh:
                    fresh.sendto(text.encode(), (address, int(dport)))
        if sock in readable:
            data, (address, sport) = sock.recvfrom(2048)
            text = data.decode(errors="replace")
            print(json.dumps({"from": address, "port": sport, "data": text}), flush=True)
            verb, _, tag = text.partition(" ")
            if verb == "whoami":
                sock.sendto(f"you {address} {sport} {tag}".encode(), (address, sport))
            elif verb == "punch":
                sock.sendto(f"ack {tag}".encode(), (address, sport))


if __name__ == "__main__":
    main()
