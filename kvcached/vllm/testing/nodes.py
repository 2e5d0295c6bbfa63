"""Two nodes on one machine, for vLLM's own multi-node launch: a second node in a namespace.

vLLM serves one model from several nodes in two ways: one engine's workers spread over nodes
(``--nnodes 2 --node-rank 1 --headless`` on the second, the mp executor's message queue carrying
each ``SchedulerOutput`` there), and data-parallel ranks on other nodes (``--headless
--data-parallel-start-rank 1``, each rank an engine core of its own). Node A is this machine as it
is; node B runs in a network namespace of its own (joined to A by a veth pair with private
addresses, so the nodes talk over an interface, not loopback) and a mount namespace with its own
``/dev/shm`` and runtime directory: its workers' KV files, sockets and budgets are not A's, as on
another machine. Needs root and ``ip``; ``unavailable`` says why not.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .e2e import Server, ServerConfig

# Private addresses of the veth pair (RFC 5737's TEST-NET-2: never routed).
ADDR_A = "198.51.100.1"
ADDR_B = "198.51.100.2"
# vLLM's CPU build binds each local worker's threads to a NUMA node of its own (this machine has
# one) and picks gloo's interface by hostname, which resolves to neither node's address.
NODE_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}


def unavailable() -> str | None:
    """Why two nodes cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    try:
        with Pair() as _:
            return None
    except (OSError, subprocess.CalledProcessError) as e:
        return f"cannot make a network namespace here: {e}"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


class Pair:
    """Node B's namespace and the veth pair to it, made on entry and removed on exit; names are
    random, so that two runs (or a namespace someone else made) never collide."""

    def __init__(self) -> None:
        tag = secrets.token_hex(3)
        self.ns = f"kvcached-{tag}"
        self.link_a, self.link_b = f"kva{tag}", f"kvb{tag}"

    def __enter__(self) -> Pair:
        _ip("netns", "add", self.ns)
        try:
            _ip("link", "add", self.link_a, "type", "veth", "peer", "name", self.link_b)
            _ip("link", "set", self.link_b, "netns", self.ns)
            _ip("addr", "add", f"{ADDR_A}/30", "dev", self.link_a)
            _ip("link", "set", self.link_a, "up")
            _ip("-n", self.ns, "addr", "add", f"{ADDR_B}/30", "dev", self.link_b)
            _ip("-n", self.ns, "link", "set", self.link_b, "up")
            _ip("-n", self.ns, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        # Deleting the namespace deletes its end of the pair, and with it the other end.
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.link_a], capture_output=True, timeout=30)

    def env(self, node: str) -> dict[str, str]:
        """What a node's processes need to find each other: its own address for gloo and vLLM."""
        addr, link = (ADDR_A, self.link_a) if node == "A" else (ADDR_B, self.link_b)
        return {**NODE_ENV, "VLLM_HOST_IP": addr, "GLOO_SOCKET_IFNAME": link}


class NodeB(Server):
    """``vllm serve --headless`` in node B: its own network, ``/dev/shm`` and runtime directory."""

    def __init__(self, pair: Pair, config: ServerConfig, log_path: str | Path) -> None:
        super().__init__(config, log_path)
        self.pair = pair

    def argv(self) -> list[str]:
        shm = 'mount -t tmpfs -o size=2g,mode=1777 kvcached-node-b /dev/shm && exec "$@"'
        return [
            "ip",
            "netns",
            "exec",
            self.pair.ns,
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            shm,
            "node-b",
            *super().argv(),
        ]


@dataclass
class Nodes:
    """Node A's server (the API server, with or without engines of its own) and node B's."""

    a: Server
    b: NodeB

    def start(self) -> Nodes:
        self.a.start()
        self.b.start()
        return self

    def stop(self) -> None:
        self.a.stop()  # the API server first: node B's headless processes end when it goes
        self.b.stop()
