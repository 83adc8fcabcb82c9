"""One version: `specdecode.__version__`, which pyproject.toml reads and the CLI, both HTTP apps and the installed
metadata show."""

from __future__ import annotations

import importlib.metadata
import tomllib
import types
from pathlib import Path

import pytest

import specdecode
from specdecode.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_reads_the_package_version() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"] and "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "specdecode.__version__"}


def test_installed_metadata_matches() -> None:
    # The metadata of the editable install is written when it is installed: re-run `pip install --no-deps -e .`
    # after changing the version.
    assert importlib.metadata.version("specdecode") == specdecode.__version__


def test_cli_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"specdecode {specdecode.__version__}"


def test_server_app_version(tiny_llama_dir: Path) -> None:
    pytest.importorskip("fastapi")
    from specdecode.server.app import build_app

    llm = specdecode.LLM(str(tiny_llama_dir), dtype="fp32", device="cpu", max_model_len=64)
    assert build_app(llm).version == specdecode.__version__


def test_cluster_app_version() -> None:
    pytest.importorskip("ray.serve")
    from specdecode.cluster.config import ClusterConfig
    from specdecode.cluster.deployment import Ingress

    ingress = types.SimpleNamespace(cfg=ClusterConfig(model="m"), errors=None)  # routes only: no replica, no handle
    app = Ingress.__serve_build_asgi_app__(ingress)
    assert app.version == specdecode.__version__
