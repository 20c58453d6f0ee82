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

from experiments.lib import generate


def read_prompt(prompt: Optional[str], prompt_file: Optional[str]) -> str:
  """The prompt of the command: exactly one of ``--prompt`` and ``--prompt_file``.

  Raises:
    ValueError naming both flags when neither or both are given, or naming
    ``--prompt_file`` when it cannot be read.
  """
  given = [name for name, v in (("--prompt", prompt), ("--prompt_file", prompt_file)) if v]
  if len(given) != 1:
    raise ValueError(f"give exactly one of --prompt and --prompt_file, got "
                     f"{' and '.join(given) if given else 'neither'}")
  if prompt:
    return prompt
  try:
    with open(prompt_file, encoding="utf-8") as f:
      return f.read()
  except OSError as err:
    raise ValueError(f"--prompt_file={prompt_file}: cannot read it ({err.strerror})") from err


def _g(x) -> str:
  return "nan" if not np.isfinite(x) else f"{x:.3g}"


def format_result(result: generate.TextResult, tokenizer, *, model_label: str = "") -> str:
  """The command's printout: settings, the answer, then one line per decode step."""
  r = result
  lines = []
  head = f"model {model_label}; " if model_label else ""
  budget = "" if r.design == generate.FULL else f" at budget {r.budget:g}"
  lines.append(f"{head}design {r.design}{budget}; regime {r.regime}; delta {r.delta:g}; "
               f"seed {r.seed}")
  chat = "chat template applied" if r.chat_applied else "plain text (no chat template)"
  if r.regime == "streaming":
    lines.append(f"prompt: {r.context_tokens} context tokens in chunks of {r.chunk}, then "
                 f"the question ({r.question_rule}; {r.question_tokens} tokens"
                 f"{' with the end of the turn' if r.chat_applied else ''}): "
                 f"{r.question_text!r}; {chat}; cache capacity {r.capacity} slots")
  else:
    lines.append(f"prompt: {r.prompt_tokens} tokens; {chat}; cache capacity {r.capacity} slots")
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
  lines += ["", r.text, ""]
  lines.append(f"certificate: {r.certificate_note}.")
  if r.certified:
    status = "" if r.calibrated_radius is not None else "not available: "
    lines.append(f"calibrated radius: {status}{r.calibration_note}.")
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
    row = [str(i), repr(tokenizer.decode([int(r.token_ids[i])]))]
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
  """The command: loads ``model`` (``experiments.lib.model_loading``), runs
  :func:`experiments.lib.generate.generate_text` and prints :func:`format_result`."""
  from experiments.lib import model_loading  # pylint: disable=g-import-not-at-top
  t0 = time.perf_counter()
  params, config, tok = model_loading.load_model(model)
  load_s = time.perf_counter() - t0
  result = generate.generate_text(
      prompt, params=params, config=config, tokenizer=tok, design=design, budget=budget,
      max_new_tokens=max_new_tokens, regime=regime, delta=delta, seed=seed,
      evaluate=evaluate, chat=chat, question_tokens=question_tokens, chunk=chunk,
      n_sink=n_sink, window=window, model_name=model_loading.model_name(model),
      profile_dir=profile_dir)
  label = (f"{model_loading.model_name(model)} ({config.n_layers} layers, {config.n_heads} "
           f"heads, {config.n_kv_heads} KV heads; loaded in {load_s:.1f} s)")
  print(format_result(result, tok, model_label=label), end="", flush=True)
  if profile_dir:
    print(f"\nprofile of one generate call (after a warm-up call) in {profile_dir}: "
          f"tensorboard --logdir={profile_dir} (Profile tab; needs the xprof / "
          "tensorboard-plugin-profile package), or open its plugins/profile/*/*.trace.json.gz "
          "in https://ui.perfetto.dev", flush=True)
  return result
