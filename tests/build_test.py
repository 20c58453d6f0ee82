"""Checks the Bazel BUILD file without Bazel (which cannot run offline here).

The BUILD file is Starlark, a Python subset: it is executed with stand-ins for
``load``, ``package``, ``requirement`` and the rule functions, which record the
targets. Then: every Python file of the packages and tests belongs to exactly
one target; every source exists; every ``:local`` dependency is defined; every
``requirement()`` is declared in setup.cfg; and every import a target's files
make is covered by its direct deps.
"""

import ast
import configparser
import glob as globlib
import importlib.util
import os
import re
import shutil
import sys
import tempfile

from absl.testing import absltest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("certkv_jax", "pallas_kernels", "models", "experiments", "examples")
# Import name -> distribution name, for the third-party packages we use.
DISTRIBUTIONS = {"absl": "absl-py", "chex": "chex", "flax": "flax", "jax": "jax",
                 "numpy": "numpy", "optax": "optax", "orbax": "orbax-checkpoint",
                 "pytest": "pytest", "scipy": "scipy", "gguf": "gguf", "jinja2": "jinja2",
                 "safetensors": "safetensors", "tokenizers": "tokenizers",
                 "matplotlib": "matplotlib"}


class _Req(str):
  pass


def _load_build():
  targets = {}

  def rule(kind):
    def record(name, srcs=(), deps=(), **kw):
      if name in targets:
        raise AssertionError(f"target {name} defined twice")
      targets[name] = {"kind": kind, "srcs": list(srcs), "deps": list(deps), **kw}
    return record

  def glob(patterns):  # Bazel's glob, on the files of the tree
    return sorted({os.path.relpath(p, ROOT) for pat in patterns
                   for p in globlib.glob(os.path.join(ROOT, pat)) if os.path.isfile(p)})

  env = {
      "glob": glob,
      "load": lambda *a, **k: None,
      "package": lambda **k: None,
      "requirement": _Req,
      "py_library": rule("py_library"),
      "py_binary": rule("py_binary"),
      "py_test": rule("py_test"),
  }
  with open(os.path.join(ROOT, "BUILD"), encoding="utf-8") as f:
    exec(compile(f.read(), "BUILD", "exec"), env)  # pylint: disable=exec-used
  return targets


def _declared_requirements():
  cfg = configparser.ConfigParser()
  cfg.read(os.path.join(ROOT, "setup.cfg"))
  lines = cfg["options"]["install_requires"].split("\n")
  lines += cfg["options.extras_require"]["test"].split("\n")
  names = set()
  for line in lines:
    line = line.strip()
    if line:
      names.add(re.split(r"[<>=!\[; ]", line, maxsplit=1)[0].lower())
  return names


def _python_files():
  files = []
  for top in PACKAGES + ("tests",):
    for dirpath, _, names in os.walk(os.path.join(ROOT, top)):
      files += [os.path.relpath(os.path.join(dirpath, n), ROOT)
                for n in names if n.endswith(".py")]
  return sorted(files)


def _imports(path):
  with open(os.path.join(ROOT, path), encoding="utf-8") as f:
    tree = ast.parse(f.read())
  mods = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      mods |= {a.name.split(".")[0] for a in node.names}
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      mods.add(node.module.split(".")[0])
  return mods


def _test_helper_imports(path):
  """The test helper files (``tests/<name>.py``) that ``path`` imports from ``tests``."""
  with open(os.path.join(ROOT, path), encoding="utf-8") as f:
    tree = ast.parse(f.read())
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names |= {a.name.split(".")[1] for a in node.names if a.name.startswith("tests.")}
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      if node.module == "tests":
        names |= {a.name for a in node.names}
      elif node.module.startswith("tests."):
        names.add(node.module.split(".")[1])
  return {f"tests/{n}.py" for n in names}


