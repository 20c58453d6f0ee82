r"""Text in, answer and per-step certificate out: the newcomer's entry point.

:func:`generate_text` tokenizes a prompt (optionally inside the model's chat
template), runs greedy generation with an eviction design in one of the two
regimes of ``models.decode`` and returns the answer text with, for every
decode step, the certificate radius of every (layer, query head) attention
call (method, section 5)::

    r = sqrt(2 V_hat L) + (2/3) b_hat L,   L = log(2 / delta)

which bounds ``||o_hat - o||`` of that call (one head's attention output with
the evicted cache vs the full cache) with probability about ``1 - delta``,
approximately and only where Assumption 2 holds (method, sections 5-6). Where
the shipped calibration (``experiments/results/validity/calibration``,
:mod:`certkv_jax.calibration.robust`, method, section 10) was made for the
model, design, regime, budget and delta, the calibrated radius is returned
too; otherwise the reason it is not.

Regimes (method, sections 3 and 8):

* ``question_aware`` (``models.decode.generate``): the whole prompt is
  prefilled, the design evicts once down to ``budget`` (designs that score
  with an observation window, snapkv and poisson_envelope, take the prompt's
  last ``window`` queries: ``certkv_jax.designs.registry``), then the answer
  is decoded.
* ``streaming`` (``models.decode.generate_streaming``): the prompt is split
  into a context and a question. The context is fed in ``chunk``-token chunks,
  each evicted down to the budget before the question is known; then the
  question is prefilled and the answer decoded. The question is the prompt's
  last line (the text after its last line break) when the prompt has more
  than one line, else its last ``min(16, n - 1)`` tokens; ``question_tokens=N``
  makes it the last ``N`` tokens instead. With the chat template, the template's
  opening goes with the context and the end of the user turn and the
  assistant header with the question.

Decode steps: step ``i`` is the attention call that reads answer token ``i``;
its output chose token ``i + 1``. Token 0 is chosen from the prefill, which
reports no certificate. Generation runs a fixed ``max_new_tokens`` steps under
``jax.jit`` (a ``lax.scan``); the tokens are cut at the first end-of-turn / EOS
id (``answer_text.stop_ids``) and only the steps before it are returned (the last of
them chose the end-of-turn token).

Deterministic designs (and ``uniform_random``, which has no Hajek offset) have
``V_hat = b_hat = 0``: their radius is 0 by construction and is no certificate
(Theorem 1, method, section 2); ``"full"`` evicts nothing and has no error.

The caches hold what a run appends (``certkv_jax.designs.budgets.capacity``). What the
radii mean (summary, certificate status, calibration) is in
:mod:`models.text.certificate`; the command's input and printout
(``python -m experiments.generate``) in :mod:`models.text.report`.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from certkv_jax import certificate
from certkv_jax.designs import budgets
from certkv_jax.designs import registry
from models import decode
from models.text import answer_text
from models.text import certificate as generate_certificate
from models.text import hint as hint_lib
from models.text import prompt_encoding

FULL = "full"
REGIMES = ("question_aware", "streaming")
# The designs' settings by default: the validity study's, which the shipped
# calibration was fitted with (models.text.certificate).
N_SINK = generate_certificate.N_SINK
WINDOW = generate_certificate.WINDOW
CHUNK = generate_certificate.CHUNK
DEFAULT_CALIBRATION = generate_certificate.DEFAULT_CALIBRATION


def _setting(default, help_text: str, choices=None):
  """A field that is also a flag of ``experiments.generate`` (``experiments.lib.plan_flags``
  reads this metadata)."""
  return dataclasses.field(default=default, metadata={"help": help_text, "choices": choices})


def design_names() -> tuple:
  """Every design name :func:`generate_text` accepts: ``"full"`` and the names of
  ``certkv_jax.designs.registry``; each may carry settings and a per-head allocation
  (``"priority_focus:diffuse_weight=0.3+cert:min_share=0.95"``,
  ``certkv_jax.designs.registry.parse``)."""
  return (FULL,) + registry.names()


@dataclasses.dataclass(frozen=True)
class TextSettings:
  """How :func:`generate_text` generates. Each field with a ``help`` is a flag of
  ``python -m experiments.generate`` (``experiments.lib.plan_flags``); ``calibration``:
  the artifact's path (None looks nothing up); ``stops``: ids that end the answer (None:
  ``answer_text.stop_ids`` of the tokenizer)."""

  design: str = _setting(
      "poisson_tail", f"Eviction design: {', '.join(design_names())} ('full': none); a name "
      "may carry settings and a per-head allocation, "
      "design[:setting=value...][+allocation[:setting=value...]] "
      "(certkv_jax.designs.registry.parse), e.g. "
      "priority_focus:diffuse_weight=0.3:focus_share=0.95+cert:min_share=0.95.")
  budget: float = _setting(0.25, "Fraction in (0, 1] of the tokens seen that is kept.")
  max_new_tokens: int = _setting(64, "Decode steps; the answer stops at end-of-turn.")
  regime: str = _setting(
      "question_aware", "question_aware: prefill the prompt, evict once, decode. streaming: "
      "the prompt's last line (or --question_tokens) is the question, the rest the context, "
      "fed in --chunk-token chunks and evicted before the question.", choices=REGIMES)
  delta: float = _setting(0.05, "Certificate miss probability, in (0, 1).")
  seed: int = _setting(0, "Seed of the randomized designs.")
  evaluate: bool = _setting(False, "Evaluation mode: a shadow full cache gives the true "
                            "error of every call next to its radius.")
  chat: bool = _setting(False, "Wrap the prompt in the model's chat template (if it has "
                        "one; chat_applied says whether it did); --nochat feeds the text as "
                        "it is.")
  question_tokens: int = _setting(0, "Streaming: the question is the prompt's last this "
                                  "many tokens (0: its last line).")
  chunk: int = _setting(CHUNK, "Streaming: context tokens per chunk (capped at the "
                        "context length).")
  n_sink: int = _setting(N_SINK, "Sink tokens kept by every design.")
  window: int = _setting(WINDOW, "Recent / observation window of the designs.")
  calibration: Optional[str] = DEFAULT_CALIBRATION
  stops: Optional[tuple] = None

  def replace(self, **kw) -> "TextSettings":
    return dataclasses.replace(self, **kw)


class Answer(NamedTuple):
  """The answer (per-step fields cover the kept steps).

  Attributes:
    text: the decoded answer, up to (not including) the end-of-turn token, in
      whole characters (``answer_text.whole_text``).
    token_ids: [steps] int32 answer token ids before the end-of-turn token.
    pieces: per step, the text its token completes (``answer_text.text_pieces``).
    steps: answer tokens kept (= decode steps reported).
    stopped_at_eos: whether an end-of-turn / EOS id ended the answer.
    stop_id: that id, or None.
  """

  text: str
  token_ids: np.ndarray
  pieces: tuple
  steps: int
  stopped_at_eos: bool
  stop_id: Optional[int]


class Certificate(NamedTuple):
  """The certificate of every decode call, raw and calibrated.

  Attributes:
    radius: [steps, n_layers, n_heads] raw Bernstein radius at ``delta``
      (method, section 5) of every decode call; absolute, in the units of one
      head's attention output.
    radius_summary: its median and max over (layer, head) per step.
    certified: whether the radius is a certificate (a Poisson tail with Hajek
      offsets); False for ``"full"``, deterministic designs and ``uniform_random``.
    note: why, in words.
    sampled_tokens: mean over the (layer, KV head) caches of the kept tokens
      that were sampled (inclusion probability < 1) at the end; 0 means the
      design kept only its certainty set and the radius is 0 (then
      ``certified`` is False).
    calibrated_radius: [steps, n_layers, n_heads] calibrated radius (method,
      section 10), or None.
    calibrated_summary: its summary, or None.
    calibration_note: where the calibration came from, or why there is none.
    calibration_in_range: whether the prompt's length lies in the context range
      the calibration was fitted on (False: ``calibration_note`` is a warning);
      None without a calibrated radius.
    smoothed_radius: [steps, n_layers, n_heads] the raw radius with each head's
      ``V_hat`` replaced by the larger of itself and its mean over the head's
      last 6 decode steps (method, section 5, "Smoothed variance"; uncalibrated).
    out_norm: [steps, n_layers, n_heads] ``||o_hat||`` of every call (what a
      radius is read against: ``radius / out_norm`` is its relative size).
    hint: for a sampling design whose radius is 0 in more than 10% of the
      calls, the budget at which this prompt's caches keep a sampled token in
      90% of the heads (:mod:`models.text.hint`), in words; else None.
  """

  radius: np.ndarray
  radius_summary: generate_certificate.RadiusSummary
  certified: bool
  note: str
  sampled_tokens: float
  calibrated_radius: Optional[np.ndarray]
  calibrated_summary: Optional[generate_certificate.RadiusSummary]
  calibration_note: str
  calibration_in_range: Optional[bool]
  smoothed_radius: Optional[np.ndarray] = None
  hint: Optional[str] = None
  out_norm: Optional[np.ndarray] = None


class Evaluation(NamedTuple):
  """Evaluation mode's truth of every decode call, from the shadow full cache."""

  true_error: np.ndarray  # [steps, n_layers, n_heads] ||o_hat - o||
  rel_error: np.ndarray  # [steps, n_layers, n_heads] ||o_hat - o|| / ||o||


