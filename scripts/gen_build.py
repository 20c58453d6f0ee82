"""Writes the Bazel BUILD file from the imports.

    python scripts/gen_build.py           # rewrites BUILD
    python scripts/gen_build.py --check   # exit 1, one line, when BUILD is stale

Every Python file belongs to the first target of ``LIBRARIES`` whose prefix it
matches; ``experiments/<name>.py`` is the binary ``<name>``; ``tests/<dir>/<name>_test.py``
the test ``<dir>_<name>_test``. A target's deps are the targets of the local modules
its files import and the distributions of the third-party ones, so they cannot
drift from the code; data files and test sizes are the tables below.
"""

import ast
import glob
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("certkv_jax", "pallas_kernels", "models", "experiments", "examples", "tests")
# Import name -> distribution (setup.cfg) name.
DISTRIBUTIONS = {"absl": "absl-py", "chex": "chex", "flax": "flax", "jax": "jax",
                 "numpy": "numpy", "optax": "optax", "orbax": "orbax-checkpoint",
                 "pytest": "pytest", "scipy": "scipy", "gguf": "gguf", "jinja2": "jinja2",
                 "safetensors": "safetensors", "tokenizers": "tokenizers",
                 "matplotlib": "matplotlib"}
# Library targets, in order: a file goes to the first whose prefix (a file or a
# folder ending in "/") it matches.
LIBRARIES = (
    ("pallas_kernels", ("pallas_kernels/",)),
    ("certkv_jax", ("certkv_jax/",)),
    ("models_text", ("models/text/",)),
    ("models", ("models/",)),
    ("examples_gpt2", ("examples/",)),
    ("plots", ("experiments/lib/plots.py",)),
    ("experiments_montecarlo", ("experiments/lib/montecarlo_certificate/",)),
    ("experiments_bench_kernels", ("experiments/lib/bench/kernels.py",)),
    ("experiments_bench_prefill", ("experiments/lib/bench/prefill.py",)),
    ("experiments_bench_sharding", ("experiments/lib/bench/sharding.py",)),
    ("experiments", ("experiments/__init__.py", "experiments/lib/__init__.py",
                     "experiments/lib/bench/__init__.py", "experiments/lib/bench/flags.py",
                     "experiments/lib/design_defaults.py", "experiments/lib/loaders.py",
                     "experiments/lib/plan_flags.py", "experiments/lib/batching.py",
                     "experiments/lib/model_loading.py",
                     "experiments/lib/prompts.py", "experiments/lib/results_io.py",
                     "experiments/lib/ruler.py", "experiments/lib/ruler_text.py",
                     "experiments/lib/scoring.py",
                     "experiments/lib/stats/", "experiments/lib/tasks.py",
                     "experiments/lib/variants.py")),
    ("experiments_bench_decode", ("experiments/lib/bench/",)),
    ("experiments_demo", ("experiments/lib/demo/",)),
    ("experiments_train_synthetic", ("experiments/lib/train_synthetic/",)),
    ("experiments_suite_runner", ("experiments/lib/suite/runner.py",)),
    ("experiments_overhead", ("experiments/lib/overhead/",)),
    ("suite", ("experiments/lib/analyses/", "experiments/lib/suite/")),
    ("experiments_theorem1", ("experiments/lib/theorem1/",)),
    ("experiments_streaming_loss", ("experiments/lib/streaming_loss/",)),
    ("experiments_equal_memory", ("experiments/lib/equal_memory/",)),
    ("experiments_leaderboard", ("experiments/lib/leaderboard/",)),
    ("experiments_damage", ("experiments/lib/damage/",)),
    ("experiments_validity", ("experiments/lib/validity/",)),
    ("experiments_results_doc", ("experiments/lib/results_doc/",)),
    ("test_util", ("tests/",)),  # conftest.py and test_util.py (tests/**/*_test.py are tests)
)
TESTONLY = ("test_util",)

_TINY = ["tests/fixtures/tiny_llama/config.json", "tests/fixtures/tiny_llama/model.safetensors"]
_TINY_REF = _TINY + ["tests/fixtures/tiny_llama/reference.npz"]
_TINY_REF_JSON = _TINY_REF + ["tests/fixtures/tiny_llama/reference.json"]
_GPL = ["experiments/data/gpl-3.0.txt"]
_VIM = ["glob:experiments/data/vim/*"]
_PROMPT = ["experiments/data/example_prompt.txt"]
# What render() of experiments.lib.results_doc reads: the summaries, not the units.
_RESULTS = ["glob:experiments/results/*.json", "glob:experiments/results/*.jsonl",
            "glob:experiments/results/*.md", "glob:experiments/results/*/*.json",
            "glob:experiments/results/*/*.jsonl", "glob:experiments/results/*/*.md",
            "experiments/results/damage/norms.npz"]
