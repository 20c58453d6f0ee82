r"""What the generate command reads and prints, and the command itself.

:func:`read_prompt` takes the command's prompt from ``--prompt`` or
``--prompt_file``; :func:`format_result` turns a
:class:`models.text.generate.TextResult` into the settings, the answer and
one row per decode step (radius, calibrated radius, true error);
:func:`run_and_print` (``python -m experiments.generate``) opens the model,
runs :func:`models.text.generate.generate_text` and prints the result.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import numpy as np

from models.text import answer_text
from models.text import generate
from models.text import prompt_encoding


def read_prompt(prompt: Optional[str], prompt_file: Optional[str]) -> str:
  """The prompt of the command: exactly one of ``--prompt`` and ``--prompt_file``.

  Raises:
    ValueError naming both flags when neither or both are given, or naming
    the flag whose text is empty or cannot be read.
  """
  given = [name for name, v in (("--prompt", prompt), ("--prompt_file", prompt_file))
           if v is not None]
  if len(given) != 1:
    raise ValueError(f"give exactly one of --prompt and --prompt_file, got "
                     f"{' and '.join(given) if given else 'neither'}")
  if prompt is not None:
    text = prompt
  else:
    try:
      with open(prompt_file, encoding="utf-8") as f:
        text = f.read()
    except OSError as err:
      raise ValueError(f"--prompt_file={prompt_file}: cannot read it ({err.strerror})") from err
    except UnicodeDecodeError as err:
      raise ValueError(f"--prompt_file={prompt_file}: not UTF-8 text ({err.reason} at byte "
                       f"{err.start})") from err
  if not text.strip():
    raise ValueError(f"{given[0]} is empty: give the text to answer or continue")
  return text


def _cell(text: str) -> str:
  """A markdown table cell showing ``text`` readably (quotes, escapes, no bars)."""
  shown = repr(text)[1:-1]
  return '"' + shown.replace("|", "\\|") + '"'


def _g(x) -> str:
  return "nan" if not np.isfinite(x) else f"{x:.3g}"


def settings_line(*, design: str, budget: float, regime: str, delta: float, seed: int) -> str:
  """The run's settings in one line."""
  at = "" if design == generate.FULL else f" at budget {budget:g}"
  return f"design {design}{at}; regime {regime}; delta {delta:g}; seed {seed}"


def _prompt_line(r: generate.TextResult) -> str:
  p, run = r.prompt, r.run
  chat = "chat template applied" if p.chat_applied else "plain text (no chat template)"
  if run.regime == "streaming":
    return (f"prompt: {p.context_tokens} context tokens in chunks of {run.chunk}, then the "
            f"question ({p.question_rule}; {p.question_tokens} tokens"
            f"{' with the end of the turn' if p.chat_applied else ''}): "
            f"{p.question_text!r}; {chat}; cache capacity {run.capacity} slots")
  return f"prompt: {p.prompt_tokens} tokens; {chat}; cache capacity {run.capacity} slots"


