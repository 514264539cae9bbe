"""The package's shape: libraries below, runs above, no import loops, and a simulator that
imports without JAX.

The import graph is read from the sources (`ast`), so every import counts: top level,
function-local and under `if TYPE_CHECKING:`; a package's `__init__` re-exports count too.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "specjax"

# Each module's layer: it may import its own layer and those below, never one above.
# `specjax.sim` is apart: pure Python and NumPy, it may import only the leaves (layer 0).
LAYERS = {
    "specjax": 0, "specjax.errors": 0, "specjax.checks": 0, "specjax.files": 0,
    "specjax.stragglers": 0,
    "specjax.tokenizer": 1, "specjax.models": 1, "specjax.optimizers": 1,
    "specjax.sharding": 2, "specjax.checkpoint": 2, "specjax.decoding": 2,
    "specjax.supervised": 3,
    "specjax.rl": 4,
    "specjax.experiments": 5,
    "specjax.cli": 6,
}
SIM = "specjax.sim"


def _modules() -> dict[str, Path]:
  modules = {}
  for file in PACKAGE.rglob("*.py"):
    parts = list(file.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts = parts[:-1]
    modules[".".join(parts)] = file
  return modules


def _imports(file: Path, name: str, modules: dict[str, Path]) -> set[str]:
  """The package's modules `file` (module `name`) imports, anywhere in it."""
  package = name if file.name == "__init__.py" else name.rpartition(".")[0]
  found = set()
  for node in ast.walk(ast.parse(file.read_text())):
    if isinstance(node, ast.Import):
      targets = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
        base = f"{anchor}.{base}" if base else anchor
      # `from pkg import mod` imports the module; `from pkg import name`, the package.
      targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                 for alias in node.names]
    else:
      continue
    for target in targets:
      while target and target not in modules:
        target = target.rpartition(".")[0]
      if target and target != name:
        found.add(target)
  return found


def _graph() -> dict[str, set[str]]:
  modules = _modules()
  return {name: _imports(file, name, modules) for name, file in modules.items()}


def _layer(module: str) -> int | None:
  best = None
  for prefix, layer in LAYERS.items():
    if module == prefix or module.startswith(prefix + "."):
      if best is None or len(prefix) > len(best[0]):
        best = (prefix, layer)
  return None if best is None else best[1]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

  def visit(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on_stack.add(v)
    for w in graph[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return found


def test_the_graph_reader_sees_local_and_type_checking_imports(tmp_path):
  """Negative control: a loop behind a function-local import and one behind TYPE_CHECKING
  are both found."""
  pkg = tmp_path / "pkg"
  pkg.mkdir()
  (pkg / "__init__.py").write_text("")
  (pkg / "a.py").write_text("def f():\n  from pkg import b\n")
  (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                            "  from pkg.a import f\n")
  modules = {"pkg": pkg / "__init__.py", "pkg.a": pkg / "a.py", "pkg.b": pkg / "b.py"}
  graph = {name: _imports(file, name, modules) for name, file in modules.items()}
  assert _cycles(graph) == [["pkg.a", "pkg.b"]]


def test_the_package_has_no_import_cycles():
  assert _cycles(_graph()) == []


def test_every_module_has_a_layer_and_imports_nothing_above_it():
  graph = _graph()
  unplaced = [m for m in graph if _layer(m) is None and not m.startswith(SIM)]
  assert not unplaced, f"modules without a layer in LAYERS: {unplaced}"
  upward = [f"{m} (layer {_layer(m)}) imports {d} (layer {_layer(d)})"
            for m, deps in sorted(graph.items()) if not m.startswith(SIM)
            for d in sorted(deps) if not d.startswith(SIM) and _layer(d) > _layer(m)]
  assert not upward, "\n".join(upward)


def test_the_simulator_imports_only_itself_and_the_leaves():
  graph = _graph()
  outside = [f"{m} imports {d}" for m, deps in sorted(graph.items()) if m.startswith(SIM)
             for d in sorted(deps) if not d.startswith(SIM) and _layer(d) != 0]
  assert not outside, "\n".join(outside)


@pytest.mark.parametrize("hidden", [("jax", "jaxlib", "flax", "optax", "chex", "orbax")])
def test_the_simulator_imports_without_jax(hidden):
  """`import specjax.sim` in a process where importing JAX (and its libraries) fails."""
  code = ("import sys\n"
          f"for name in {list(hidden)!r}:\n"
          "  sys.modules[name] = None  # `import name` now raises ImportError\n"
          "import specjax.sim\n"
          "assert not any(m.split('.')[0] in {n!r} for m in sys.modules if sys.modules[m])\n"
          .replace("{n!r}", repr(set(hidden))))
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        cwd=PACKAGE.parent, timeout=120)
  assert done.returncode == 0, done.stderr
  # Negative control: the same guard stops a module that does need JAX.
  blocked = subprocess.run([sys.executable, "-c", code.replace("specjax.sim", "specjax.decoding")],
                           capture_output=True, text=True, cwd=PACKAGE.parent, timeout=120)
  assert blocked.returncode != 0 and "import of jax halted" in blocked.stderr


def test_every_error_class_of_the_package_is_a_specjax_error():
  """`except SpecjaxError` catches every failure specjax raises on purpose."""
  import importlib
  import inspect

  from specjax.errors import SpecjaxError
  outside = []
  for name in sorted(_modules()):
    if name.endswith("__main__"):
      continue
    module = importlib.import_module(name)
    for attr, value in vars(module).items():
      if (inspect.isclass(value) and issubclass(value, BaseException)
          and value.__module__.startswith("specjax") and not issubclass(value, SpecjaxError)):
        outside.append(f"{value.__module__}.{attr}")
  assert not outside, outside
