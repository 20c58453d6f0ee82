"""Analysis of the damage study: per-token tables, the learned predictor, and the scores.

From the unit files of :mod:`experiments.lib.damage.collect`:

* :func:`token_table` flattens the text units into one row per scored token
  after the first eviction (earlier tokens see the whole context: no damage,
  no radius) and the task units into one row per decode step whose prefix is
  still the full run's (``same_prefix``: only there is the KL of the two
  next-token distributions defined);
* :func:`features` gives the learned predictor's inputs: the log of each
  layer's projected radius ``D_l`` (method, section 11) and the log of the
  layer-mean warning signals;
* :func:`fit_predictor` fits it on the training text segments only; the
  held-out segments and every task are its test;
* :func:`example_scores` aggregates per-step scores to one per example (the
  mean over decode steps, fixed in advance) for attribution and gating.
"""

from __future__ import annotations

import glob
import os
from typing import Optional

import numpy as np

from certkv_jax.calibration import damage_predictor
from experiments.lib.damage import collect as collect_lib

# Warning signals used as features: every signal of certkv_jax.certificate.signals except
# range_ratio = b_hat / sqrt(V_hat), which is infinite where V_hat = 0.
FEATURE_SIGNALS = ("tail_mass", "r_hat", "entropy", "ess", "max_tail_weight")
LOG_FLOOR = 1e-6  # added before every log (KL, radii, signals): their scale is >= 1e-4
SCORES = ("learned", "damage_bound", "damage_rms", "radius")  # certificate-based
BASELINES = ("confidence",)  # per-token online baselines (the evicted model's entropy)


def load_units(out: str) -> tuple[dict, dict]:
  """``({unit: arrays}, norms)`` of a damage run directory."""
  units = {}
  for p in sorted(glob.glob(os.path.join(out, "units", "*.npz"))):
    arrays, meta = collect_lib.load_npz(p)
    units[meta["unit"]] = arrays
  if not units:
    raise ValueError(f"no unit files under {out}/units: run the collection first")
  norms, _ = collect_lib.load_npz(os.path.join(out, "norms.npz"))
  return units, norms


def _per_step_scores(radius: np.ndarray, norms: dict) -> dict:
  """radius [..., L, H] -> per-layer projected radius and the three analytic scores."""
  d_l = np.sum(radius * norms["spectral"], axis=-1)
  return {"d_layer": d_l, "damage_bound": d_l.sum(-1),
          "damage_rms": np.sum(radius * norms["rms"], axis=(-2, -1)),
          "radius": radius.sum(axis=(-2, -1))}


def token_table(units: dict, norms: dict, chunk: int) -> dict:
  """One row per token (text) or decode step (tasks); see the module docstring.

  Columns: ``source`` ("text" / "task"), ``group`` (segment or setting),
  ``example`` (a cluster id unique across sources), ``split`` ("train" for
  text segments < ``train_segments``, else "test"), ``kl``, ``dnll`` (text
  only, NaN for tasks), ``confidence``, the analytic scores, ``d_layer``
  [n, L] and one ``sig_<name>`` column per feature signal.
  """
  cols = {k: [] for k in ("source", "group", "example", "split", "kl", "dnll", "confidence",
                          "damage_bound", "damage_rms", "radius", "d_layer")
          + tuple("sig_" + s for s in FEATURE_SIGNALS)}
  plan = None
  cluster = 0

  def add(labels, kl, dnll, conf, radius, sig):
    """Rows of one stream; ``labels``: its (source, group, example, split)."""
    source, group, example, split = labels
    s = _per_step_scores(radius, norms)
    n = len(kl)
    for k, v in (("source", [source] * n), ("group", [group] * n), ("example", [example] * n),
                 ("split", [split] * n), ("kl", kl), ("dnll", dnll), ("confidence", conf),
                 ("damage_bound", s["damage_bound"]), ("damage_rms", s["damage_rms"]),
                 ("radius", s["radius"]), ("d_layer", s["d_layer"])):
      cols[k].append(np.asarray(v))
    for name in FEATURE_SIGNALS:
      cols["sig_" + name].append(np.mean(sig[name], axis=-1))

  for u, a in sorted(units.items()):
    if u.startswith("text_"):
      plan = plan or a
      keep = a["scored"].copy()
      keep[:chunk] = False  # before the first eviction: no damage and no radius
      sig = {s: a["sig_" + s][keep] for s in FEATURE_SIGNALS}
      add(("text", u, cluster, "text"), a["kl"][keep], a["dnll"][keep],
          a["entropy_evicted"][keep], a["radius"][keep], sig)
      cluster += 1
    else:
      setting = u[5:]
      for run in (0, 1):
        same = a[f"run{run}_same_prefix"]
        for e in range(same.shape[0]):
          # Step s's logits (its KL and log-probability) come from the pass that read token
          # s - 1, whose statistics the generator returns as step s - 1's; step 0's logits
          # come from the question's prefill, which has no certificate: left out.
          step = np.flatnonzero(same[e][1:]) + 1
          lp = a[f"run{run}_logprobs"][e][step]
          sig = {s: a[f"run{run}_sig_{s}"][e][step - 1] for s in FEATURE_SIGNALS}
          add(("task", setting, cluster + e, "test"), a[f"run{run}_kl"][e][step],
              np.full(len(step), np.nan), -lp, a[f"run{run}_radius"][e][step - 1], sig)
      cluster += same.shape[0]
  out = {k: np.concatenate(v) for k, v in cols.items()}
  return out


