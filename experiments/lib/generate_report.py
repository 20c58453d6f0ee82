r"""What the generate command reads and prints, and the command itself.

:func:`read_prompt` takes the command's prompt from ``--prompt`` or
``--prompt_file``; :func:`format_result` turns a
:class:`experiments.lib.generate.TextResult` into the settings, the answer and
one row per decode step (radius, calibrated radius, true error);
:func:`run_and_print` (``python -m experiments.generate``) loads the model,
runs :func:`experiments.lib.generate.generate_text` and prints the result.
"""

from __future__ import annotations

import time
from typing import Optional

import numpy as np

from experiments.lib import answer_text
from experiments.lib import generate
from experiments.lib import prompt_encoding


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
  chat = "chat template applied" if r.chat_applied else "plain text (no chat template)"
  if r.regime == "streaming":
    return (f"prompt: {r.context_tokens} context tokens in chunks of {r.chunk}, then the "
            f"question ({r.question_rule}; {r.question_tokens} tokens"
            f"{' with the end of the turn' if r.chat_applied else ''}): "
            f"{r.question_text!r}; {chat}; cache capacity {r.capacity} slots")
  return f"prompt: {r.prompt_tokens} tokens; {chat}; cache capacity {r.capacity} slots"


def format_result(result: generate.TextResult, tokenizer, *, model_label: str = "",
                  streamed: bool = False) -> str:
  """The command's printout: settings, the answer, then one line per decode step.

  ``streamed``: the model line and the answer were already printed as they
  came (:class:`experiments.lib.answer_text.TokenStream`), so they are left out.
  """
  r = result
  lines = []
  if not streamed:
    head = f"model {model_label}; " if model_label else ""
    lines.append(head + settings_line(design=r.design, budget=r.budget, regime=r.regime,
                                      delta=r.delta, seed=r.seed))
  lines.append(_prompt_line(r))
  if r.stopped_at_eos:
    end = (f"stopped at the end-of-turn token {tokenizer.decode([r.stop_id])!r} "
           f"(id {r.stop_id})")
  else:
    end = "no end-of-turn token within max_new_tokens: the answer may be cut short"
  what = ("after a warm-up call, traced" if r.warmed_up
          else "first call: includes compilation unless compiled before")
  lines.append(f"answer: {r.steps} tokens, {end}; generate call {r.generate_seconds:.2f} s "
               f"({what})")
  if r.n_dropped:
    lines.append(f"WARNING: {r.n_dropped} tokens found no cache slot")
  if not streamed:
    lines += ["", r.text, ""]
  lines.append(f"certificate: {r.certificate_note}.")
  if r.certified:
    if r.calibration_in_range is False:
      note = r.calibration_note.removeprefix("WARNING: ")
      lines.append(f"WARNING: calibrated radius shown outside its fitted context range: {note}.")
    else:
      status = "" if r.calibrated_radius is not None else "not available: "
      lines.append(f"calibrated radius: {status}{r.calibration_note}.")
    zero = float(np.mean(r.radius == 0)) if r.radius.size else 0.0
    if zero > 0:
      lines.append(f"radius 0 in {zero:.0%} of the calls: those heads' caches hold no sampled "
                   "token, so those calls have NO certificate (a 0 there is not 'no error').")
  n_layers, n_heads = r.radius.shape[1:] if r.radius.ndim == 3 else (0, 0)
  if r.steps == 0:
    lines.append("no decode steps to report (the first answer token ended the turn).")
    return "\n".join(lines) + "\n"
  if not r.certified and r.true_error is None:
    return "\n".join(lines) + "\n"  # no numbers per step to show
  cols = ["step", "token"]
  if r.certified:
    cols += ["median r", "max r"]
    if r.calibrated_radius is not None:
      cols += ["median r_cal", "max r_cal"]
  if r.true_error is not None:
    cols += ["median ||e||", "max ||e||"]
    if r.certified:
      cols += ["covered", "median r/||o||"]
  lines += ["", f"per decode step, over {n_layers} layers x {n_heads} heads "
            f"({n_layers * n_heads} attention calls); step i reads answer token i and chooses "
            "token i + 1:", "| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
  for i in range(r.steps):
    row = [str(i), _cell(r.pieces[i]) if r.pieces[i] else "(part of the next)"]
    if r.certified:
      row += [_g(r.radius_summary.median[i]), _g(r.radius_summary.max[i])]
      if r.calibrated_radius is not None:
        row += [_g(r.calibrated_summary.median[i]), _g(r.calibrated_summary.max[i])]
    if r.true_error is not None:
      err = r.true_error[i]
      row += [_g(np.median(err)), _g(np.max(err))]
      if r.certified:
        out_norm = np.where(r.rel_error[i] > 0, err / np.maximum(r.rel_error[i], 1e-30), np.nan)
        rel = r.radius[i] / out_norm
        row += [f"{np.mean(err <= r.radius[i]):.2f}",
                _g(np.nanmedian(rel)) if np.isfinite(rel).any() else "n/a"]
    lines.append("| " + " | ".join(row) + " |")
  if r.certified:
    overall = (f"over all {r.steps} steps: median r {_g(np.median(r.radius))}, max r "
               f"{_g(np.max(r.radius))}")
    if r.calibrated_radius is not None:
      overall += (f"; median r_cal {_g(np.median(r.calibrated_radius))}, max r_cal "
                  f"{_g(np.max(r.calibrated_radius))}")
    if r.true_error is not None:
      overall += (f"; covered {np.mean(r.true_error <= r.radius):.3f} of the calls at delta "
                  f"{r.delta:g}")
    lines += ["", overall + "."]
  elif r.true_error is not None:
    lines += ["", f"over all {r.steps} steps: median ||e|| {_g(np.median(r.true_error))}, max "
              f"||e|| {_g(np.max(r.true_error))}."]
  if r.certified:
    lines += ["", "r: the Bernstein radius sqrt(2 V_hat L) + (2/3) b_hat L, L = log(2/delta) "
              "(method, section 5), of one head's attention output: with probability about "
              "1 - delta, ||o_hat - o|| <= r for that call. It is absolute (units of the value "
              "vectors); the decode loop does not return ||o_hat||, so compare r with the size "
              "of the head's output (--evaluate prints r/||o||, from the shadow full cache)."]
  if r.true_error is not None:
    lines.append("||e||: the true error ||o_hat - o|| of each call (evaluation mode, from a "
                 "shadow full cache)" + ("; covered: the fraction of the step's calls with "
                                         "||e|| <= r; r/||o||: the radius relative to the "
                                         "full-cache output" if r.certified else "") + ".")
  return "\n".join(lines) + "\n"


def run_and_print(*, prompt: str, model: str, design: str, budget: float,
                  max_new_tokens: int, regime: str, delta: float, seed: int, chat: bool,
                  evaluate: bool, question_tokens: int = 0, chunk: int = generate.CHUNK,
                  n_sink: int = generate.N_SINK, window: int = generate.WINDOW,
                  profile_dir: Optional[str] = None) -> generate.TextResult:
  """The command: opens ``model`` (tokenizer and config), checks the prompt
  against them, reads the weights, streams the answer as it is decoded
  (:class:`experiments.lib.answer_text.TokenStream`), then prints the rest of
  :func:`format_result`.

  Raises:
    ValueError naming the argument when the prompt does not fit the model,
    before the weights are read.
  """
  from experiments.lib import model_loading  # pylint: disable=g-import-not-at-top
  say = lambda text="": print(text, flush=True)
  t0 = time.perf_counter()
  say(f"loading {model_loading.model_name(model)} ...")
  source = model_loading.ModelSource(model)
  encoded = prompt_encoding.encode_prompt(source.tokenizer, prompt, regime=regime, chat=chat,
                                   question_tokens=question_tokens)
  prompt_encoding.check_fits(encoded, max_new_tokens=max_new_tokens,
                      max_positions=source.config.max_positions)
  params = source.load_params()
  config, tok = source.config, source.tokenizer
  say(f"model {source.name} ({config.n_layers} layers, {config.n_heads} heads, "
      f"{config.n_kv_heads} KV heads, context {config.max_positions or 'unlimited'}; loaded in "
      f"{time.perf_counter() - t0:.1f} s)")
  say(settings_line(design=design, budget=budget, regime=regime, delta=delta, seed=seed))
  say(f"answer ({encoded.n_tokens} prompt tokens; printed as it is decoded; the first call "
      "compiles the model first):")
  say()
  stream = answer_text.TokenStream(tok, answer_text.stop_ids(tok))
  result = generate.generate_text(
      prompt, params=params, config=config, tokenizer=tok, design=design, budget=budget,
      max_new_tokens=max_new_tokens, regime=regime, delta=delta, seed=seed,
      evaluate=evaluate, chat=chat, question_tokens=question_tokens, chunk=chunk,
      n_sink=n_sink, window=window, model_name=source.name, profile_dir=profile_dir,
      on_token=stream)
  say()
  say()
  print(format_result(result, tok, streamed=True), end="", flush=True)
  if profile_dir:
    print(f"\nprofile of one generate call (after a warm-up call) in {profile_dir}: "
          f"tensorboard --logdir={profile_dir} (Profile tab; needs the xprof / "
          "tensorboard-plugin-profile package), or open its plugins/profile/*/*.trace.json.gz "
          "in https://ui.perfetto.dev", flush=True)
  return result
