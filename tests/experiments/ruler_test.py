"""experiments.lib.ruler: RULER's synthetic tasks, their lengths, answers and scoring."""

import collections
import re

from absl.testing import absltest
from absl.testing import parameterized

from experiments.lib import ruler
from experiments.lib import ruler_text
from tests import test_util

CharTokenizer = test_util.CharTokenizer  # one token per character; id 1 is BOS
CONTEXT = 3000  # characters: every task fits, vt's few-shot example included
# the largest step of one haystack unit, in characters (a uuid needle line)
SLACK = 140


class ChatTokenizer(CharTokenizer):
  def apply_chat_template(self, messages):
    return "".join(f"<u>{m['content']}</u><a>" for m in messages)


def _examples(name, seed=0, n=2, context_len=CONTEXT, tok=None):
  return ruler.make_examples(name, tok or CharTokenizer(), n, context_len, seed)


class RulerTest(parameterized.TestCase):

  @parameterized.parameters(*ruler.TASKS)
  def test_length_answers_and_determinism(self, name):
    tok = CharTokenizer()
    exs = _examples(name)
    again = _examples(name)
    self.assertEqual([e.context_ids + e.question_ids for e in exs],
                     [e.context_ids + e.question_ids for e in again])
    self.assertNotEqual(exs[0].answers, _examples(name, seed=1)[0].answers)
    self.assertNotEqual(exs[0].answers, exs[1].answers)
    gen = ruler.tokens_to_generate(name)
    for ex in exs:
      total = len(ex.context_ids) + len(ex.question_ids) + gen
      self.assertLessEqual(total, CONTEXT)
      self.assertGreater(total, CONTEXT - SLACK)
      self.assertEqual(ex.meta["n_prompt_tokens"] + gen, total)
      self.assertEqual(ex.metric, "ruler_all")
      context = tok.decode(ex.context_ids)
      for a in ex.answers:
        self.assertIn(a, context)
      self.assertEqual(ex.grade(" " + " ".join(ex.answers)), 1.0)
      self.assertEqual(ex.grade(" I do not know."), 0.0)

  def test_niah_templates(self):
    tok = CharTokenizer()
    one = _examples("niah_single_1", n=1)[0]
    key = one.meta["keys"][0]
    self.assertEqual(tok.decode(one.question_ids),
                     f"\nWhat is the special magic number for {key} mentioned in the provided "
                     f"text? The special magic number for {key} mentioned in the provided text "
                     "is")
    context = tok.decode(one.context_ids)
    self.assertTrue(context.startswith(
        "A special magic number is hidden within the following text. Make sure to memorize "
        "it. I will quiz you about the number afterwards.\n" + ruler_text.NOISE + "\n"))
    self.assertIn(f"One of the special magic numbers for {key} is: {one.answer}.", context)
    self.assertRegex(key, r"^[a-z]{4,}-[a-z]{4,}$")
    multi = _examples("niah_multiquery", n=1)[0]
    q = tok.decode(multi.question_ids)
    keys = multi.meta["keys"]
    self.assertIn(f"What are all the special magic numbers for {keys[0]}, {keys[1]}, "
                  f"{keys[2]}, and {keys[3]} mentioned", q)
    self.assertLen(multi.answers, 4)
    self.assertEqual(multi.grade(" ".join(multi.answers[:3])), 0.75)
    uuid = _examples("niah_multikey_3", n=1)[0]
    self.assertRegex(uuid.answer, r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-"
                     r"[0-9a-f]{12}$")
    lines = tok.decode(uuid.context_ids).split("\n")[1:]
    self.assertTrue(all(ln.startswith("One of the special magic uuids for ") for ln in lines))
    self.assertEqual(sum(uuid.meta["keys"][0] in ln for ln in lines), 1)

  def test_essay_haystack_is_the_builtin_text(self):
    tok = CharTokenizer()
    ex = _examples("niah_single_2", n=1)[0]
    context = tok.decode(ex.context_ids)
    self.assertIn("GNU GENERAL PUBLIC LICENSE Version 3", context)
    self.assertEqual(context.count("One of the special magic numbers"), 1)
    text = "Alpha beta gamma. Delta epsilon zeta! " * 10 + "words wordy wordier wordiest " * 8
    mine = ruler.make_examples("niah_single_2", tok, 1, 1500, 0, haystack=text + " ".join(
        c * 4 for c in "abcdefghijklmnopqrstuvwxyz"))[0]
    self.assertIn("Alpha beta gamma.", tok.decode(mine.context_ids))

  def test_variable_tracking_chain_and_few_shot(self):
    tok = CharTokenizer()
    for ex in _examples("vt"):
      text = tok.decode(ex.context_ids)
      main = text[text.rindex("Memorize and track"):]
      value = {}
      for name, rhs in re.findall(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d+)", main):
        value[name] = value[rhs[4:]] if rhs.startswith("VAR") else rhs  # defined first
      self.assertLen(value, 5)
      want = [n for n, v in value.items() if v == list(value.values())[0]]
      self.assertEqual(sorted(want), sorted(ex.answers))
      self.assertIn(f"5 variables are assigned the value {value[ex.answers[0]]}, they are: ",
                    tok.decode(ex.question_ids))
      shot = text[:text.rindex("Memorize and track")]  # RULER's in-context example
      self.assertLen(re.findall(r"VAR [A-Z]{3} = ", shot), 5)
      self.assertRegex(shot, r"they are:  ([A-Z]{3} ){4}[A-Z]{3}\n\n$")  # as RULER: 2 spaces
      self.assertNotIn("12345", shot)

  def test_common_and_frequent_words(self):
    tok = CharTokenizer()
    ex = _examples("cwe", n=1)[0]
    text = tok.decode(ex.context_ids)
    main = text[text.rindex("Below is a numbered list"):]
    counts = collections.Counter(re.findall(r"\d+\. ([a-z]+)", main))
    self.assertEqual({w for w, c in counts.items() if c == 6}, set(ex.answers))  # < 4096
    self.assertEqual(set(counts.values()), {6, 1})
    self.assertLen(ex.answers, 10)
    fwe = _examples("fwe", n=1)[0]
    words = tok.decode(fwe.context_ids).split("coded words. ", 1)[1].split()
    ranked = [w for w, _ in collections.Counter(words).most_common(4)]
    self.assertEqual(ranked[0], "...")
    self.assertEqual(set(ranked[1:]), set(fwe.answers))

  def test_chat_template_wraps_the_user_turn(self):
    tok = ChatTokenizer()
    ex = ruler.make_examples("niah_single_1", tok, 1, CONTEXT, 0)[0]
    self.assertTrue(tok.decode(ex.context_ids).startswith("<u>A special magic number"))
    self.assertTrue(tok.decode(ex.question_ids).endswith(
        "provided text?</u><a> The special magic number for " + ex.meta["keys"][0] +
        " mentioned in the provided text is"))

  def test_scoring_is_rulers(self):
    # scripts/eval/synthetic/constants.py: percent, rounded to 2 places, lower-cased
    preds = ["A b", "x", "The C"]
    refs = [["a", "B", "c"], ["z"], ["c", "d"]]
    self.assertEqual(ruler.task_score(preds, refs, "all"), round((2 / 3 + 0 + 0.5) / 3 * 100, 2))
    self.assertEqual(ruler.task_score(preds, refs, "all"), 38.89)
    self.assertEqual(ruler.task_score(preds, refs, "part"), 66.67)
    self.assertEqual(ruler.postprocess("  ab\x01c\t \n"), "ab\nc")
    self.assertEqual([ruler.tokens_to_generate(t) for t in ("niah_single_1", "vt", "cwe", "fwe")],
                     [128, 30, 120, 50])

  @parameterized.parameters(
      (dict(name="qa_1"), "SQuAD"),
      (dict(name="nope"), "name must be one of"),
      (dict(context_len=300), r"context_len=300 is too small for task 'niah_single_1'"),
      (dict(context_len=10), r"context_len must be an int >= 64"),
      (dict(num_examples=0), r"num_examples must be an int >= 1"),
      (dict(max_new_tokens=5000), r"max_new_tokens must be an int \[1, 2999\]"),
  )
  def test_errors(self, kw, msg):
    args = dict(name="niah_single_1", tokenizer=CharTokenizer(), num_examples=1,
                context_len=CONTEXT, seed=0)
    args.update(kw)
    with self.assertRaisesRegex(ValueError, msg):
      ruler.make_examples(**args)


class SmolLM2TokenizerTest(test_util.SmolLM2TokenizerCase):

  @parameterized.parameters(*ruler.TASKS)
  def test_4k_prompts_fill_the_context(self, name):
    ex = ruler.make_examples(name, self.tok, 1, 4096, 0)[0]
    total = ex.meta["n_prompt_tokens"] + ruler.tokens_to_generate(name)
    self.assertLessEqual(total, 4096)
    self.assertGreater(total, 4096 - 200)  # one uuid needle line is ~60 tokens
    context = self.tok.decode(ex.context_ids)
    self.assertTrue(context.startswith("<|im_start|>"))
    for a in ex.answers:
      self.assertIn(a, context)


if __name__ == "__main__":
  absltest.main()
