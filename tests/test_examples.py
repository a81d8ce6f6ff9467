"""The notebooks in examples/ run top to bottom, on a kernel running this interpreter (the project's venv)."""

import json
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
KERNEL = "kimi-vl-tests"


@pytest.fixture
def kernel(tmp_path, monkeypatch):
    """A kernelspec that starts `sys.executable` (found first through JUPYTER_PATH), whatever else is installed."""
    spec = tmp_path / "jupyter" / "kernels" / KERNEL
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": KERNEL, "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf_modules"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    return KERNEL


@pytest.mark.timeout(600)
def test_quickstart_notebook(kernel, tmp_path):
    nb = nbformat.read(EXAMPLES / "quickstart.ipynb", as_version=4)
    assert not any(cell.get("outputs") for cell in nb.cells if cell.cell_type == "code"), "commit it without outputs"
    nb.cells.append(nbformat.v4.new_code_cell("import sys; print(sys.executable)"))
    client = nbclient.NotebookClient(nb, kernel_name=kernel, timeout=300, resources={"metadata": {"path": str(tmp_path)}})
    client.execute()

    def stdout(cell) -> str:
        return "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream")

    assert stdout(nb.cells[-1]).strip() == sys.executable
    printed = "".join(stdout(c) for c in nb.cells if c.cell_type == "code")
    assert "KimiVLForConditionalGeneration KimiVLProcessor" in printed
    assert "video chunks (t, h, w):" in printed