def _generator():
  spec = importlib.util.spec_from_file_location(
      "gen_build", os.path.join(ROOT, "scripts", "gen_build.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


class BuildTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.targets = _load_build()

  def test_committed_build_is_generated(self):
    with open(os.path.join(ROOT, "BUILD"), encoding="utf-8") as f:
      self.assertMultiLineEqual(f.read(), _generator().render(),
                                "BUILD is stale: run `python scripts/gen_build.py`")

  def test_generator_follows_an_added_import(self):
    # A copy of the tree where certkv_jax starts importing scipy and a new module
    # appears: the rendering must change with it (so the check above can fail).
    gen = _generator()
    tmp = tempfile.mkdtemp(prefix="build_test_")
    self.addCleanup(shutil.rmtree, tmp)
    for top in gen.PACKAGES:
      shutil.copytree(os.path.join(ROOT, top), os.path.join(tmp, top),
                      ignore=shutil.ignore_patterns("__pycache__", "fixtures", "data"))
    with open(os.path.join(tmp, "certkv_jax", "zz_new.py"), "w", encoding="utf-8") as f:
      f.write("import scipy\nfrom models import llama\n")
    deps = gen.targets(tmp)["certkv_jax"]["deps"]
    self.assertIn('requirement("scipy")', deps)
    self.assertIn('":models"', deps)
    self.assertIn("certkv_jax/zz_new.py", gen.targets(tmp)["certkv_jax"]["srcs"])
    with open(os.path.join(tmp, "certkv_jax", "zz_new.py"), "w", encoding="utf-8") as f:
      f.write("import not_a_known_package\n")
    with self.assertRaisesRegex(ValueError, "not_a_known_package"):
      gen.targets(tmp)

  def test_no_dependency_cycle(self):
    graph = {n: [d[1:] for d in t["deps"] if not isinstance(d, _Req)]
             for n, t in self.targets.items()}
    state = {}

    def visit(n, path):
      state[n] = "open"
      for d in graph[n]:
        self.assertNotEqual(state.get(d), "open", f"cycle: {' -> '.join(path + [n, d])}")
        if d not in state:
          visit(d, path + [n])
      state[n] = "done"
    for n in graph:
      if n not in state:
        visit(n, [])

  def test_every_file_in_exactly_one_target(self):
    owners = {}
    for name, t in self.targets.items():
      for src in t["srcs"]:
        owners.setdefault(src, []).append(name)
    for path in _python_files():
      self.assertIn(path, owners, f"{path} belongs to no BUILD target")
      self.assertLen(owners[path], 1, f"{path} belongs to several targets: {owners[path]}")
    for src in owners:
      self.assertTrue(os.path.exists(os.path.join(ROOT, src)), f"missing source {src}")

  def test_tests_are_py_test_targets(self):
    for path in _python_files():
      if path.startswith("tests/") and path.endswith("_test.py"):
        name = path[len("tests/"):-3].replace("/", "_")
        self.assertEqual(self.targets[name]["kind"], "py_test", path)
        self.assertEqual(self.targets[name]["srcs"], [path])

  def test_dependencies_exist(self):
    declared = _declared_requirements()
    for name, t in self.targets.items():
      for dep in t["deps"]:
        if isinstance(dep, _Req):
          self.assertIn(dep.lower(), declared, f"{name}: requirement({dep}) not in setup.cfg")
        else:
          self.assertTrue(dep.startswith(":"), f"{name}: unexpected label {dep}")
          self.assertIn(dep[1:], self.targets, f"{name}: dependency {dep} is not defined")
      for path in t.get("data", []):
        self.assertTrue(os.path.exists(os.path.join(ROOT, path)), f"{name}: missing {path}")

  def test_imports_are_covered_by_deps(self):
    module_target = {}
    for name, t in self.targets.items():
      for src in t["srcs"]:
        module_target[src] = name
    package_target = {p: p for p in PACKAGES}
    stdlib = set(sys.stdlib_module_names)
    for name, t in self.targets.items():
      local = {d[1:] for d in t["deps"] if not isinstance(d, _Req)} | {name}
      reqs = {d.lower() for d in t["deps"] if isinstance(d, _Req)}
      for src in t["srcs"]:
        for helper in _test_helper_imports(src):
          self.assertIn(module_target.get(helper), local,
                        f"{src} imports {helper} but {name} does not depend on its target")
        for mod in _imports(src):
          if mod in stdlib or mod in ("tests",):
            continue
          if mod in package_target:
            self.assertIn(package_target[mod], local | self._binaries_of(local, mod),
                          f"{src} imports {mod} but {name} does not depend on :{mod}")
          elif mod in DISTRIBUTIONS:
            self.assertIn(DISTRIBUTIONS[mod], reqs,
                          f"{src} imports {mod}; add requirement('{DISTRIBUTIONS[mod]}') "
                          f"to {name}")
          else:
            self.fail(f"{src} imports {mod}, which no rule of this test knows")

  def _binaries_of(self, local, package):
    """Local binary targets whose sources live in ``package`` (e.g. experiments)."""
    return {package for d in local
            if any(s.startswith(package + "/") for s in self.targets.get(d, {}).get("srcs", []))}


if __name__ == "__main__":
  absltest.main()
