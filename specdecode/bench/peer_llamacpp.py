"""The llama.cpp peer through its Python bindings, on the GGUF's own quantized weights.

- ``llamacpp-plain``: ``Llama(model_path=GGUF)``.
- ``llamacpp-prompt-lookup``: ``draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10)``.
- ``llamacpp-draft``: a GGUF draft model through ``LlamaDraftLlama`` (`specdecode.bench.llamacpp_draft`).

llama.cpp runs through ``Llama.generate`` (the token loop under ``create_completion``) so that the exact output
token ids are known: they are counted and compared like ours.

Where ``llama_cpp`` (llama-cpp-python, an sdist that compiles llama.cpp) is not installed, the peer uses ``llama``
(llama-cpp-cffi, a binary wheel with a prebuilt CPU library; see ``specdecode.bench.llamacpp_cffi``) instead: the
same GGUF, prompt ids, greedy token loop and stops on llama.cpp's C API. That binding has no speculative decoding,
so it gives ``llamacpp-plain`` only. Each method's settings name the binding and its version.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from specdecode.bench.llamacpp_draft import DRAFT_TOKENS, LlamaDraftLlama
from specdecode.bench.peer_base import GenerateFn, Peer, PeerContext, PeerMethod


def _dist_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def llamacpp_binding() -> str | None:
    """Which llama.cpp binding the peer would use here (imports nothing), or None."""
    if importlib.util.find_spec("llama_cpp") is not None:
        return "llama-cpp-python"
    # ``llama`` is a common name: only llama-cpp-cffi's counts.
    if importlib.util.find_spec("llama") is not None and _dist_version("llama-cpp-cffi") is not None:
        return "llama-cpp-cffi"
    return None


class LlamaCppPeer(Peer):
    name = "llama.cpp"
    package = "llama_cpp"

    def __init__(self, ctx: PeerContext) -> None:
        super().__init__(ctx)
        self.llms: list[Any] = []
        self.binding = llamacpp_binding()
        if self.binding == "llama-cpp-cffi":
            self.package = "llama"

    def available(self) -> str | None:
        if self.binding is None:
            why = ("llama.cpp: skipped, neither 'llama_cpp' (pip install llama-cpp-python) nor 'llama' "
                   "(pip install --no-deps llama-cpp-cffi==0.4.42) is installed")
        else:
            why = super().available()
        if why is None and (self.ctx.target_path.is_dir() or self.ctx.target_path.suffix != ".gguf"):
            why = f"llama.cpp: skipped, it needs a GGUF target (got {self.ctx.target_path})"
        return why

    def method_names(self) -> list[str]:
        if self.binding == "llama-cpp-cffi":
            return ["llamacpp-plain"]  # the binding has no speculative decoding
        names = ["llamacpp-plain", "llamacpp-prompt-lookup"]
        if self._draft_gguf() is not None:
            names.append("llamacpp-draft")
        return names

    def _draft_gguf(self) -> Path | None:
        draft = self.ctx.draft_path
        return draft if draft is not None and draft.suffix == ".gguf" and draft.is_file() else None

    def _n_ctx(self) -> int:
        return max(4096, self.ctx.max_prompt_tokens + self.ctx.max_tokens + 16)

    def _settings(self, **extra: Any) -> dict[str, Any]:
        version = _dist_version(self.binding or "") or "unknown"
        return {"binding": f"{self.binding} {version}", "n_threads": self.ctx.threads, **extra}

    def _new_llama(self, draft_model: Any = None, path: Path | None = None) -> Any:
        from llama_cpp import Llama

        # With a draft model llama-cpp-python keeps every position's logits, but sizes that buffer by the
        # logits_all argument: left False, it holds n_batch rows and a prompt longer than n_batch (512)
        # fails ("could not broadcast ... into shape (0,)"). Asking for it explicitly sizes it n_ctx.
        llm = Llama(model_path=str(path or self.ctx.target_path), n_threads=self.ctx.threads, n_ctx=self._n_ctx(),
                    verbose=False, seed=self.ctx.seed, draft_model=draft_model, logits_all=draft_model is not None)
        self.llms.append(llm)
        return llm

    def _stop(self, llm: Any) -> set[int]:
        stop = {int(llm.token_eos())}
        if self.ctx.eos_token_id is not None:
            stop.add(self.ctx.eos_token_id)
        return stop

    def _make(self, llm: Any) -> GenerateFn:
        ctx = self.ctx
        stop = self._stop(llm)
        greedy = ctx.temperature <= 0

        def generate(ids: list[int]) -> list[int]:
            llm.reset()  # no reuse of the previous prompt's KV cache
            out: list[int] = []
            if ctx.max_tokens <= 0:
                return out
            for tok in llm.generate(ids, temp=0.0 if greedy else ctx.temperature, top_k=1 if greedy else 0,
                                    top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
                out.append(int(tok))
                if tok in stop or len(out) >= ctx.max_tokens:
                    break
            return out

        return generate

    def _open_cffi(self) -> list[PeerMethod]:
        from specdecode.bench.llamacpp_cffi import CffiLlama

        ctx = self.ctx
        llm = CffiLlama(ctx.target_path, n_threads=ctx.threads, n_ctx=self._n_ctx(), seed=ctx.seed,
                        temperature=ctx.temperature)
        self.llms.append(llm)
        stop = self._stop(llm)
        generate: GenerateFn = lambda ids: llm.generate(ids, ctx.max_tokens, stop)
        return [PeerMethod("llamacpp-plain", generate, self._settings(backend="cpu"))]

    def open(self) -> list[PeerMethod]:
        if self.binding == "llama-cpp-cffi":
            return self._open_cffi()
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        plain = self._new_llama()
        lookup = self._new_llama(LlamaPromptLookupDecoding(num_pred_tokens=10))
        methods = [
            PeerMethod("llamacpp-plain", self._make(plain), self._settings()),
            PeerMethod("llamacpp-prompt-lookup", self._make(lookup),
                       self._settings(num_pred_tokens=10, max_ngram_size=2)),
        ]
        draft_gguf = self._draft_gguf()
        if draft_gguf is not None:
            drafter = self._new_llama(path=draft_gguf)
            target = self._new_llama(LlamaDraftLlama(drafter, DRAFT_TOKENS, self._stop(drafter)))
            methods.append(PeerMethod("llamacpp-draft", self._make(target),
                                      self._settings(draft=draft_gguf.name, num_pred_tokens=DRAFT_TOKENS)))
        return methods

    def close(self) -> None:
        for llm in self.llms:
            close = getattr(llm, "close", None)
            if close is not None:
                close()
        self.llms = []
        super().close()
