"""Other engines on the same prompts (peers): Hugging Face transformers (`peer_transformers`), llama.cpp through
llama-cpp-python or llama-cpp-cffi (`peer_llamacpp`) and llama.cpp's own server, `llama-server`
(`peer_llama_server`).

Each peer (`peer_base.Peer`) hands the harness one ``generate(prompt_ids) -> output_ids`` callable per method; the
harness times them exactly like our own methods (batch 1, one warm-up, prefill included, stop at EOS). A peer whose
package is missing, or that cannot load the model, is skipped with a note, never a failure.
"""

from __future__ import annotations

from specdecode.bench.peer_base import Peer, PeerContext
from specdecode.bench.peer_llama_server import LlamaServerPeer
from specdecode.bench.peer_llamacpp import LlamaCppPeer
from specdecode.bench.peer_transformers import TransformersPeer

PEERS: tuple[str, ...] = ("transformers", "llama.cpp", "llama-server")
PEER_ALIASES = {"transformers": "transformers", "hf": "transformers", "llama.cpp": "llama.cpp",
                "llamacpp": "llama.cpp", "llama_cpp": "llama.cpp", "llama-server": "llama-server",
                "llamaserver": "llama-server"}

PEER_CLASSES: dict[str, type[Peer]] = {"transformers": TransformersPeer, "llama.cpp": LlamaCppPeer,
                                       "llama-server": LlamaServerPeer}


def parse_peers(names: list[str]) -> list[str]:
    """The peers `names` asks for (aliases resolved, each once), or ValueError naming an unknown one."""
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
