"""Gossip children forked from a pre-imported process, for the network tests (ADR 0024).

A node's gossip child is a fresh interpreter (``spawn``: py-libp2p cannot load beside hivemind,
ADR 0001) that spends about 2 CPU-s importing py-libp2p, which imports its QUIC, TLS and ACME
modules whatever the host uses. A full test run starts about a hundred, several at once when a
network comes up, so the import sat on every network test's start-up (six nodes: about 12
CPU-s on 2 cores before anyone could gossip).

The test zygote (tests/zygote.py) calls :func:`install` once: it starts one gossip zygote, a
fresh interpreter that imports ``p2pdiloco.net.gossip_host`` (never hivemind) and forks a child
per request, and points ``p2pdiloco.net.gossip_spawn.start_child`` in the nodes it forks at
this module's :func:`start_child`. The forked child runs the product's own ``child_entry`` on
the node's pipe, stdout and stderr (passed over a unix socket); only the imports are shared.
Its parent is the gossip zygote, not the node, so its watchdog follows the node by pid and
start time instead of by ``getppid``; the node's reaper guards it by pid as it guards a spawned
one. The spawned path stays tested by every test that runs ``python -m p2pdiloco`` (test_gossip,
test_process_hygiene, the dashboard terminal).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from multiprocessing.connection import Connection

MARK = "p2pdiloco-gossip-zygote"  # in its command line: tests/conftest.py spares it

SERVER = r"""
import os, pickle, signal, socket, struct, sys, threading, time, traceback
from multiprocessing.connection import Connection
from p2pdiloco.net import gossip_spawn, lifeline
import p2pdiloco.net.gossip_host  # py-libp2p and what it imports, once

path, owner = sys.argv[1], int(sys.argv[2])
lifeline.watch_parent(owner)  # the test zygote: this goes with it


def watch_node(parent, interval=lifeline.POLL_INTERVAL):
    # The forked child's parent is this zygote: follow the node by pid and start time.
    node = lifeline.identify(parent)

    def watch():
        while node is not None and lifeline.alive(node):
            time.sleep(interval)  # the watchdog's poll period
        lifeline.kill_all(lifeline.descendants([os.getpid()]))
        os._exit(1)

    threading.Thread(target=watch, name="p2pdiloco-lifeline", daemon=True).start()


def child(fds, args):
    os.setsid()
    conn, out, err = fds
    os.dup2(out, 1); os.dup2(err, 2); os.close(out); os.close(err)
    lifeline.watch_parent = watch_node
    code = 0
    try:
        gossip_spawn.child_entry(Connection(conn), *args)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc(); code = 1
    finally:
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(code)


lock, waiting, forked = threading.Lock(), {}, threading.Semaphore(0)


def reap():
    while True:
        forked.acquire()  # one per fork: a child to wait for
        pid, status = os.waitpid(-1, 0)
        with lock:
            client = waiting.pop(pid, None)
        if client is not None:
            try:
                client.sendall(struct.pack("!i", os.waitstatus_to_exitcode(status)))
            except OSError:
                pass
            client.close()


threading.Thread(target=reap, daemon=True).start()
srv = socket.socket(socket.AF_UNIX)
srv.bind(path)
srv.listen(64)
print("ready", flush=True)  # install() reads this line
while True:
    client, _ = srv.accept()
    msg, fds, _, _ = socket.recv_fds(client, 1 << 16, 3)
    with lock:  # registered before the reaper can see it exit
        pid = os.fork()
        if pid == 0:
            srv.close(); client.close()
            child(fds, pickle.loads(msg))
        waiting[pid] = client
    forked.release()
    for fd in fds:
        os.close(fd)
    client.sendall(struct.pack("!q", pid))
"""

_path: str | None = None


def install() -> None:
    """In the test zygote: start the gossip zygote and fork gossip children from it."""
    global _path
    import p2pdiloco.net.gossip_spawn as gossip_spawn

    path = os.path.join(tempfile.mkdtemp(prefix="p2pdiloco-gz-"), "sock")
    server = subprocess.Popen(
        [sys.executable, "-c", f"# {MARK}\n{SERVER}", path, str(os.getpid())],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdout is not None
    if server.stdout.readline().strip() != "ready":  # once py-libp2p is imported and it listens
        raise RuntimeError(f"the gossip zygote did not start (exit code {server.wait()})")
    server.stdout.close()
    _path = path
    gossip_spawn.start_child = start_child  # type: ignore[assignment]


class ForkedChild:
    """What ``GossipProcess`` uses of a ``multiprocessing`` process, for a forked child: the
    zygote writes its exit code on the request's socket, whose end here is the sentinel."""

    def __init__(self, pid: int, sock: socket.socket) -> None:
        self.pid = pid
        self._sock = sock
        self.sentinel = sock.fileno()
        self.exitcode: int | None = None

    def _poll(self, timeout: float | None) -> int | None:
        if self.exitcode is None and select.select([self._sock], [], [], timeout)[0]:
            raw = self._sock.recv(4, socket.MSG_WAITALL)
            self.exitcode = struct.unpack("!i", raw)[0] if len(raw) == 4 else -signal.SIGKILL
        return self.exitcode

    def join(self, timeout: float | None = None) -> None:
        self._poll(timeout)

    def is_alive(self) -> bool:
        return self._poll(0) is None

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, sig: int) -> None:
        if self.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)


def start_child(
    seed: bytes, listen_host: str, port: int, topics: list[str], parent: int
) -> tuple[ForkedChild, Connection]:
    """``gossip_spawn.start_child``, forked from the gossip zygote."""
    assert _path is not None
    parent_conn, child_conn = multiprocessing.Pipe(duplex=True)
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(_path)
    msg = pickle.dumps((seed, listen_host, port, topics, parent))
    socket.send_fds(sock, [msg], [child_conn.fileno(), 1, 2])
    child_conn.close()
    raw = sock.recv(8, socket.MSG_WAITALL)
    if len(raw) != 8:
        raise RuntimeError("the gossip zygote did not fork")
    return ForkedChild(struct.unpack("!q", raw)[0], sock), parent_conn