def mark_splits(table: dict, units: dict, train_segments: int) -> dict:
  """Sets ``split`` of text rows: segments < ``train_segments`` train, the rest test."""
  seg = np.asarray([int(g[5:]) if s == "text" else -1
                    for s, g in zip(table["source"], table["group"])])
  split = np.where(table["source"] == "task", "test",
                   np.where(seg < train_segments, "train", "test"))
  return dict(table, split=split)


def features(table: dict) -> tuple[np.ndarray, list[str], np.ndarray]:
  """``(x [n, F], names, finite [n])``: log D_l per layer and log layer-mean signals."""
  d = np.log(np.maximum(table["d_layer"], 0.0) + LOG_FLOOR)
  sig = [np.log(np.maximum(table["sig_" + s], 0.0) + LOG_FLOOR) for s in FEATURE_SIGNALS]
  x = np.concatenate([d, np.stack(sig, axis=1)], axis=1)
  names = [f"log_D_{l}" for l in range(d.shape[1])] + [f"log_{s}" for s in FEATURE_SIGNALS]
  return x, names, np.all(np.isfinite(x), axis=1)


def target(table: dict) -> np.ndarray:
  """log(KL + 1e-6); KL below 0 is float rounding (|KL| < 1e-5) and is read as 0."""
  return np.log(np.maximum(table["kl"], 0.0) + LOG_FLOOR)


def fit_predictor(table: dict, *, model: str, design: str, budget: float, seed: int = 0,
                  steps: int = 1500) -> tuple[damage_predictor.DamagePredictor, dict]:
  """Fits a linear and a one-hidden-layer predictor on the training text rows and keeps the
  one with the lower validation loss (a split of the training rows; the test rows play no
  part). Returns the predictor and a description of the fit."""
  x, names, ok = features(table)
  tr = ok & (table["split"] == "train")
  if tr.sum() < 50:
    raise ValueError(f"only {int(tr.sum())} training tokens with finite features; need >= 50")
  fits = {}
  for hidden in (0, 16):
    spec = damage_predictor.PredictorSpec(feature_names=tuple(names), hidden=hidden,
                                          model=model, design=design, budget=str(budget),
                                          target="log_kl")
    fits[hidden] = damage_predictor.fit(spec, x[tr], target(table)[tr], seed=seed, steps=steps)
  best = min(fits, key=lambda h: fits[h].val_loss)
  info = {"n_train_tokens": int(tr.sum()), "n_nonfinite_rows": int((~ok).sum()),
          "val_loss": {str(h): float(f.val_loss) for h, f in fits.items()},
          "chosen_hidden": int(best), "features": names,
          "trained_on": "text segments < train_segments (held out: the other segments, "
                        "every task)"}
  return fits[best], info


def add_learned(table: dict, predictor: damage_predictor.DamagePredictor) -> dict:
  x, _, ok = features(table)
  pred = np.full(len(x), np.nan)
  pred[ok] = predictor.predict(x[ok])
  return dict(table, learned=pred)


def example_scores(units: dict, norms: dict, predictor: Optional[damage_predictor.DamagePredictor],
                   run: int = 0) -> dict:
  """Per task example of run ``run``: correctness (full, evicted, other run), the setting,
  and the scores, each the mean of its per-step value over decode steps 1, ..., S - 1:
  step s's statistics are the generator's at s - 1 (as in :func:`token_table`), step 0
  (the prefill's logits) has no certificate, and the statistics at S - 1 are behind a
  step never generated."""
  rows = {k: [] for k in ("setting", "full_correct", "evicted_correct", "two_run",
                          "confidence", "damage_bound", "damage_rms", "radius", "learned",
                          "first_kl")}
  other = 1 - run
  for u, a in sorted(units.items()):
    if not u.startswith("task_"):
      continue
    r = a[f"run{run}_radius"][:, :-1]  # [E, S - 1, L, H]: behind steps 1, ..., S - 1
    s = _per_step_scores(r, norms)
    n = r.shape[0]
    rows["setting"] += [u[5:]] * n
    rows["full_correct"].append(a["full_correct"])
    rows["evicted_correct"].append(a[f"run{run}_correct"])
    rows["two_run"].append(np.any(a[f"run{run}_tokens"] != a[f"run{other}_tokens"], axis=1)
                           .astype(np.float64))
    rows["confidence"].append(-a[f"run{run}_logprobs"][:, 1:].mean(axis=1))  # same steps
    for k in ("damage_bound", "damage_rms", "radius"):
      rows[k].append(s[k].mean(axis=1))
    rows["first_kl"].append(a[f"run{run}_kl"][:, 0])
    if predictor is not None:
      tab = {"d_layer": s["d_layer"].reshape(-1, s["d_layer"].shape[-1])}
      for name in FEATURE_SIGNALS:
        tab["sig_" + name] = a[f"run{run}_sig_{name}"][:, :-1].reshape(-1, r.shape[2])
      x, _, ok = features({**tab, **{"sig_" + k: tab["sig_" + k].mean(-1)
                                     for k in FEATURE_SIGNALS}})
      pred = np.full(len(x), np.nan)
      pred[ok] = predictor.predict(x[ok])
      rows["learned"].append(pred.reshape(n, -1).mean(axis=1))
    else:
      rows["learned"].append(np.full(n, np.nan))
  out = {k: (np.asarray(v) if k == "setting" else np.concatenate(v)) for k, v in rows.items()}
  out["full_correct"] = out["full_correct"].astype(bool)
  out["evicted_correct"] = out["evicted_correct"].astype(bool)
  return out
