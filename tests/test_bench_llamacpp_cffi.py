"""The llama.cpp peer's llama-cpp-cffi binding (module ``llama``), without the real package: a fake C API."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import shutil
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from specdecode.bench import llamacpp_cffi, peer_llamacpp
from specdecode.bench.peer_base import PeerContext
from specdecode.bench.peers import make_peers

EOS = 99


class FakeFFI:
    NULL = None

    def new(self, ctype: str, values: list[int]) -> list[int]:
        assert ctype == "int32_t[]"
        return list(values)


class FakeLib:
    """llama.h as the backend calls it. The "model" predicts last token + 1; n_batch is 2."""

    def __init__(self) -> None:
        self.seq: list[int] = []
        self.chunks: list[int] = []
        self.chain: list[tuple[Any, ...]] = []
        self.calls: list[str] = []
        self.freed: set[str] = set()

    def llama_model_default_params(self) -> Any:
        return types.SimpleNamespace(n_gpu_layers=99, use_mmap=True)

    def llama_model_load_from_file(self, path: bytes, params: Any) -> Any:
        assert path == b"/models/m.gguf" and params.n_gpu_layers == 0
        return "model"

    def llama_context_default_params(self) -> Any:
        return types.SimpleNamespace(n_ctx=0, n_threads=0, n_threads_batch=0, no_perf=False)

    def llama_init_from_model(self, model: Any, params: Any) -> Any:
        self.cparams = params
        return "context"

    def llama_model_get_vocab(self, model: Any) -> Any:
        return "vocab"

    def llama_vocab_eos(self, vocab: Any) -> int:
        return EOS

    def llama_n_batch(self, context: Any) -> int:
        return 2

    def llama_sampler_chain_default_params(self) -> Any:
        return "chain-params"

    def llama_sampler_chain_init(self, params: Any) -> Any:
        return "chain"

    def llama_sampler_chain_add(self, chain: Any, sampler: tuple[Any, ...]) -> None:
        self.chain.append(sampler)

    def llama_sampler_init_greedy(self) -> tuple[Any, ...]:
        return ("greedy",)

    def llama_sampler_init_temp(self, t: float) -> tuple[Any, ...]:
        return ("temp", t)

    def llama_sampler_init_dist(self, seed: int) -> tuple[Any, ...]:
        return ("dist", seed)

    def llama_kv_self_clear(self, context: Any) -> None:
        self.calls.append("clear")
        self.seq = []

    def llama_sampler_reset(self, chain: Any) -> None:
        self.calls.append("reset")

    def llama_batch_get_one(self, tokens: list[int], n: int) -> list[int]:
        return tokens[:n]

    def llama_decode(self, context: Any, batch: list[int]) -> int:
        assert 1 <= len(batch) <= 2  # never more than n_batch
        self.chunks.append(len(batch))
        self.seq += batch
        return 0

    def llama_sampler_sample(self, chain: Any, context: Any, idx: int) -> int:
        assert idx == -1
        return self.seq[-1] + 1

    def llama_sampler_free(self, chain: Any) -> None:
        self.freed.add(chain)

    def llama_free(self, context: Any) -> None:
        self.freed.add(context)

    def llama_model_free(self, model: Any) -> None:
        self.freed.add(model)


def _fake_module(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=name == "llama")
    for k, v in attrs.items():
        setattr(mod, k, v)
    return mod


@pytest.fixture
def fake_cffi(monkeypatch: pytest.MonkeyPatch) -> FakeLib:
    """llama-cpp-cffi "installed" (module ``llama``, version 0.4.42), llama-cpp-python not."""
    lib = FakeLib()
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    monkeypatch.setitem(sys.modules, "llama", _fake_module("llama"))
    monkeypatch.setitem(sys.modules, "llama.llama_cpp", _fake_module("llama.llama_cpp", ffi=FakeFFI(), lib=lib))
    monkeypatch.setattr(peer_llamacpp, "_dist_version", lambda name: "0.4.42" if name == "llama-cpp-cffi" else None)
    return lib


def test_llamacpp_peer_uses_llama_cpp_cffi_when_llama_cpp_python_is_missing(fake_cffi: FakeLib) -> None:
    lib = fake_cffi
    ctx = PeerContext(target_path=Path("/models/m.gguf"), draft_path=None, eos_token_id=5, max_tokens=4,
                      threads=3, max_prompt_tokens=5000)
    found, notes = make_peers(["llama.cpp"], ctx)
    assert notes == [] and len(found) == 1
    peer = found[0]
    assert peer.binding == "llama-cpp-cffi" and peer.package == "llama"
    assert peer.method_names() == ["llamacpp-plain"]  # the binding has no speculative decoding
    (plain,) = peer.open()
    assert plain.name == "llamacpp-plain"
    assert plain.settings == {"binding": "llama-cpp-cffi 0.4.42", "n_threads": 3, "backend": "cpu"}
    assert (lib.cparams.n_threads, lib.cparams.n_threads_batch, lib.cparams.n_ctx) == (3, 3, 5000 + 4 + 16)
    assert lib.chain == [("greedy",)]

    assert plain.generate([10, 11, 12, 13, 14]) == [15, 16, 17, 18]  # max tokens
    assert lib.chunks == [2, 2, 1, 1, 1, 1]  # the prompt in chunks of n_batch, then one token a step
    assert lib.seq == [10, 11, 12, 13, 14, 15, 16, 17]  # the last token is not decoded
    assert plain.generate([2, 3]) == [4, 5]  # the target's EOS (included)
    assert lib.seq == [2, 3, 4]  # the KV cache was cleared: nothing reused from the first prompt
    assert plain.generate([97]) == [98, EOS]  # llama.cpp's own EOS
    assert lib.calls == ["clear", "reset"] * 3
    peer.close()
    assert lib.freed == {"chain", "context", "model"} and peer.llms == []


def test_llamacpp_cffi_temperature_and_edge_cases(fake_cffi: FakeLib) -> None:
    lib = fake_cffi
    llm = llamacpp_cffi.CffiLlama(Path("/models/m.gguf"), n_threads=1, n_ctx=64, seed=7, temperature=0.5)
    assert lib.chain == [("temp", 0.5), ("dist", 7)]
    assert llm.generate([1, 2], 0, {EOS}) == [] and llm.generate([], 4, {EOS}) == []
    assert lib.chunks == []
    assert llm.generate([1], 1, {EOS}) == [2]
    llm.close()
    llm.close()  # twice is harmless


def test_llamacpp_peer_skip_notes(monkeypatch: pytest.MonkeyPatch, fake_cffi: FakeLib) -> None:
    hf_dir = PeerContext(target_path=Path("/models/hf-dir"), draft_path=None, eos_token_id=5, max_tokens=4)
    found, notes = make_peers(["llamacpp"], hf_dir)
    assert found == [] and "needs a GGUF" in notes[0]

    monkeypatch.setattr(peer_llamacpp, "_dist_version", lambda name: None)  # a "llama" module of another package
    gguf = PeerContext(target_path=Path("/models/m.gguf"), draft_path=None, eos_token_id=5, max_tokens=4)
    found, notes = make_peers(["llama.cpp"], gguf)
    assert found == [] and notes[0].startswith("llama.cpp: skipped, neither") and "llama-cpp-cffi" in notes[0]


class _FlakyFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Provides ``llama`` and ``llama.llama_cpp``; the latter fails once like a library missing a symbol."""

    def __init__(self) -> None:
        self.attempts = 0

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname in ("llama", "llama.llama_cpp"):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=fullname == "llama")
        return None

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        if module.__name__ == "llama.llama_cpp":
            self.attempts += 1
            if self.attempts == 1:
                raise ImportError("_llama_cpp_cpu.so: undefined symbol: __cxa_call_terminate")
            module.ffi, module.lib = "ffi", "lib"


