"""Two processes on 127.0.0.1 (jax.distributed, CPU collectives) decode like one process.

The test starts two copies of this file as workers (``CERTKV_MP_WORKER=<id>``),
each with 2 CPU devices, that join one ``jax.distributed`` runtime through a
coordinator on a free local port and use the CPU collectives (gloo). The 4
global devices form a (data=1, model=2, seq=2) mesh ordered so that the
``seq`` axis crosses the process boundary: the sequence shards of every cache
live in different processes, and the split-K combine of their partial
statistics (an all-gather over ``seq``), the gathered eviction metadata and
the slot placement of appends go through gloo. Worker 0 writes the gathered
result; the test compares it with the same ``generate`` call on this
process's single device.

Tolerance: float32, logits to 2e-5 absolute (values are O(1); the sharded
run sums attention and the row-parallel matmuls in a different order, so the
last bits differ: the one-process-sharded test sees about 2e-6), certificate
statistics to 1e-4 relative; tokens, kept slots, positions and the eviction
counters exactly.
"""

import os
import socket
import subprocess
import sys

from absl.testing import absltest
import numpy as np
import pytest

from tests import test_util

ROOT = test_util.ROOT
N_PROCESSES = 2
DEVICES_PER_PROCESS = 2
TIMEOUT_S = 300


def _problem():
  """The tiny model and prompts both sides run (deterministic)."""
  from certkv_jax import designs  # pylint: disable=import-outside-toplevel
  from models import decode  # pylint: disable=import-outside-toplevel
  config = test_util.tiny_config()
  params = test_util.tiny_params(config, seed=1)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, config.vocab_size, (2, 20)).astype(np.int32)
  mask = np.arange(20)[None] < np.array([[20], [15]])
  kwargs = dict(config=config, gen=decode.GenerationConfig(
      n_steps=3, design=designs.poisson_tail(
          0.5, certain=designs.CertaintySet(n_sink=2, window=3)), capacity=24,
      evict_each_step=True, return_logits=True))
  return params, tokens, mask, kwargs


def _result_arrays(gen, host):
  out = {"tokens": gen.tokens, "logits": gen.logits, "var_hat": gen.var_hat,
         "range_hat": gen.range_hat}
  out.update({f"cache_{f}": getattr(gen.caches, f) for f in gen.caches.as_kvcache()._fields})
  return {k: host(v) for k, v in out.items()}


def _worker(process_id: int, port: int, out_path: str) -> None:
  """One process of the distributed run (called with the env set up by the test)."""
  import jax  # pylint: disable=import-outside-toplevel
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                             num_processes=N_PROCESSES, process_id=process_id)
  from certkv_jax.kv import distributed  # pylint: disable=import-outside-toplevel
  from models import sharding  # pylint: disable=import-outside-toplevel
  assert jax.process_count() == N_PROCESSES and jax.device_count() == 4, jax.devices()
  # Interleave processes so that the seq axis (last) crosses them: [p0, p1] per model index.
  by_process = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  local = DEVICES_PER_PROCESS
  order = [by_process[p * local + j] for j in range(local) for p in range(N_PROCESSES)]
  mesh = distributed.make_mesh(data=1, model=2, seq=2, devices=order)
  params, tokens, mask, kwargs = _problem()
  params = sharding.shard_params(params, kwargs["config"], mesh)
  gen = sharding.generate(mesh, params, tokens, mask, np.asarray(jax.random.PRNGKey(7)),
                          **kwargs)
  arrays = _result_arrays(gen, sharding.replicate)
  seq_processes = {d.process_index for d in mesh.devices[0, 0]}
  arrays["seq_crosses_processes"] = np.asarray(len(seq_processes) == N_PROCESSES)
  if process_id == 0:
    np.savez(out_path, **arrays)
  jax.distributed.shutdown()


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow  # three processes (two gloo workers and this one) each compile generate
class MultiProcessTest(absltest.TestCase):

  def test_two_processes_match_one(self):
    out_dir = test_util.temp_dir(self)
    out_path = os.path.join(out_dir, "result.npz")
    port = _free_port()
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        f" --xla_force_host_platform_device_count={DEVICES_PER_PROCESS}")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["JAX_PLATFORMS"] = "cpu"
    procs = []
    for i in range(N_PROCESSES):
      env_i = dict(env, CERTKV_MP_WORKER=str(i), CERTKV_MP_PORT=str(port),
                   CERTKV_MP_OUT=out_path)
      procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__)], env=env_i,
                                    cwd=ROOT, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True))
    logs = []
    for p in procs:
      try:
        logs.append(p.communicate(timeout=TIMEOUT_S)[0])
      except subprocess.TimeoutExpired:
        for q in procs:
          q.kill()
        self.fail(f"worker timed out after {TIMEOUT_S}s")
    for i, p in enumerate(procs):
      self.assertEqual(p.returncode, 0, f"worker {i} failed:\n{logs[i][-4000:]}")
    got = dict(np.load(out_path))
    self.assertTrue(bool(got.pop("seq_crosses_processes")))

    import jax  # pylint: disable=import-outside-toplevel
    from models import decode  # pylint: disable=import-outside-toplevel
    params, tokens, mask, kwargs = _problem()
    ref = decode.generate(params, tokens, mask, jax.random.PRNGKey(7), **kwargs)
    want = _result_arrays(ref, np.asarray)
    np.testing.assert_array_equal(got["tokens"], want["tokens"])
    np.testing.assert_allclose(got["logits"], want["logits"], atol=2e-5, rtol=0)
    for name in ("var_hat", "range_hat"):
      np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-7, err_msg=name)
    self.assertGreater(float(np.max(want["var_hat"])), 0.0)  # the tail was sampled
    for name in ("cache_valid", "cache_pos", "cache_n_seen", "cache_n_dropped"):
      np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    np.testing.assert_allclose(got["cache_log_pi"], want["cache_log_pi"], atol=1e-6)
    np.testing.assert_allclose(got["cache_k"], want["cache_k"], atol=2e-5)


if __name__ == "__main__":
  if "CERTKV_MP_WORKER" in os.environ:
    _worker(int(os.environ["CERTKV_MP_WORKER"]), int(os.environ["CERTKV_MP_PORT"]),
            os.environ["CERTKV_MP_OUT"])
  else:
    absltest.main()