# Data files per target; "glob:" entries become Bazel globs.
DATA = {
    "test_util": _TINY_REF,
    "experiments_equal_memory": _VIM,
    "experiments_leaderboard": _GPL,
    "experiments_suite_runner": _GPL,
    "experiments_results_doc": _RESULTS,
    "generate": _PROMPT,
    "models_decode_amortized_test": _TINY_REF_JSON,
    "experiments_bench_decode_test": ["scripts/device_check.sh"] + _TINY,
    "experiments_bench_prefill_test": _TINY,
    "models_bfloat16_test": _PROMPT + _GPL,
    "build_test": ["BUILD", "setup.cfg", "scripts/gen_build.py"],
    "scripts_device_check_test": ["scripts/device_check.sh", "scripts/make_random_checkpoint.py"],
    "experiments_equal_memory_test": ["experiments/results/equal_memory/summary.json"] + _TINY + _VIM,
    "experiments_perplexity_test": _TINY,
    "experiments_scripts_test": _TINY,
    "models_text_generate_cli_test": _PROMPT + _TINY,
    "models_text_generate_test": _TINY,
    "models_forward_layer_loop_test": _TINY_REF,
    "experiments_leaderboard_test": _GPL + _TINY,
    "models_layer_budgets_test": _TINY_REF,
    "models_decode_test": _TINY_REF_JSON,
    "models_hf_parity_test": _TINY_REF_JSON + ["glob:tests/fixtures/tiny_qwen2/*"],
    "models_kvpress_parity_test": ["glob:tests/fixtures/kvpress/*"] + _TINY,
    "models_smollm2_test": ["glob:tests/fixtures/smollm2_reference/*"],
    "readme_test": ["README.md", "docs/guide.md"] + _GPL,
    "certkv_jax_designs_registry_test": _TINY,
    "experiments_results_doc_test": ["docs/results.md"] + _RESULTS,
    "experiments_ruler_test": _GPL,
    "certkv_jax_designs_sort_free_test": _TINY,
    "experiments_suite_report_test": ["experiments/results/equal_memory/summary.json",
                                      "experiments/results/equal_memory_tasks/summary.json",
                                      "experiments/results/leaderboard_smoke/summary.json",
                                      "experiments/results/leaderboard_8k/summary.json",
                                      "experiments/results/overhead_long/overhead_rows.jsonl",
                                      "experiments/results/suite_quick/report.md",
                                      "experiments/results/validity/summary.json",
                                      "experiments/results/validity_long/summary.json"],
    "experiments_suite_test": _TINY,
}
SIZES = {"pallas_kernels_offset_decode_test": "medium", "pallas_kernels_precision_test": "small",
         "certkv_jax_certificate_montecarlo_test": "medium", "models_smollm2_designs_test": "large",
         "experiments_demo_test": "medium", "models_sharding_test": "large",
         "models_multiprocess_test": "large", "experiments_equal_memory_test": "medium",
         "experiments_leaderboard_test": "medium", "experiments_perplexity_test": "medium",
         "experiments_suite_test": "large", "experiments_scripts_test": "large",
         "readme_test": "large"}

HEADER = '''\
# Generated by scripts/gen_build.py from the imports; do not edit by hand
# (tests/build_test.py fails when this file differs from what it writes).
# Bazel cannot fetch rules_python offline on the development machines, so
# tests/build_test.py also checks it: every module and test belongs to exactly
# one target, every dependency is defined or declared in setup.cfg, and every
# import is covered by the target's deps.

load("@rules_python//python:defs.bzl", "py_binary", "py_library", "py_test")
load("@pip//:requirements.bzl", "requirement")

package(default_visibility = ["//visibility:public"])
'''


def python_files(root=ROOT):
  """Every ``.py`` file of the packages and tests, relative to ``root``, sorted."""
  files = []
  for top in PACKAGES:
    for dirpath, dirs, names in os.walk(os.path.join(root, top)):
      dirs[:] = sorted(d for d in dirs if d != "__pycache__")
      files += [os.path.relpath(os.path.join(dirpath, n), root)
                for n in names if n.endswith(".py")]
  return sorted(files)


def owner(path: str) -> tuple:
  """``(target, kind)`` of a file; ValueError when no rule places it."""
  if path.startswith("tests/") and path.endswith("_test.py"):
    return path[len("tests/"):-3].replace("/", "_"), "py_test"
  if path.startswith("experiments/") and path.count("/") == 1 and path != "experiments/__init__.py":
    return os.path.basename(path)[:-3], "py_binary"
  for name, prefixes in LIBRARIES:
    if any(path == p or (p.endswith("/") and path.startswith(p)) for p in prefixes):
      return name, "py_library"
  raise ValueError(f"{path} matches no target: add it to LIBRARIES in scripts/gen_build.py")


