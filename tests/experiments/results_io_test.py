"""experiments.lib.results_io: a unit's rows reach the file together or not at all."""

import os
import tempfile

from absl.testing import absltest

from experiments.lib import results_io


class JsonlResultsTest(absltest.TestCase):

  def test_atomic_write_gives_the_mode_open_would(self):
    # Before: 0600 (mkstemp's), so results in a shared folder were unreadable to others.
    path = os.path.join(self.enter_context(tempfile.TemporaryDirectory()), "report.md")
    umask = os.umask(0o022)
    try:
      results_io.atomic_write_text(path, "x")
    finally:
      os.umask(umask)
    self.assertEqual(os.stat(path).st_mode & 0o777, 0o644)

  def test_add_many_is_one_write_and_a_rerun_finds_all_or_none(self):
    path = os.path.join(self.enter_context(tempfile.TemporaryDirectory()), "rows.jsonl")
    results = results_io.JsonlResults(path, ("unit", "row"))
    results.add(dict(unit=0, row=0, x=1.0))
    writes = []
    real = results_io.atomic_write_text

    def killed(p, text):  # the run is killed while the unit's rows are written
      writes.append(text)
      raise KeyboardInterrupt

    results_io.atomic_write_text = killed
    try:
      with self.assertRaises(KeyboardInterrupt):
        results.add_many([dict(unit=1, row=0, x=2.0), dict(unit=1, row=1, x=float("nan"))])
    finally:
      results_io.atomic_write_text = real
    self.assertLen(writes, 1)  # one rewrite for the whole unit
    again = results_io.JsonlResults(path, ("unit", "row"))  # the rerun
    self.assertEqual([r["unit"] for r in again.rows], [0])  # none of unit 1: it reruns whole
    again.add_many([dict(unit=1, row=0, x=2.0), dict(unit=1, row=1, x=float("nan"))])
    rows = results_io.read_rows(path)
    self.assertEqual([(r["unit"], r["row"]) for r in rows], [(0, 0), (1, 0), (1, 1)])
    self.assertIsNone(rows[-1]["x"])  # NaN is not JSON: stored as null
    for dup in ([dict(unit=1, row=1)], [dict(unit=2, row=0), dict(unit=2, row=0)]):
      with self.assertRaisesRegex(ValueError, "is already in"):
        again.add_many(dup)
    self.assertLen(results_io.read_rows(path), 3)

  def test_a_resume_with_other_settings_is_refused(self):
    path = os.path.join(self.enter_context(tempfile.TemporaryDirectory()), "rows.jsonl")
    results = results_io.JsonlResults(path, ("unit",))
    results.add_many([dict(unit=0, chunk=64, model="m"), dict(unit=1, model="m")])
    same = dict(chunk=("chunk", 64), model=("model", "m"))
    results_io.check_settings(results, same)
    with self.assertRaisesRegex(ValueError, r"--chunk=32 in this run, but .* holds rows made "
                                            r"with chunk=64: rerun with the same settings"):
      results_io.check_settings(results, dict(same, chunk=("chunk", 32)))
    # A field no row has (rows made before it existed) is not compared, unless the value
    # such rows held is given.
    results_io.check_settings(results, dict(same, coverage=("with_coverage", True)))
    results_io.check_settings(results, dict(same, dtype=("dtype", "float32", "float32")))
    with self.assertRaisesRegex(ValueError, "--dtype=bfloat16 in this run, .* dtype=float32:"):
      results_io.check_settings(results, dict(same, dtype=("dtype", "bfloat16", "float32")))


if __name__ == "__main__":
  absltest.main()