def test_load_binding_builds_and_loads_the_libstdcxx_shim_once_needed(monkeypatch: pytest.MonkeyPatch) -> None:
    finder = _FlakyFinder()
    for name in ("llama", "llama.llama_cpp"):  # set first so that undoing removes what the import adds
        monkeypatch.setitem(sys.modules, name, None)
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    loaded = []
    monkeypatch.setattr(llamacpp_cffi, "build_shim", lambda: Path("/cache/shim.so"))
    monkeypatch.setattr(llamacpp_cffi.ctypes, "CDLL", lambda path, mode: loaded.append((path, mode)))
    monkeypatch.delenv("LLAMA_CPP_BACKEND", raising=False)

    assert llamacpp_cffi.load_binding() == ("ffi", "lib")
    assert finder.attempts == 2 and loaded == [("/cache/shim.so", llamacpp_cffi.ctypes.RTLD_GLOBAL)]
    assert "LLAMA_CPP_BACKEND" not in os.environ  # set to "cpu" only while importing


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="no C++ compiler")
def test_libstdcxx_shim_compiles_and_exports_its_symbols(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import ctypes

    monkeypatch.setenv("SPECDECODE_HOME", str(tmp_path))
    path = llamacpp_cffi.build_shim()
    assert path.is_file() and path.parent == tmp_path / "native"
    assert llamacpp_cffi.build_shim() == path  # cached
    so = ctypes.CDLL(str(path))
    for sym in ("__cxa_call_terminate", "_ZSt21ios_base_library_initv"):
        assert hasattr(so, sym)
