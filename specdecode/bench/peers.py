"""Other engines on the same prompts: Hugging Face transformers, llama.cpp (llama-cpp-python or llama-cpp-cffi)
and llama.cpp's own server (`llama-server`).

Each peer is an object that lists its method names without loading anything, loads its
models in ``open()``, and hands the harness one ``generate(prompt_ids) -> output_ids``
callable per method; the harness times them exactly like our own methods (batch 1, one
warm-up, prefill included, stop at EOS). A peer whose package is missing, or that cannot
load the model, is skipped with a note, never a failure.

Methods:

- ``hf-plain``: ``model.generate`` greedy on the target's weights (a GGUF is dequantized by
  transformers: ``from_pretrained(dir, gguf_file=name)``).
- ``hf-assisted``: ``assistant_model=`` the draft loaded the same way, with transformers' own
  default schedule (whatever the draft's ``generation_config`` holds; unset means the library
  default, in transformers 5: 20 tokens, "constant", confidence threshold 0.4, which HF adapts
  across calls and keeps).
- ``hf-assisted-k4``: the same with ``num_assistant_tokens=4``, schedule ``"constant"``.
- ``hf-prompt-lookup``: ``prompt_lookup_num_tokens=10`` (the value transformers' docs use;
  the library has no default: ``None`` disables it), ``max_matching_ngram_size`` at its default.
- ``llamacpp-plain``: ``Llama(model_path=GGUF)`` on the GGUF's native quantized weights.
- ``llamacpp-prompt-lookup``: ``draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10)``.

llama.cpp runs through ``Llama.generate`` (the token loop under ``create_completion``) so
that the exact output token ids are known: they are counted and compared like ours.

Where ``llama_cpp`` (llama-cpp-python, an sdist that compiles llama.cpp) is not installed, the
llama.cpp peer uses ``llama`` (llama-cpp-cffi, a binary wheel with a prebuilt CPU library; see
``specdecode.bench.llamacpp_cffi``) instead: the same GGUF, prompt ids, greedy token loop and stops
on llama.cpp's C API. That binding has no speculative decoding, so it gives ``llamacpp-plain`` only.
Each method's settings name the binding and its version.

The ``llama-server`` peer runs llama.cpp as its users serve it: the `llama-server` binary
(``benchmarks/build_llama_server.sh`` builds it from the vendored sources of the llama-cpp-python
sdist; found through ``$SPECDECODE_LLAMA_SERVER``, the user cache or ``PATH``), one server per method,
greedy ``/completion`` requests with the prompt's token ids and no prompt cache between requests:

- ``llamaserver-plain``: no speculation.
- ``llamaserver-ngram-simple``: ``--spec-type ngram-simple`` at its defaults.
- ``llamaserver-draft``: ``-md DRAFT --spec-type draft-simple`` at its defaults (with a GGUF draft).

Each method's settings record the server's peak RSS (``VmHWM``) after its last request.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specdecode.bench.llamacpp_draft import DRAFT_TOKENS, LlamaDraftLlama
from specdecode.bench.process import free_port, status_bytes, wait_healthy

PEERS: tuple[str, ...] = ("transformers", "llama.cpp", "llama-server")
PEER_ALIASES = {"transformers": "transformers", "hf": "transformers", "llama.cpp": "llama.cpp",
                "llamacpp": "llama.cpp", "llama_cpp": "llama.cpp", "llama-server": "llama-server",
                "llamaserver": "llama-server"}

GenerateFn = Callable[[list[int]], list[int]]


@dataclass
class PeerContext:
    target_path: Path
    """Resolved target: a .gguf file or a Hugging Face directory."""
    draft_path: Path | None
    """Resolved draft model for assisted generation, or None."""
    eos_token_id: int | None
    """The target tokenizer's EOS (the id our engine stops at)."""
    max_tokens: int
    temperature: float = 0.0
    dtype: torch.dtype = torch.bfloat16
    threads: int = 2
    seed: int = 0
    max_prompt_tokens: int = 0
    """Longest prompt of the run (llama.cpp's context is sized to fit it)."""


@dataclass
class PeerMethod:
    name: str
    generate: GenerateFn
    settings: dict[str, Any] = field(default_factory=dict)
    prepare: Callable[[], None] | None = None
    """Called once before the method's warm-up (sets per-method engine options)."""


