"""The CPU's instruction-set class, and the one switch that makes a machine run as a lesser class.

Five classes, each a superset of the one before; the kernels choose by them:

| class | CPUs | GGUF blocks | bf16 linears, fp32, attention and the native stack |
|---|---|---|---|
| `avx2` | Haswell+, Zen 1-3, laptops | AVX2 (and AVX-VNNI if present) | AVX2 library: GEMMs, decoder ops, stack |
| `avx512` | Skylake-SP | AVX2 | as `avx2` |
| `avx512vnni` | Cascade Lake, Ice Lake | AVX512-VNNI | as `avx2` |
| `avx512bf16` | Cooper Lake, Zen 4, Zen 5 | AVX512-VNNI | AVX512-BF16 library: every GEMM and decoder op |
| `amx` | Sapphire Rapids+ | AVX512-VNNI | the AVX512-BF16 library, bf16 GEMMs on AMX tiles |

`SPECDECODE_ISA=<class>` runs this machine as that class: every kernel family (GGUF, bf16, int8/int4, fp32, the
heads, which run on the same linears) takes only what the class has, and torch's own kernels are capped alike
(`ATEN_CPU_CAPABILITY`, `ONEDNN_MAX_CPU_ISA`, `MKL_ENABLE_INSTRUCTIONS`, set when the package is imported before
torch). A class above what the CPU has changes nothing: each kernel still checks the CPU before it runs.
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

ENV = "SPECDECODE_ISA"
CLASSES = ("avx2", "avx512", "avx512vnni", "avx512bf16", "amx")
"""From least to most; each has everything the ones before it have."""
_NEEDS = {  # class: the /proc/cpuinfo flags that make it
    "avx2": ("avx2", "fma"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "avx512vnni": ("avx512_vnni",),
    "avx512bf16": ("avx512_bf16",),
    "amx": ("amx_bf16", "amx_tile"),
}
_TORCH = {  # class: (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS)
    "avx2": ("avx2", "AVX2", "AVX2"),
    "avx512": ("avx512", "AVX512_CORE", "AVX512"),
    "avx512vnni": ("avx512", "AVX512_CORE_VNNI", "AVX512_E1"),
    "avx512bf16": ("avx512", "AVX512_CORE_BF16", "AVX512_E1"),
    "amx": ("avx512", "AVX512_CORE_AMX", "AVX512_E1"),
}


@functools.cache
def cpuinfo() -> tuple[str, frozenset[str]]:
    """(model name, flags) of the first processor in /proc/cpuinfo; the platform's name and no flags elsewhere."""
    name, flags = "", frozenset()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and not name:
                name = value.strip()
            elif key == "flags" and not flags:
                flags = frozenset(value.split())
    except OSError:
        pass
    return name or platform.processor() or platform.machine(), flags


def class_of(flags: frozenset[str] | set[str]) -> str | None:
    """The highest class whose flags (and those of every class below) are all in `flags`; None below AVX2."""
    best = None
    for name in CLASSES:
        if not all(f in flags for f in _NEEDS[name]):
            break
        best = name
    return best


def detected() -> str | None:
    """This CPU's class, from /proc/cpuinfo (None where it cannot be read or the CPU lacks AVX2)."""
    return class_of(cpuinfo()[1])


def forced() -> str | None:
    """SPECDECODE_ISA's class, or None where it is unset; any other value is refused, naming the classes."""
    value = os.environ.get(ENV, "").strip().lower()
    if not value:
        return None
    if value not in CLASSES:
        raise ValueError(f"{ENV}={value!r}: expected one of {', '.join(CLASSES)}")
    return value


def allows(needed: str) -> bool:
    """Kernels of class `needed` may run: SPECDECODE_ISA, where set, is at least `needed`. (Whether the CPU runs
    them is each kernel's own check.)"""
    cap = forced()
    return cap is None or CLASSES.index(cap) >= CLASSES.index(needed)


def effective() -> str | None:
    """The class the kernels run as: the CPU's, lowered to SPECDECODE_ISA where that is set."""
    found, cap = detected(), forced()
    if found is None or cap is None:
        return found if cap is None else cap
    return CLASSES[min(CLASSES.index(found), CLASSES.index(cap))]


def cap_torch() -> None:
    """Cap torch's own CPU kernels at SPECDECODE_ISA's class (its vectorised ATen ops, oneDNN and MKL), unless the
    user set their switches. Takes effect only before torch is imported."""
    cap = forced()
    if cap is not None:
        for name, value in zip(("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"), _TORCH[cap],
                               strict=True):
            os.environ.setdefault(name, value)
