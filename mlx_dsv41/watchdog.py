"""Peer watchdog for multi-process runs: a dead, frozen or stalled peer becomes a one-line error
and an exit within a bounded time, instead of a collective that waits forever.

Collectives cannot time out: NCCL and JACCL wait forever for a peer that died, and every backend
waits forever for a peer that is alive but never joins. So the ranks also keep a small TCP side
channel, a star around rank 0 (the hub), carrying one JSON line per heartbeat:
`{"c": N}` (N = MoE exchanges this rank has built), `{"bye": "ok"|"error", "c": N}` at exit and,
from the hub, `{"abort": reason}`. One daemon thread per process watches it (MLX releases the GIL
while it evaluates, so the thread runs while the main thread waits in a collective).

A rank exits with EXIT_CODE and `mlx_dsv41.distributed: rank r of n: <reason>` on stderr when
- a peer's connection closes without a goodbye (its process died or was killed), or a peer exits
  with an uncaught exception: within two heartbeat intervals (the first lets this rank's own
  error, if it has one, be the one reported);
- a peer sends nothing for `timeout_s` (frozen, or its machine or network is gone);
- a peer has built fewer exchanges than another rank and none for `timeout_s` (alive, but it never
  joins the collective the others wait in);
- a peer exited otherwise (normally, or through sys.exit) and this rank has built exchanges it
  will never join (within one interval), or this rank is still running `timeout_s` later;
- the ring backend fails a collective because a peer's socket closed (main thread, at once).
The hub decides for everyone and tells the others before it exits; the others watch the hub. A
heartbeat interval is min(1 s, timeout_s / 8), so every bound is at most `timeout_s` + 2 s, and
`timeout_s` must exceed the longest evaluation of one forward (prefill chunk, first-call JIT
compiles included). Not covered: a peer that keeps heartbeating but hangs outside a forward with
the same count as the others (e.g. while loading, before `apply`'s collective).
"""

from __future__ import annotations

import atexit
import json
import os
import re
import select
import socket
import sys
import threading
import time
from dataclasses import dataclass

EXIT_CODE = 75
PREFIX = "mlx_dsv41.distributed"
# Errors a backend raises in the main thread when a peer is lost mid-collective (ring: "[ring]
# connection to a peer was lost").
_PEER_LOST = re.compile(r"^\[(ring|nccl|jaccl|mpi)\].*(lost|closed|connection|timed out)", re.I)


def hub_host() -> str | None:
    """Rank 0's address as the launch environment gives it (mlx.launch, docs/mlx.md#launch), or the
    MLX_DSV41_WATCHDOG_HOST override; None when it cannot be told."""
    if os.environ.get("MLX_DSV41_WATCHDOG_HOST"):
        return os.environ["MLX_DSV41_WATCHDOG_HOST"]
    if os.environ.get("MLX_JACCL_COORDINATOR"):  # "ip:port"
        return os.environ["MLX_JACCL_COORDINATOR"].rsplit(":", 1)[0]
    if os.environ.get("NCCL_HOST_IP"):
        return os.environ["NCCL_HOST_IP"]
    hostfile = os.environ.get("MLX_HOSTFILE")
    if hostfile:
        try:
            with open(hostfile) as f:
                hosts = json.load(f)
            first = hosts["hosts"][0]["ips"][0] if isinstance(hosts, dict) else hosts[0][0]
            return first.rsplit(":", 1)[0]
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            return None
    return None


def open_hub(host: str) -> socket.socket:
    """Rank 0's listening socket on `host` (port from MLX_DSV41_WATCHDOG_PORT, else any free one)."""
    port = int(os.environ.get("MLX_DSV41_WATCHDOG_PORT", "0"))
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen()
    return sock


@dataclass
class _Link:
    """One connection: the hub's view of a peer, or a peer's view of the hub."""

    rank: int
    sock: socket.socket | None
    heard: float
    count: int = 0
    buffer: bytes = b""
    finished: str | None = None  # "ok" | "error" after a goodbye, "lost" after a bare close
    finished_at: float = 0.0


