"""experiments.lib.plan_flags: flags generated from a Plan, and the Plan built back."""

import dataclasses
import subprocess
import sys
import os
from typing import Optional

from absl import flags
from absl.testing import absltest
import pytest

from experiments.lib import plan_flags
from tests import test_util

ROOT = test_util.ROOT


def _pairs(entries):
  return tuple((int(a), b) for a, b in (e.split(":") for e in entries))


@dataclasses.dataclass(frozen=True)
class _Plan:
  budget: float = plan_flags.setting(0.25, "Budget.")
  steps: int = plan_flags.setting(16, "Steps.")
  name: str = plan_flags.setting("snapkv", "Design.", choices=("snapkv", "h2o"))
  chat: bool = plan_flags.setting(True, "Chat.")
  ratios: tuple = plan_flags.setting((0.5, 0.75), "Ratios.")
  lens: tuple = plan_flags.setting((1024,), "Lengths.")
  tasks: tuple = plan_flags.setting(("a", "b"), "Tasks.")
  limit: Optional[int] = plan_flags.setting(None, "Limit.")
  at: tuple = plan_flags.setting((), "CONTEXT:task pairs.", parse=_pairs)
  dims: Optional[tuple] = plan_flags.setting(None, "Dims (None: the backend's).")
  sizes: Optional[tuple[int, ...]] = plan_flags.setting(None, "Sizes (typed by annotation).")
  splits: tuple[int, ...] = plan_flags.setting((), "Splits (typed by annotation).")
  hidden: int = 3  # not a setting: no flag

  def check(self):
    if self.steps < 1:
      raise ValueError(f"--steps must be >= 1, got {self.steps}")
    return self


class PlanFlagsTest(absltest.TestCase):

  def _parse(self, *argv):
    fv = flags.FlagValues()
    plan_flags.define_flags(_Plan, fv)
    fv(["prog", *argv])
    return fv

  def test_defaults_give_the_plans_defaults(self):
    fv = self._parse()
    self.assertEqual(plan_flags.plan_from_flags(_Plan, fv), _Plan())
    self.assertNotIn("hidden", fv)

  def test_values_are_typed_from_the_fields(self):
    fv = self._parse("--budget=0.5", "--steps=3", "--name=h2o", "--nochat",
                     "--ratios=0.125,0.875", "--lens=512,2048", "--tasks=c", "--limit=7",
                     "--at=8192:vt,4096:qa", "--dims=64,128", "--sizes=8,16",
                     "--splits=2")
    plan = plan_flags.plan_from_flags(_Plan, fv)
    self.assertEqual(plan, _Plan(budget=0.5, steps=3, name="h2o", chat=False,
                                 ratios=(0.125, 0.875), lens=(512, 2048), tasks=("c",),
                                 limit=7, at=((8192, "vt"), (4096, "qa")),
                                 dims=("64", "128"),  # no default to type them: strings
                                 sizes=(8, 16), splits=(2,)))
    self.assertIsInstance(plan.lens[0], int)
    self.assertIsInstance(plan.ratios[0], float)

  def test_given_fields_and_skip_are_not_read(self):
    fv = flags.FlagValues()
    plan_flags.define_flags(_Plan, fv, skip=("steps",))
    fv(["prog", "--budget=0.5"])
    self.assertNotIn("steps", fv)
    plan = plan_flags.plan_from_flags(_Plan, fv, skip=("steps",), tasks=("z",))
    self.assertEqual((plan.budget, plan.steps, plan.tasks), (0.5, 16, ("z",)))

  def test_bad_values_name_the_flag(self):
    with self.assertRaises(flags.IllegalFlagValueError):
      self._parse("--name=tova")  # not a choice
    with self.assertRaises(flags.IllegalFlagValueError):
      self._parse("--steps=x")
    with self.assertRaisesRegex(ValueError, "--lens entries must be ints, got '1.5'"):
      plan_flags.plan_from_flags(_Plan, self._parse("--lens=1.5"))
    for flag in ("--sizes=40x6", "--splits=a"):  # no default, typed by the annotation
      with self.assertRaisesRegex(ValueError, "entries must be ints"):
        plan_flags.plan_from_flags(_Plan, self._parse(flag))
    with self.assertRaisesRegex(ValueError, "--steps must be >= 1"):  # the Plan's check
      plan_flags.plan_from_flags(_Plan, self._parse("--steps=0"))

  def test_cli_defaults_and_plain_metadata(self):
    @dataclasses.dataclass(frozen=True)
    class Plain:  # a settings class that cannot import plan_flags (models/)
      chat: bool = dataclasses.field(default=False, metadata={"help": "Chat."})
      n: int = dataclasses.field(default=2, metadata={"help": "N.", "choices": None})
      kept: Optional[str] = None

    fv = flags.FlagValues()
    plan_flags.define_flags(Plain, fv, defaults={"chat": True})
    fv(["prog", "--n=5"])
    self.assertEqual(plan_flags.plan_from_flags(Plain, fv), Plain(chat=True, n=5))
    self.assertNotIn("kept", fv)
    with self.assertRaisesRegex(ValueError, r"defaults: \['nope'\] are not settings of Plain"):
      plan_flags.define_flags(Plain, flags.FlagValues(), defaults={"nope": 1})

  def test_bad_declarations(self):
    with self.assertRaisesRegex(ValueError, "help"):
      plan_flags.setting(1, "")

    @dataclasses.dataclass(frozen=True)
    class Bad:
      x: dict = plan_flags.setting(None, "A dict.")

    with self.assertRaisesRegex(TypeError, "Bad.x: a flag needs"):
      plan_flags.define_flags(Bad, flags.FlagValues())
    with self.assertRaisesRegex(TypeError, "dataclass"):
      plan_flags.define_flags(object, flags.FlagValues())


