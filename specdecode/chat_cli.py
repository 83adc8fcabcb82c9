"""`specdecode chat`: an interactive multi-turn chat in the terminal.

Each turn applies the model's chat template to the whole conversation, streams the reply as it is
generated and prints the turn's speed and mean accepted length (tau). `/reset` clears the conversation,
`/exit` (or Ctrl-D) quits; Ctrl-C stops a reply early and keeps the chat going.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, TextIO

from specdecode.cli_args import (
    add_cache_args,
    add_model_args,
    add_sampling_args,
    add_threads_arg,
    cache_kwargs,
    fit_to_context,
    sampling_params_from_args,
    speculative_config_from_args,
)

if TYPE_CHECKING:
    from specdecode.engine.llm import LLM
    from specdecode.sampling import SamplingParams

Message = dict[str, str]
COMMANDS_HELP = "/reset clears the conversation, /exit or Ctrl-D quits, Ctrl-C stops a reply"


def add_chat_parser(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("chat", help="chat with a model in the terminal (multi-turn, streamed)",
                       description=f"Interactive multi-turn chat with streamed replies. {COMMANDS_HELP}.")
    add_model_args(c)
    add_threads_arg(c)
    add_cache_args(c)
    c.add_argument("--system", default=None, help="system prompt that opens every conversation")
    add_sampling_args(c)
    c.set_defaults(func=run_chat_command)


def run_chat_command(args: argparse.Namespace) -> int:
    from specdecode import LLM

    params = sampling_params_from_args(args)
    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
              speculative_config=speculative_config_from_args(args), quantization=args.quantization,
              **cache_kwargs(args))  # each turn reuses the conversation so far
    if not llm.tokenizer.has_chat_template:
        raise ValueError(f"{args.model!r} has no chat template: use `specdecode generate` for plain completion")
    try:
        import readline  # noqa: F401 - line editing and history for input()
    except ImportError:  # pragma: no cover - platforms without GNU readline
        pass
    return ChatSession(llm, params, args.max_tokens, args.system).run(sys.stdin, sys.stdout)


class ChatSession:
    """The conversation and the read-reply loop (input from `input()` on a terminal, else from `stdin`)."""

    def __init__(self, llm: LLM, params: SamplingParams, max_tokens: int | None, system: str | None) -> None:
        self.llm = llm
        self.params = params
        self.max_tokens = max_tokens
        self.system: list[Message] = [{"role": "system", "content": system}] if system else []
        self.history: list[Message] = []

    def run(self, stdin: TextIO, out: TextIO) -> int:
        out.write(f"specdecode chat: {self.llm.target.name} ({COMMANDS_HELP})\n")
        while True:
            try:
                line = _read_line(stdin, out, ">>> ")
            except KeyboardInterrupt:
                out.write("\n(/exit or Ctrl-D quits)\n")
                continue
            if line is None or line.strip() == "/exit":
                out.write("\n" if line is None else "")
                return 0
            text = line.strip()
            if not text:
                continue
            if text == "/reset":
                self.history.clear()
                out.write("(conversation cleared)\n")
                continue
            if text.startswith("/"):
                out.write(f"unknown command {text.split()[0]!r}: {COMMANDS_HELP}\n")
                continue
            self.reply(text, out)

    def reply(self, text: str, out: TextIO) -> None:
        """Stream the model's answer to `text`, then one stats line; the exchange joins the history."""
        self.history.append({"role": "user", "content": text})
        kept = len(self.history)
        ids = self._prompt_ids()
        if ids is not None and len(self.history) < kept:
            out.write(f"(the {kept - len(self.history)} oldest messages are dropped to fit the context)\n")
        if ids is None:
            self.history.pop()
            out.write("(the message does not fit the context: /reset or raise --max-model-len)\n")
            return
        params = fit_to_context(self.params, self.max_tokens, self.llm, len(ids))
        seq = None
        try:
            for delta, current in self.llm.stream(ids, params):
                seq = current
                out.write(delta)
                out.flush()
        except KeyboardInterrupt:
            out.write(" [stopped]")
        if seq is None:  # interrupted before the first token
            self.history.pop()
            out.write("\n")
            return
        self.history.append({"role": "assistant", "content": seq.text})
        m = seq.to_output().metrics
        out.write(f"\n[{m['output_tokens']} tokens, {m['tokens_per_second']:.1f} tok/s, "
                  f"tau {m['mean_accepted_length']:.2f}, context {len(seq.token_ids)}/{self.llm.max_model_len}]\n")
        out.flush()

    def _prompt_ids(self) -> list[int] | None:
        """The templated conversation; its oldest exchanges are dropped while it leaves less room for the reply
        than --max-tokens (without it, a quarter of the context). None if the last message alone does not fit."""
        max_len = self.llm.max_model_len
        reserve = max(1, min(self.max_tokens or max_len // 4, max_len // 2))
        while True:
            ids = self.llm.chat_prompt_ids(self.system + self.history)
            room = max_len - len(ids)
            if room >= reserve or (len(self.history) <= 1 and room >= 1):
                return ids
            if len(self.history) <= 1:
                return None
            del self.history[:2]  # the oldest user message and its reply


def _read_line(stdin: TextIO, out: TextIO, prompt: str) -> str | None:
    """One line of input, None at end of input."""
    if stdin is sys.stdin and stdin.isatty():
        try:
            return input(prompt)
        except EOFError:
            return None
    out.write(prompt)
    out.flush()
    line = stdin.readline()
    return line.rstrip("\n") if line else None
