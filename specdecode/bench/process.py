"""Child processes of the benchmarks: a free loopback port, waiting for a server to answer /health, and a
process's memory figures from /proc."""

from __future__ import annotations

import socket
import subprocess
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float) -> None:
    """Return once `url`/health answers 200; RuntimeError if the process exits first, TimeoutError after
    `timeout` seconds."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the server did not become healthy within {timeout:.0f} s")


def status_bytes(field: str, pid: int | str = "self") -> int | None:
    """A /proc/PID/status memory field (e.g. VmHWM, VmRSS) in bytes, or None once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":")), None)
    except OSError:
        return None
