"""The machine and software a benchmark session runs on, recorded with its results."""

from __future__ import annotations

import os
import platform
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from specdecode import cpu_isa


def _git_commit() -> str | None:
    try:
        repo = Path(__file__).resolve().parents[2]
        out = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5, check=False)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def machine_info() -> dict[str, Any]:
    import specdecode

    info: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "cpu": cpu_isa.cpuinfo()[0],
        "cpu_flags": " ".join(sorted(cpu_isa.cpuinfo()[1])),  # lscpu's flags line
        "isa_class": cpu_isa.effective(),  # what the kernels run as: the CPU's class, or SPECDECODE_ISA's below it
        "isa_forced": cpu_isa.forced(),
        "logical_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),  # `--threads`: torch's, the native kernels' and the peers'
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "specdecode": specdecode.__version__,
        "git_commit": _git_commit(),
    }
    try:
        import psutil

        info["physical_cores"] = psutil.cpu_count(logical=False)
        info["memory_bytes"] = psutil.virtual_memory().total
    except ImportError:
        pass
    for mod in ("transformers", "llama_cpp"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - absent or broken: just not reported
            info[mod] = None
    return info


def cpu_line() -> str:
    """The CPU's model, logical cores, the class the kernels run as and the flags line, for a benchmark's output."""
    name, flags = cpu_isa.cpuinfo()
    forced = f" (forced; the CPU's own: {cpu_isa.detected()})" if cpu_isa.forced() else ""
    return (f"{name}, {os.cpu_count()} logical cores, class {cpu_isa.effective()}{forced}; "
            f"flags: {' '.join(sorted(flags))}")


def class_env(cls: str) -> dict[str, str]:
    """This process's environment for a child that runs as CPU class `cls` ("best": the CPU's own); the class
    switch is read when the package is imported, so a class needs a process of its own."""
    env = {k: v for k, v in os.environ.items() if k not in (cpu_isa.ENV, "SPECDECODE_GGUF_ISA")}
    if cls != "best":
        env[cpu_isa.ENV] = cls
    return env

