"""experiments.lib.loaders on small files written in a temp dir."""

import json
import os

from absl.testing import absltest
from absl.testing import parameterized

from experiments.lib import loaders
from tests import test_util

CharTokenizer = test_util.CharTokenizer  # one token per character; id 1 is BOS


def setUpModule():
  test_util.ensure_flags_parsed()  # under pytest (create_tempdir reads --test_tmpdir)


def _write(directory, name, records):
  path = os.path.join(directory, name)
  with open(path, "w", encoding="utf-8") as f:
    for r in records:
      f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
  return path


LB = [
    {"input": "Who built it?", "context": "The tower was built by Gustave Eiffel in Paris.",
     "answers": ["Gustave Eiffel", "Eiffel"], "length": 9, "_id": "a1", "dataset": "qa"},
    {"input": "Where?", "context": "x " * 200, "answers": ["Paris"], "length": 200},
    {"input": "Third?", "context": "y", "answers": ["z"], "length": 1},
]


class LongBenchTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.dir = self.create_tempdir().full_path
    self.tok = CharTokenizer()

  def test_parse_and_score(self):
    path = _write(self.dir, "lb.jsonl", LB[:1] + [""] + LB[1:])  # a blank line is skipped
    exs = loaders.load_longbench(path, self.tok)
    self.assertLen(exs, 3)
    ex = exs[0]
    self.assertEqual(ex.answers, ("Gustave Eiffel", "Eiffel"))
    self.assertEqual(ex.task, "longbench/qa")
    self.assertEqual((ex.meta["id"], ex.meta["line"], exs[1].meta["line"]), ("a1", 1, 3))
    self.assertIsNone(ex.meta["truncation"])
    context = self.tok.decode(ex.context_ids)
    self.assertTrue(context.startswith(loaders.LONGBENCH_INSTRUCTION))
    self.assertTrue(context.endswith(LB[0]["context"]))
    q = self.tok.decode(ex.question_ids)
    self.assertIn("Question: Who built it?", q)
    self.assertTrue(q.endswith("\nAnswer:"))
    self.assertTrue(ex.score(" It was Gustave Eiffel."))
    self.assertTrue(ex.score("eiffel"))
    self.assertFalse(ex.score(" Gustave"))
    self.assertTrue(loaders.exact_match(" The Eiffel.", ex.answers))
    self.assertAlmostEqual(loaders.f1_score("Gustave", ex.answers), 2 / 3)
    self.assertEqual(loaders.f1_score("Alexandre Gustave Eiffel", ex.answers), 0.8)
    self.assertLen(loaders.load_longbench(path, self.tok, max_examples=2), 2)

  def test_truncation_is_explicit(self):
    path = _write(self.dir, "lb.jsonl", LB[1:2])
    with self.assertRaisesRegex(ValueError, r"lb.jsonl:1: context has \d+ tokens > "
                                r"max_context_tokens=150; pass truncate='middle'"):
      loaders.load_longbench(path, self.tok, max_context_tokens=150)
    ex = loaders.load_longbench(path, self.tok, max_context_tokens=150, truncate="middle")[0]
    self.assertLen(ex.context_ids, 150)
    t = ex.meta["truncation"]
    n_before = 1 + len(loaders.LONGBENCH_INSTRUCTION) + 400
    self.assertEqual(t["n_tokens_before"], n_before)
    self.assertEqual(t["n_tokens_cut"], n_before - 150)
    self.assertEqual(t["cut_start"], 1 + len(loaders.LONGBENCH_INSTRUCTION) + 52)
    with self.assertRaisesRegex(ValueError, "needs max_context_tokens"):
      loaders.load_longbench(path, self.tok, truncate="middle")
    with self.assertRaisesRegex(ValueError, "truncate must be one of"):
      loaders.load_longbench(path, self.tok, max_context_tokens=10, truncate="end")

  @parameterized.named_parameters(
      ("missing", [{"input": "q", "context": "c", "length": 1}],
       r"bad.jsonl:1: missing field 'answers'"),
      ("bad_json", [LB[0], "{not json"], r"bad.jsonl:2: invalid JSON"),
      ("not_object", ["[1, 2]"], r"bad.jsonl:1: expected a JSON object"),
      ("answers_type", [dict(LB[0], answers="Paris")],
       r"bad.jsonl:1: field 'answers' must be a non-empty list of strings"),
      ("empty", [], "no records"),
  )
  def test_errors(self, records, msg):
    path = _write(self.dir, "bad.jsonl", records)
    with self.assertRaisesRegex(ValueError, msg):
      loaders.load_longbench(path, self.tok)

  def test_option_errors(self):
    path = _write(self.dir, "lb.jsonl", LB)
    with self.assertRaisesRegex(ValueError, "max_examples must be None or an int >= 1"):
      loaders.load_longbench(path, self.tok, max_examples=0)
    with self.assertRaisesRegex(ValueError, "is not a file"):
      loaders.load_longbench(os.path.join(self.dir, "nope.jsonl"), self.tok)


class RulerTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.dir = self.create_tempdir().full_path
    self.tok = CharTokenizer()

  def test_input_split_and_scoring(self):
    rec = {"index": 0, "length": 50, "outputs": ["1234", "5678"],
           "input": "Some numbers.\nOne is 1234. Another is 5678.\nWhat are the numbers?",
           "answer_prefix": " Answer:"}
    path = _write(self.dir, "r.jsonl", [rec, {"index": 1, "length": 5, "outputs": ["x"],
                                              "context": "ctx", "query": " q?"}])
    ex, ex2 = loaders.load_ruler(path, self.tok)
    self.assertEqual(self.tok.decode(ex.context_ids),
                     "Some numbers.\nOne is 1234. Another is 5678.")
    self.assertEqual(self.tok.decode(ex.question_ids), "\nWhat are the numbers?\n Answer:")
    self.assertIn("input split", ex.meta["split"])
    self.assertEqual(ex2.meta["split"], "context+query")
    self.assertTrue(ex.score("5678 and 1234"))
    self.assertFalse(ex.score("only 1234"))
    part = loaders.load_ruler(path, self.tok, metric="part")[0]
    self.assertTrue(part.score("only 1234"))
    self.assertEqual(loaders.string_match_all("only 1234", ex.answers), 0.5)

  def test_errors(self):
    path = _write(self.dir, "r.jsonl", [{"index": 0, "length": 1, "outputs": ["a"],
                                         "context": "c"}])
    with self.assertRaisesRegex(ValueError, r"r.jsonl:1: missing field 'input'"):
      loaders.load_ruler(path, self.tok)
    path = _write(self.dir, "r2.jsonl", [{"index": 0, "outputs": ["a"], "input": "c"}])
    with self.assertRaisesRegex(ValueError, r"r2.jsonl:1: missing field 'length'"):
      loaders.load_ruler(path, self.tok)
    path = _write(self.dir, "r3.jsonl", [{"index": 0, "length": 1, "outputs": ["a"],
                                          "input": "no newline here"}])
    with self.assertRaisesRegex(ValueError, r"r3.jsonl:1: cannot split"):
      loaders.load_ruler(path, self.tok)
    with self.assertRaisesRegex(ValueError, "metric must be"):
      loaders.load_ruler(path, self.tok, metric="some")


class TextTest(absltest.TestCase):

  def test_load_text(self):
    d = self.create_tempdir()
    self.assertEqual(loaders.load_text(d.create_file("a.txt", content="hello\n").full_path),
                     "hello\n")
    with self.assertRaisesRegex(ValueError, "empty"):
      loaders.load_text(d.create_file("b.txt", content=" \n").full_path)
    with self.assertRaisesRegex(ValueError, "not a file"):
      loaders.load_text(os.path.join(d.full_path, "c.txt"))


if __name__ == "__main__":
  absltest.main()
