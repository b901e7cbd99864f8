"""The project's import graph: no cycle, and no program importing another program.

A program is a module run with `python -m` (it has an `if __name__ == "__main__":` block);
every other module is a library. Imports are read from the source with `ast`, top-level and
function-local alike, so a cycle hidden inside a function is found too.
"""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("pspec_jax", "infer", "train", "configs")
LIBRARY_PACKAGES = ("pspec_jax", "configs")  # never import the programs' packages
PROGRAM_PACKAGES = ("infer", "train")


def project_modules(root: str, packages=PACKAGES) -> dict[str, str]:
  """{dotted module name: file} of every module of `packages` under `root`."""
  out = {}
  for package in packages:
    for directory, _, files in os.walk(os.path.join(root, package)):
      for file in sorted(files):
        if not file.endswith(".py"):
          continue
        parts = os.path.relpath(os.path.join(directory, file), root)[:-3].split(os.sep)
        if parts[-1] == "__init__":
          parts = parts[:-1]
        out[".".join(parts)] = os.path.join(directory, file)
  return out


def _parse(path: str) -> ast.Module:
  with open(path) as fh:
    return ast.parse(fh.read(), path)


def imports_of(name: str, path: str, modules: dict[str, str]) -> set[str]:
  """The project modules that module `name` imports, anywhere in its file."""
  package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
  out = set()
  for node in ast.walk(_parse(path)):
    if isinstance(node, ast.Import):
      for alias in node.names:
        # `import a.b.c` imports a, a.b and a.b.c; the deepest project module is what is used.
        parts = alias.name.split(".")
        found = [".".join(parts[:n]) for n in range(len(parts), 0, -1)]
        out.update(next(([m] for m in found if m in modules), []))
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
      for alias in node.names:
        if f"{base}.{alias.name}" in modules:
          out.add(f"{base}.{alias.name}")  # a module of the package
        elif base in modules:
          out.add(base)  # a name the module defines
  out.discard(name)
  return out


def import_graph(root: str, packages=PACKAGES) -> dict[str, set[str]]:
  modules = project_modules(root, packages)
  return {name: imports_of(name, path, modules) for name, path in modules.items()}


def is_program(path: str) -> bool:
  """Whether the module has a top-level `if __name__ == "__main__":` block."""
  for node in _parse(path).body:
    if isinstance(node, ast.If) and isinstance(node.test, ast.Compare):
      names = [node.test.left, *node.test.comparators]
      if any(isinstance(n, ast.Name) and n.id == "__name__" for n in names):
        return True
  return False


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One import cycle as [a, b, ..., a], or None."""
  state = {}  # 1: on the current path, 2: done
  path = []

  def visit(node):
    state[node] = 1
    path.append(node)
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == 1:
        return path[path.index(nxt) :] + [nxt]
      if nxt not in state and (cycle := visit(nxt)):
        return cycle
    path.pop()
    state[node] = 2
    return None

  for node in sorted(graph):
    if node not in state and (cycle := visit(node)):
      return cycle
  return None


def layering_errors(root: str, packages=PACKAGES) -> list[str]:
  """Imports across the layers: a library package importing the programs' packages, or a
  module of the programs' packages importing a program (other than itself)."""
  modules = project_modules(root, packages)
  graph = import_graph(root, packages)
  programs = {name for name, path in modules.items() if is_program(path)}
  errors = []
  for name, imported in sorted(graph.items()):
    top = name.split(".")[0]
    for other in sorted(imported):
      other_top = other.split(".")[0]
      if top in LIBRARY_PACKAGES and other_top in PROGRAM_PACKAGES:
        errors.append(f"library {name} imports {other}")
      elif top in PROGRAM_PACKAGES and other in programs:
        errors.append(f"{name} imports the program {other}: move what it needs into a library")
  return errors


def test_no_import_cycle():
  cycle = find_cycle(import_graph(ROOT))
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_program_imports_another_program():
  assert layering_errors(ROOT) == []


def test_every_program_runs_a_main():
  modules = project_modules(ROOT, PROGRAM_PACKAGES)
  programs = [name for name, path in modules.items() if is_program(path)]
  assert {"infer.bench", "train.distill", "infer.tune_tree"} <= set(programs)
  for name in programs:
    tree = _parse(modules[name])
    defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert "main" in defined, f"{name}: the entry point is named main"
    (block,) = [n for n in tree.body if isinstance(n, ast.If)][-1:]
    assert "cli.run(main," in ast.unparse(block), f"{name}: runs main with cli.run"


def _write(root, files: dict[str, str]) -> None:
  for path, text in files.items():
    os.makedirs(os.path.dirname(root / path), exist_ok=True)
    (root / path).write_text(text)


def test_the_checks_find_a_cycle_and_a_program_import(tmp_path):
  """The checks themselves, on a made-up project: a cycle through a function-local import,
  a program importing another, a library importing a program; and a clean one."""
  main = 'def main():\n  pass\n\n\nif __name__ == "__main__":\n  cli.run(main, None)\n'
  _write(
    tmp_path,
    {
      "pspec_jax/__init__.py": "",
      "pspec_jax/a.py": "from pspec_jax import b\n",
      "pspec_jax/b.py": "def f():\n  from pspec_jax.c import g\n",
      "pspec_jax/c.py": "import pspec_jax.a\n\ndef g():\n  pass\n",
      "pspec_jax/d.py": "from infer import shared\n",
      "infer/__init__.py": "",
      "infer/shared.py": "from pspec_jax import c\n",
      "infer/one.py": "from infer import shared\n\n" + main,
      "infer/two.py": "def main():\n  from infer.one import main\n\n" + main.split("\n\n\n")[1],
      "train/__init__.py": "",
      "configs/__init__.py": "",
    },
  )
  graph = import_graph(tmp_path)
  assert graph["pspec_jax.b"] == {"pspec_jax.c"} and graph["infer.two"] == {"infer.one"}
  cycle = find_cycle(graph)  # a -> b -> c -> a, from wherever the walk entered it
  assert cycle[0] == cycle[-1] and sorted(cycle[1:]) == [
    "pspec_jax.a",
    "pspec_jax.b",
    "pspec_jax.c",
  ]
  assert layering_errors(tmp_path) == [
    "infer.two imports the program infer.one: move what it needs into a library",
    "library pspec_jax.d imports infer.shared",
  ]
  (tmp_path / "pspec_jax/c.py").write_text("def g():\n  pass\n")
  (tmp_path / "infer/two.py").write_text("from infer import shared\n")
  (tmp_path / "pspec_jax/d.py").write_text("")
  assert find_cycle(import_graph(tmp_path)) is None and layering_errors(tmp_path) == []


def test_no_test_imports_another_test_file():
  """Shared fixtures live in `pspec_jax.testing` (and conftest.py), never in a test file."""
  tests = os.path.join(ROOT, "tests")
  names = {f[: -len(".py")] for f in os.listdir(tests) if f.endswith(".py")}
  offenders = []
  for name in sorted(names):
    with open(os.path.join(tests, f"{name}.py")) as fh:
      tree = ast.parse(fh.read())
    for node in ast.walk(tree):
      modules = []
      if isinstance(node, ast.Import):
        modules = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.module:
        modules = [node.module]
      for module in modules:
        if module.startswith("tests") or (module in names and module != "conftest"):
          offenders.append(f"{name} imports {module}")
  assert not offenders, offenders
