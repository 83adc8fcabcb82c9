"""What a benchmark run keeps on disk so that `specdecode bench --resume` continues it.

A full run of every method and peer takes hours on a small CPU. Records are appended to
``records.jsonl`` as they are measured, and the facts the whole run shares (prompt ids, EOS id,
plain weight bytes, bandwidth, per-method resources, notes, the sessions that worked on it) live
in ``run-state.json``. A resumed run must have the same settings, so its records stay comparable.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STATE_FILE = "run-state.json"
RECORDS_FILE = "records.jsonl"

KEY_FIELDS = ("model", "dataset", "tasks", "per_task", "limit", "max_tokens", "temperature", "dtype", "seed",
              "draft", "heads", "flat_verify_cost")
"""Settings a resumed run must share with the stored one (methods and peers may be added, and with them
heads of a kind the run had none of)."""


def _same_setting(field: str, stored: Any, now: Any) -> bool:
    if field == "heads" and isinstance(stored, dict) and isinstance(now, dict):
        return all(now.get(kind) == path for kind, path in stored.items())  # a new kind of head may join
    if field == "flat_verify_cost":
        return bool(stored) == bool(now)  # runs stored before the option existed measured the real cost
    return stored == now

Key = tuple[str, str, int]
"""(method, task, prompt index): one measured generation."""


def _json_roundtrip(value: Any) -> Any:
    return json.loads(json.dumps(value))


def read_records(path: Path) -> list[dict[str, Any]]:
    """Records of a JSONL file; a last line cut short by a crash is dropped."""
    if not path.is_file():
        return []
    records = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise
    return records


@dataclass
class RunState:
    out: Path
    key: dict[str, Any]
    prompt_ids: list[list[int]] | None = None
    """Chat-template ids of every prompt of the run, in prompt order (set by the first engine)."""
    eos_token_id: int | None = None
    plain_weights: dict[str, dict[str, Any]] = field(default_factory=dict)
    bandwidth: dict[str, Any] | None = None
    resources: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    sessions: list[dict[str, Any]] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def start(cls, out: Path, key: dict[str, Any], resume: bool, read_only: bool = False) -> RunState:
        """A fresh run in ``out`` (previous records there are discarded), or the stored one (`read_only`:
        to report on it, leaving its files alone while the run may still be appending)."""
        out.mkdir(parents=True, exist_ok=True)
        key = _json_roundtrip({k: key.get(k) for k in KEY_FIELDS})
        path = out / STATE_FILE
        if not resume:
            (out / RECORDS_FILE).write_text("", encoding="utf-8")
            state = cls(out, key)
            state.save()
            return state
        if not path.is_file():
            raise ValueError(f"--resume: no run to resume in {out} (no {STATE_FILE})")
        data = json.loads(path.read_text(encoding="utf-8"))
        changed = [f"{k}: {data['key'].get(k)!r} -> {key.get(k)!r}" for k in KEY_FIELDS
                   if not _same_setting(k, data["key"].get(k), key.get(k))]
        if changed:
            raise ValueError(f"--resume: the run in {out} used other settings ({'; '.join(changed)}); "
                             "use the same options or a new --out")
        fields = {k: data[k] for k in ("prompt_ids", "eos_token_id", "plain_weights", "bandwidth", "resources",
                                       "notes", "sessions") if k in data}
        state = cls(out, key, **fields, records=read_records(out / RECORDS_FILE))
        if not read_only:
            state._rewrite_records()  # a line cut short by a crash must not prefix the next appended record
        return state

    def _rewrite_records(self) -> None:
        tmp = self.out / (RECORDS_FILE + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in self.records), encoding="utf-8")
        os.replace(tmp, self.out / RECORDS_FILE)

    def forget(self, methods: list[str]) -> int:
        """Drop the records of ``methods`` (to measure them again, e.g. after a head was retrained)."""
        keep = [r for r in self.records if r["method"] not in methods]
        dropped = len(self.records) - len(keep)
        self.records = keep
        self._rewrite_records()
        for m in methods:
            self.resources.pop(m, None)
        return dropped

    def done(self) -> set[Key]:
        return {(r["method"], r["task"], r["prompt_index"]) for r in self.records}

    def add_record(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        with (self.out / RECORDS_FILE).open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def add_note(self, note: str) -> None:
        if note not in self.notes:
            self.notes.append(note)

    def merge_resources(self, method: str, res: dict[str, Any]) -> None:
        """The newest load's figures, with the highest peak RSS of any load of the method."""
        old = self.resources.get(method, {})
        peaks = [p for p in (old.get("peak_rss_bytes"), res.get("peak_rss_bytes")) if p is not None]
        self.resources[method] = {**res, "peak_rss_bytes": max(peaks) if peaks else None}

    def save(self) -> None:
        data = {"key": self.key, "prompt_ids": self.prompt_ids, "eos_token_id": self.eos_token_id,
                "plain_weights": self.plain_weights, "bandwidth": self.bandwidth, "resources": self.resources,
                "notes": self.notes, "sessions": self.sessions}
        tmp = self.out / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(data) + "\n", encoding="utf-8")
        os.replace(tmp, self.out / STATE_FILE)
