"""A real ``redis-server`` for tests: started on a free port of 127.0.0.1, stopped after.

``with redis_server() as server:`` gives a :class:`RedisServer` (``.url``, ``.port``,
``.kill()``); the ``redis_url`` fixture gives the URL of one server that the whole
session shares, flushed before each test (import it into a test module:
``from redis_server import redis_url  # noqa: F401``). Without ``redis-server`` on
PATH the tests skip, except under ``CI=true``, where they fail: CI installs it, and must
never skip silently.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

import pytest

MISSING = "redis-server is not installed (apt-get install redis-server); CI installs it"
START_SECONDS = 10.0


def require_redis_server() -> str:
    """The path of ``redis-server``, or skip (fail under ``CI=true``) if there is none."""
    path = shutil.which("redis-server")
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail(MISSING)
        pytest.skip(MISSING)
    return path


def require_redis_client():
    """The ``redis`` client module, or skip (fail under ``CI=true``) if it is missing."""
    try:
        import redis
    except ImportError:
        message = 'the redis client is not installed (pip install "nbkv[store]")'
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return redis


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(port: int, command: bytes = b"PING", timeout: float = 1.0) -> bytes:
    """Send one inline command to the server on ``port``; its first reply line."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(command + b"\r\n")
        reply = b""
        while not reply.endswith(b"\r\n"):
            chunk = s.recv(4096)
            if not chunk:
                break
            reply += chunk
    return reply


class RedisServer:
    """A running ``redis-server`` process (see :func:`redis_server`)."""

    def __init__(self, process: subprocess.Popen, port: int) -> None:
        self.process, self.port = process, port
        self.url = f"redis://127.0.0.1:{port}/0"

    def kill(self) -> None:
        """Kill the server at once (SIGKILL) and wait for it: a crash, mid-test."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()

    def stop(self) -> None:
        """Terminate the server, killing it if it lingers."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()


@contextlib.contextmanager
def redis_server(*extra: str) -> Iterator[RedisServer]:
    """Start ``redis-server`` (no persistence; ``extra`` options such as ``"--maxmemory",
    "10mb"``) on a free port, wait until it answers PING, yield it, then stop it."""
    exe = require_redis_server()
    with tempfile.TemporaryDirectory(prefix="nbkv-redis-") as workdir:
        log = os.path.join(workdir, "redis.log")
        for _ in range(3):  # another process may take the free port before the server
            port = _free_port()
            args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
            args += ["--appendonly", "no", "--dir", workdir, "--logfile", log, *extra]
            process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
            server = RedisServer(process, port)
            deadline = time.monotonic() + START_SECONDS
            while process.poll() is None and time.monotonic() < deadline:
                with contextlib.suppress(OSError):
                    if command(port).startswith(b"+PONG"):
                        break
                time.sleep(0.02)
            else:
                server.stop()
                continue
            try:
                yield server
            finally:
                server.stop()
            return
        with open(log, errors="replace") as f:
            tail = f.read()[-2000:]
        pytest.fail(f"redis-server did not start:\n{tail}")


_shared: dict[str, RedisServer] = {}


@pytest.fixture
def redis_url(request: pytest.FixtureRequest) -> str:
    """The URL of a running redis-server, emptied for this test. One server serves the
    whole session (started on first use, stopped when the session ends)."""
    server = _shared.get("server")
    if server is None or server.process.poll() is not None:
        stack = contextlib.ExitStack()
        server = _shared["server"] = stack.enter_context(redis_server())
        request.session.addfinalizer(stack.close)
    assert command(server.port, b"FLUSHALL").startswith(b"+OK")
    return server.url