def format_result(result: generate.TextResult, tokenizer, *, model_label: str = "",
                  streamed: bool = False) -> str:
  """The command's printout: settings, the answer, then one line per decode step.

  ``streamed``: the model line and the answer were already printed as they
  came (:class:`models.text.answer_text.TokenStream`), so they are left out.
  """
  a, c, ev, run = result.answer, result.certificate, result.evaluation, result.run
  lines = []
  if not streamed:
    head = f"model {model_label}; " if model_label else ""
    lines.append(head + settings_line(design=run.design, budget=run.budget, regime=run.regime,
                                      delta=run.delta, seed=run.seed))
  lines.append(_prompt_line(result))
  if a.stopped_at_eos:
    end = (f"stopped at the end-of-turn token {tokenizer.decode([a.stop_id])!r} "
           f"(id {a.stop_id})")
  else:
    end = "no end-of-turn token within max_new_tokens: the answer may be cut short"
  what = ("after a warm-up call, traced" if run.warmed_up
          else "first call: includes compilation unless compiled before")
  lines.append(f"answer: {a.steps} tokens, {end}; generate call {run.generate_seconds:.2f} s "
               f"({what})")
  if run.n_dropped:
    lines.append(f"WARNING: {run.n_dropped} tokens found no cache slot")
  if not streamed:
    lines += ["", a.text, ""]
  lines.append(f"certificate: {c.note}.")
  if c.certified:
    if c.calibration_in_range is False:
      note = c.calibration_note.removeprefix("WARNING: ")
      lines.append(f"WARNING: calibrated radius shown outside its fitted context range: {note}.")
    else:
      status = "" if c.calibrated_radius is not None else "not available: "
      lines.append(f"calibrated radius: {status}{c.calibration_note}.")
    zero = float(np.mean(c.radius == 0)) if c.radius.size else 0.0
    if zero > 0:
      lines.append(f"radius 0 in {zero:.0%} of the calls: those heads' caches hold no sampled "
                   "token, so those calls have NO certificate (a 0 there is not 'no error').")
    if c.hint:
      lines.append(f"for a certificate in most calls: {c.hint}.")
  n_layers, n_heads = c.radius.shape[1:] if c.radius.ndim == 3 else (0, 0)
  if a.steps == 0:
    lines.append("no decode steps to report (the first answer token ended the turn).")
    return "\n".join(lines) + "\n"
  if not c.certified and ev is None:
    return "\n".join(lines) + "\n"  # no numbers per step to show
  cols = ["step", "token"]
  r_rel = None
  if c.certified and c.out_norm is not None:  # each radius against its call's ||o_hat||
    norm = np.where(np.isfinite(c.out_norm) & (c.out_norm > 0), c.out_norm, np.nan)
    r_rel = c.radius / norm
  if c.certified:
    cols += ["median r", "max r"] + (["median r/||o_hat||"] if r_rel is not None else [])
    if c.calibrated_radius is not None:
      cols += ["median r_cal", "max r_cal"]
  if ev is not None:
    cols += ["median ||e||", "max ||e||"]
    if c.certified:
      cols += ["covered", "median r/||o||"]
  lines += ["", f"per decode step, over {n_layers} layers x {n_heads} heads "
            f"({n_layers * n_heads} attention calls); step i reads answer token i and chooses "
            "token i + 1:", "| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
  for i in range(a.steps):
    row = [str(i), _cell(a.pieces[i]) if a.pieces[i] else "(part of the next)"]
    if c.certified:
      row += [_g(c.radius_summary.median[i]), _g(c.radius_summary.max[i])]
      if r_rel is not None:
        row.append(_g(np.nanmedian(r_rel[i])) if np.isfinite(r_rel[i]).any() else "n/a")
      if c.calibrated_radius is not None:
        row += [_g(c.calibrated_summary.median[i]), _g(c.calibrated_summary.max[i])]
    if ev is not None:
      err = ev.true_error[i]
      row += [_g(np.median(err)), _g(np.max(err))]
      if c.certified:
        out_norm = np.where(ev.rel_error[i] > 0, err / np.maximum(ev.rel_error[i], 1e-30),
                            np.nan)
        rel = c.radius[i] / out_norm
        row += [f"{np.mean(err <= c.radius[i]):.2f}",
                _g(np.nanmedian(rel)) if np.isfinite(rel).any() else "n/a"]
    lines.append("| " + " | ".join(row) + " |")
  if c.certified:
    overall = (f"over all {a.steps} steps: median r {_g(np.median(c.radius))}, max r "
               f"{_g(np.max(c.radius))}")
    if r_rel is not None and np.isfinite(r_rel).any():
      overall += (f" (relative to the call's ||o_hat||: median {_g(np.nanmedian(r_rel))}, "
                  f"90th percentile {_g(np.nanpercentile(r_rel, 90))})")
    if c.calibrated_radius is not None:
      overall += (f"; median r_cal {_g(np.median(c.calibrated_radius))}, max r_cal "
                  f"{_g(np.max(c.calibrated_radius))}")
    if ev is not None:
      overall += (f"; covered {np.mean(ev.true_error <= c.radius):.3f} of the calls at delta "
                  f"{run.delta:g}")
    if c.smoothed_radius is not None:
      overall += ("; smoothed radius (method, section 5): median "
                  f"{_g(np.median(c.smoothed_radius))}")
      if ev is not None:
        overall += f", covered {np.mean(ev.true_error <= c.smoothed_radius):.3f}"
    lines += ["", overall + "."]
  elif ev is not None:
    lines += ["", f"over all {a.steps} steps: median ||e|| {_g(np.median(ev.true_error))}, max "
              f"||e|| {_g(np.max(ev.true_error))}."]
  if c.certified:
    lines += ["", "r: the Bernstein radius sqrt(2 V_hat L) + (2/3) b_hat L, L = log(2/delta) "
              "(method, section 5), of one head's attention output: with probability about "
              "1 - delta, ||o_hat - o|| <= r for that call. It is absolute (units of the value "
              "vectors); r/||o_hat|| reads it against the size of that call's output."]
  if ev is not None:
    lines.append("||e||: the true error ||o_hat - o|| of each call (evaluation mode, from a "
                 "shadow full cache)" + ("; covered: the fraction of the step's calls with "
                                         "||e|| <= r; r/||o||: the radius relative to the "
                                         "full-cache output" if c.certified else "") + ".")
  return "\n".join(lines) + "\n"


def run_and_print(prompt: str, settings: generate.TextSettings, open_model: Callable, *,
                  name: str, profile_dir: Optional[str] = None) -> generate.TextResult:
  """The command: opens the model (``open_model()``: the model with its tokenizer and
  config read, its weights not yet, e.g. ``experiments.lib.model_loading.ModelSource``:
  ``.tokenizer``, ``.config``, ``.name``, ``.load_params()``; ``name`` is shown while it
  opens), checks the prompt against them, reads the weights, streams the answer as it is
  decoded (:class:`models.text.answer_text.TokenStream`), then prints the rest of
  :func:`format_result`.

  Raises:
    ValueError naming the argument when the prompt does not fit the model,
    before the weights are read.
  """
  s = settings
  say = lambda text="": print(text, flush=True)
  t0 = time.perf_counter()
  say(f"loading {name} ...")
  source = open_model()
  encoded = prompt_encoding.encode_prompt(source.tokenizer, prompt, regime=s.regime,
                                          chat=s.chat, question_tokens=s.question_tokens)
  prompt_encoding.check_fits(encoded, max_new_tokens=s.max_new_tokens,
                             max_positions=source.config.max_positions)
  params = source.load_params()
  config, tok = source.config, source.tokenizer
  say(f"model {source.name} ({config.n_layers} layers, {config.n_heads} heads, "
      f"{config.n_kv_heads} KV heads, context {config.max_positions or 'unlimited'}, "
      f"{config.dtype} weights and caches; loaded in "
      f"{time.perf_counter() - t0:.1f} s)")
  say(settings_line(design=s.design, budget=s.budget, regime=s.regime, delta=s.delta,
                    seed=s.seed))
  say(f"answer ({encoded.n_tokens} prompt tokens; printed as it is decoded; the first call "
      "compiles the model first):")
  say()
  stream = answer_text.TokenStream(tok, answer_text.stop_ids(tok))
  result = generate.generate_text(prompt, params=params, config=config, tokenizer=tok,
                                  settings=s, model_name=source.name,
                                  profile_dir=profile_dir, on_token=stream)
  say()
  say()
  print(format_result(result, tok, streamed=True), end="", flush=True)
  if profile_dir:
    print(f"\nprofile of one generate call (after a warm-up call) in {profile_dir}: "
          f"tensorboard --logdir={profile_dir} (Profile tab; needs the xprof / "
          "tensorboard-plugin-profile package), or open its plugins/profile/*/*.trace.json.gz "
          "in https://ui.perfetto.dev", flush=True)
  return result
