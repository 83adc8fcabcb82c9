"""Compile a small C/C++ source into a shared library once, cached under the specdecode home by the hash of
its source and flags (the llama.cpp binding's libstdc++ shim, the weight-only GEMM kernels)."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

from specdecode.log import timed_step

logger = logging.getLogger(__name__)


class BuildError(RuntimeError):
    pass


def find_compiler(cxx: bool) -> str | None:
    env = os.environ.get("CXX" if cxx else "CC")
    names = ("g++", "c++", "clang++") if cxx else ("gcc", "cc", "clang")
    return env or next((p for p in map(shutil.which, names) if p), None)


def build_shared(source: str, name: str, flags: list[str], *, cxx: bool = False) -> Path:
    """Path of `name`-<hash>.so built from `source` with `flags` (built now if it is not cached)."""
    from specdecode.fetch import models_home

    tag = hashlib.sha256("\0".join([source, *flags]).encode()).hexdigest()[:12]
    out = models_home() / "native" / f"{name}-{tag}.so"
    if out.is_file():
        return out
    compiler = find_compiler(cxx)
    if compiler is None:
        raise BuildError(f"no {'C++' if cxx else 'C'} compiler found to build {name}")
    out.parent.mkdir(parents=True, exist_ok=True)
    suffix = ".cc" if cxx else ".c"
    src = out.with_suffix(f".{os.getpid()}{suffix}")
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    try:
        src.write_text(source)
        with timed_step(logger, f"compiled {name} (once; cached in {out.parent})", always=True):
            proc = subprocess.run([compiler, *flags, "-shared", "-fPIC", "-o", str(tmp), str(src)],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise BuildError(f"building {name} failed: {proc.stderr.strip()[-500:]}")
        os.replace(tmp, out)  # atomic: a concurrent build of the same source wins or loses whole
    finally:
        src.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)
    return out
