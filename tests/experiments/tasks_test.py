"""experiments.lib.tasks: lengths, determinism, answers present and exact scoring."""

import re

from absl.testing import absltest
from absl.testing import parameterized

from experiments.lib import tasks
from tests import test_util

CharTokenizer = test_util.CharTokenizer  # one token per character; id 1 is BOS


class WordTokenizer:
  """One token per whitespace-separated word (no BOS by default), with a chat template."""

  def __init__(self):
    self.vocab = {}
    self.inverse = {}

  def encode(self, text, add_bos=False):
    out = [0] if add_bos else []
    for w in text.split():
      if w not in self.vocab:
        self.vocab[w] = len(self.vocab) + 1
        self.inverse[self.vocab[w]] = w
      out.append(self.vocab[w])
    return out

  def decode(self, ids):
    return " ".join(self.inverse[i] for i in ids if i)

  def apply_chat_template(self, messages):
    return "".join(f"<user> {m['content']} </user>\n<assistant> " for m in messages)


class NoTemplateTokenizer(CharTokenizer):
  """A tokenizer whose apply_chat_template raises, like models.tokenizer without one."""

  def apply_chat_template(self, messages):
    raise ValueError("no chat template")


def _generation(ex):
  """A correct generation for the example."""
  if ex.metric == "set_exact":
    return " " + ", ".join(reversed(ex.answers)) + ".\nDone."
  if ex.metric == "numbers_all":
    return " " + ", ".join(reversed(ex.answers)) + "."
  if ex.metric == "exact_prefix":
    return f' "{ex.answer}"'
  return f" {ex.answer}."


