"""Network guard for the test suite, loaded by every Python process the tests start (via PYTHONPATH).

Any ``socket.connect`` to an address outside loopback is refused, and recorded in the file named by
``RLLOG_NETGUARD_LOG`` so the test that caused it fails, even when it happened in a subprocess
(the delivery agent, a torchrun worker).
"""

import ipaddress
import os
import socket
import sys


def _is_loopback(address) -> bool:
    if not (isinstance(address, tuple) and address):
        return True  # AF_UNIX paths and the like
    host = address[0]
    if host in ("localhost", "", None):
        return True
    try:
        return ipaddress.ip_address(str(host).split("%")[0]).is_loopback
    except ValueError:
        return False  # any other host name would need DNS: not allowed


def _record(address) -> None:
    path = os.environ.get("RLLOG_NETGUARD_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{os.getpid()} {sys.argv[:2]} {address!r}\n")


def _audit(event, args):
    if event == "socket.getaddrinfo":  # a DNS lookup of anything but loopback names is already reaching out
        host = args[0]
        if isinstance(host, bytes):
            host = host.decode(errors="replace")
        if host is not None and not _is_loopback((host,)):
            _record(("dns", host))
            raise OSError(f"name resolution blocked by the rllog test suite: {host!r}")
    if event == "socket.connect":
        sock, address = args[0], args[1]
        if getattr(sock, "family", None) in (socket.AF_INET, socket.AF_INET6) and not _is_loopback(address):
            _record(address)
            raise OSError(f"network access blocked by the rllog test suite: {address!r}")


if not getattr(sys, "_rllog_netguard", False):
    sys._rllog_netguard = True
    sys.addaudithook(_audit)
