"""The core's layout (docs/guide.md, "Layout"): subpackages that only re-export in
``__init__.py``, modules that import their siblings, never their own package."""

import ast
import pathlib
import unittest

CORE = pathlib.Path(__file__).resolve().parents[2] / "certkv_jax"
SUBPACKAGES = ("attention", "calibration", "certificate", "designs", "kv")
TESTS = CORE.parent / "tests" / "certkv_jax"
# Core modules whose tests run a model or a mesh and live beside those: module -> test file.
TESTED_ELSEWHERE = {
    "attention/certified": "tests/pallas_kernels/offset_decode_test.py",
    "kv/distributed": "tests/models/sharding_test.py",
}


def _tree(path):
  return ast.parse(path.read_text(), filename=str(path))


class LayoutTest(unittest.TestCase):

  def test_subpackages_are_the_ones_documented(self):
    found = sorted(p.parent.name for p in CORE.glob("*/__init__.py"))
    self.assertEqual(found, sorted(SUBPACKAGES))

  def test_init_files_only_import(self):
    for init in [CORE / "__init__.py"] + [CORE / p / "__init__.py" for p in SUBPACKAGES]:
      for i, node in enumerate(_tree(init).body):
        docstring = i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        dunder = (isinstance(node, ast.Assign) and len(node.targets) == 1
                  and isinstance(node.targets[0], ast.Name)
                  and node.targets[0].id in ("__all__", "__version__"))
        with self.subTest(init=str(init.relative_to(CORE)), line=node.lineno):
          self.assertTrue(docstring or dunder or isinstance(node, (ast.Import, ast.ImportFrom)),
                          f"{ast.dump(node)[:80]}: __init__.py only re-exports")

  def test_modules_import_siblings_not_their_package(self):
    for pkg in SUBPACKAGES:
      siblings = {p.stem for p in (CORE / pkg).glob("*.py")} - {"__init__"}
      for path in sorted((CORE / pkg).glob("*.py")):
        if path.name == "__init__.py":
          continue
        for node in ast.walk(_tree(path)):
          if not isinstance(node, ast.ImportFrom):
            continue
          names = [a.name for a in node.names]
          with self.subTest(module=f"{pkg}/{path.name}", line=node.lineno):
            self.assertFalse(node.module == "certkv_jax" and pkg in names,
                             f"imports its own package {pkg}")
            if node.module == f"certkv_jax.{pkg}":
              self.assertLessEqual(set(names), siblings,
                                   "a name from the package's re-exports, not a sibling module")

  def test_no_core_module_imports_the_whole_package(self):
    # `import certkv_jax` inside the core is a loop through __init__.py that works only
    # because attributes are read at call time.
    for path in sorted(CORE.rglob("*.py")):
      for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
          with self.subTest(module=str(path.relative_to(CORE)), line=node.lineno):
            self.assertNotIn("certkv_jax", [a.name for a in node.names])

  def test_every_core_module_has_its_test_file(self):
    for path in sorted(CORE.rglob("*.py")):
      module = str(path.relative_to(CORE).with_suffix(""))
      if path.stem.startswith("_"):  # __init__ and the private checks
        continue
      with self.subTest(module=module):
        if module in TESTED_ELSEWHERE:
          self.assertTrue((CORE.parent / TESTED_ELSEWHERE[module]).exists())
        else:
          self.assertTrue((TESTS / f"{module}_test.py").exists(),
                          f"tests/certkv_jax/{module}_test.py is missing")

  def test_test_file_names_are_unique(self):
    # pytest imports test files by basename (no __init__.py under tests/).
    names = [p.name for p in (CORE.parent / "tests").rglob("*_test.py")]
    self.assertEqual(sorted(n for n in set(names) if names.count(n) > 1), [])

  def test_no_flat_module_left_behind(self):
    # The top level holds the verbs a model calls and the private checks only.
    top = sorted(p.stem for p in CORE.glob("*.py"))
    self.assertEqual(top, ["__init__", "_validate", "checked", "eviction", "layer"])


if __name__ == "__main__":
  unittest.main()
