"""notebooks/analysis.ipynb runs headless against the committed results, and stays paired with analysis.py.

The notebook is executed as a user would open it (kernel ``python3``, working directory ``notebooks/``),
on whatever ``results/`` holds: the newest committed decoder run, or, while none is committed, a run
replayed on the fly from ``tests/data/replay-bert-base-h200-20261128``. Any failing cell fails the test, and
the notebook asserts what it relies on itself (columns, the baseline trial, the statuses).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "analysis.ipynb"
SOURCE = ROOT / "notebooks" / "analysis.py"
# Headless on a laptop CPU the notebook takes ~30 s (two replays of ~12 s while nothing is committed);
# this bound catches a notebook that has grown a search, not a slow machine.
MAX_SECONDS = 240


def _cells(nb) -> list[tuple[str, str]]:
    return [(c.cell_type, c.source.strip()) for c in nb.cells]


def test_py_and_ipynb_are_in_sync():
    """analysis.py is the source; analysis.ipynb must be what `jupytext --to ipynb analysis.py` makes of it
    (cell types and sources; outputs are not committed)."""
    jupytext = pytest.importorskip("jupytext", reason="jupytext is in the test extra: pip install -e .[test]")
    nbformat = pytest.importorskip("nbformat", reason="nbformat is in the test extra: pip install -e .[test]")
    from_py = jupytext.read(SOURCE, fmt="py:percent")
    from_ipynb = nbformat.read(NOTEBOOK, as_version=4)
    assert _cells(from_ipynb) == _cells(from_py), (
        "notebooks/analysis.ipynb is out of date: run `jupytext --to ipynb notebooks/analysis.py`")
    # The round trip the other way gives back the same cells too (nothing lost in the pairing).
    assert _cells(jupytext.reads(jupytext.writes(from_ipynb, fmt="py:percent"), fmt="py:percent")) == _cells(from_py)
    assert all(not c.get("outputs") for c in from_ipynb.cells if c.cell_type == "code"), \
        "commit analysis.ipynb without outputs (they embed PNGs and temp paths)"


def test_notebook_runs_headless(monkeypatch):
    nbclient = pytest.importorskip("nbclient", reason="nbclient is in the test extra: pip install -e .[test]")
    pytest.importorskip("ipykernel", reason="ipykernel is in the test extra: pip install -e .[test]")
    import nbformat

    # the notebook's defaults, not a developer's override
    for var in ("PDL_TUNE_RUN", "PDL_TUNE_COMPARE", "PDL_TUNE_REPLAY_TRIALS"):
        monkeypatch.delenv(var, raising=False)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    t0 = time.monotonic()
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as e:
        pytest.fail(f"a cell of {NOTEBOOK.name} failed:\n{e}", pytrace=False)
    seconds = time.monotonic() - t0
    assert seconds < MAX_SECONDS, f"the notebook took {seconds:.0f} s"

    text = "\n".join(_text(o) for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "run folder: " in text and "Top " in text and "SUMMARY OF ALL SHAPES" in text
    committed = [p for p in (ROOT / "results").glob("*/*/topk.json")]
    if not committed:  # a replay must say so, wherever its numbers appear
        assert "REPLAYED" in text
    pngs = sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code"
               for o in c.get("outputs", []))
    # 8 for a run with every optional file; a run without importance.json (fewer than 8 ok trials) or breakdown.json
    # draws one fewer for each (session 46 committed a 6-trial run, the newest, and the fixed 8 failed)
    import re

    shown = re.search(r"run folder: (\S+) \(", text).group(1)
    folder = Path(shown) if Path(shown).is_absolute() else ROOT / shown
    want = 8 - sum(not (folder / f).is_file() for f in ("importance.json", "breakdown.json"))
    assert pngs >= want, f"only {pngs} figures drawn for {folder} (want {want})"


def _text(output) -> str:
    if output.get("output_type") == "stream":
        return output.get("text", "")
    data = output.get("data", {})
    return data.get("text/markdown", "") + data.get("text/plain", "")