class Peer:
    name = ""
    package = ""

    def __init__(self, ctx: PeerContext) -> None:
        self.ctx = ctx
        self.notes: list[str] = []

    def available(self) -> str | None:
        """None if the peer can run here; otherwise why not (a note)."""
        if importlib.util.find_spec(self.package) is None:
            return f"{self.name}: skipped, package {self.package!r} is not installed"
        return None

    def method_names(self) -> list[str]:
        raise NotImplementedError

    def open(self) -> list[PeerMethod]:
        raise NotImplementedError

    def close(self) -> None:
        gc.collect()


def _hf_load(path: Path, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    from specdecode.model.load import hf_checkpoint_dir

    # Not from_pretrained(gguf_file=...): transformers 5 keeps GGUF weights packed and computes in its
    # own kernels. Our dequantized copy makes the peer run on exactly the weights we run on.
    model = AutoModelForCausalLM.from_pretrained(str(hf_checkpoint_dir(path, dtype)), dtype=dtype)
    return model.eval()


class TransformersPeer(Peer):
    name = "transformers"
    package = "transformers"

    def __init__(self, ctx: PeerContext) -> None:
        super().__init__(ctx)
        self.model: Any = None
        self.assistant: Any = None

    def method_names(self) -> list[str]:
        names = ["hf-plain"]
        if self.ctx.draft_path is not None:
            names += ["hf-assisted", "hf-assisted-k4"]
        names.append("hf-prompt-lookup")
        return names

    def _kwargs(self) -> dict[str, Any]:
        ctx = self.ctx
        kw: dict[str, Any] = {"max_new_tokens": ctx.max_tokens, "eos_token_id": ctx.eos_token_id,
                              "pad_token_id": ctx.eos_token_id, "repetition_penalty": 1.0}
        if ctx.temperature > 0:
            kw.update(do_sample=True, temperature=ctx.temperature, top_k=0, top_p=1.0)
        else:
            kw.update(do_sample=False, temperature=None, top_k=None, top_p=None)
        return kw

    def _make(self, extra: Callable[[], dict[str, Any]]) -> GenerateFn:
        def generate(ids: list[int]) -> list[int]:
            input_ids = torch.tensor([ids], dtype=torch.long)
            if self.ctx.temperature > 0:
                torch.manual_seed(self.ctx.seed)
            with torch.inference_mode():
                out = self.model.generate(
                    input_ids, attention_mask=torch.ones_like(input_ids), **self._kwargs(), **extra()
                )
            return out[0, len(ids):].tolist()

        return generate

    def open(self) -> list[PeerMethod]:
        ctx = self.ctx
        self.model = _hf_load(ctx.target_path, ctx.dtype)
        methods = [PeerMethod("hf-plain", self._make(dict))]
        if ctx.draft_path is not None:
            self.assistant = _hf_load(ctx.draft_path, ctx.dtype)
            gen_cfg = self.assistant.generation_config
            keys = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
            default = {k: getattr(gen_cfg, k, None) for k in keys}
            assisted = lambda: {"assistant_model": self.assistant}

            def restore_default() -> None:  # once per method: what HF adapts across calls stays adapted
                for k, v in default.items():
                    setattr(self.assistant.generation_config, k, v)

            def set_k4() -> None:
                restore_default()
                self.assistant.generation_config.num_assistant_tokens = 4
                self.assistant.generation_config.num_assistant_tokens_schedule = "constant"

            shown = {k: ("library default" if v is None else v) for k, v in default.items()}
            methods.append(PeerMethod("hf-assisted", self._make(assisted), shown, restore_default))
            methods.append(PeerMethod("hf-assisted-k4", self._make(assisted), {
                **shown, "num_assistant_tokens": 4, "num_assistant_tokens_schedule": "constant"}, set_k4))
        methods.append(PeerMethod("hf-prompt-lookup", self._make(lambda: {"prompt_lookup_num_tokens": 10}),
                                  {"prompt_lookup_num_tokens": 10, "max_matching_ngram_size": "library default"}))
        return methods

    def close(self) -> None:
        self.model = self.assistant = None
        super().close()


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


def llama_server_binary() -> Path | None:
    """`$SPECDECODE_LLAMA_SERVER`, else the build script's output in the user cache, else `llama-server` on PATH."""
    env = os.environ.get("SPECDECODE_LLAMA_SERVER")
    if env:
        return Path(env) if Path(env).is_file() else None
    cached = Path.home() / ".cache" / "specdecode" / "llama-server" / "bin" / "llama-server"
    if cached.is_file():
        return cached
    found = shutil.which("llama-server")
    return Path(found) if found else None


class LlamaServerPeer(Peer):
    name = "llama-server"

    def __init__(self, ctx: PeerContext) -> None:
        super().__init__(ctx)
        self.binary = llama_server_binary()
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    def available(self) -> str | None:
        if self.binary is None:
            return ("llama-server: skipped, no llama-server binary (benchmarks/build_llama_server.sh builds one; "
                    "or set SPECDECODE_LLAMA_SERVER)")
        if self.ctx.target_path.is_dir() or self.ctx.target_path.suffix != ".gguf":
            return f"llama-server: skipped, it needs a GGUF target (got {self.ctx.target_path})"
        return None

    def _variants(self) -> dict[str, list[str]]:
        out = {"llamaserver-plain": [], "llamaserver-ngram-simple": ["--spec-type", "ngram-simple"]}
        draft = self.ctx.draft_path
        if draft is not None and draft.suffix == ".gguf" and draft.is_file():
            out["llamaserver-draft"] = ["-md", str(draft), "--spec-type", "draft-simple"]
        return out

    def method_names(self) -> list[str]:
        return list(self._variants())

    def _start(self, extra: list[str]) -> None:
        """A fresh server for one method (the previous one stopped first)."""
        self._stop()
        ctx, port = self.ctx, free_port()
        n_ctx = max(4096, ctx.max_prompt_tokens + ctx.max_tokens + 16)
        cmd = [str(self.binary), "-m", str(ctx.target_path), "-t", str(ctx.threads), "-c", str(n_ctx), "-np", "1",
               "--host", "127.0.0.1", "--port", str(port), "--no-webui", "-ngl", "0", *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(self.proc, self.url, 600)
        except RuntimeError as exc:
            err = self.proc.stderr.read().decode(errors="replace")[-2000:] if self.proc.stderr else ""
            raise RuntimeError(f"llama-server: {exc}: {err}") from exc

    def _stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self.proc = None

    def _make(self, settings: dict[str, Any]) -> GenerateFn:
        import httpx

        ctx = self.ctx

        def generate(ids: list[int]) -> list[int]:
            assert self.proc is not None
            body = {"prompt": ids, "n_predict": ctx.max_tokens, "temperature": 0.0, "top_k": 1, "seed": ctx.seed,
                    "cache_prompt": False, "return_tokens": True, "stream": False}
            r = httpx.post(f"{self.url}/completion", json=body, timeout=3600)
            r.raise_for_status()
            out = r.json()
            settings["server_peak_rss_bytes"] = status_bytes("VmHWM", self.proc.pid)
            return [int(t) for t in out.get("tokens") or []]  # the end-of-turn token it stopped at included

        return generate

    def open(self) -> list[PeerMethod]:
        methods = []
        for name, extra in self._variants().items():
            settings: dict[str, Any] = {"binary": str(self.binary), "args": " ".join(extra) or "(none)",
                                        "threads": self.ctx.threads}
            methods.append(PeerMethod(name, self._make(settings), settings,
                                      prepare=lambda extra=extra: self._start(extra)))
        return methods

    def close(self) -> None:
        self._stop()
        super().close()


PEER_CLASSES: dict[str, type[Peer]] = {"transformers": TransformersPeer, "llama.cpp": LlamaCppPeer,
                                       "llama-server": LlamaServerPeer}


def parse_peers(names: list[str]) -> list[str]:
    out = []
    for n in names:
        key = PEER_ALIASES.get(n.strip().lower())
        if key is None:
            raise ValueError(f"unknown peer {n!r}; choose from {', '.join(PEERS)}")
        if key not in out:
            out.append(key)
    return out


def make_peers(names: list[str], ctx: PeerContext) -> tuple[list[Peer], list[str]]:
    """The peers that can run, and a note for each one skipped."""
    peers: list[Peer] = []
    notes: list[str] = []
    for name in parse_peers(names):
        peer = PEER_CLASSES[name](ctx)
        why = peer.available()
        if why is None:
            peers.append(peer)
        else:
            notes.append(why)
    return peers, notes
