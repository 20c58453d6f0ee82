r"""Experiment 1: permutation / rotation (Theorem 1) on a real model's cache.

For each example (question-aware prompt) and design: prefill, evict, then
rotate the VALUES of a fixed set P of evicted tokens (a random orthogonal
matrix: every value norm, hence every value-aware score, is unchanged) in the
pre-eviction cache and in the shadow full cache, and evict again with the same
PRNG key. Reported per (design, example, draw):

* ``kept_set_identical``: the kept set (positions, validity, log pi) is
  identical after the perturbation; ``retained_identical``: the whole kept
  state (with the kept keys and values) is bit-identical;
* ``tokens_identical`` / ``radius_identical``: the decoded tokens and the
  certificate statistics computed from the kept state are identical;
* ``err_orig`` / ``err_pert``: the mean true attention error over the decode
  calls, against the original and the perturbed full cache.

Deterministic designs: P is the design's own evicted set; everything it
computes is blind to P, while the error it would have to certify changes
(Theorem 1). The randomized design is blind per draw as well; what differs is
that its radius is a statement over draws: P is the set one draw (draw 0)
evicts, and the coverage at ``delta = 0.05`` over the other draws is reported
for the original and for the perturbed values.

The command: ``python -m experiments.theorem1 --out=/tmp/thm1``.
"""

from __future__ import annotations

import dataclasses
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from certkv_jax import certificate
from certkv_jax.designs import budgets
from certkv_jax.designs import registry
from certkv_jax import eviction
from certkv_jax.kv import caches as caches_lib
from certkv_jax import layer as layer_lib
from experiments.lib import batching
from experiments.lib import design_defaults
from experiments.lib import model_loading
from experiments.lib import plan_flags
from experiments.lib import results_io
from experiments.lib import tasks
from models import decode
from models import forward

KEY_FIELDS = ("model", "task", "design", "budget", "example", "draw", "seed", "context_len")