class PromptInfo(NamedTuple):
  """How the prompt was fed.

  Attributes:
    prompt_tokens: tokens fed before decoding (context + question).
    context_tokens, question_tokens: the streaming split (question-aware: the
      whole prompt is the context, ``question_tokens`` 0).
    question_text: the streaming question (decoded), or None.
    question_rule: how the streaming question was split off, or None.
    chat_applied: whether the chat template wrapped the prompt.
  """

  prompt_tokens: int
  context_tokens: int
  question_tokens: int
  question_text: Optional[str]
  question_rule: Optional[str]
  chat_applied: bool


class RunInfo(NamedTuple):
  """The run's settings and what it cost.

  Attributes:
    design, budget, regime, delta, seed: the settings (``budget`` 1.0 for "full").
    capacity: cache slots per (layer, KV head) (``certkv_jax.designs.budgets.capacity``).
    chunk: streaming context chunk, or None.
    n_dropped: tokens that found no cache slot (0 when capacity is right).
    generate_seconds: wall time of the generate call that produced the result.
    warmed_up: whether a warm-up call ran first (with ``profile_dir``), so that
      the time excludes compilation; otherwise it includes it unless this
      process compiled the same call before.
    profile_dir: where the trace was written, or None.
  """

  design: str
  budget: float
  regime: str
  delta: float
  seed: int
  capacity: int
  chunk: Optional[int]
  n_dropped: int
  generate_seconds: float
  warmed_up: bool
  profile_dir: Optional[str]