def _module_file(dotted: str, files: set):
  """The file of a dotted module name (``a/b.py`` or ``a/b/__init__.py``), or None."""
  base = dotted.replace(".", "/")
  for cand in (base + ".py", base + "/__init__.py"):
    if cand in files:
      return cand
  return None


def imported(path: str, files: set, root=ROOT) -> tuple:
  """``(local files, third-party top-level names)`` that ``path`` imports."""
  with open(os.path.join(root, path), encoding="utf-8") as f:
    tree = ast.parse(f.read(), path)
  package = os.path.dirname(path).replace("/", ".")
  names = []  # dotted names, each possibly a module or a name inside one
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names += [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parts = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(p for p in parts + ([base] if base else []) if p)
      names += [f"{base}.{a.name}" for a in node.names] + [base]
  local, third = set(), set()
  for dotted in names:
    top = dotted.split(".")[0]
    if top in PACKAGES:
      parts = dotted.split(".")
      for i in range(len(parts), 0, -1):  # the longest prefix that is a module
        found = _module_file(".".join(parts[:i]), files)
        if found:
          local.add(found)
          break
    elif top and top not in sys.stdlib_module_names:
      third.add(top)
  return local, third


def targets(root=ROOT) -> dict:
  """``{name: {kind, srcs, deps, ...}}`` of the tree under ``root``."""
  files = python_files(root)
  fileset = set(files)
  out = {}
  for path in files:
    name, kind = owner(path)
    t = out.setdefault(name, {"kind": kind, "srcs": [], "local": set(), "third": set()})
    t["srcs"].append(path)
    local, third = imported(path, fileset, root)
    t["local"] |= {owner(f)[0] for f in local}
    t["third"] |= third
  for name, t in out.items():
    unknown = sorted(t["third"] - set(DISTRIBUTIONS))
    if unknown:
      raise ValueError(f"{name} imports {unknown}: add them to DISTRIBUTIONS in "
                       "scripts/gen_build.py and setup.cfg")
    t["deps"] = ([f'":{d}"' for d in sorted(t["local"] - {name})]
                 + [f'requirement("{DISTRIBUTIONS[m]}")' for m in
                    sorted(t["third"], key=lambda m: DISTRIBUTIONS[m])])
  for name in list(DATA) + list(SIZES):
    if name not in out:
      raise ValueError(f"DATA or SIZES names {name}, which is no target")
  return out


def _strings(values, indent, key=""):
  """A Starlark list: on one line when ``key = [...]`` fits in 100 columns."""
  one = "[" + ", ".join(values) + "]"
  if indent + len(key) + len(one) + 1 <= 100:
    return one
  pad = " " * indent
  return "[\n" + "".join(f"{pad}    {v},\n" for v in values) + f"{pad}]"


def _data(entries):
  plain = [f'"{e}"' for e in entries if not e.startswith("glob:")]
  globs = [f'"{e[5:]}"' for e in entries if e.startswith("glob:")]
  parts = []
  if plain:
    parts.append(_strings(plain, 4, "data = "))
  if globs:
    parts.append("glob(" + _strings(globs, 4, "data = [...] + glob(") + ")")
  return " + ".join(parts)


def _rule(name, t) -> str:
  lines = [f"{t['kind']}(", f'    name = "{name}",']
  if t["kind"] == "py_binary":
    lines.append(f'    main = "{t["srcs"][0]}",')
  if name in SIZES:
    lines.append(f'    size = "{SIZES[name]}",')
  lines.append(f"    srcs = {_strings([f'{chr(34)}{s}{chr(34)}' for s in t['srcs']], 4, 'srcs = ')},")
  if name in DATA:
    lines.append(f"    data = {_data(DATA[name])},")
  if name in TESTONLY:
    lines.append("    testonly = True,")
  lines.append(f"    deps = {_strings(t['deps'], 4, 'deps = ')},")
  lines.append(")")
  return "\n".join(lines)


def render(root=ROOT) -> str:
  """The BUILD file's text: libraries in ``LIBRARIES`` order, then binaries, then tests."""
  ts = targets(root)
  order = ([n for n, _ in LIBRARIES if n in ts]
           + sorted(n for n, t in ts.items() if t["kind"] == "py_binary")
           + sorted(n for n, t in ts.items() if t["kind"] == "py_test"))
  return HEADER + "".join(f"\n{_rule(n, ts[n])}\n" for n in order)


def main(argv):
  path = os.path.join(ROOT, "BUILD")
  text = render()
  if argv[1:] == ["--check"]:
    with open(path, encoding="utf-8") as f:
      if f.read() != text:
        print("BUILD is stale: run `python scripts/gen_build.py` and commit it")
        return 1
    return 0
  if argv[1:]:
    print(__doc__.strip().splitlines()[0])
    print("usage: python scripts/gen_build.py [--check]")
    return 2
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(text)
  os.replace(tmp, path)
  print(f"wrote {path} ({text.count(chr(10))} lines)")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
