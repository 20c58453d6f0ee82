"""One name for a design everywhere: ``certkv_jax.designs.registry.parse`` reads every design
string, and the registry, the experiments' variants, the leaderboard, the equal-memory
comparison and ``generate`` accept the same strings (settings and allocations
included) with the same errors."""

import dataclasses

from absl.testing import absltest
from absl.testing import parameterized

from certkv_jax import designs
from certkv_jax.designs import allocation as allocation_lib
from certkv_jax.designs import registry
from experiments.lib import design_defaults
from experiments.lib import model_loading
from experiments.lib import variants
from experiments.lib.equal_memory import experiment as equal_memory
from experiments.lib.leaderboard import experiment as leaderboard
from models.text import generate
from tests import test_util

# The certified design the README puts forward.
PUT_FORWARD = "priority_focus:diffuse_weight=0.3:focus_share=0.95+cert:min_share=0.95"
PROMPT = "the quick brown fox jumps over the lazy dog. " * 3 + "\nwhere is the dog?"


class ParseTest(parameterized.TestCase):

  def test_put_forward_design(self):
    spec = registry.parse(PUT_FORWARD)
    self.assertEqual(spec, registry.Spec("priority_focus", (("diffuse_weight", 0.3),
                                                           ("focus_share", 0.95)),
                                         "cert", (("min_share", 0.95),)))
    design, alloc = registry.make_with_allocation(PUT_FORWARD, 0.25, n_sink=4, window=16)
    self.assertEqual((design.tail.focus_share, design.certain.n_sink), (0.95, 4))
    self.assertEqual(alloc, allocation_lib.CertificateTargeted(scope="layer", min_share=0.95))

  def test_plain_names_aliases_and_full(self):
    self.assertEqual(registry.parse("snapkv"), registry.Spec("snapkv"))
    self.assertEqual(registry.parse("pyramidkv"), registry.Spec("snapkv", (), "pyramid"))
    self.assertEqual(registry.parse("full"), registry.Spec("full"))
    self.assertEqual(registry.make_with_allocation("full", 0.5), (None, None))
    self.assertEqual(registry.parse("priority_floor:min_tail=8").settings, (("min_tail", 8),))
    self.assertIsInstance(registry.parse("h2o+cert:max_share=2").allocation_settings[0][1],
                          int)

  def test_make_reads_design_settings_but_not_allocations(self):
    self.assertEqual(registry.make("priority_floor:min_tail=8", 0.5).min_tail, 8)
    # the string's settings override the shared ones
    self.assertEqual(registry.make("snapkv:window=8", 0.5, window=16),
                     registry.make("snapkv", 0.5, window=8))
    with self.assertRaisesRegex(ValueError, "per-head allocation.*make_with_allocation"):
      registry.make(PUT_FORWARD, 0.25)
    with self.assertRaisesRegex(ValueError, "unknown design 'nope'; choose from"):
      registry.make("nope", 0.5)

  def test_grouped_settings_are_read_by_field_name(self):
    """A factory's frozen-dataclass settings (``certain``, ``focus``) are flat in a
    design string and in ``make``'s keywords; flat fields override a group given."""
    want = designs.priority_focus(
        0.5, certain=designs.CertaintySet(n_sink=4, window=16, heavy=2),
        focus=designs.Focus(pool_size=3, diffuse_weight=0.3), focus_share=0.5)
    self.assertEqual(registry.make("priority_focus:heavy=2:pool_size=3:diffuse_weight=0.3"
                                   ":focus_share=0.5", 0.5, n_sink=4, window=16), want)
    given = designs.CertaintySet(n_sink=4, window=8, heavy=2)
    self.assertEqual(registry.make("poisson_tail:window=16", 0.5, certain=given).certain,
                     designs.CertaintySet(n_sink=4, window=16, heavy=2))
    with self.assertRaisesRegex(ValueError, r"takes no setting 'nope'; it takes \[.*'heavy'"):
      registry.make("poisson_tail", 0.5, nope=1)
    with self.assertRaisesRegex(ValueError, "heavy must be"):
      registry.make("poisson_tail", 0.5, heavy=-1)

  @parameterized.parameters(
      ("nope", r"--x: unknown design 'nope'; choose from \['full', .*\+allocation"),
      ("snapkv+nope", r"--x: unknown allocation 'nope' in 'snapkv\+nope'; choose from"),
      ("snapkv+", "--x: no allocation after"),
      ("h2o:nope=1", "--x: design 'h2o' takes no setting 'nope'"),
      ("sink_window:window=8", "takes no setting 'window'"),
      ("priority_floor:min_tail", "--x: setting 'min_tail' in .* must be name=number"),
      ("h2o+cert:nope=1", "--x: allocation 'cert' takes no setting 'nope'"),
      ("h2o+uniform:min_share=1", "--x: uniform budgets take no settings"),
      ("full+cert", "--x: 'full' .* takes no settings or allocation"),
      ("", "--x: a design must be a non-empty string"),
      # before: 2 and 0.5 read as true; a wrong type escaped as a TypeError without the flag
      ("keydiff_cert:value_aware=2", r"--x: value_aware must be a bool, got 2"),
      ("h2o:value_aware=0.5", r"--x: value_aware must be a bool, got 0.5"),
      ("h2o_cert:window=1.5", r"--x: window must be an int >= 0, got 1.5"),
  )
  def test_errors_name_the_flag(self, text, pattern):
    with self.assertRaisesRegex(ValueError, pattern):
      registry.make_with_allocation(text, 0.5, flag="--x", n_sink=4, window=16)


