"""The wheel works: built from the package's files, it holds everything the package reads at run time (the C
kernel sources, the shipped head), and installed into a fresh virtual environment it imports from there and
generates text from outside the checkout.

The environment sees the system site-packages (torch and the rest are not installed again), where the checkout's
editable install also lives: the child asserts that `specdecode` comes from the environment's own copy.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

import specdecode

ROOT = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent("""
    import importlib.metadata, json, sys
    from pathlib import Path

    import specdecode
    from safetensors import safe_open
    from specdecode.heads.persist import read_head_config
    from specdecode.heads.shipped import shipped_head
    from specdecode.model import gguf_linear, native_kernels

    venv = Path(sys.prefix).resolve()
    here = Path(specdecode.__file__).resolve()
    assert "site-packages" in here.parts and here.is_relative_to(venv), here
    head = shipped_head("qwen2.5-coder-1.5b-instruct", "eagle")
    assert head is not None and head.resolve().is_relative_to(venv), head
    with safe_open(str(head / "head.safetensors"), "pt") as f:
        tensors = len(list(f.keys()))
    for path in (native_kernels.SOURCE, native_kernels.SOURCE_AMX, native_kernels.SOURCE_AVX2):
        assert path.resolve().is_relative_to(venv) and path.read_text(), path
    assert "gguf" in gguf_linear.source("scalar")
    print(json.dumps({"version": specdecode.__version__, "metadata": importlib.metadata.version("specdecode"),
                      "head_kind": read_head_config(head).kind, "tensors": tensors}))
""")


def _copy_sources(dst: Path) -> None:
    """What a wheel is built from: the project file, the files it names and the package (no caches)."""
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, dst / name)
    shutil.copytree(ROOT / "specdecode", dst / "specdecode", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


def _package_files() -> set[str]:
    """The package's files as git tracks them (every one must ship)."""
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "specdecode"], capture_output=True, text=True,
                         check=False)
    if out.returncode != 0:  # not a git checkout: the files on disk
        return {str(p.relative_to(ROOT)) for p in (ROOT / "specdecode").rglob("*")
                if p.is_file() and "__pycache__" not in p.parts}
    return {f for f in out.stdout.splitlines() if (ROOT / f).is_file()}


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing may point back at the checkout
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.mark.real
@pytest.mark.timeout(900)
def test_the_wheel_installs_and_runs(tmp_path: Path) -> None:
    src, dist, venv, elsewhere = (tmp_path / d for d in ("src", "dist", "venv", "elsewhere"))
    for d in (src, elsewhere):
        d.mkdir()
    _copy_sources(src)
    # No build isolation: the installed setuptools builds it, with no package index needed.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                    "-w", str(dist), str(src)], check=True, capture_output=True, text=True, timeout=600)
    (wheel,) = dist.glob("specdecode-*.whl")
    assert wheel.name.startswith(f"specdecode-{specdecode.__version__}-")
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = _package_files() - names
    assert not missing, f"the wheel lacks {sorted(missing)}"
    assert {n for n in names if n.startswith("specdecode/model/kernels/")} >= {
        f"specdecode/model/kernels/{p.name}" for p in (ROOT / "specdecode/model/kernels").glob("*.[ch]")}

    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = venv / "bin" / "python"
    # The system's pip, run by the environment's python, installs into the environment; the checkout's editable
    # install, outside it, is left alone.
    subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--force-reinstall", "-q",
                    str(wheel)], check=True, capture_output=True, text=True, timeout=300, env=_child_env())

    res = subprocess.run([str(python), "-c", CHILD], cwd=elsewhere, capture_output=True, text=True, timeout=300,
                         env=_child_env(), check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["version"] == report["metadata"] == specdecode.__version__
    assert report["head_kind"] == "eagle" and report["tensors"] > 0

    script = venv / "bin" / "specdecode"
    version = subprocess.run([str(script), "--version"], cwd=elsewhere, capture_output=True, text=True,
                             timeout=120, env=_child_env(), check=True)
    assert version.stdout.strip() == f"specdecode {specdecode.__version__}"
    gen = subprocess.run([str(script), "generate", "--model", "smollm2-135m-instruct", "--max-tokens", "8",
                          "--threads", "1", "Hello"], cwd=elsewhere, capture_output=True, text=True, timeout=600,
                         env=_child_env(), check=False)
    assert gen.returncode == 0, gen.stderr[-3000:]
    assert gen.stdout.strip() and re.search(r"\[[1-8] tokens in ", gen.stderr), (gen.stdout, gen.stderr[-2000:])
    # the checkout's own (editable) install is untouched
    assert importlib.metadata.version("specdecode") == specdecode.__version__
