"""ROC analysis: :func:`roc_auc` (Mann-Whitney, ties count 1/2), :func:`roc_curve`,
the failure-prediction / attribution wrappers :func:`failure_auc`,
:func:`attribution_auc`, and their within-stratum versions :func:`stratified_auc`,
:func:`stratified_attribution_auc`."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from experiments.lib.stats import validation


def average_ranks(x: np.ndarray) -> np.ndarray:
  """Ranks 1..n, tied values getting their average rank."""
  order = np.argsort(x, kind="mergesort")
  xs = x[order]
  ranks = np.empty(len(x), np.float64)
  starts = np.r_[0, np.flatnonzero(np.diff(xs)) + 1]
  ends = np.r_[starts[1:], len(x)]
  # Every element of a tie run [s, e) gets the run's average rank (s + 1 + e) / 2.
  ranks[order] = np.repeat(0.5 * (starts + 1 + ends), ends - starts)
  return ranks


def _checked(scores, labels):
  """Scores and boolean labels as arrays with the positive and negative counts."""
  s = validation.vector(scores, "scores")
  lab = validation.labels(labels)
  validation.same_length(scores=s, labels=lab)
  if not np.all(np.isfinite(s)):
    raise ValueError("scores must be finite")
  n1 = int(lab.sum())
  n0 = len(lab) - n1
  if n1 == 0 or n0 == 0:
    raise ValueError(f"labels must contain both classes, got {n1} positives and {n0} negatives")
  return s, lab, n1, n0


def roc_auc(scores, labels) -> float:
  """Area under the ROC curve: P(score of a positive > score of a negative), ties 1/2.

  Args:
    scores: [n] real scores (higher = more likely positive); finite.
    labels: [n] booleans (or 0/1).

  Raises:
    ValueError: shapes differ, non-finite scores, or only one class present.
  """
  s, lab, n1, n0 = _checked(scores, labels)
  ranks = average_ranks(s)
  return float((ranks[lab].sum() - n1 * (n1 + 1) / 2.0) / (n1 * n0))


class RocCurve(NamedTuple):
  fpr: np.ndarray
  tpr: np.ndarray
  thresholds: np.ndarray  # predict positive when score >= threshold; first is +inf


def roc_curve(scores, labels) -> RocCurve:
  """ROC points at every distinct score, from (0, 0) to (1, 1); errors as :func:`roc_auc`.

  The trapezoid area under ``(fpr, tpr)`` equals :func:`roc_auc`.
  """
  s, lab, n1, n0 = _checked(scores, labels)
  order = np.argsort(-s, kind="mergesort")
  ss, ll = s[order], lab[order]
  last = np.r_[np.flatnonzero(np.diff(ss)), len(ss) - 1]  # last index of each tie group
  tp = np.cumsum(ll)[last]
  fp = np.cumsum(~ll)[last]
  return RocCurve(np.r_[0.0, fp / n0], np.r_[0.0, tp / n1], np.r_[np.inf, ss[last]])


def failure_auc(score, evicted_correct) -> float:
  """AUC of ``score`` (higher = more suspicious) for predicting that the evicted run is
  wrong (label = ``not evicted_correct``)."""
  return roc_auc(score, ~validation.labels(evicted_correct, "evicted_correct"))


def attribution_auc(score, full_correct, evicted_correct) -> float:
  """AUC of ``score`` for separating cache-induced from inherent failures.

  Only the evicted run's failures count (``evicted_correct`` false). Positive:
  cache-induced (the full cache is correct); negative: inherent (the full
  cache is wrong too). Examples the evicted run gets right are left out.
  """
  s = validation.vector(score, "score")
  full = validation.labels(full_correct, "full_correct")
  ev = validation.labels(evicted_correct, "evicted_correct")
  validation.same_length(score=s, full_correct=full, evicted_correct=ev)
  fail = ~ev
  return roc_auc(s[fail], full[fail])


def stratified_auc(scores, labels, strata) -> float:
  """AUC over (positive, negative) pairs drawn from the same stratum only, ties 1/2.

  Equals the mean of the per-stratum AUCs weighted by each stratum's
  ``n_pos * n_neg``; strata with one class contribute no pair. Use it where
  the pooled AUC could be earned by telling strata apart (e.g. one task whose
  failures are all inherent, another whose failures are all cache-induced).

  Raises:
    ValueError: as :func:`roc_auc`, or when no stratum holds both classes.
  """
  s = validation.vector(scores, "scores")
  lab = validation.labels(labels)
  g = np.asarray(strata)
  validation.same_length(scores=s, labels=lab, strata=g)
  validation.finite_labels(g, "strata")
  if not np.all(np.isfinite(s)):
    raise ValueError("scores must be finite")
  total, pairs = 0.0, 0
  for u in np.unique(g):
    idx = g == u
    n1 = int(lab[idx].sum())
    n0 = int(idx.sum()) - n1
    if n1 and n0:
      total += roc_auc(s[idx], lab[idx]) * n1 * n0
      pairs += n1 * n0
  if not pairs:
    raise ValueError("strata: no stratum contains both classes")
  return total / pairs


def stratified_attribution_auc(score, full_correct, evicted_correct, strata) -> float:
  """:func:`attribution_auc` over pairs of failures from the same stratum."""
  s = validation.vector(score, "score")
  full = validation.labels(full_correct, "full_correct")
  ev = validation.labels(evicted_correct, "evicted_correct")
  g = np.asarray(strata)
  validation.same_length(score=s, full_correct=full, evicted_correct=ev, strata=g)
  fail = ~ev
  return stratified_auc(s[fail], full[fail], g[fail])
