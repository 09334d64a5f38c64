"""Execute a notebook with nbclient, optionally overriding its parameters.

    .venv/bin/python notebooks/execute.py notebooks/continuation_fidelity.ipynb --inplace
    .venv/bin/python notebooks/execute.py notebooks/continuation_fidelity.ipynb \\
        -p MODEL ../configs/demo -p N_CONVERSATIONS 8 --output /tmp/fidelity.ipynb

Parameters work as in papermill: a code cell assigning them is inserted right after the cell
tagged `parameters`, so the notebook's defaults stay visible and the override is recorded.
Values are Python literals (`8`, `0.1`, `'tiny'`); anything else is taken as a string. The
kernel is `python3`, which jupyter_client starts with the interpreter running this script
(run it from the venv), in the notebook's directory.
"""

from __future__ import annotations

import argparse
import ast
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import nbformat
from nbclient import NotebookClient


def inject_parameters(nb: nbformat.NotebookNode, params: dict[str, Any]) -> None:
    """Insert `NAME = value` assignments after the cell tagged `parameters` (or first)."""
    if not params:
        return
    tagged = [
        i for i, c in enumerate(nb.cells) if "parameters" in c.get("metadata", {}).get("tags", [])
    ]
    at = tagged[0] + 1 if tagged else 0
    source = "# injected parameters\n" + "".join(f"{k} = {v!r}\n" for k, v in params.items())
    cell = nbformat.v4.new_code_cell(source, metadata={"tags": ["injected-parameters"]})
    nb.cells.insert(at, cell)


def execute(
    path: str | Path,
    params: dict[str, Any] | None = None,
    *,
    output: str | Path | None = None,
    timeout: int = 3600,
    kernel_name: str = "python3",
    append: Sequence[str] = (),
) -> nbformat.NotebookNode:
    """Run every cell of the notebook at `path` (in its directory) and return it; written to
    `output` when given. `append`: code cells added at the end (checks). A failing cell
    raises `nbclient.exceptions.CellExecutionError`."""
    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    inject_parameters(nb, params or {})
    nb.cells += [nbformat.v4.new_code_cell(src) for src in append]
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name=kernel_name,
        resources={"metadata": {"path": str(path.parent.resolve())}},
    )
    client.execute()
    if output is not None:
        nbformat.write(nb, output)
    return nb


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("notebook", type=Path)
    ap.add_argument(
        "-p", "--param", nargs=2, action="append", default=[], metavar=("NAME", "VALUE")
    )
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--inplace", action="store_true", help="write the outputs into NOTEBOOK")
    where.add_argument("--output", type=Path, help="write the executed notebook here")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per cell")
    args = ap.parse_args(argv)
    params = {name: _literal(value) for name, value in args.param}
    execute(
        args.notebook,
        params,
        output=args.notebook if args.inplace else args.output,
        timeout=args.timeout,
    )


if __name__ == "__main__":
    main()