class SameStringsEverywhereTest(absltest.TestCase):
  """Each consumer builds the same (design, allocation) from the same string."""

  STRINGS = ("snapkv", "h2o+adakv", "pyramidkv", "priority_floor:min_tail=8+cert", PUT_FORWARD)

  def test_variants_leaderboard_equal_memory_and_generate_agree(self):
    lb_plan = leaderboard.Plan(designs=("full",) + self.STRINGS, tasks=("niah_single_1",))
    lb_plan.check()
    em_plan = equal_memory.Plan(sources=("x",), variants=self.STRINGS).check()
    for s in self.STRINGS:
      want = registry.make_with_allocation(s, 0.5, n_sink=design_defaults.N_SINK,
                                           window=design_defaults.WINDOW)
      self.assertEqual(variants.design_and_allocation(s, design_defaults.N_SINK,
                                                      design_defaults.WINDOW), want, s)
      self.assertEqual(leaderboard.design_of(s, lb_plan), want, s)
      self.assertEqual(equal_memory.design_and_allocation(s, em_plan.n_sink, em_plan.window),
                       want, s)
      settings = generate.TextSettings(design=s, budget=0.5, n_sink=design_defaults.N_SINK,
                                       window=design_defaults.WINDOW)
      got = generate.check_arguments(PROMPT, settings)
      self.assertEqual(got, dataclasses.replace(want[0], budget=got.budget), s)
    self.assertTrue(design_defaults.is_randomized(PUT_FORWARD))
    self.assertFalse(design_defaults.is_randomized("h2o+adakv"))
    self.assertFalse(design_defaults.is_randomized("full"))

  def test_the_same_error_from_each(self):
    bad = "snapkv+nope"
    for check in (lambda: variants.parse_variant(bad),
                  lambda: leaderboard.Plan(designs=(bad,)).check(),
                  lambda: equal_memory.Plan(sources=("x",), variants=(bad,)).check(),
                  lambda: generate.check_arguments(PROMPT, generate.TextSettings(design=bad))):
      with self.assertRaisesRegex(ValueError, "unknown allocation 'nope' in 'snapkv\\+nope'"):
        check()


class GenerateWithAllocationTest(absltest.TestCase):
  """``generate`` runs a design string with a per-head allocation end to end."""

  def test_put_forward_design_generates_with_a_certificate(self):
    directory = test_util.tiny_hf_dir(test_util.temp_dir(self, "design_names_"))
    params, config, tok = model_loading.load_model(directory)
    res = generate.generate_text(
        PROMPT, params=params, config=config, tokenizer=tok,
        settings=generate.TextSettings(design=PUT_FORWARD, budget=0.5, max_new_tokens=2,
                                       n_sink=2, window=4, stops=()))
    self.assertEqual(res.run.design, PUT_FORWARD)
    self.assertEqual(res.answer.steps, 2)
    self.assertEqual(res.run.n_dropped, 0)
    self.assertTrue(res.certificate.certified, res.certificate.note)
    self.assertIn("priority sampling, Hajek offsets", res.certificate.note)


if __name__ == "__main__":
  absltest.main()
