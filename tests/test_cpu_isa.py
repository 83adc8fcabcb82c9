"""SPECDECODE_ISA: the CPU class from its flags, and the switch that makes every kernel family run as a lesser
class (specdecode/cpu_isa.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from specdecode import cpu_isa
from specdecode.model import bf16_linear, gguf_linear, native_kernels

ZEN4 = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16"}


@pytest.mark.parametrize(("flags", "expected"), [
    (set(), None),
    ({"avx2"}, None),  # no FMA: not even the AVX2 class
    ({"avx2", "fma", "avx_vnni"}, "avx2"),
    ({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"}, "avx512"),
    ({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}, "avx512vnni"),
    (ZEN4, "avx512bf16"),
    (ZEN4 | {"amx_bf16", "amx_tile"}, "amx"),
    ({"avx2", "fma", "avx512_vnni"}, "avx2"),  # a class needs every class below it
])
def test_class_of_flags(flags: set[str], expected: str | None) -> None:
    assert cpu_isa.class_of(flags) == expected


def test_unknown_class_is_refused_naming_the_classes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_isa.ENV, "avx1024")
    with pytest.raises(ValueError, match="avx2, avx512, avx512vnni, avx512bf16, amx"):
        cpu_isa.forced()


def test_forced_class_only_lowers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cpu_isa.ENV, raising=False)
    assert cpu_isa.allows("amx") and cpu_isa.effective() == cpu_isa.detected()
    monkeypatch.setenv(cpu_isa.ENV, "AVX512VNNI")
    assert cpu_isa.allows("avx512vnni") and not cpu_isa.allows("avx512bf16")
    if cpu_isa.detected() in ("avx512bf16", "amx"):
        assert cpu_isa.effective() == "avx512vnni"
    monkeypatch.setenv(cpu_isa.ENV, "amx")
    assert cpu_isa.effective() == cpu_isa.detected()  # no class above the CPU's


@pytest.mark.parametrize("cls", cpu_isa.CLASSES)
def test_every_kernel_family_honours_the_class(monkeypatch: pytest.MonkeyPatch, cls: str) -> None:
    monkeypatch.setenv(cpu_isa.ENV, cls)
    monkeypatch.delenv("SPECDECODE_GGUF_ISA", raising=False)
    rank = cpu_isa.CLASSES.index(cls)
    kernel = gguf_linear.isa()
    if kernel == "avx512":
        assert rank >= cpu_isa.CLASSES.index("avx512vnni")
    assert kernel != "avxvnni"  # a forced class stands for CPUs without AVX-VNNI
    if rank < cpu_isa.CLASSES.index("avx512bf16"):
        assert not native_kernels.available()
    if rank < cpu_isa.CLASSES.index("amx"):
        assert not native_kernels.amx_available()
    if rank < cpu_isa.CLASSES.index("avx512"):
        assert not bf16_linear.onednn_bf16_supported()
    if not native_kernels.available() and native_kernels.avx2_available():
        assert bf16_linear.bf16_uses_avx2_kernel()  # our AVX2 GEMM, never oneDNN's emulated bf16


def test_best_class_of_this_cpu_takes_its_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cpu_isa.ENV, raising=False)
    monkeypatch.delenv("SPECDECODE_GGUF_ISA", raising=False)
    if cpu_isa.detected() in ("avx512bf16", "amx"):
        assert native_kernels.available() and gguf_linear.isa() == "avx512"


def test_torch_is_capped_when_imported_after_the_package() -> None:
    code = ("import specdecode, torch, os; "
            "print(torch.backends.cpu.get_cpu_capability(), os.environ['ONEDNN_MAX_CPU_ISA'])")
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")}
    out = subprocess.run([sys.executable, "-c", code], env={**env, cpu_isa.ENV: "avx2"}, capture_output=True,
                         text=True, check=True, timeout=120)
    assert out.stdout.split() == ["AVX2", "AVX2"]


def test_a_benchmark_child_runs_as_the_class_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    from specdecode.bench.machine import class_env, cpu_line

    monkeypatch.setenv("SPECDECODE_ISA", "avx512vnni")
    monkeypatch.setenv("SPECDECODE_GGUF_ISA", "avx2")
    assert class_env("avx2")["SPECDECODE_ISA"] == "avx2" and "SPECDECODE_GGUF_ISA" not in class_env("avx2")
    assert "SPECDECODE_ISA" not in class_env("best")
    assert f"class {cpu_isa.effective()} (forced; the CPU's own: {cpu_isa.detected()})" in cpu_line()