class ScriptsTest(absltest.TestCase):
  """The converted scripts define one flag per setting of their Plan."""

  @pytest.mark.slow  # starts every script (17 imports of jax): 38 s of the fast tier
  def test_every_setting_is_a_flag(self):
    from experiments.lib.montecarlo_certificate import experiment as montecarlo_certificate  # pylint: disable=g-import-not-at-top
    from experiments.lib.overhead import experiment as overhead  # pylint: disable=g-import-not-at-top
    from experiments.lib.theorem1 import experiment as theorem1  # pylint: disable=g-import-not-at-top
    from experiments.lib.train_synthetic import experiment as train_synthetic  # pylint: disable=g-import-not-at-top
    from experiments.lib.leaderboard import experiment as leaderboard  # pylint: disable=g-import-not-at-top
    from experiments.lib.equal_memory import experiment as equal_memory  # pylint: disable=g-import-not-at-top
    from experiments.lib.bench import decode as bench_decode  # pylint: disable=g-import-not-at-top
    from experiments.lib.damage import collect as damage  # pylint: disable=g-import-not-at-top
    from experiments.lib.bench import kernels as bench_kernels, prefill as bench_prefill  # pylint: disable=g-import-not-at-top,g-multiple-import
    from experiments.lib.streaming_loss import experiment as perplexity  # pylint: disable=g-import-not-at-top
    from models.text import generate  # pylint: disable=g-import-not-at-top
    from experiments.lib.validity import calibrate, collect as validity  # pylint: disable=g-import-not-at-top,g-multiple-import
    from experiments.lib.demo import experiment as demo  # pylint: disable=g-import-not-at-top
    from experiments.lib.bench import sharding as bench_sharding  # pylint: disable=g-import-not-at-top
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    helps = {}  # one start per script
    for script, plan in (("leaderboard", leaderboard.Plan), ("theorem1", theorem1.Plan),
                         ("overhead", overhead.Plan),
                         ("montecarlo_certificate", montecarlo_certificate.Plan),
                         ("train_synthetic", train_synthetic.Settings),
                         ("equal_memory", equal_memory.Plan),
                         ("bench_decode", bench_decode.Plan), ("damage", damage.Plan),
                         ("bench_kernels", bench_kernels.Plan),
                         ("bench_prefill", bench_prefill.Plan),
                         ("perplexity", perplexity.Plan), ("generate", generate.TextSettings),
                         ("validity", validity.Plan),
                         ("calibrate", calibrate.Plan), ("demo_smollm2", demo.Plan),
                         ("bench_sharding", bench_sharding.Plan),
                         ("bench_sharding", bench_sharding.Model)):
      names = [f.name for f in plan_flags.flag_fields(plan)]
      self.assertNotEmpty(names)
      if script not in helps:
        helps[script] = subprocess.run(
            [sys.executable, "-m", f"experiments.{script}", "--helpshort"], cwd=ROOT, env=env,
            capture_output=True, text=True, timeout=300).stdout.replace("--[no]", "--")
      for name in names:
        self.assertIn(f"--{name}:", helps[script], (script, name))


if __name__ == "__main__":
  absltest.main()