class TasksTest(parameterized.TestCase):

  @parameterized.product(name=tasks.TASKS, tok=("char", "word"), context_len=(200, 1000))
  def test_length_determinism_and_scoring(self, name, tok, context_len):
    make_tok = CharTokenizer if tok == "char" else WordTokenizer
    exs = tasks.make_task(name, make_tok(), 3, context_len, seed=7)
    again = tasks.make_task(name, make_tok(), 3, context_len, seed=7)
    other = tasks.make_task(name, make_tok(), 3, context_len, seed=8)
    self.assertLen(exs, 3)
    self.assertEqual([e.context_ids for e in exs], [e.context_ids for e in again])
    self.assertEqual([e.answer for e in exs], [e.answer for e in again])
    self.assertNotEqual([e.answer for e in exs], [e.answer for e in other])
    # the longest piece is an agent-log line (~120 characters)
    slack = 130 if tok == "char" else 30
    for ex in exs:
      self.assertEqual(ex.task, name)
      self.assertGreaterEqual(len(ex.context_ids), context_len)
      if ex.meta["n_pieces"]:  # else the instruction and needles alone are longer
        self.assertLessEqual(len(ex.context_ids), context_len + slack)
      self.assertEqual(ex.meta["n_context_tokens"], len(ex.context_ids))
      self.assertNotEmpty(ex.question_ids)
      self.assertTrue(ex.score(_generation(ex)), _generation(ex))
      self.assertFalse(ex.score(" I do not know."))
      if tok == "char":
        context = CharTokenizer().decode(ex.context_ids)
        for a in ex.answers:
          self.assertIn(a, context)

  def test_plain_and_chat_prompts(self):
    tok = WordTokenizer()
    word = tasks.make_task("passkey", tok, 1, 100, 0)[0]
    self.assertTrue(tok.decode(word.context_ids).startswith("<user> There is a pass key"))
    self.assertEqual(tok.decode(word.question_ids),
                     "What is the pass key? </user> <assistant> The pass key is")
    for t in (CharTokenizer(), NoTemplateTokenizer()):
      ex = tasks.make_task("passkey", t, 1, 100, 0)[0]
      self.assertEqual(t.decode(ex.question_ids), "\n\nWhat is the pass key?\nThe pass key is")
      self.assertEqual(ex.context_ids[0], 1)  # the tokenizer's BOS
      self.assertNotIn(1, ex.question_ids)

  @parameterized.parameters(0.0, 0.5, 1.0)
  def test_passkey_depth(self, depth):
    t = CharTokenizer()
    ex = tasks.make_task("passkey", t, 1, 2000, 0, depth=depth)[0]
    text = t.decode(ex.context_ids)
    body_start = text.index("\n\n") + 2
    where = (text.index("The pass key is") - body_start) / (len(text) - body_start)
    self.assertAlmostEqual(where, depth, delta=0.05)
    self.assertAlmostEqual(ex.meta["depth"], depth, delta=0.02)

  def test_depth_sweep(self):
    exs = tasks.depth_sweep("passkey", CharTokenizer(), [0.0, 1.0], 2, 300, 0)
    self.assertEqual([round(e.meta["depth"]) for e in exs], [0, 0, 1, 1])

  def test_multi_needle(self):
    t = CharTokenizer()
    ex = tasks.make_task("multi_needle", t, 1, 800, 0, num_needles=3, query="all")[0]
    self.assertEqual(ex.metric, "numbers_all")
    self.assertLen(ex.answers, 3)
    a = ex.answers
    self.assertTrue(ex.score(f" {a[2]}, {a[0]} and {a[1]}."))
    self.assertFalse(ex.score(f" {a[2]}, {a[0]}."))
    self.assertFalse(ex.score(f" {a[2]}, 1, {a[0]}, {a[1]}."))
    one = tasks.make_task("multi_needle", t, 1, 800, 0, num_needles=3)[0]
    word = re.search(r"for (\w+) mentioned", t.decode(one.question_ids)).group(1)
    self.assertIn(f"for {word} is: {one.answer}.", t.decode(one.context_ids))

  @parameterized.parameters("json", "lines")
  def test_kv_retrieval(self, fmt):
    t = CharTokenizer()
    ex = tasks.make_task("kv_retrieval", t, 1, 1500, 0, fmt=fmt)[0]
    text = t.decode(ex.context_ids)
    key = ex.meta["key"]
    self.assertEqual(text.count(key), 1)
    self.assertIn(key, t.decode(ex.question_ids))
    pattern = f'"{key}": "{ex.answer}"' if fmt == "json" else f"{key}: {ex.answer}"
    self.assertIn(pattern, text)
    self.assertTrue(re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
                                 ex.answer))
    self.assertTrue(ex.score(" " + ex.answer.upper() + '"}'))
    self.assertFalse(ex.score(" " + ex.answer[:-1]))

  def test_variable_tracking_chain_resolves(self):
    t = CharTokenizer()
    for ex in tasks.make_task("variable_tracking", t, 3, 1500, 0, num_hops=3, num_chains=3):
      text = t.decode(ex.context_ids)
      value = {}
      for name, rhs in re.findall(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d+)\.", text):
        value[name] = value[rhs[4:]] if rhs.startswith("VAR") else rhs  # must be defined first
      self.assertLen(value, 3 * 4)
      want = sorted(n for n, v in value.items() if v == ex.meta["value"])
      self.assertEqual(want, sorted(ex.answers))
      self.assertTrue(ex.score(" " + " ".join(want)))
      self.assertFalse(ex.score(" " + " ".join(want[:-1])))
      self.assertFalse(ex.score(" " + " ".join(want) + " " + next(
          n for n in value if n not in want)))

  def test_agent_memory_fact_is_early(self):
    t = CharTokenizer()
    for ex in tasks.make_task("agent_memory", t, 5, 1500, 3):
      self.assertLessEqual(ex.meta["depth"], 0.21)
      text = t.decode(ex.context_ids)
      self.assertEqual(text.count(ex.answer), 1)
      self.assertIn(f"the access code for the {ex.meta['service']} server is {ex.answer}", text)
      self.assertNotIn("what is the access code", text)
      self.assertIn(ex.meta["service"], t.decode(ex.question_ids))

  def test_scoring_rules(self):
    self.assertTrue(tasks.score_digits(" 1 2 3 4 5 and more", ["12345"]))
    self.assertFalse(tasks.score_digits(" 1234", ["12345"]))
    self.assertFalse(tasks.score_digits(" 123465", ["12345"]))
    self.assertTrue(tasks.score_digits("The pass key is 12,345.", ["12345"]))
    self.assertFalse(tasks.score_digits(" 542422.", ["54242"]))  # a longer number
    self.assertFalse(tasks.score_digits("1. fig 2. plum 3. kiwi 4. pear 5. yam", ["12345"]))
    self.assertFalse(tasks.score_digits("no digits", ["12345"]))
    listed = ":\n\n1. 4653837\n2. 1111\n3. 222"  # SmolLM2 answers in a numbered list
    self.assertTrue(tasks.score_numbers_all(listed, ["222", "4653837", "1111"]))
    self.assertTrue(tasks.score_numbers_all("4653837, 1111, 222", ["222", "4653837", "1111"]))
    self.assertFalse(tasks.score_numbers_all(listed, ["4653837", "1111", "223"]))
    self.assertTrue(tasks.contains_match("It is The Eiffel Tower!", ["eiffel tower"]))
    self.assertFalse(tasks.contains_match("towering", ["tower"]))
    self.assertTrue(tasks.exact_match(" The answer.", ["answer"]))
    self.assertAlmostEqual(tasks.f1_score("the red big dog", ["big red cat"]), 2 / 3)
    self.assertEqual(tasks.f1_score("", ["x"]), 0.0)
    self.assertEqual(tasks.string_match_all("A b", ["a", "B", "c"]), 2 / 3)
    self.assertEqual(tasks.string_match_part("A b", ["z", "B"]), 1.0)

  @parameterized.parameters(
      (dict(name="nope"), "name must be one of"),
      (dict(context_len=3), r"context_len must be an int >= 16"),
      (dict(num_examples=0), r"num_examples must be an int >= 1"),
      (dict(depth=1.5), r"depth must be None or a number in \[0, 1\]"),
      (dict(bogus=1), r"unknown option\(s\) \['bogus'\]"),
      (dict(name="multi_needle", query="some"), "query must be"),
      (dict(name="multi_needle", num_needles=99), r"num_needles must be an int \[1, 16\]"),
      (dict(name="variable_tracking", num_hops=0), r"num_hops must be an int \[1, 50\]"),
  )
  def test_errors(self, kw, msg):
    args = dict(name="passkey", tokenizer=CharTokenizer(), num_examples=1, context_len=100,
                seed=0)
    args.update(kw)
    with self.assertRaisesRegex(ValueError, msg):
      tasks.make_task(**args)


class SmolLM2TokenizerTest(test_util.SmolLM2TokenizerCase):

  @parameterized.parameters(*tasks.TASKS)
  def test_lengths_and_template(self, name):
    for ex in tasks.make_task(name, self.tok, 2, 400, 0):
      self.assertBetween(len(ex.context_ids), 400, 480)  # a key-value pair is ~70 tokens
      self.assertTrue(self.tok.decode(ex.context_ids).startswith("<|im_start|>system"))
      q = self.tok.decode(ex.question_ids)
      self.assertIn("<|im_end|>\n<|im_start|>assistant\n", q)
      self.assertTrue(ex.score(_generation(ex)))
      for a in ex.answers:
        self.assertIn(a, self.tok.decode(ex.context_ids))


if __name__ == "__main__":
  absltest.main()
