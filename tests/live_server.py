"""Real ``glmasr serve`` processes (uvicorn on 127.0.0.1) for the server tests, and raw-socket helpers for what an
HTTP client library would not send (stalled heads, trickled bodies, ambiguous framing)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx2

KEY = "test-key"
MODEL = "glm-asr-nano-2512"

LAUNCHER = """
import os, sys, time
delay = float(os.environ.get("GLMASR_TEST_STEP_DELAY", "0"))
if delay:  # test hook: every engine step sleeps, so a request lasts long enough to be interrupted
    from glmasr.engine.engine import Engine
    _step = Engine.step
    def step(self):
        time.sleep(delay)
        return _step(self)
    Engine.step = step
if __name__ == "__main__":  # engine processes (--frontends, --data-parallel) spawn from this file: not again there
    from glmasr.cli import main
    sys.exit(main(sys.argv[1:]))
"""


def ready_frontends(base: str, count: int, timeout: float, check=None) -> dict[int, int]:
    """Front-end index -> pid, from ``/health`` (with the key) on fresh connections until ``count`` front-ends have
    answered ready ("ok"): a connection may reach any front-end, and one still warming up answers otherwise.
    ``check()``: True while waiting makes sense, else the failure's message."""
    seen: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    while len(seen) < count:
        ok = True if check is None else check()
        assert ok is True, ok
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {count} front-ends " \
                                            f"to answer /health ready (seen: {sorted(seen)})"
        try:
            with httpx2.Client(base_url=base, timeout=30) as fresh:
                h = fresh.get("/health", headers={"Authorization": f"Bearer {KEY}"}).json()
            f = h.get("frontend")
            if f is not None and h.get("status") == "ok":
                seen[f["index"]] = f["pid"]
        except (httpx2.TransportError, ValueError):
            pass
        time.sleep(0.02)
    return seen


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``glmasr serve`` on the tiny checkpoint, CPU (``--device cpu``, unless ``extra`` names ``--devices``), with
    the key ``KEY``; ``extra``: more flags."""

    def __init__(self, folder: Path, tmp: Path, delay: float = 0.0, extra=(), log_level: str = "warning"):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        launcher = tmp / "launch_server.py"
        launcher.write_text(LAUNCHER)
        env = dict(os.environ, GLMASR_TEST_STEP_DELAY=str(delay), PYTHONUNBUFFERED="1")
        self.log_path = tmp / f"server-{self.port}.log"
        self.log = open(self.log_path, "w+")
        device = () if "--devices" in extra else ("--device", "cpu")  # --data-parallel: the workers' devices
        self.proc = subprocess.Popen(
            [sys.executable, str(launcher), "serve", "--model", str(folder), *device, "--host",
             "127.0.0.1", "--port", str(self.port), "--api-key", KEY, "--max-batch", "8", "--warmup", "request",
             "--log-level", log_level, *extra], env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.http = httpx2.Client(base_url=self.base, timeout=30)
        try:
            deadline = time.monotonic() + 90
            while True:
                assert self.proc.poll() is None, f"server exited: {self.output()}"
                assert time.monotonic() < deadline, f"server not healthy in time: {self.output()}"
                try:
                    if self.http.get("/health").status_code == 200:
                        break
                except httpx2.TransportError:
                    pass
                time.sleep(0.1)
            frontends = int(extra[list(extra).index("--frontends") + 1]) if "--frontends" in extra else 1
            if frontends > 1:  # each front-end warms up on its own: wait until every one says ok
                ready_frontends(self.base, frontends, deadline - time.monotonic(),
                                check=lambda: self.proc.poll() is None or f"server exited: {self.output()}")
        except BaseException:
            self.stop()
            raise

    def output(self, tail: int = 3000) -> str:
        self.log.flush()
        return self.log_path.read_text()[-tail:]

    def client(self, cls=None):
        import openai

        return (cls or openai.OpenAI)(base_url=f"{self.base}/v1", api_key=KEY, max_retries=0, timeout=60)

    def metrics(self) -> str:
        return self.http.get("/metrics").text

    def connect(self, timeout: float = 10.0) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=timeout)
        s.settimeout(timeout)
        return s

    def stop(self):
        self.http.close()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


def multipart(fields: dict, file: tuple[str, bytes] | None, boundary: str = "glmasrboundary") -> tuple[bytes, str]:
    """A multipart/form-data body and its content type."""
    parts = []
    for name, value in fields.items():
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode())
    if file is not None:
        fname, data = file
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{fname}"\r\n'
                     f"Content-Type: application/octet-stream\r\n\r\n".encode() + data + b"\r\n")
    parts.append(f"--{boundary}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"


def post_head(path: str, length: int, ctype: str, key: str | None = KEY, extra: str = "") -> bytes:
    """The request line and headers of a POST with a Content-Length."""
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}Content-Type: {ctype}\r\n"
            f"Content-Length: {length}\r\n{extra}\r\n").encode()


def read_response(s: socket.socket, timeout: float = 10.0) -> bytes:
    """Everything the server sends until it closes the connection (or ``timeout`` passes without a byte)."""
    s.settimeout(timeout)
    out = b""
    while True:
        try:
            chunk = s.recv(65536)
        except socket.timeout:
            return out
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk


def status_of(raw: bytes) -> int | None:
    if not raw.startswith(b"HTTP/1.1 "):
        return None
    return int(raw[9:12])


def body_of(raw: bytes) -> bytes:
    return raw.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in raw else b""
