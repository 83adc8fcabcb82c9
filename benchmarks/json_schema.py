"""Tokens per second of JSON-schema generation (structured outputs), with and without speculation.

Each prompt asks for a JSON object of a given schema (records of people, products, events, ...); every
method generates all of them greedy, constrained by the schema, one prompt at a time (the latency a client
sees) and as one batch. The constrained outputs must be identical across methods (speculation is lossless
with respect to the constrained target) and must validate against their schemas.

On the Qwen pair::

    python benchmarks/json_schema.py --model qwen2.5-coder-1.5b-instruct --methods plain,ngram,draft,eagle \\
        --num-prompts 16 --max-tokens 256 --out bench-out/json_schema

Smoke run on a small model::

    python benchmarks/json_schema.py --model smollm2-135m-instruct --methods plain,ngram --num-prompts 2 \\
        --max-tokens 48
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdecode import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from specdecode.bench.methods import parse_method  # noqa: E402
from specdecode.heads.shipped import shipped_heads  # noqa: E402

STR = {"type": "string", "maxLength": 40}
SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("a list of 3 people with name, age and email", {
        "type": "object", "additionalProperties": False, "required": ["people"],
        "properties": {"people": {"type": "array", "minItems": 3, "maxItems": 3, "items": {
            "type": "object", "additionalProperties": False, "required": ["name", "age", "email"],
            "properties": {"name": STR, "age": {"type": "integer", "minimum": 0, "maximum": 120}, "email": STR}}}}}),
    ("a product with name, price, currency, tags and stock", {
        "type": "object", "additionalProperties": False, "required": ["name", "price", "currency", "tags", "in_stock"],
        "properties": {"name": STR, "price": {"type": "number", "minimum": 0},
                       "currency": {"enum": ["USD", "EUR", "GBP"]},
                       "tags": {"type": "array", "items": STR, "maxItems": 5}, "in_stock": {"type": "boolean"}}}),
    ("an event with title, date, location (city, country) and 2 speakers", {
        "type": "object", "additionalProperties": False, "required": ["title", "date", "location", "speakers"],
        "properties": {"title": STR, "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                       "location": {"type": "object", "additionalProperties": False, "required": ["city", "country"],
                                    "properties": {"city": STR, "country": STR}},
                       "speakers": {"type": "array", "minItems": 2, "maxItems": 2, "items": STR}}}),
    ("a Python function's documentation: name, arguments (name, type, description) and return type", {
        "type": "object", "additionalProperties": False, "required": ["name", "arguments", "returns"],
        "properties": {"name": STR, "returns": STR, "arguments": {"type": "array", "maxItems": 4, "items": {
            "type": "object", "additionalProperties": False, "required": ["name", "type", "description"],
            "properties": {"name": STR, "type": STR, "description": STR}}}}}),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--methods", default="plain,ngram,draft,eagle", help="comma list of bench method names")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct", help="draft model of draft methods")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--out", type=Path, default=None, help="write results.json here")
    return p.parse_args(argv)


def requests(n: int) -> list[tuple[list[dict[str, str]], dict[str, Any]]]:
    out = []
    for i in range(n):
        what, schema = SCHEMAS[i % len(SCHEMAS)]
        ask = f"Invent {what} (example {i + 1}). Answer with JSON only."
        out.append(([{"role": "user", "content": ask}], schema))
    return out


def run_method(name: str, args: argparse.Namespace, reqs: list[tuple[list[dict[str, str]], dict[str, Any]]]
               ) -> tuple[dict[str, Any], list[list[int]]]:
    spec = parse_method(name, args.draft, shipped_heads(args.model))  # eagle/medusa: the shipped head
    llm = LLM(args.model, dtype=args.dtype, speculative_config=spec.speculative_config,
              max_model_len=args.max_model_len, quantization=spec.quantization, max_num_seqs=len(reqs))
    prompts = [llm.chat_prompt_ids(m) for m, _ in reqs]
    params = [SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                             structured_outputs=StructuredOutputsParams(json=schema)) for _, schema in reqs]
    # Warm-up, every request at once: the grammar engine's tokenizer and grammars, the batch's forward costs.
    llm.run_sequences([llm.new_sequence(p, SamplingParams(max_tokens=4, temperature=0.0,
                                                          structured_outputs=StructuredOutputsParams(json=schema)))
                       for p, (_, schema) in zip(prompts, reqs, strict=True)])
    t0 = time.perf_counter()
    single = [llm.generate([p], sp)[0] for p, sp in zip(prompts, params, strict=True)]
    single_s = time.perf_counter() - t0
    seqs = [llm.new_sequence(p, sp) for p, sp in zip(prompts, params, strict=True)]
    t0 = time.perf_counter()
    batched = [s.to_output() for s in llm.run_sequences(seqs)]
    batched_s = time.perf_counter() - t0
    valid = 0
    for o, (_, schema) in zip(single, reqs, strict=True):
        try:
            import jsonschema

            jsonschema.validate(json.loads(o.text), schema)
            valid += 1
        except Exception:  # noqa: BLE001 - a truncated (max_tokens) output does not parse
            pass
    tokens = sum(len(o.token_ids) for o in single)
    steps = sum(o.metrics["steps"] for o in single)
    result = {"method": name, "prompts": len(reqs), "output_tokens": tokens, "valid_json": valid,
              "one_at_a_time_seconds": single_s, "one_at_a_time_tokens_per_second": tokens / single_s,
              "batched_seconds": batched_s,
              "batched_tokens_per_second": sum(len(o.token_ids) for o in batched) / batched_s,
              "tau": tokens / steps if steps else 0.0,
              "batched_identical": [o.token_ids for o in single] == [o.token_ids for o in batched]}
    ids = [o.token_ids for o in single]
    del llm
    gc.collect()
    return result, ids


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reqs = requests(args.num_prompts)
    results, reference = [], None
    for name in [m.strip() for m in args.methods.split(",") if m.strip()]:
        r, ids = run_method(name, args, reqs)
        reference = ids if reference is None else reference
        r["identical_to_first_method"] = ids == reference
        results.append(r)
        print(f"{name:<10} {r['one_at_a_time_tokens_per_second']:7.1f} tok/s one at a time, "
              f"{r['batched_tokens_per_second']:7.1f} tok/s batched, tau {r['tau']:.2f}, "
              f"valid {r['valid_json']}/{r['prompts']}, identical {r['identical_to_first_method']}", file=sys.stderr)
    plain = next((r for r in results if r["method"] == "plain"), None)
    if plain is not None:
        for r in results:
            r["speedup_one_at_a_time"] = r["one_at_a_time_tokens_per_second"] / plain["one_at_a_time_tokens_per_second"]
            r["speedup_batched"] = r["batched_tokens_per_second"] / plain["batched_tokens_per_second"]
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps({"command": " ".join(sys.argv), "results": results},
                                                          indent=1))
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
