"""llama.cpp through ``llama-cpp-cffi`` (module ``llama``), the llama.cpp peer's second binding.

``llama-cpp-cffi`` ships a prebuilt CPU library (``llama/_llama_cpp_cpu*.so``) in a binary wheel, so
it installs without compiling llama.cpp, where ``llama-cpp-python`` is an sdist that builds for a long
time. Its high-level ``llama.Model`` downloads from the Hugging Face hub and tokenizes with an HF
tokenizer, so the peer uses the C API it exposes (``llama.llama_cpp.lib`` / ``ffi``): load the GGUF,
decode the prompt token ids, then sample and decode one token at a time. The wheel binds llama.cpp's
``llama.h`` (and ggml, clip, llava) only: none of ``common/``'s speculative decoding (draft model,
n-gram / prompt lookup) is in it, so this binding gives ``llamacpp-plain`` only.

Loading: the CPU library is chosen explicitly (``LLAMA_CPP_BACKEND=cpu`` while importing; otherwise
the package picks its CUDA build wherever ``nvidia-smi`` runs), and ``n_gpu_layers=0``, like the
llama-cpp-python peer's default. Version 0.4.42's CPU library was built with GCC 14 and references two
libstdc++ symbols older systems lack (``__cxa_call_terminate``, GCC 14;
``std::ios_base_library_init()``, GCC 13; e.g. Debian 12 ships GCC 12's libstdc++). When the import
fails on one of those, a two-function shim is compiled once with the system C++ compiler into the
specdecode cache and loaded globally before importing again.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DIST = "llama-cpp-cffi"
"""The distribution that provides the ``llama`` module."""

_SHIM_SYMBOLS = ("__cxa_call_terminate", "_ZSt21ios_base_library_initv")
_SHIM_SOURCE = r"""// libstdc++ symbols newer than this system's, for llama-cpp-cffi's prebuilt CPU library.
#include <cxxabi.h>
#include <exception>
#include <ios>
// GCC 14: called when an exception leaves a noexcept function.
extern "C" [[noreturn]] void __cxa_call_terminate(void* ue) noexcept {
    if (ue) __cxxabiv1::__cxa_begin_catch(ue);
    std::terminate();
}
// GCC 13: <iostream> references it so that the standard streams are initialized.
namespace std { void ios_base_library_init() { static ios_base::Init init; } }
"""


@contextlib.contextmanager
def _env(key: str, value: str) -> Iterator[None]:
    old = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


def build_shim() -> Path:
    """Compile the libstdc++ shim once (cached by its source's hash); the path of the .so."""
    from specdecode.native_build import BuildError, build_shared

    try:
        return build_shared(_SHIM_SOURCE, "libstdcxx-shim", ["-O2"], cxx=True)
    except BuildError as exc:
        raise ImportError(f"{DIST}'s CPU library needs libstdc++ symbols this system lacks "
                          f"({', '.join(_SHIM_SYMBOLS)}): {exc}") from exc


def load_binding() -> tuple[Any, Any]:
    """``(ffi, lib)`` of llama-cpp-cffi's CPU library (with the libstdc++ shim where it is needed)."""
    with _env("LLAMA_CPP_BACKEND", "cpu"):
        try:
            from llama.llama_cpp import ffi, lib
        except ImportError as exc:
            if not any(sym in str(exc) for sym in _SHIM_SYMBOLS):
                raise
            ctypes.CDLL(str(build_shim()), mode=ctypes.RTLD_GLOBAL)
            for name in [m for m in sys.modules if m == "llama" or m.startswith("llama.")]:
                del sys.modules[name]  # the failed import's leftovers
            from llama.llama_cpp import ffi, lib
    return ffi, lib


class CffiLlama:
    """One GGUF on llama.cpp's C API: a model, a context and a sampler chain (greedy, or temperature)."""

    def __init__(self, model_path: Path, *, n_threads: int, n_ctx: int, seed: int = 0,
                 temperature: float = 0.0) -> None:
        self.ffi, self.lib = load_binding()
        lib = self.lib
        self.model = self.context = self.sampler = None
        mparams = lib.llama_model_default_params()
        mparams.n_gpu_layers = 0
        self.model = lib.llama_model_load_from_file(str(model_path).encode(), mparams)
        if self.model == self.ffi.NULL:
            raise RuntimeError(f"llama.cpp could not load {model_path}")
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_threads = n_threads
        cparams.n_threads_batch = n_threads
        cparams.no_perf = True
        self.context = lib.llama_init_from_model(self.model, cparams)
        if self.context == self.ffi.NULL:
            self.close()
            raise RuntimeError(f"llama.cpp could not create a context (n_ctx={n_ctx}) for {model_path}")
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.sampler = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        if temperature > 0:
            lib.llama_sampler_chain_add(self.sampler, lib.llama_sampler_init_temp(temperature))
            lib.llama_sampler_chain_add(self.sampler, lib.llama_sampler_init_dist(seed))
        else:
            lib.llama_sampler_chain_add(self.sampler, lib.llama_sampler_init_greedy())

    def token_eos(self) -> int:
        return int(self.lib.llama_vocab_eos(self.vocab))

    def _decode(self, ids: list[int]) -> None:
        """Append ``ids`` to the sequence (positions follow the KV cache), in chunks of n_batch."""
        lib = self.lib
        n_batch = max(1, int(lib.llama_n_batch(self.context)))
        for i in range(0, len(ids), n_batch):
            chunk = self.ffi.new("int32_t[]", ids[i:i + n_batch])
            rc = lib.llama_decode(self.context, lib.llama_batch_get_one(chunk, len(chunk)))
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")

    def generate(self, ids: list[int], max_tokens: int, stop: set[int]) -> list[int]:
        """Greedy (or sampled) continuation of ``ids``: at most ``max_tokens``, ending at a ``stop`` token
        (which is included). The KV cache is cleared first: nothing is reused across calls."""
        lib = self.lib
        out: list[int] = []
        if max_tokens <= 0 or not ids:
            return out
        lib.llama_kv_self_clear(self.context)
        lib.llama_sampler_reset(self.sampler)
        self._decode(list(ids))
        while True:
            tok = int(lib.llama_sampler_sample(self.sampler, self.context, -1))
            out.append(tok)
            if tok in stop or len(out) >= max_tokens:
                return out
            self._decode([tok])

    def close(self) -> None:
        lib = self.lib
        if self.sampler is not None:
            lib.llama_sampler_free(self.sampler)
        if self.context is not None and self.context != self.ffi.NULL:
            lib.llama_free(self.context)
        if self.model is not None and self.model != self.ffi.NULL:
            lib.llama_model_free(self.model)
        self.model = self.context = self.sampler = None
