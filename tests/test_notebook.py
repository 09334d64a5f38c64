"""The continuation-fidelity notebook runs end to end with small settings, so it cannot rot:
executed by nbclient (through `notebooks/execute.py`, parameters injected as papermill does)
in a `python3` kernel that must be this venv's interpreter."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from ds4jax import fidelity

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "continuation_fidelity.ipynb"


def _execute_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "notebook_execute", NOTEBOOK.parent / "execute.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _text(cell) -> str:
    return "".join(
        o.get("text", "") for o in cell.get("outputs", []) if o["output_type"] == "stream"
    )


def test_the_fidelity_notebook_runs_with_small_settings() -> None:
    small = {"N_CONVERSATIONS": 2, "POSITIONS": 3, "REASONING_TOKENS": 8}
    small |= {"DRIFT_LOOPS": 1, "DRIFT_DTYPES": ("fp8",)}  # one loop of each kind
    # the context of test_fidelity's engine: the kernel compiles the programs that file runs
    # (or takes them from the persistent cache), not others for states of 8,192 rows
    small |= {"MAX_LEN": 2048}
    nb = _execute_module().execute(
        NOTEBOOK, small, timeout=600, append=["import sys\nprint(sys.prefix)"]
    )
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert _text(code[-1]).strip() == sys.prefix  # the kernel runs on this venv
    assert "injected-parameters" in code[1].metadata.tags
    assert not [o for c in code for o in c.outputs if o["output_type"] == "error"]
    table = next(_text(c) for c in code if "KL@0 mean" in _text(c))
    for kind in [*fidelity.KINDS, fidelity.OTHER]:
        assert f"\n{kind} " in table
    assert "2/2 conversations" in "".join(_text(c) for c in code)
    drift = next(_text(c) for c in code if "3 loops" in _text(c))  # the state-dtype table
    assert "\nfp8    assistant" in drift and "\nfp8    all" in drift
    images = [o for c in code for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) == 1
    assert any(c.cell_type == "markdown" and c.source.startswith("## Conclusion") for c in nb.cells)