class TextResult(NamedTuple):
  """What :func:`generate_text` returns: the answer, the certificate of its decode
  steps, evaluation mode's truth (None otherwise), the prompt as fed and the run."""

  answer: Answer
  certificate: Certificate
  evaluation: Optional[Evaluation]
  prompt: PromptInfo
  run: RunInfo


# --------------------------------------------------------------------------- checks


def _is_int(x) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_number(x) -> bool:
  return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def check_arguments(prompt, settings: TextSettings):
  """Checks :func:`generate_text`'s prompt and settings before any model work.

  Returns:
    The design object (None for ``"full"``).

  Raises:
    ValueError naming the argument and its allowed values.
  """
  return _checked(prompt, settings)[0]


def _checked(prompt, settings: TextSettings):
  """:func:`check_arguments`, returning ``(design, allocation)`` (None for uniform
  budgets) of the design string."""
  s = settings
  if not isinstance(prompt, str) or not prompt.strip():
    raise ValueError(f"prompt must be a non-empty str, got {prompt!r}")
  if s.regime not in REGIMES:
    raise ValueError(f"regime must be one of {list(REGIMES)}, got {s.regime!r}")
  if not _is_number(s.budget) or not 0.0 < float(s.budget) <= 1.0:
    raise ValueError(f"budget must be a fraction in (0, 1] of the tokens seen, got "
                     f"{s.budget!r}")
  if not _is_int(s.max_new_tokens) or s.max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be an int >= 1, got {s.max_new_tokens!r}")
  if not _is_number(s.delta) or not 0.0 < float(s.delta) < 1.0:
    raise ValueError(f"delta (the certificate's miss probability) must be in (0, 1), got "
                     f"{s.delta!r}")
  if not _is_int(s.seed):
    raise ValueError(f"seed must be an int, got {s.seed!r}")
  for name, value, lo in (("question_tokens", s.question_tokens, 0), ("chunk", s.chunk, 1),
                          ("n_sink", s.n_sink, 0), ("window", s.window, 0)):
    if not _is_int(value) or value < lo:
      raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")
  if s.design == FULL:
    return None, None
  if not isinstance(s.design, str):
    raise ValueError(f"design must be one of {list(design_names())}, got {s.design!r}")
  return registry.make_with_allocation(s.design, float(s.budget), n_sink=int(s.n_sink),
                                       window=int(s.window))