def _tree_equal(a, b) -> bool:
  return all(np.array_equal(np.asarray(x), np.asarray(y))
             for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def _retained(c):
  return (c.k, c.v, c.log_pi, c.pos, c.valid)


def _rotate(caches, shadow, perturb, key):
  """Values of the slots in ``perturb`` [L, B, Hkv, cap] rotated, in caches and shadow."""
  d = caches.v.shape[-1]
  rot, _ = jnp.linalg.qr(jax.random.normal(key, (d, d)))
  cap = caches.v.shape[-2]
  new_v = jnp.where(perturb[..., None], caches.v @ rot, caches.v)
  sh_v = shadow.v.at[..., :cap, :].set(
      jnp.where(perturb[..., None], shadow.v[..., :cap, :] @ rot, shadow.v[..., :cap, :]))
  return caches.replace(v=new_v), shadow.replace(v=sh_v)


@dataclasses.dataclass(frozen=True)
class Plan:
  """What :func:`run_theorem1` runs (and the rows' keys)."""

  designs: tuple = plan_flags.setting(("snapkv", "h2o", "poisson_tail"), "Designs.")
  budget: float = plan_flags.setting(0.25, "Budget: the share of tokens kept.")
  model: str = model_loading.DEFAULT_MODEL  # the name in rows (the command: the --model spec)
  task: str = plan_flags.setting("passkey", "Task of the prompts.")
  context_len: int = plan_flags.setting(192, "Context length (tokens).")
  seed: int = plan_flags.setting(0, "Seed.")
  n_draws: int = plan_flags.setting(4, "Draws of the randomized designs.")
  n_steps: int = plan_flags.setting(8, "Decode steps after the rotation.")
  n_sink: int = design_defaults.N_SINK
  window: int = design_defaults.WINDOW

  def check(self) -> "Plan":
    for d in self.designs:
      if d not in registry.names():
        raise ValueError(f"--designs: {d!r} is not an evicting design; choose from "
                         f"{list(registry.names())}")
    return self


def run_theorem1(params, config, examples, out_dir: str, plan: Plan, *,
                 log=print) -> list[dict]:
  """Runs the experiment for every (design, example, draw) of ``plan`` not yet in
  ``out_dir``; returns the rows of ``plan`` (its designs, examples and draws). A file
  holding rows of other ``n_steps``, ``n_sink`` or ``window`` is refused (ValueError)."""
  results = results_io.JsonlResults(os.path.join(out_dir, "theorem1_rows.jsonl"), KEY_FIELDS)
  settings = {f: getattr(plan, f) for f in ("n_steps", "n_sink", "window")}
  results_io.check_settings(results, {f: (f, v) for f, v in settings.items()})
  prompt, mask = batching.pad_batch([e.context_ids + e.question_ids for e in examples])
  batch, plen = prompt.shape
  budget, n_steps = plan.budget, plan.n_steps
  common = dict(model=plan.model, task=plan.task, budget=float(budget), seed=plan.seed,
                context_len=plan.context_len)
  progress = results_io.Progress(len(plan.designs))
  n_draws = {}
  for name in plan.designs:
    design = design_defaults.make_design(name, budget, plan.n_sink, plan.window)
    draws = n_draws[name] = plan.n_draws if design.randomized else 1
    if all(results.has(design=name, example=i, draw=k, **common)
           for i in range(batch) for k in range(draws)):
      log(f"{progress.step()} theorem1/{name}: already done")
      continue
    t0 = time.time()
    capacity = budgets.capacity(design, budgets.Lengths(n_context=plen, n_steps=n_steps),
                                budget=budget)

    @jax.jit
    def prefill(p):
      shadow = caches_lib.shadow_caches(config, batch, plen + n_steps)
      logits, caches, _, shadow = forward.forward_chunk(
          p, config, prompt, mask, caches_lib.init_caches(config, batch, capacity),
          settings=layer_lib.Settings(design=design, certificate=False), shadow=shadow)
      return batching.last_logits(logits, mask), caches, shadow

    @jax.jit
    def evict(caches, shadow, key):
      new, _, info, _ = eviction.evict(design, caches, key, budget=jnp.float32(budget))
      return new, eviction.record_inclusion(shadow, caches, info), info.evicted

    @jax.jit
    def decode_from(p, first, caches, shadow, key):
      gen = decode.decode_from(p, decode.DecodeCarry(caches, shadow, None, key), first,
                               config=config,
                               gen=decode.GenerationConfig(n_steps=n_steps, design=design))
      return gen.tokens, gen.var_hat, gen.range_hat, gen.true_error

    first, caches, shadow = prefill(params)
    assert np.array_equal(np.asarray(caches.pos[..., :plen]),
                          np.asarray(shadow.pos[..., :plen]))
    keys = [jax.random.fold_in(jax.random.PRNGKey(plan.seed), k) for k in range(draws + 1)]
    _, _, evicted0 = evict(caches, shadow, keys[0])
    pert_caches, pert_shadow = _rotate(caches, shadow, evicted0,
                                       jax.random.PRNGKey(plan.seed + 1))
    for k in range(draws):
      key = keys[k] if not design.randomized else keys[k + 1]
      kept_a, sh_a, _ = evict(caches, shadow, key)
      kept_b, sh_b, _ = evict(pert_caches, pert_shadow, key)
      dec_key = jax.random.fold_in(key, 1)
      ta, va, ra, ea = (np.asarray(x) for x in decode_from(params, first, kept_a, sh_a, dec_key))
      tb, vb, rb, eb = (np.asarray(x) for x in decode_from(params, first, kept_b, sh_b, dec_key))
      rad_a = np.asarray(certificate.radius_from_stats(va, ra, 0.05))
      for i in range(batch):
        if results.has(design=name, example=i, draw=k, **common):
          continue
        same_kept = _tree_equal([x[:, i] for x in _retained(kept_a)],
                                [x[:, i] for x in _retained(kept_b)])
        same_set = _tree_equal([x[:, i] for x in _retained(kept_a)[2:]],
                               [x[:, i] for x in _retained(kept_b)[2:]])
        results.add(dict(
            common, **settings, design=name, example=i, draw=k,
            randomized=bool(design.randomized),
            n_perturbed=int(np.asarray(evicted0)[:, i].sum()),
            retained_identical=same_kept, kept_set_identical=same_set,
            tokens_identical=bool(np.array_equal(ta[i], tb[i])),
            radius_identical=bool(np.array_equal(va[:, :, i], vb[:, :, i])
                                  and np.array_equal(ra[:, :, i], rb[:, :, i])),
            err_orig=float(ea[:, :, i].mean()), err_pert=float(eb[:, :, i].mean()),
            mean_radius=float(rad_a[:, :, i].mean()),
            coverage_orig=float(np.mean(ea[:, :, i] <= rad_a[:, :, i])),
            coverage_pert=float(np.mean(eb[:, :, i] <= rad_a[:, :, i]))))
    log(f"{progress.step()} theorem1/{name}: {time.time() - t0:.0f}s")
  return [r for r in results.rows if r["design"] in n_draws and r["example"] < batch
          and r["draw"] < n_draws[r["design"]] and all(r.get(k) == v for k, v in common.items())]


def summarize(rows) -> dict:
  """Per-design aggregates and the markdown section."""
  out = {"designs": {}}
  body = []
  for name in sorted({r["design"] for r in rows}):
    sel = [r for r in rows if r["design"] == name]
    agg = {k: float(np.mean([r[k] for r in sel])) for k in (
        "retained_identical", "kept_set_identical", "tokens_identical", "radius_identical",
        "err_orig", "err_pert", "mean_radius", "coverage_orig", "coverage_pert")}
    agg["rel_err_change"] = float(np.mean([abs(r["err_pert"] - r["err_orig"])
                                           / max(r["err_orig"], 1e-12) for r in sel]))
    agg["n"] = len(sel)
    out["designs"][name] = agg
    body.append([name, agg["n"], f"{agg['kept_set_identical']:.2f}",
                 f"{agg['retained_identical']:.2f}",
                 f"{agg['tokens_identical']:.2f}", f"{agg['radius_identical']:.2f}",
                 f"{agg['err_orig']:.4f}", f"{agg['err_pert']:.4f}",
                 f"{agg['rel_err_change']:.2f}", f"{agg['coverage_orig']:.3f}",
                 f"{agg['coverage_pert']:.3f}"])
  md = ["## Theorem 1: rotating evicted values (experiment 1)", "",
        "Fractions of (example, draw) pairs with a bit-identical kept state, identical "
        "decoded tokens and identical certificate statistics after rotating the values of "
        "the evicted set P; mean true error before/after; coverage at delta 0.05 of the "
        "(unchanged) radius against both errors.", "",
        "| design | n | kept set identical | kept state identical | tokens identical | "
        "radius identical | err orig | err pert | rel. change | cov orig | cov pert |",
        "|" + "---|" * 11]
  md += ["| " + " | ".join(str(x) for x in row) + " |" for row in body]
  md += ["", "A deterministic design's radius is 0 (nothing it computes sees P), so its "
         "'coverage' is the fraction of calls with no error; the randomized design's "
         "radius is a statement over draws (draws 1..n; P is the set draw 0 evicted)."]
  out["md"] = "\n".join(md)
  return out


def run_and_report(plan: Plan, *, out: str, num_examples: int) -> str:
  """The command: runs :func:`run_theorem1` on ``num_examples`` prompts of ``plan.task``
  (``plan.model``: the ``--model`` spec), writes ``out/theorem1_rows.jsonl`` and
  ``out/summary.md``; returns the summary."""
  plan.check()
  params, config, tok = model_loading.load_model(plan.model)
  exs = tasks.make_task(plan.task, tok, num_examples, plan.context_len, plan.seed)
  rows = run_theorem1(params, config, exs, out,
                      dataclasses.replace(plan, model=model_loading.model_name(plan.model)))
  s = summarize(rows)
  results_io.atomic_write_text(os.path.join(out, "summary.md"), s["md"] + "\n")
  return s["md"]
