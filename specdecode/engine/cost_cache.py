"""The measured costs of one machine and model set-up, kept on disk so that a new process starts with them.

Measuring the target's forwards and the drafter's step takes seconds to most of a minute, and until it is done
the engine cannot size drafts: so it is done once per machine and set-up and kept in
`<SPECDECODE_HOME>/costs/<key>.json`. The key hashes everything the costs depend on: the CPU (its model name and
the instruction-set flags the kernels dispatch on), the kernel switches in force (SPECDECODE_NATIVE_KERNELS,
SPECDECODE_AMX, SPECDECODE_GGUF_ISA), torch's thread count and version, the device, the target's and the drafter's
files (the pinned sha256 of an alias, else path, size and modification time) and weight formats, the context
length and the draft settings, and the package version. Change any and the key changes: the costs are measured
again. The same file keeps what earlier requests of the pair measured (engine/history.py).
`SPECDECODE_COST_CACHE=0` turns the cache off: every process measures afresh and writes nothing.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from specdecode import cpu_isa
from specdecode.fetch import KNOWN_MODELS, models_home

logger = logging.getLogger(__name__)

COST_CACHE_ENV = "SPECDECODE_COST_CACHE"
FORMAT = 2
"""The file layout's version (part of the key: a new layout never reads an old file)."""
ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")
"""The CPU flags (as /proc/cpuinfo and lscpu name them) the kernels choose by."""
ISA_SWITCHES = ("SPECDECODE_ISA", "SPECDECODE_NATIVE_KERNELS", "SPECDECODE_AMX", "SPECDECODE_GGUF_ISA")
"""The environment switches that change which kernels run."""


def cost_cache_enabled() -> bool:
    return os.environ.get(COST_CACHE_ENV, "1") != "0"


def cpu_identity() -> dict[str, Any]:
    """The CPU's model name and which of ISA_FLAGS it has."""
    name, flags = cpu_isa.cpuinfo()
    return {"model": name, "flags": [f for f in ISA_FLAGS if f in flags]}


def machine_identity(device: torch.device) -> dict[str, Any]:
    """What the costs of the same weights depend on besides the weights: CPU, kernels, threads, software."""
    try:
        version = importlib.metadata.version("specdecode")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return {
        "cpu": cpu_identity(),
        "switches": {name: os.environ[name] for name in ISA_SWITCHES if name in os.environ},
        "threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "torch": torch.__version__,
        "specdecode": version,
    }


def file_identity(name: str, path: Path) -> dict[str, Any]:
    """A model's identity: the pinned sha256 of a known alias; else its path with the size and modification time
    of the file, or of every file in the directory (a Hugging Face checkpoint, a head)."""
    if name in KNOWN_MODELS:
        return {"sha256": KNOWN_MODELS[name].sha256}
    path = path.resolve()
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    stats = [(p.name, p.stat()) for p in files]
    return {"path": str(path), "files": [[n, s.st_size, s.st_mtime_ns] for n, s in stats]}


class CostCache:
    """The cache file of one set-up (`identity`: a JSON-ready dict that machine_identity() is added to), read
    once; `get` and `put` named parts of it ("costs", "history"). A file that cannot be read or written costs a
    measurement and a warning, never the run."""

    def __init__(self, identity: dict[str, Any], device: torch.device) -> None:
        text = json.dumps({"format": FORMAT, **identity, "machine": machine_identity(device)}, sort_keys=True,
                          default=str)
        self.identity: dict[str, Any] = json.loads(text)
        self.path = models_home() / "costs" / f"{hashlib.sha256(text.encode()).hexdigest()[:32]}.json"
        self._parts: dict[str, Any] = self._read()
        self._writable = True

    def get(self, part: str) -> Any:
        """The part as last written, or None."""
        return self._parts.get(part)

    def put(self, part: str, value: Any) -> None:
        """Replace one part and write the file (atomically: a reader sees the old file or the new one)."""
        self._parts[part] = value
        if not self._writable:
            return
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"identity": self.identity, **self._parts}, indent=1, sort_keys=True))
            os.replace(tmp, self.path)
        except OSError as exc:
            self._writable = False
            logger.warning("cannot write the cost cache %s (%s): later runs measure the costs again", self.path, exc)

    def _read(self) -> dict[str, Any]:
        try:
            record = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            logger.warning("ignoring the unreadable cost cache %s: %s", self.path, exc)
            return {}
        if not isinstance(record, dict) or record.get("identity") != self.identity:
            logger.warning("ignoring the cost cache %s: it was written for another set-up", self.path)
            return {}
        return {k: v for k, v in record.items() if k != "identity"}
