"""The Colab notebooks in colab/ run top to bottom at the small size, as CI runs them, and are
committed as sources: no outputs, no execution counts.

Each notebook runs in a fresh `python3` kernel whose working directory is a temporary folder
(so it can only reach specjax as installed, as on Colab), with `SPECJAX_NOTEBOOK_SIZE=small`
and its files under a temporary `SPECJAX_NOTEBOOK_DIR`. A cell that raises fails the test with
the cell's source and the error. nbclient, nbformat and ipykernel are test dependencies: when
they are missing this module fails to import, it is never skipped.
"""

import json
import re
from pathlib import Path

import nbformat
import numpy as np
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from support import DEVICE_COUNT_FLAG, child_env, write_hf_checkpoint

COLAB = Path(__file__).resolve().parents[1] / "colab"
NOTEBOOKS = sorted(COLAB.glob("*.ipynb"))
EXPECTED = {"drafters", "grpo_speculative", "gsm8k_own_model", "quickstart", "scale"}
# Against a hang, with room for a shared machine: the longest cell, gsm8k_own_model's run
# (distillation, three GRPO steps, calibration at two batch sizes, three timed rollout arms),
# ran past 300 s in CI beside another test on 2 cores; the whole notebook takes 232 s alone.
CELL_TIMEOUT_S = 600
ANSI_COLOUR = re.compile(r"\x1b\[[0-9;]*m")


def _gsm8k_like(path: Path, n: int = 64) -> Path:
  """GSM8K-format JSONL: word problems whose answers end "#### <number>"."""
  rng = np.random.default_rng(0)
  with open(path, "w") as f:
    for _ in range(n):
      a, b = (int(x) for x in rng.integers(2, 50, 2))
      f.write(json.dumps({"question": f"Tom has {a} apples and buys {b} more. How many apples "
                                      "does he have now?",
                          "answer": f"He has {a} + {b} = {a + b} apples.\n#### {a + b}"}) + "\n")
  return path


@pytest.fixture(scope="module")
def own_model(tmp_path_factory) -> dict[str, str]:
  """What gsm8k_own_model runs on in CI: a tiny checkpoint and questions, no network."""
  root = tmp_path_factory.mktemp("own_model")
  corpus = _gsm8k_like(root / "gsm8k.jsonl")
  texts = [json.loads(line)["question"] for line in corpus.read_text().splitlines()]
  texts.append("Please reason step by step, and put your final answer within \\boxed{}.")
  model = write_hf_checkpoint(root / "tiny-qwen3", texts)
  return {"SPECJAX_NOTEBOOK_MODEL": str(model), "SPECJAX_NOTEBOOK_GSM8K": str(corpus)}


def _kernel_env(tmp_path: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
  env = child_env(**(extra or {}))
  env["SPECJAX_NOTEBOOK_SIZE"] = "small"
  env["SPECJAX_NOTEBOOK_DIR"] = str(tmp_path / "files")
  # Never the network: the Hub is offline, the model and data are the test's.
  env["HF_HUB_OFFLINE"] = "1"
  # Speculation costs, if a notebook measured them, stay out of the user's cache.
  env["SPECJAX_CACHE_DIR"] = str(tmp_path / "cache")
  return env


def _failure(name: str, nb, err: CellExecutionError) -> str:
  """The failing cell's number, source and error, for the test report."""
  for index, cell in enumerate(nb.cells):
    errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
    if errors:
      trace = ANSI_COLOUR.sub("", "\n".join(errors[0].get("traceback", [])))
      return (f"{name}: cell {index} raised {errors[0]['ename']}: {errors[0]['evalue']}\n"
              f"--- cell source ---\n{cell.source}\n--- traceback ---\n{trace}")
  return f"{name}: {err}"


def test_colab_holds_the_four_notebooks():
  assert EXPECTED <= {p.stem for p in NOTEBOOKS}, sorted(p.name for p in NOTEBOOKS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_committed_without_outputs_or_execution_counts(path):
  nb = nbformat.read(path, as_version=4)
  nbformat.validate(nb)
  assert nb.metadata.kernelspec.name == "python3"
  for index, cell in enumerate(nb.cells):
    assert not cell.get("attachments"), f"{path.name} cell {index} embeds a file"
    if cell.cell_type == "code":
      assert cell.outputs == [], f"{path.name} cell {index} has outputs"
      assert cell.execution_count is None, f"{path.name} cell {index} has an execution count"


def _execute(path: Path, tmp_path: Path, extra: dict[str, str] | None = None):
  """`path` run top to bottom in a fresh kernel (cwd `tmp_path`, `extra` in its environment);
  returns the executed notebook, or fails the test naming the cell that raised."""
  nb = nbformat.read(path, as_version=4)
  client = NotebookClient(nb, kernel_name="python3", timeout=CELL_TIMEOUT_S,
                          resources={"metadata": {"path": str(tmp_path)}})
  try:
    client.execute(env=_kernel_env(tmp_path, extra))
  except CellExecutionError as err:
    pytest.fail(_failure(path.name, nb, err), pytrace=False)
  return nb


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom_at_the_small_size(path, tmp_path, request):
  extra = request.getfixturevalue("own_model") if path.stem == "gsm8k_own_model" else None
  nb = _execute(path, tmp_path, extra)
  figures = sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code"
                for o in c.outputs)
  assert figures >= 1, f"{path.name} drew no figure"


def test_a_cell_that_raises_fails_the_run_naming_its_source_and_error(tmp_path):
  """Negative control: the runner must not pass a notebook that raises, nor one that sees the
  test process's 8 fake devices instead of choosing its own."""
  nb = nbformat.v4.new_notebook()
  nb.metadata.kernelspec = {"name": "python3", "display_name": "Python 3", "language": "python"}
  nb.cells = [nbformat.v4.new_code_cell("import os\nflags = os.environ['XLA_FLAGS']"),
              nbformat.v4.new_code_cell(f"assert {DEVICE_COUNT_FLAG!r} not in flags\n"
                                        "raise ValueError('size ' + os.environ["
                                        "'SPECJAX_NOTEBOOK_SIZE'])")]
  path = tmp_path / "raises.ipynb"
  nbformat.write(nb, path)
  with pytest.raises(pytest.fail.Exception,
                     match=r"(?s)raises.ipynb: cell 1 raised ValueError: size small\n"
                           r"--- cell source ---\nassert .*raise ValueError"):
    _execute(path, tmp_path)