class Watchdog:
    """The side channel of one rank; see the module docstring. `note_exchange()` is the only call
    on the hot path (an integer increment)."""

    def __init__(self, rank: int, size: int, timeout_s: float, links: list[_Link]):
        self.rank, self.size, self.timeout_s = rank, size, float(timeout_s)
        self.interval = min(1.0, self.timeout_s / 8)
        self.exchanges = 0
        self._links = links
        self._lock = threading.Lock()  # socket writes: the thread's heartbeats and the goodbye
        self._stopping = False
        self._failed = False
        self._progress: dict[int, tuple[int, float]] = {}  # rank -> (count, when it last moved or led)
        now = time.monotonic()
        for link in links:
            link.heard = now
        self._thread = threading.Thread(target=self._run, name="mlx_dsv41-watchdog", daemon=True)
        self._previous_hook = sys.excepthook
        sys.excepthook = self._excepthook
        atexit.register(self.close)
        self._thread.start()

    # ------------------------------------------------------------------------- setup

    @classmethod
    def start(
        cls, rank: int, size: int, timeout_s: float, address: tuple[str, int], hub: socket.socket | None = None
    ) -> Watchdog:
        """Rank 0 accepts every other rank on `hub`; the others connect to `address`. Raises
        RuntimeError if the channel is not up within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        if rank == 0:
            links = {}
            hub.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                while len(links) < size - 1:
                    conn, _ = hub.accept()
                    conn.settimeout(max(0.1, deadline - time.monotonic()))
                    hello = b""
                    while not hello.endswith(b"\n"):  # byte by byte: heartbeats follow the hello
                        chunk = conn.recv(1)
                        if not chunk:
                            break
                        hello += chunk
                    peer = int(json.loads(hello)["rank"])
                    if not 0 < peer < size or peer in links:
                        raise RuntimeError(f"unexpected watchdog hello from rank {peer}")
                    links[peer] = _Link(peer, conn, 0.0)
            except (TimeoutError, OSError, ValueError, KeyError) as e:
                missing = sorted(set(range(1, size)) - set(links))
                raise RuntimeError(
                    f"{PREFIX}: rank 0: ranks {missing} did not open the watchdog "
                    f"channel to {hub.getsockname()} within {timeout_s:g} s ({e})"
                ) from None
            finally:
                hub.close()
            return cls(rank, size, timeout_s, [links[r] for r in sorted(links)])
        while True:
            try:
                conn = socket.create_connection(address, timeout=max(0.1, deadline - time.monotonic()))
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{PREFIX}: rank {rank}: cannot reach the watchdog of rank 0 at "
                        f"{address[0]}:{address[1]} within {timeout_s:g} s ({e})"
                    ) from None
                time.sleep(0.05)
        conn.sendall(json.dumps({"rank": rank}).encode() + b"\n")
        return cls(rank, size, timeout_s, [_Link(0, conn, 0.0)])

    # ------------------------------------------------------------------------- main thread

    def note_exchange(self) -> None:
        self.exchanges += 1

    def close(self) -> None:
        """Say goodbye (ok unless an exception escaped the main thread) and stop watching."""
        if self._stopping:
            return
        self._stopping = True  # the thread stops; the sockets close when the process ends
        self._send_all({"bye": "error" if self._failed else "ok", "c": self.exchanges})

    def _excepthook(self, kind, value, tb):
        self._failed = True
        if isinstance(value, RuntimeError) and _PEER_LOST.match(str(value)):
            self.close()
            self._exit(f"a collective failed: {value}")
        self._previous_hook(kind, value, tb)

    # ------------------------------------------------------------------------- thread

    def _run(self) -> None:
        try:
            self._watch()
        except Exception as e:  # a broken watchdog must not pass for a healthy run
            if not self._stopping:
                os.write(
                    2, f"{PREFIX}: rank {self.rank}: watchdog failed ({e!r}); peers are no longer watched\n".encode()
                )

    def _watch(self) -> None:
        next_beat = 0.0
        while not self._stopping:
            socks = [link.sock for link in self._links if link.sock is not None]
            if socks:
                ready = select.select(socks, [], [], self.interval)[0]
            else:  # every peer has finished: only the grace period is left to watch
                ready = []
                time.sleep(self.interval)
            if self._stopping:
                return
            now = time.monotonic()
            for link in self._links:
                if link.sock is not None and link.sock in ready:
                    self._receive(link, now)
            if now >= next_beat:
                self._send_all({"c": self.exchanges})
                next_beat = now + self.interval
            reason = self._hub_verdict(now) if self.rank == 0 else self._common_verdict(self._links[0], now)
            if reason:
                self._fail(reason)

    def _receive(self, link: _Link, now: float) -> None:
        try:
            data = link.sock.recv(65536)
        except OSError:
            data = b""
        if not data:
            link.sock.close()
            link.sock = None
            if link.finished is None:
                link.finished, link.finished_at = "lost", now
            return
        link.heard = now
        link.buffer += data
        *lines, link.buffer = link.buffer.split(b"\n")
        for line in lines:
            msg = json.loads(line)
            if "abort" in msg:
                self._exit(f"{msg['abort']} (detected by rank 0)")
            if "c" in msg:
                link.count = int(msg["c"])
            if "bye" in msg:
                link.finished, link.finished_at = msg["bye"], now

    def _common_verdict(self, link: _Link, now: float) -> str | None:
        """What any rank concludes about one link (a peer, or the hub)."""
        who = f"rank {link.rank}"
        if link.finished in ("lost", "error") and now - link.finished_at < self.interval:
            return None  # one interval for this rank's main thread to report its own error first
        if link.finished == "lost":
            return f"{who} disconnected without finishing: its process died or was killed"
        if link.finished == "error":
            return f"{who} exited with an error (see its output)"
        if link.finished == "ok":  # a normal exit (or sys.exit: its status is not visible)
            if self.exchanges > link.count:
                return (
                    f"{who} exited after {link.count} MoE exchanges, but this rank has built "
                    f"{self.exchanges} and waits for it"
                )
            if now - link.finished_at > self.timeout_s:
                return (
                    f"{who} exited {now - link.finished_at:.0f} s ago and this rank is still "
                    "running (blocked in a collective it will never join?)"
                )
            return None
        if now - link.heard > self.timeout_s:
            return f"{who} stopped answering: nothing heard for {now - link.heard:.0f} s"
        return None

    def _hub_verdict(self, now: float) -> str | None:
        for link in self._links:
            reason = self._common_verdict(link, now)
            if reason:
                return reason
        # A rank behind the leader whose count has not moved for timeout_s never joins the
        # collective the leader waits in. Leading (or tying) resets the clock: idle ranks that
        # agree are never stalled, whatever the time since their last forward.
        counts = {0: self.exchanges, **{link.rank: link.count for link in self._links if link.finished is None}}
        silent = {link.rank for link in self._links if now - link.heard > 2 * self.interval}
        top = max(counts.values())
        for r, c in counts.items():
            last, since = self._progress.get(r, (None, now))
            if c != last or c >= top:
                self._progress[r] = (c, now)
            elif now - since > self.timeout_s and r not in silent:  # silence has its own verdict
                leader = max(counts, key=counts.get)
                return (
                    f"rank {r} stopped making progress: it has built {c} MoE exchanges, rank "
                    f"{leader} {top}, and none for {now - since:.0f} s"
                )
        return None

    # ------------------------------------------------------------------------- exits

    def _send_all(self, msg: dict) -> None:
        line = json.dumps(msg).encode() + b"\n"
        with self._lock:
            for link in self._links:
                if link.sock is None or link.finished is not None:
                    continue
                try:
                    link.sock.settimeout(self.interval)
                    link.sock.sendall(line)
                except OSError:
                    pass  # a dead peer shows up as a closed socket or as silence

    def _fail(self, reason: str) -> None:
        if self.rank == 0:
            self._send_all({"abort": reason})
        self._exit(reason)

    def _exit(self, reason: str) -> None:
        if self._failed and threading.current_thread() is self._thread:
            # The main thread is reporting its own error and exiting: let it, unless it hangs.
            time.sleep(self.timeout_s)
        # os.write / os._exit: the main thread may hold Python's stderr lock or be blocked in a
        # collective that will never return.
        os.write(2, f"{PREFIX}: rank {self.rank} of {self.size}: {reason}; exiting\n".encode())
        os._exit(EXIT_CODE)
