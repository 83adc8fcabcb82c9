"""Write a benchmark's records, summary (JSON and Markdown) and plots."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from specdecode.bench.stats import OVERALL
from specdecode.extras import missing_extra

logger = logging.getLogger(__name__)

PLOTS = ("speedup_by_task.png", "acceptance_by_position.png", "tokens_per_second.png")


def write_records(path: Path, records: list[dict[str, Any]]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: write null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def write_outputs(out: Path, records: list[dict[str, Any]] | None, summary: dict[str, Any], plots: bool = True) -> None:
    """summary.json, summary.md and the plots; records.jsonl too unless `records` is None (a report on a
    run that may still be appending to it)."""
    out.mkdir(parents=True, exist_ok=True)
    if records is not None:
        write_records(out / "records.jsonl", records)
    (out / "summary.json").write_text(json.dumps(_clean(summary), indent=1) + "\n", encoding="utf-8")
    made = write_plots(out, summary) if plots else []
    (out / "summary.md").write_text(render_markdown(summary, made), encoding="utf-8")


# ---- Markdown ------------------------------------------------------------------------------------


def _f(value: Any, fmt: str = "{:.2f}", suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return fmt.format(value) + suffix


def _gib(value: Any) -> str:
    return _f(value / 2**30 if value is not None else None, "{:.2f}")


def _bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale / 10:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def _row(method: str, s: dict[str, Any], peak: Any, alone: Any) -> str:
    own = ""
    if "speedup_vs_own_plain" in s:
        own = f" ({_f(s.get('speedup_vs_own_plain'), suffix='×')} vs own plain)"
    return (
        f"| {method} | {_f(s['tokens_per_second'])} | {_f(s['speedup'], suffix='×')}{own} "
        f"| {_f(s['mean_accepted_length'])} | {_f(s['acceptance_rate'], '{:.0%}')} "
        f"| {_f(s['identical_rate'], '{:.0%}')} | {_gib(peak)} | {_gib(alone)} | {s['prompts']} | {s['output_tokens']} "
        f"| {_f(s['draft_seconds'], '{:.1f}')} / {_f(s['verify_seconds'], '{:.1f}')} |"
    )


_HEADER = (
    "| method | tok/s | speedup vs plain | τ | acceptance | identical to plain | peak RSS (GiB) "
    "| peak RSS alone (GiB) | prompts | output tokens | draft / verify s |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def _table(summary: dict[str, Any], task: str | None) -> str:
    lines = [_HEADER]
    for method in summary["methods"]:
        entry = summary["by_method"][method]
        s = entry["overall"] if task is None else entry["tasks"].get(task)
        if s is None:
            continue
        res = entry.get("resources", {})
        lines.append(_row(method, s, res.get("peak_rss_bytes"), res.get("alone_peak_rss_bytes")))
    return "\n".join(lines)


_FAMILIES = {"plain": "autoregressive (no speculation)", "ngram": "n-gram prompt lookup",
             "draft": "draft model", "eagle": "EAGLE-style head", "medusa": "Medusa heads"}


def _family(method: str, config: dict[str, Any] | None) -> str:
    base, _, quant = method.partition("@")
    base, _, label = base.partition(":")
    kind = base.split("-")[0]
    name = _FAMILIES.get(kind, kind) + (f" {label}" if label else "")
    if kind in ("draft", "eagle", "medusa"):
        width = (config or {}).get("draft_tree_width")
        tree = width != 1 if kind != "draft" else width not in (None, 1)
        name += (f", tree of width {width}" if width and width > 1 else ", dynamic tree") if tree else ", chain"
        branching = (config or {}).get("draft_tree_branching")
        if tree and branching:
            name += f", top-{branching} expansion"
    return name + (f", {quant} target" if quant else "")


def comparison_table(summary: dict[str, Any]) -> str:
    """The field's comparison (plain, n-gram, draft chain, tree head ...): acceptance, τ, speedup and the
    memory each method adds to plain decoding (draft model or head weights, its caches, and the change of
    the target's own weights for a quantized target); peers: not measured."""
    by = summary["by_method"]

    def added(method: str) -> float | None:  # target weights + what speculation adds (draft/head, caches)
        res = by.get(method, {}).get("resources", {})
        if "target_weight_bytes" not in res:
            return None
        return res["target_weight_bytes"] + res["speculation_bytes"]

    plain = added("plain")
    lines = ["| method | kind | acceptance rate | τ | speedup | extra memory vs plain (GiB) |",
             "|---|---|---:|---:|---:|---:|"]
    for method in summary["methods"]:
        s = by[method]["overall"]
        mine = added(method)
        extra = mine - plain if (mine is not None and plain is not None) else None
        cfg = by[method].get("resources", {}).get("speculative_config")
        lines.append(f"| {method} | {_family(method, cfg)} | {_f(s['acceptance_rate'], '{:.0%}')} "
                     f"| {_f(s['mean_accepted_length'])} | {_f(s['speedup'], suffix='×')} | {_gib(extra)} |")
    return "\n".join(lines)


def _resumed_lines(sessions: list[dict[str, Any]]) -> list[str]:
    later = [f"{x.get('date')} ({x.get('git_commit')}, after {x.get('records_before')} records)" for x in sessions[1:]]
    return ["- resumed: " + "; ".join(later)] if later else []


def render_markdown(summary: dict[str, Any], plots: list[str] | None = None) -> str:
    m = summary["machine"]
    cfg = summary["config"]
    parts = [
        "# specdecode benchmark",
        "",
        "```",
        summary["command"],
        "```",
        "",
        f"- date: {m.get('date')}",
        *_resumed_lines(summary.get("sessions", [])),
        f"- machine: {m.get('cpu')}, {m.get('logical_cores')} logical cores"
        + (f" ({m['physical_cores']} physical)" if m.get("physical_cores") else "")
        + (f", {m['memory_bytes'] / 2**30:.0f} GiB" if m.get("memory_bytes") else "")
        + f", torch {m.get('torch')} ({m.get('torch_threads')} threads), transformers {m.get('transformers')}, "
        f"llama_cpp {m.get('llama_cpp')}, specdecode {m.get('specdecode')} ({m.get('git_commit')})",
        f"- CPU class: {m.get('isa_class')}" + (f" (forced: SPECDECODE_ISA={m['isa_forced']})" if m.get("isa_forced")
                                                else "") + f"; flags: {m.get('cpu_flags')}",
        f"- target `{cfg['model']}` ({cfg['dtype']}), draft `{cfg['draft']}`, dataset `{cfg['dataset']}`, "
        f"{summary['num_prompts']} prompts"
        + (f" ({summary['num_prompts_complete']} measured by every method)"
           if summary.get("num_prompts_complete", summary["num_prompts"]) < summary["num_prompts"] else "")
        + f", max tokens {cfg['max_tokens']}",
        f"- protocol: {summary['protocol']}",
        "",
        "τ = output tokens / target forwards (steps, prefill included); acceptance = accepted / drafted tokens; "
        "speedup = mean tok/s ÷ mean tok/s of `plain` on the same prompts (ratio of means); peers' speedup is "
        "also given against their own plain run. Peak RSS is sampled over the method's load and run "
        "(a peer's models share one process lifetime); peak RSS alone is a plain engine's (ours per format, "
        "llama.cpp's) in a child process of its own, one generation of the first prompt at the same context "
        "size (ours includes the interpreter and torch, ~0.3 GiB; llama.cpp's the interpreter only).",
        "",
        "## Overall",
        "",
        _table(summary, None),
    ]
    if "plain" in summary["by_method"]:
        parts += ["", "## Comparison table (the field's methods, this run)", "", comparison_table(summary)]
    for task in summary["tasks"]:
        parts += ["", f"## {task}", "", _table(summary, task)]

    floor = summary.get("memory_floor")
    bw = summary.get("bandwidth")
    parts += ["", "## Memory floor (plain)", ""]
    if floor is not None:
        parts.append(
            f"Read bandwidth {_f(bw['read_gb_per_s'], '{:.1f}')} GB/s (copy {_f(bw['copy_gb_per_s'], '{:.1f}')} "
            f"GB/s, best of {bw['repeats']} over {_bytes(bw['bytes'])}, {bw['threads']} threads"
            f"{_probes(bw)}); weights "
            f"read per token {_bytes(floor['weight_bytes_per_token'])} (embedding table, "
            f"{_bytes(floor['embedding_bytes_excluded'])}, excluded: a token reads one row) → floor "
            f"{_f(floor['floor_tokens_per_second'], '{:.1f}')} tok/s; plain reaches "
            f"{_f(floor['plain_tokens_per_second'], '{:.2f}')} tok/s with prefill = "
            f"**{_f(floor['plain_fraction_of_floor'], '{:.0%}')} of the floor**, and "
            f"{_f(floor.get('plain_decode_tokens_per_second'), '{:.2f}')} tok/s decoding only (prefill and its "
            f"token excluded) = **{_f(floor.get('plain_decode_fraction_of_floor'), '{:.0%}')} of the floor**."
        )
    else:
        parts.append("Not measured (`--bandwidth-gb 0`).")
    floors = summary.get("memory_floors") or {}
    if len(floors) > 1 or (floors and "plain" not in floors):
        parts += ["", "### Memory floor by target format", "",
                  "| plain method | weight bytes / token | floor tok/s | decode tok/s | floor ÷ decode |",
                  "|---|---:|---:|---:|---:|"]
        for method, fl in floors.items():
            frac = fl.get("plain_decode_fraction_of_floor")
            parts.append(f"| {method} | {_bytes(fl['weight_bytes_per_token'])} | "
                         f"{_f(fl['floor_tokens_per_second'], '{:.1f}')} | "
                         f"{_f(fl.get('plain_decode_tokens_per_second'))} | {_f(1 / frac if frac else None)}× |")

    pos_lines = []
    width = 0
    for method in summary["methods"]:
        abp = summary["by_method"][method]["overall"].get("acceptance_by_position")
        if abp:
            width = max(width, len(abp))
            pos_lines.append((method, abp))
    if pos_lines:
        parts += ["", "## Acceptance by draft position (overall)", "",
                  "| method | " + " | ".join(str(i + 1) for i in range(width)) + " |",
                  "|---|" + "---:|" * width]
        for method, abp in pos_lines:
            cells = [_f(v, "{:.0%}") for v in abp] + [""] * (width - len(abp))
            parts.append(f"| {method} | " + " | ".join(cells) + " |")

    if summary.get("notes"):
        parts += ["", "## Notes", ""] + [f"- {n}" for n in summary["notes"]]
    if plots:
        parts += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    return "\n".join(parts) + "\n"


# ---- plots ---------------------------------------------------------------------------------------


def write_plots(out: Path, summary: dict[str, Any]) -> list[str]:
    """The three plots; returns the file names written (none, with a warning, without matplotlib)."""
    try:
        import matplotlib
    except ImportError as exc:
        logger.warning("plots skipped: %s", missing_extra("bench", exc))
        return []

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    made: list[str] = []
    by_method = summary["by_method"]
    ours = [m for m in summary["methods"] if by_method[m].get("resources", {}).get("engine", "specdecode")
            == "specdecode"]

    # speedup by task: grouped bars, our speculative methods × (tasks + overall)
    spec_methods = [m for m in ours if m != summary.get("baseline", "plain")]
    groups = list(summary["tasks"]) + [OVERALL]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(groups) * max(1, len(spec_methods)) / 2 + 3), 4))
    width = 0.8 / max(1, len(spec_methods))
    for i, method in enumerate(spec_methods):
        vals = []
        for g in groups:
            s = by_method[method]["overall"] if g == OVERALL else by_method[method]["tasks"].get(g, {})
            vals.append(s.get("speedup") or 0.0)
        xs = [j + (i - (len(spec_methods) - 1) / 2) * width for j in range(len(groups))]
        ax.bar(xs, vals, width, label=method)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(groups)), groups, rotation=20, ha="right")
    ax.set_ylabel("speedup vs plain (ratio of mean tok/s)")
    ax.set_title("Speedup by task")
    if spec_methods:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "speedup_by_task.png", dpi=120)
    plt.close(fig)
    made.append("speedup_by_task.png")

    # acceptance by position: one line per method that drafted
    fig, ax = plt.subplots(figsize=(6, 4))
    any_line = False
    for method in summary["methods"]:
        abp = by_method[method]["overall"].get("acceptance_by_position")
        if abp:
            ax.plot(range(1, len(abp) + 1), abp, marker="o", label=method)
            any_line = True
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.05)
    ax.set_title("Acceptance by draft position")
    if any_line:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "acceptance_by_position.png", dpi=120)
    plt.close(fig)
    made.append("acceptance_by_position.png")

    # tokens/s: all methods, ours and peers
    methods = summary["methods"]
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(methods) + 2), 4))
    vals = [by_method[m]["overall"].get("tokens_per_second") or 0.0 for m in methods]
    colors = ["tab:blue" if m in ours else "tab:gray" for m in methods]
    bars = ax.bar(range(len(methods)), vals, color=colors)
    ax.bar_label(bars, fmt="%.1f", fontsize=8)
    floor = summary.get("memory_floor")
    if floor and floor.get("floor_tokens_per_second") and floor["floor_tokens_per_second"] <= 5 * max(vals + [0.0]):
        ax.axhline(floor["floor_tokens_per_second"], color="tab:red", linestyle="--", linewidth=0.8,
                   label=f"plain memory floor {floor['floor_tokens_per_second']:.1f} tok/s")
        ax.legend(fontsize=8)
    ax.set_xticks(range(len(methods)), methods, rotation=30, ha="right")
    ax.set_ylabel("mean tokens/s")
    ax.set_title("Tokens per second (blue: specdecode, gray: peers)")
    fig.tight_layout()
    fig.savefig(out / "tokens_per_second.png", dpi=120)
    plt.close(fig)
    made.append("tokens_per_second.png")
    return made


def _probes(bw: dict[str, Any]) -> str:
    """", the median of N probes (a, b, c GB/s)" for a run probed more than once, else ""."""
    probes = bw.get("probes_read_gb_per_s") or []
    if len(probes) < 2:
        return ""
    return f"; the median of {len(probes)} probes (one per session and between rounds): " \
        f"{', '.join(f'{v:.1f}' for v in probes)} GB/s"
