"""The ``llama-server`` peer: llama.cpp as its users serve it.

The `llama-server` binary (``benchmarks/build_llama_server.sh`` builds it from the vendored sources of the
llama-cpp-python sdist; found through ``$SPECDECODE_LLAMA_SERVER``, the user cache or ``PATH``), one server per
method, greedy ``/completion`` requests with the prompt's token ids and no prompt cache between requests:

- ``llamaserver-plain``: no speculation.
- ``llamaserver-ngram-simple``: ``--spec-type ngram-simple`` at its defaults.
- ``llamaserver-ngram-mod``, ``llamaserver-ngram-cache``: ``--spec-type ngram-mod`` / ``ngram-cache`` at their
  defaults: lookups that also learn from the server's earlier requests (one server serves every prompt of a
  method, so they learn as our `suffix` does).
- ``llamaserver-draft``: ``-md DRAFT --spec-type draft-simple`` at its defaults (with a GGUF draft).

Each method's settings record the server's peak RSS (``VmHWM``) after its last request.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from specdecode.bench.peer_base import GenerateFn, Peer, PeerContext, PeerMethod
from specdecode.bench.process import free_port, status_bytes, wait_healthy


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
        out = {"llamaserver-plain": [], "llamaserver-ngram-simple": ["--spec-type", "ngram-simple"],
               "llamaserver-ngram-mod": ["--spec-type", "ngram-mod"],
               "llamaserver-ngram-cache": ["--spec-type", "ngram-cache"]}
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
