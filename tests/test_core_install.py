"""The core install (`pip install -e .`, no extras) runs `LLM`, `specdecode generate`, `chat` and `--help`:
checked in a child interpreter where the extras' packages cannot be imported."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

BLOCKED = ("fastapi", "starlette", "uvicorn", "prometheus_client", "matplotlib", "llguidance")
"""The [serve] and [bench] extras' packages (pydantic stays: transformers may bring it)."""

CHILD = textwrap.dedent("""
    import contextlib, io, json, pathlib, sys
    for name in {blocked!r}:
        sys.modules[name] = None  # `import name` fails; importlib.util.find_spec(name) is None

    from specdecode import LLM, SamplingParams
    import specdecode.chat_cli, specdecode.cli, specdecode.engine.llm
    from specdecode.bench.report import write_plots

    try:
        specdecode.cli.main(["--help"])
    except SystemExit as exc:
        assert exc.code == 0, exc.code
    out = LLM({model!r}, dtype="fp32", device="cpu").generate("hi", SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(out[0].token_ids) == 2
    assert specdecode.cli.main(["generate", "--model", {model!r}, "--dtype", "fp32", "--max-tokens", "2", "hi"]) == 0
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = specdecode.cli.main(["serve", "--model", {model!r}])
    plots = write_plots(pathlib.Path({out!r}), {{}})
    print()  # after the streamed text
    print(json.dumps({{"serve_rc": rc, "serve_err": err.getvalue(), "plots": plots,
                      "loaded": sorted(n for n in {blocked!r} if sys.modules.get(n) is not None)}}))
""")


def test_core_install_needs_no_extra(tiny_llama_dir: Path, tmp_path: Path) -> None:
    import json

    code = CHILD.format(blocked=BLOCKED, model=str(tiny_llama_dir), out=str(tmp_path))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                         check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["loaded"] == []
    assert report["serve_rc"] == 2 and "pip install 'specdecode[serve]'" in report["serve_err"], report
    assert report["plots"] == []  # plots skipped without matplotlib
    assert "pip install 'specdecode[bench]'" in res.stderr  # with a warning that names the extra


@pytest.mark.parametrize("extra", ["serve", "bench", "cluster", "peers", "dev"])
def test_extras_are_declared(extra: str) -> None:
    import tomllib

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    assert extra in project["optional-dependencies"]
    assert not any(d.startswith(("fastapi", "uvicorn", "matplotlib", "prometheus")) for d in project["dependencies"])
    assert (Path(__file__).resolve().parents[1] / project["license-files"][0]).is_file()


def test_dependencies_are_ranges_the_pinned_torch_satisfies() -> None:
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    torch_req = next(Requirement(d) for d in project["dependencies"] if d.startswith("torch"))
    assert torch_req.specifier.contains("2.13.0") and not torch_req.specifier.contains("3.0")  # README's pin
    ray = Requirement(extras["cluster"][0])
    assert ray.specifier.contains("2.56.0") and not ray.specifier.contains("2.55.1")  # `@serve.ingress()`
    assert "train" not in extras  # head training runs on the core install
    # [dev] does not pull the peers in: llama-cpp-python compiles llama.cpp for minutes
    assert not any("llama" in d or "peers" in d for d in extras["dev"])
