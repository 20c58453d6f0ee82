r"""Side-by-side demo: deterministic vs randomized eviction on SmolLM2, with the certificate.

A synthetic pass-key retrieval task (seeded): a five-digit pass key is hidden
at a random depth inside ``--context_len`` tokens of filler sentences, and the
model (SmolLM2-135M-Instruct, ``models.gguf_loader.load_smollm2``, chat
template) is asked for it. Every (design, budget) runs in evaluation mode
(``models.decode.generate`` or ``generate_streaming`` with ``evaluate=True``:
a shadow full cache gives each decode call's true attention error) and
reports:

* accuracy: the first five digits generated equal the pass key;
* mean true error ``||o_hat - o||`` over (example, step, layer, head) calls;
* certificate coverage at ``--delta``: the fraction of those calls with
  ``true_error <= radius_from_stats(var_hat, range_hat, delta)``, and
  sharpness (median radius / error over covered calls with an error);
* memory: the bytes of the caches as allocated (K/V payload and per-slot
  metadata, ``models.memory``) next to the full cache, and of the slots kept;
* tokens/s of prefill (prompt tokens / time of a separately compiled prefill
  and eviction) and of decode (generated tokens / time of the same decode loop
  compiled on its own from the prefill's caches), both in evaluation mode,
  compile time excluded; ``timed_path_same_tokens`` checks that this split
  path generates the same tokens as ``generate``.

Regimes: ``question_aware`` (the whole prompt is prefilled, evicted once with
the question's observation window, then decoded) and ``streaming`` (the
context arrives in ``--chunk`` token chunks and is evicted after each, before
the question; the caches' capacity is sized to the budget).

Deterministic designs have no sampling variance, so their radius is 0 and
their "coverage" is the fraction of calls with no error at all (Theorem 1).

The command: ``python -m experiments.demo_smollm2 --out=/tmp/demo``.
Rows go to ``--out/rows.jsonl`` atomically as they finish; a rerun skips them.
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
import time

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from certkv_jax import certificate
from certkv_jax.certificate import diagnostics
from certkv_jax.designs import budgets as budgets_lib
from certkv_jax import eviction
from certkv_jax.kv import caches as caches_lib
from certkv_jax import layer as layer_lib
from experiments.lib import batching
from experiments.lib import design_defaults
from experiments.lib import plan_flags
from experiments.lib import results_io
from models import decode
from models import forward
from models import gguf_loader
from models import memory

KEY_DIGITS = 5
N_STEPS = 8  # " 12345." is 7 tokens (digits are single tokens in SmolLM2)
FILLER = (
    "The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
    "There and back again.", "The river flows to the sea.", "Birds sing in the morning.",
    "The road goes on and on.", "Clouds drift over the hills.", "The old clock ticks.",
)
INSTRUCTION = ("There is a pass key hidden inside a lot of irrelevant text. Find it and "
               "remember it.\n\n")
QUESTION = "\n\nWhat is the pass key?"
ANSWER_PREFIX = "The pass key is"
REGIMES = ("question_aware", "streaming")


@dataclasses.dataclass(frozen=True)
class Plan:
  """What the demo runs; each setting is a flag of ``python -m experiments.demo_smollm2``."""

  designs: tuple = plan_flags.setting(
      ("snapkv", "poisson_tail"),
      f"Designs, from {', '.join(design_defaults.names())}; 'full' keeps everything (the "
      "reference); 'all' = every one of them.")
  budgets: tuple = plan_flags.setting((0.125, 0.25, 0.5),
                                      "Budgets, fractions of the tokens seen.")
  regime: str = plan_flags.setting("question_aware", "Eviction regime; 'both' runs "
                                   "question_aware then streaming.",
                                   choices=REGIMES + ("both",))
  context_len: int = plan_flags.setting(256, "Filler tokens around the pass key "
                                        "(approximately).")
  num_examples: int = plan_flags.setting(4, "Examples (one batch).")
  delta: float = plan_flags.setting(0.05, "Certificate miss probability.")
  seed: int = plan_flags.setting(0, "Seed of the task and of the randomized designs.")
  n_sink: int = plan_flags.setting(design_defaults.N_SINK, "Sink tokens kept by every design.")
  window: int = plan_flags.setting(design_defaults.WINDOW, "Recent window / observation "
                                   "window kept by every design.")
  chunk: int = plan_flags.setting(64, "Streaming: context tokens per chunk.")

  @property
  def design_names(self) -> tuple:
    """The designs to run (``("all",)``: every one of ``design_defaults.names()``)."""
    return design_defaults.names() if list(self.designs) == ["all"] else tuple(self.designs)

  @property
  def regimes(self) -> tuple:
    return REGIMES if self.regime == "both" else (self.regime,)

  def check(self) -> "Plan":
    known = design_defaults.names()
    for d in self.design_names:
      if d not in known:
        raise ValueError(f"--designs: unknown design {d!r}; choose from {list(known)} "
                         "(or 'all')")
    for b in self.budgets:
      if not 0.0 < float(b) <= 1.0:
        raise ValueError(f"--budgets entries must be in (0, 1], got {b}")
    if self.regime not in REGIMES + ("both",):
      raise ValueError(f"--regime must be one of {list(REGIMES) + ['both']}, got "
                       f"{self.regime!r}")
    return self


def make_examples(tok, n: int, context_len: int, seed: int):
  """Pass-key examples: ``[(context_ids, question_ids, key)]``.

  ``context_ids`` is the chat prefix, the instruction and the filler with the
  pass key at a random depth; ``question_ids`` the question, the end of the
  user turn, the assistant header and ``ANSWER_PREFIX``. Their concatenation
  is the question-aware prompt.
  """
  rng = random.Random(seed)
  prefix, suffix = tok.apply_chat_template([{"role": "user", "content": "\x00"}]).split("\x00")
  examples = []
  for _ in range(n):
    key = "".join(str(rng.randrange(10)) for _ in range(KEY_DIGITS))
    sentences, n_tok = [], 0
    while n_tok < context_len:
      s = rng.choice(FILLER)
      sentences.append(s)
      n_tok += len(tok.encode(" " + s, add_bos=False))
    depth = rng.randrange(len(sentences) + 1)
    sentences.insert(depth, f"The pass key is {key}. Remember it. {key} is the pass key.")
    context = prefix + INSTRUCTION + " ".join(sentences)
    question = QUESTION + suffix + ANSWER_PREFIX
    examples.append((tok.encode(context), tok.encode(question, add_bos=False), key))
  return examples


def _pad(seqs):
  n = max(len(s) for s in seqs)
  ids = np.zeros((len(seqs), n), np.int32)
  mask = np.zeros((len(seqs), n), bool)
  for i, s in enumerate(seqs):
    ids[i, :len(s)], mask[i, :len(s)] = s, True
  return ids, mask


def answer_correct(text: str, key: str) -> bool:
  return "".join(re.findall(r"\d", text))[:KEY_DIGITS] == key


def _timed(fn, *args):
  """(result, seconds) of a compiled call, blocking on the result."""
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  return out, time.perf_counter() - t0


def ratio_summary(err, radius, ratio) -> dict:
  """The Assumption-2 audit of a run's calls (method, section 6).

  ``R`` (``Generation.ratio``) is 0 for calls with no sampled token (every
  deterministic design); the quantiles and the split coverage are over the
  calls with ``R > 0``. Coverage where ``R > 1`` vs ``R <= 1`` answers "does
  coverage hold where Assumption 2 is strained?".
  """
  ratio = np.asarray(ratio, np.float64)
  audited = ratio > 0
  out = {"n_calls_audited": int(audited.sum())}
  if not audited.any():
    return dict(out, median_ratio=None, p90_ratio=None, coverage_r_le_1=None,
                coverage_r_gt_1=None, n_calls_r_gt_1=0)
  r = ratio[audited]
  covered = (np.asarray(err) <= np.asarray(radius))[audited]
  low, high = r <= 1.0, r > 1.0
  return dict(out, median_ratio=float(np.median(r)), p90_ratio=float(np.quantile(r, 0.9)),
              coverage_r_le_1=float(covered[low].mean()) if low.any() else None,
              coverage_r_gt_1=float(covered[high].mean()) if high.any() else None,
              n_calls_r_gt_1=int(high.sum()))


def run_one(params, config, tok, examples, plan: Plan, design_name: str, budget: float,
            compiled: dict | None = None) -> dict:
  """One (design, budget) of ``plan.regime`` over a batch of examples; returns the row.

  The design is built at budget 1.0 and the run's budget is passed as the
  traced ``budget`` argument of ``models.decode``, so that the compiled
  programs (kept in ``compiled``, keyed by design, regime and capacity) serve
  every budget of a design whose caches have the same capacity
  (``certkv_jax.designs.budgets.capacity``: in the question-aware regime the prompt,
  whatever the budget, unless the kept tokens plus the answer exceed it).
  """
  regime, delta, seed, chunk = plan.regime, plan.delta, plan.seed, plan.chunk
  design = design_defaults.make_design(design_name, 1.0, plan.n_sink, plan.window)
  b_arg = None if design is None else jnp.float32(budget)
  sizing = None if design is None else budget
  compiled = {} if compiled is None else compiled
  ctx, ctx_mask = _pad([c for c, _, _ in examples])
  qst, q_mask = _pad([q for _, q, _ in examples])
  key = jax.random.PRNGKey(seed)
  batch = len(examples)
  if regime == "question_aware":
    prompt, p_mask = _pad([c + q for c, q, _ in examples])
    capacity = budgets_lib.capacity(
        design, budgets_lib.Lengths(n_context=prompt.shape[1], n_steps=N_STEPS), budget=sizing)
    gen_cfg = decode.GenerationConfig(n_steps=N_STEPS, design=design, evaluate=True,
                                      capacity=capacity)
    gen_fn = jax.jit(lambda p, k, b: decode.generate(p, prompt, p_mask, k, config=config,
                                                     gen=gen_cfg, budget=b))

    def prefill(p, k, b):  # generate() up to the first decode step
      shadow = caches_lib.shadow_caches(config, batch, prompt.shape[1] + N_STEPS)
      logits, caches, _, shadow = forward.forward_chunk(
          p, config, prompt, p_mask, caches_lib.init_caches(config, batch, capacity),
          settings=layer_lib.Settings(design=design, certificate=False), shadow=shadow)
      state = None
      if design is not None:
        caches, state, _, shadow = eviction.evict_and_record(
            design, caches, shadow, jax.random.split(k)[1], budget=b)
      return batching.last_logits(logits, p_mask), caches, shadow, state
    n_prompt = int(p_mask.sum())
    full_tokens = prompt.shape[1] + N_STEPS
  else:
    n_ctx = ctx.shape[1]
    n_chunks = -(-n_ctx // chunk)
    # the kept tokens plus the next chunk (appended before it is evicted), then the
    # question and the answer; without a design, everything
    capacity = budgets_lib.capacity(
        design, budgets_lib.Lengths(n_context=n_ctx, n_question=qst.shape[1], n_steps=N_STEPS,
                                    chunk=chunk), budget=sizing)
    gen_cfg = decode.GenerationConfig(n_steps=N_STEPS, design=design, evaluate=True,
                                      capacity=capacity, chunk=chunk)
    gen_fn = jax.jit(lambda p, k, b: decode.generate_streaming(
        p, (ctx, ctx_mask), (qst, q_mask), k, config=config, gen=gen_cfg, budget=b))

    def prefill(p, k, b):  # generate_streaming up to the first decode step
      pad = n_chunks * chunk - n_ctx
      as_chunks = lambda x: jnp.pad(x, ((0, 0), (0, pad))).reshape(
          batch, n_chunks, chunk).swapaxes(0, 1)

      def feed(carry, xs):
        caches, shadow, state, k = carry
        _, caches, _, shadow = forward.forward_chunk(
            p, config, xs[0], xs[1], caches,
            settings=layer_lib.Settings(design=design, certificate=False), shadow=shadow)
        k, sub = jax.random.split(k)
        if design is not None:
          caches, state, _, shadow = eviction.evict_and_record(design, caches, shadow, sub,
                                                            state=state, budget=b)
        return (caches, shadow, state, k), None
      caches = caches_lib.init_caches(config, batch, capacity)
      state = None if design is None else eviction.init_state(design, caches)
      shadow = caches_lib.shadow_caches(config, batch, n_chunks * chunk + qst.shape[1] + N_STEPS)
      (caches, shadow, state, k), _ = jax.lax.scan(
          feed, (caches, shadow, state, k), (as_chunks(ctx), as_chunks(ctx_mask)))
      logits, caches, _, shadow = forward.forward_chunk(
          p, config, qst, q_mask, caches,
          settings=layer_lib.Settings(design=design, certificate=False), shadow=shadow)
      return batching.last_logits(logits, q_mask), caches, shadow, state
    n_prompt = int(ctx_mask.sum() + q_mask.sum())
    full_tokens = n_chunks * chunk + qst.shape[1] + N_STEPS

  def decode_steps(p, first_logits, caches, shadow, state, k, b):
    # The decode loop generate() runs after its prefill (same arguments), timed on its
    # own; k matches generate's key after the prefill's split.
    return decode.decode_from(p, decode.DecodeCarry(caches, shadow, state, k), first_logits,
                              config=config, gen=gen_cfg, budget=b)

  t0 = time.perf_counter()
  slot = (design_name, regime, capacity, batch)
  if slot not in compiled:
    compiled[slot] = {"gen": gen_fn.lower(params, key, b_arg).compile(),
                      "prefill": jax.jit(prefill).lower(params, key, b_arg).compile()}
  gen_c, prefill_c = compiled[slot]["gen"], compiled[slot]["prefill"]
  compile_s = time.perf_counter() - t0
  gen, t_gen = _timed(gen_c, params, key, b_arg)
  (first_logits, caches, shadow, state), t_prefill = _timed(prefill_c, params, key, b_arg)
  k_decode = jax.random.split(key)[0] if regime == "question_aware" else None
  if k_decode is None:  # streaming: one split per chunk
    k_decode = key
    for _ in range(-(-ctx.shape[1] // chunk)):
      k_decode = jax.random.split(k_decode)[0]
  t0 = time.perf_counter()
  if "decode" not in compiled[slot]:
    compiled[slot]["decode"] = jax.jit(decode_steps).lower(
        params, first_logits, caches, shadow, state, k_decode, b_arg).compile()
  decode_c = compiled[slot]["decode"]
  compile_s += time.perf_counter() - t0
  split_gen, t_decode = _timed(decode_c, params, first_logits, caches, shadow, state, k_decode,
                               b_arg)
  # The separately timed prefill + decode reproduce generate()'s tokens.
  same_tokens = bool(np.array_equal(np.asarray(split_gen.tokens), np.asarray(gen.tokens)))

  texts = [tok.decode(np.asarray(gen.tokens[i])) for i in range(batch)]
  correct = [answer_correct(t, ex[2]) for t, ex in zip(texts, examples)]
  err = np.asarray(gen.true_error, np.float64)  # [steps, layers, batch, heads]
  radius = np.asarray(certificate.radius_from_stats(gen.var_hat, gen.range_hat, delta))
  mem = memory.memory_summary(gen.caches, config, full_tokens)
  kept_mem = memory.retained_bytes(gen.caches)
  n_caches = int(np.prod(gen.caches.n_seen.shape))
  return {
      "design": design_name, "budget": budget, "regime": regime,
      "randomized": bool(design is not None and design.randomized),
      "num_examples": batch, "prompt_tokens_mean": n_prompt / batch,
      "accuracy": float(np.mean(correct)),
      "mean_true_error": float(err.mean()),
      "mean_rel_error": float(np.asarray(gen.rel_error, np.float64).mean()),
      "delta": delta,
      "coverage": diagnostics.coverage(err, radius),
      "sharpness": diagnostics.sharpness(err, radius),
      "mean_radius": float(radius.mean()),
      "n_calls": int(err.size),
      "kv_bytes": mem["kv_bytes"], "metadata_bytes": mem["metadata_bytes"],
      "full_kv_bytes": mem["full_kv_bytes"], "full_metadata_bytes": mem["full_metadata_bytes"],
      "kv_fraction": mem["kv_fraction"], "capacity": mem["capacity"],
      "full_capacity": mem["full_capacity"],
      "kept_kv_bytes": kept_mem["kv"], "kept_metadata_bytes": kept_mem["metadata"],
      "mean_kept_slots": kept_mem["slots"] / n_caches,
      "n_dropped": int(np.sum(np.asarray(gen.caches.n_dropped))),
      "prefill_tokens_per_s": n_prompt / t_prefill,
      "decode_tokens_per_s": batch * N_STEPS / t_decode,
      "prefill_s": round(t_prefill, 3), "decode_s": round(t_decode, 3),
      "generate_s": round(t_gen, 3), "timed_path_same_tokens": same_tokens,
      "compile_s": round(compile_s, 2),
      "answers": texts, "keys": [ex[2] for ex in examples],
      **ratio_summary(err, radius, gen.ratio),
  }


def run_demo(params, config, tok, out: str, plan: Plan) -> list[dict]:
  """Runs every (regime, design, budget) of ``plan`` not yet in ``out/rows.jsonl``
  (regimes in :attr:`Plan.regimes` order); returns the rows of ``plan``'s regimes."""
  plan.check()
  results = results_io.JsonlResults(os.path.join(out, "rows.jsonl"),
                                    ("regime", "design", "budget", "context_len",
                                     "num_examples", "seed"))
  examples = make_examples(tok, plan.num_examples, plan.context_len, plan.seed)
  budgets = [float(b) for b in plan.budgets]
  rows = []
  compiled = {}  # one set of compiled programs per (design, regime, capacity)
  for regime in plan.regimes:
    units = [(d, b) for d in plan.design_names
             for b in (budgets if d != design_defaults.FULL else [1.0])]
    common = dict(regime=regime, context_len=plan.context_len,
                  num_examples=plan.num_examples, seed=plan.seed)
    todo = [u for u in units if not results.has(design=u[0], budget=u[1], **common)]
    progress = results_io.Progress(len(units), len(units) - len(todo))
    logging.info("%d runs to do, %d already in %s", len(todo), len(units) - len(todo),
                 results.path)
    for design_name, budget in todo:
      row = run_one(params, config, tok, examples, dataclasses.replace(plan, regime=regime),
                    design_name, budget, compiled)
      row.update(context_len=plan.context_len, seed=plan.seed)
      results.add(row)
      msg = (f"{progress.step()} {regime}/{design_name}@{budget}: acc {row['accuracy']:.2f} "
             f"err {row['mean_true_error']:.4f} cov {row['coverage']:.3f} "
             f"median R {_fmt(row['median_ratio'], '.2f')} "
             f"prefill {row['prefill_tokens_per_s']:.0f} tok/s decode "
             f"{row['decode_tokens_per_s']:.1f} tok/s")
      logging.info(msg)
      print(msg, flush=True)
    rows += [r for r in results.rows if all(r.get(k) == v for k, v in common.items())]
  return rows