def _row(ids) -> tuple[jax.Array, jax.Array]:
  tokens = jnp.asarray([ids], jnp.int32)
  return tokens, jnp.ones(tokens.shape, bool)


# --------------------------------------------------------------------------- generation


def _timed_call(run, profile_dir: Optional[str], on_token):
  """``(Generation, seconds)`` of ``run()``; with ``profile_dir`` a warm-up call first
  (``on_token`` muted), then the timed call inside a profiler trace."""
  if not profile_dir:
    t0 = time.perf_counter()
    gen = jax.block_until_ready(run())
    return gen, time.perf_counter() - t0
  muted = getattr(on_token, "enabled", False)
  if muted:
    on_token.enabled = False  # the warm-up call shows nothing
  jax.block_until_ready(run())  # compile (and run) once outside the trace
  if muted:
    on_token.enabled = True
  os.makedirs(profile_dir, exist_ok=True)
  with jax.profiler.trace(profile_dir):
    t0 = time.perf_counter()
    gen = jax.block_until_ready(run())
    return gen, time.perf_counter() - t0


def generate_text(prompt: str, *, params, config, tokenizer,
                  settings: TextSettings = TextSettings(), model_name: Optional[str] = None,
                  profile_dir: Optional[str] = None, on_token=None) -> TextResult:
  """Greedy generation from text with an eviction design and its certificate.

  Args:
    prompt: the user's text (non-empty).
    params, config, tokenizer: the model (e.g. ``experiments.lib.model_loading.load_model``).
    settings: how to generate (:class:`TextSettings`: design, budget, regime, ...).
    model_name: the model's name for the calibration lookup ('smollm2', see
      ``experiments.lib.model_loading.model_name``); None looks nothing up.
    profile_dir: if given, a first generate call compiles (warm-up) and a
      second one runs inside ``jax.profiler.trace(profile_dir)``.
    on_token: optional host function ``on_token(step, tokens)`` called as each
      decode step's token is chosen (``GenerationConfig.on_token``), e.g. an
      ``answer_text.TokenStream``.

  Returns:
    A :class:`TextResult`.

  Raises:
    ValueError naming the argument and its allowed values.
  """
  s = settings
  design_obj, allocation = _checked(prompt, s)
  design = s.design
  budget = 1.0 if design_obj is None else float(s.budget)
  delta = float(s.delta)
  max_new_tokens, regime = s.max_new_tokens, s.regime
  key = jax.random.PRNGKey(int(s.seed))
  encoded = prompt_encoding.encode_prompt(tokenizer, prompt, regime=regime, chat=s.chat,
                                          question_tokens=s.question_tokens)
  prompt_encoding.check_fits(encoded, max_new_tokens=max_new_tokens,
                             max_positions=getattr(config, "max_positions", None))
  n_context, n_question = len(encoded.context), len(encoded.question)
  gen_cfg = decode.GenerationConfig(n_steps=max_new_tokens, design=design_obj,
                                    allocation=allocation, evaluate=s.evaluate,
                                    on_token=on_token)
  per_head = dict(allocation=allocation, config=config)  # capacity of the largest head
  if regime == "question_aware":
    run_chunk = None
    capacity = budgets.capacity(
        design_obj, budgets.Lengths(n_context=n_context, n_steps=max_new_tokens), **per_head)
    tokens, mask = _row(encoded.context)
    gen_cfg = gen_cfg.replace(capacity=capacity)
    run = lambda: decode.generate(params, tokens, mask, key, config=config, gen=gen_cfg)
  else:
    run_chunk = min(s.chunk, n_context)
    capacity = budgets.capacity(
        design_obj, budgets.Lengths(n_context=n_context, n_question=n_question,
                                    n_steps=max_new_tokens, chunk=run_chunk), **per_head)
    ctx, ctx_mask = _row(encoded.context)
    qst, q_mask = _row(encoded.question)
    gen_cfg = gen_cfg.replace(capacity=capacity, chunk=run_chunk)
    run = lambda: decode.generate_streaming(params, (ctx, ctx_mask), (qst, q_mask), key,
                                            config=config, gen=gen_cfg)
  gen, seconds = _timed_call(run, profile_dir, on_token)

  all_tokens = np.asarray(gen.tokens[0])
  kept, stopped, stop_id = answer_text.truncate_at_stop(
      all_tokens, answer_text.stop_ids(tokenizer) if s.stops is None else s.stops)
  steps = int(kept.size)
  take = lambda a: np.asarray(a, np.float64)[:steps, :, 0, :]  # [steps, layers, heads]
  radius = take(certificate.radius_from_stats(gen.var_hat, gen.range_hat, delta))
  smoothed = take(certificate.smoothed_radius(gen.var_hat, gen.range_hat, delta))
  certified, cert_note = generate_certificate.certificate_status(design, design_obj)
  sampled = float(np.mean(np.sum(np.asarray(gen.caches.valid)
                                 & (np.asarray(gen.caches.log_pi) < 0), axis=-1)))
  suggestion = None
  zero_share = float(np.mean(radius == 0)) if radius.size else 1.0
  if certified and (sampled == 0 or zero_share > 1.0 - hint_lib.TARGET + 1e-9):
    where = "prompt" if regime == "question_aware" else "prompt's context"
    suggestion = hint_lib.describe(hint_lib.certifying_budget(
        params, config, encoded.context, design_obj, key, start=budget,
        allocation=allocation), where)
  if certified and sampled == 0:
    certified = False
    cert_note = generate_certificate.no_sample_note(design_obj, budget, n_context, regime,
                                                    suggestion)
  elif certified and steps and not np.nanmax(radius) > 0:
    certified = False
    cert_note = (f"design {design!r} kept sampled tokens, but every radius is 0 (no sampled "
                 "token carried attention weight in any call): this is NOT a certificate")
  cal_radius, cal_note = None, "the design's radius is not a certificate, so nothing to calibrate"
  cal_in_range = None
  if certified:
    run_key = generate_certificate.Run(model_name=model_name, design_name=design,
                                       regime=regime, budget=budget, delta=delta,
                                       n_sink=s.n_sink, window=s.window, chunk=s.chunk,
                                       dtype=config.dtype)
    cal_radius, cal_note, cal_in_range = generate_certificate.calibrated(
        radius, run_key, calibration=s.calibration, context_tokens=encoded.n_tokens)
  return TextResult(
      answer=Answer(text=answer_text.whole_text(tokenizer, kept),
                    token_ids=kept.astype(np.int32),
                    pieces=answer_text.text_pieces(tokenizer, kept), steps=steps,
                    stopped_at_eos=stopped, stop_id=stop_id),
      certificate=Certificate(
          radius=radius, radius_summary=generate_certificate.summarize(radius),
          certified=certified, note=cert_note, sampled_tokens=sampled,
          calibrated_radius=cal_radius,
          calibrated_summary=(None if cal_radius is None
                              else generate_certificate.summarize(cal_radius)),
          calibration_note=cal_note, calibration_in_range=cal_in_range,
          smoothed_radius=smoothed, hint=suggestion,
          out_norm=None if gen.out_norm is None else take(gen.out_norm)),
      evaluation=(Evaluation(true_error=take(gen.true_error), rel_error=take(gen.rel_error))
                  if s.evaluate else None),
      prompt=PromptInfo(prompt_tokens=n_context + n_question, context_tokens=n_context,
                        question_tokens=n_question, question_text=encoded.question_text,
                        question_rule=encoded.question_rule,
                        chat_applied=encoded.chat_applied),
      run=RunInfo(design=design, budget=budget, regime=regime, delta=delta, seed=int(s.seed),
                  capacity=capacity, chunk=run_chunk,
                  n_dropped=int(np.sum(np.asarray(gen.caches.n_dropped))),
                  generate_seconds=seconds, warmed_up=bool(profile_dir),
                  profile_dir=profile_dir or None))
