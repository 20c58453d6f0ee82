"""pytest session setup: a faster XLA compile, compiled programs released after each
file, an opt-in persistent compilation cache, and the file order.

Most of the suite's time is XLA compilation. ``CERTKV_TEST_JAX_CACHE=<dir>``
keeps compiled executables in ``<dir>`` (keyed by the computation, the compile
options and the jax/jaxlib version, so a stale entry is never used): a rerun,
an xdist worker or a test's child process (they inherit the environment
variables set here) loads what another process compiled. The cache is pruned
(oldest entries first) to ``MAX_CACHE_BYTES`` when a session starts.

It is off unless asked for. Within one run from an empty cache, which is what
CI always runs, it saves nothing measurable (fast tier: 767 s of CPU time with
it, 763 s without); the gain is on local reruns (fast tier 8 min 12 s cold,
1 min 21 s warm). And writing it crashed xdist workers twice (a segfault in
``executable.serialize()`` inside JAX's ``put_executable_and_time``, once on CI,
after which xdist hung until CI's limit; the cause was the memory-map limit
that ``_release_compiled_programs`` below now keeps far off), so CI does not
depend on it.
"""

import gc
import os
import sys

import pytest

CACHE_ENV = "CERTKV_TEST_JAX_CACHE"
MAX_CACHE_BYTES = 1 << 30
# Every compilation is written, the tiny ones of eager ops too: measured on
# kernels/attention/designs tests, a warm rerun took 40 s with 0 and 77 s with
# 0.1 s (cold: 158 s vs 171 s, i.e. writing them costs nothing measurable).
MIN_COMPILE_SECS = 0.0


def _cache_dir():
  d = os.environ.get(CACHE_ENV, "")
  return None if d.lower() in ("", "0", "off", "none") else os.path.abspath(d)


def _prune(directory, max_bytes):
  entries = []
  for name in os.listdir(directory):
    path = os.path.join(directory, name)
    try:
      st = os.stat(path)
    except OSError:
      continue
    entries.append((st.st_mtime, st.st_size, path))
  total = sum(size for _, size, _ in entries)
  for _, size, path in sorted(entries):
    if total <= max_bytes:
      break
    try:
      os.remove(path)
      total -= size
    except OSError:
      pass


# XLA's CPU backend at LLVM optimisation level 0: the suite is mostly compilation
# of small programs. Measured (tiny-model decode and design tests, one process,
# 2-core machine): 135 s -> 102 s wall, 178 s -> 124 s CPU; earlier, two
# SmolLM2 design tests (real weights) 52 s -> 45 s. Set in the environment, so
# the tests' child processes inherit it; a level in XLA_FLAGS already wins.
XLA_TEST_FLAGS = "--xla_backend_optimization_level=0"


def _set_xla_flags():
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_backend_optimization_level" not in flags:
    os.environ["XLA_FLAGS"] = (flags + " " + XLA_TEST_FLAGS).strip()


def pytest_configure(config):
  _set_xla_flags()
  if hasattr(config.option, "loadscopereorder"):  # xdist: keep the file order set below
    config.option.loadscopereorder = False
  # xdist: a crashed worker ends the run (failed) instead of being replaced;
  # after a replacement a CI run once hung until CI's time limit.
  if getattr(config.option, "maxworkerrestart", None) is None and hasattr(config.option, "numprocesses"):
    config.option.maxworkerrestart = "0"
  directory = _cache_dir()
  if directory is None:
    return
  os.makedirs(directory, exist_ok=True)
  if not hasattr(config, "workerinput"):  # the main process: workers have not started
    _prune(directory, MAX_CACHE_BYTES)
  # Environment variables reach child processes (scripts run by the tests) and
  # the jax that test modules import; config.update covers a jax imported
  # earlier (by a plugin). The main process of an xdist run never imports it.
  # The thresholds keep a value set in the environment (to experiment with).
  os.environ["JAX_COMPILATION_CACHE_DIR"] = directory
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", str(MIN_COMPILE_SECS))
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")  # no size floor
  if "jax" in sys.modules:
    for name, kind in (("jax_compilation_cache_dir", str),
                       ("jax_persistent_cache_min_compile_time_secs", float),
                       ("jax_persistent_cache_min_entry_size_bytes", int)):
      sys.modules["jax"].config.update(name, kind(os.environ[name.upper()]))


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
  """Drops JAX's compiled programs after each test file.

  Each CPU executable keeps memory mappings: a worker that ran a third of the
  suite held about 20,000 after 4 files (``/proc/self/maps``), and at the
  kernel's limit (``vm.max_map_count``, 65,530 here) XLA segfaults inside a
  compile or a cache write; that crashed CI workers late in the run. Cleared
  after every file the count stays near 600 and resident memory halves.
  """
  yield
  if "jax" in sys.modules:
    sys.modules["jax"].clear_caches()
  gc.collect()


# ------------------------------------------------------------------ file order for -n 2
# Seconds of each file's tests among the 100 slowest (>= 4.3 s each) in a
# clean-clone CI-like run (78c5540, 2026-12-02, `--durations=100`, 14 min 20 s);
# files not listed had none. Only the order of the files depends on it: the
# heaviest first, so that xdist's `--dist loadfile` (which hands a worker its
# next file when it runs dry) approximates longest-processing-time-first
# scheduling and two workers end close together. A stale table costs balance,
# never correctness.
FILE_SECONDS = {
    "tests/models/sharding_test.py": 109,
    "tests/readme_test.py": 109,
    "tests/models/smollm2_designs_test.py": 86,
    "tests/experiments/validity_test.py": 73,
    "tests/experiments/damage_experiment_test.py": 73,
    "tests/experiments/suite_test.py": 72,
    "tests/models/decode_test.py": 72,
    "tests/pallas_kernels/offset_decode_test.py": 69,
    "tests/experiments/leaderboard_test.py": 64,
    "tests/experiments/scripts_test.py": 59,
    "tests/certkv_jax/designs/framework_test.py": 54,
    "tests/experiments/demo_test.py": 38,
    "tests/experiments/bench_decode_test.py": 38,
    "tests/models/text/generate_cli_test.py": 34,
    "tests/models/multiprocess_test.py": 33,
    "tests/models/text/generate_test.py": 30,
    "tests/models/decode_amortized_test.py": 29,
    "tests/certkv_jax/attention/offset_test.py": 26,
    "tests/experiments/equal_memory_test.py": 24,
    "tests/certkv_jax/certificate/montecarlo_test.py": 20,
    "tests/examples/gpt2_test.py": 16,
    "tests/experiments/bench_kernels_sharding_test.py": 16,
    "tests/experiments/theorem1_test.py": 15,
    "tests/models/smollm2_test.py": 15,
    "tests/certkv_jax/designs/sort_free_test.py": 14,
    "tests/models/kvpress_parity_test.py": 13,
    "tests/certkv_jax/checked_test.py": 12,
    "tests/certkv_jax/designs/sampling_test.py": 11,
    "tests/experiments/results_doc_test.py": 10,
    "tests/certkv_jax/designs/priority_sampling_test.py": 10,
    "tests/models/layer_budgets_test.py": 10,
    "tests/experiments/train_synthetic_test.py": 9,
    "tests/experiments/montecarlo_certificate_test.py": 9,
    "tests/certkv_jax/designs/allocation_test.py": 9,
}


def pytest_collection_modifyitems(config, items):
  """Orders the test files heaviest first (stable within a file and among the rest)."""
  del config
  items.sort(key=lambda item: -FILE_SECONDS.get(item.nodeid.split("::")[0], 0))