def _fmt(x, spec):
  return "n/a" if x is None or (isinstance(x, float) and not np.isfinite(x)) else format(x, spec)


def render_summary(rows, delta: float) -> str:
  lines = [
      "# SmolLM2 pass-key demo: deterministic vs randomized eviction", "",
      f"| regime | design | budget | acc | mean ||e|| | cov@{delta} | sharp | median R "
      f"| cov R<=1 / R>1 | K/V (run / full) | metadata | kept K/V | prefill tok/s "
      "| decode tok/s |",
      "|" + "---|" * 14,
  ]
  for r in sorted(rows, key=lambda r: (r["regime"], r["budget"], r["randomized"],
                                       r["design"])):
    lines.append(
        f"| {r['regime']} | {r['design']} | {r['budget']} | {r['accuracy']:.2f} | "
        f"{_fmt(r['mean_true_error'], '.4f')} | {_fmt(r['coverage'], '.3f')} | "
        f"{_fmt(r['sharpness'], '.2f')} | {_fmt(r.get('median_ratio'), '.2f')} | "
        f"{_fmt(r.get('coverage_r_le_1'), '.3f')} / {_fmt(r.get('coverage_r_gt_1'), '.3f')} | "
        f"{memory.format_bytes(r['kv_bytes'])} / "
        f"{memory.format_bytes(r['full_kv_bytes'])} | "
        f"{memory.format_bytes(r['metadata_bytes'])} | "
        f"{memory.format_bytes(r['kept_kv_bytes'])} | "
        f"{r['prefill_tokens_per_s']:.0f} | {r['decode_tokens_per_s']:.1f} |")
  lines += ["", "acc: first five generated digits equal the pass key. ||e||: true attention "
            "error per (step, layer, head) decode call, from the shadow full cache. cov: "
            "fraction of calls with ||e|| <= Bernstein radius at delta; sharp: median "
            "radius/||e|| over covered calls with an error (deterministic designs: radius 0). "
            "R: Assumption-2 ratio m max_T a_i/(pi_i sum a) of each call over the full "
            "context (median over calls with a sampled tail; n/a for deterministic designs), "
            "and coverage split at R = 1. "
            "K/V run/full: bytes as allocated (capacity) vs a cache holding every token; "
            "kept K/V: bytes of the slots in use at the end. Tokens/s in evaluation mode "
            "(shadow cache on), compile excluded."]
  return "\n".join(lines) + "\n"


def run_and_report(plan: Plan, *, out: str) -> str:
  """The command: every (design, budget) of ``plan`` in its regimes on SmolLM2; writes
  ``out/rows.jsonl`` and ``out/summary.md``, prints the summary and the total time, and
  returns the summary."""
  plan.check()
  t0 = time.time()
  params, config, tok = gguf_loader.load_smollm2()
  logging.info("loaded SmolLM2 in %.1fs", time.time() - t0)
  rows = run_demo(params, config, tok, out, plan)
  summary = render_summary(rows, plan.delta)
  results_io.atomic_write_text(os.path.join(out, "summary.md"), summary)
  print(summary)
  print(f"total {time.time() - t0:.0f}s")
  return summary
