"""A small learned map from per-step features to output damage (method, section 11).

How much of each layer's attention damage (:mod:`certkv_jax.certificate.damage`) reaches
the next-token distribution depends on the rest of the network; a
:class:`DamagePredictor` learns that step from evaluation-mode rows of
features and a target such as ``log KL(p_full || p_evicted)``. It is linear
or has one hidden layer, fitted full-batch by AdamW on standardized data; the
held-out rows only pick the step, so evaluate on seeds and texts kept apart
(split by sequence). Saved as an orbax directory (as
:mod:`certkv_jax.calibration.store`); :func:`load` refuses a predictor made
for other features, model, design, budget or target.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import os
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

from certkv_jax import _validate
from certkv_jax.calibration import store

Array = jax.Array

FORMAT_VERSION = 1
KIND = "certkv_jax.damage_predictor"  # the artifact format name, kept from before the move
ACTIVATIONS = ("tanh", "gelu")
MIN_ROWS = 10


@dataclasses.dataclass(frozen=True)
class PredictorSpec:
  """What a predictor reads, its size, and what it was fitted for.

  Attributes:
    feature_names: names of the feature columns, in order (distinct, non-empty).
    hidden: 0 for a linear model, else the width of the one hidden layer.
    model: name of the model the rows came from.
    design: eviction design (e.g. "poisson_tail").
    budget: the cache budget, as a string (e.g. "0.25").
    target: what ``y`` is (e.g. "log_kl").
    activation: hidden-layer nonlinearity, "tanh" or "gelu" (unused if linear).
  """

  feature_names: tuple
  hidden: int
  model: str
  design: str
  budget: str
  target: str = "log_kl"
  activation: str = "tanh"

  def __post_init__(self):
    names = self.feature_names
    if (isinstance(names, str) or not isinstance(names, Sequence) or not names
        or not all(isinstance(s, str) and s for s in names)):
      raise ValueError(f"feature_names must be a non-empty sequence of non-empty str, got "
                       f"{names!r}")
    if len(set(names)) != len(names):
      raise ValueError(f"feature_names must be distinct, got {names!r}")
    object.__setattr__(self, "feature_names", tuple(names))
    if isinstance(self.hidden, bool) or not isinstance(self.hidden, numbers.Integral):
      raise ValueError(f"hidden must be an int >= 0, got {self.hidden!r}")
    if self.hidden < 0:
      raise ValueError(f"hidden must be an int >= 0, got {self.hidden}")
    object.__setattr__(self, "hidden", int(self.hidden))
    for name in ("model", "design", "budget", "target"):
      if not isinstance(getattr(self, name), str) or not getattr(self, name):
        raise ValueError(f"{name} must be a non-empty str, got {getattr(self, name)!r}")
    if self.activation not in ACTIVATIONS:
      raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")

  @property
  def n_features(self) -> int:
    return len(self.feature_names)

  def to_json(self) -> dict:
    return {"feature_names": list(self.feature_names), "hidden": self.hidden,
            "model": self.model, "design": self.design, "budget": self.budget,
            "target": self.target, "activation": self.activation}

  @classmethod
  def from_json(cls, d: dict) -> "PredictorSpec":
    return cls(feature_names=tuple(d["feature_names"]), hidden=d["hidden"], model=d["model"],
               design=d["design"], budget=d["budget"], target=d["target"],
               activation=d["activation"])


def param_shapes(spec: PredictorSpec) -> dict:
  """Name -> shape of every parameter of a predictor with ``spec``."""
  f, h = spec.n_features, spec.hidden
  shapes = {"x_mean": (f,), "x_std": (f,), "y_mean": (), "y_std": (),
            "w_out": (h if h else f,), "b_out": ()}
  if h:
    shapes.update(w_hidden=(f, h), b_hidden=(h,))
  return shapes


_HIGHEST = jax.lax.Precision.HIGHEST  # not TF32 on a GPU


def _forward(params: dict, z: Array, activation: str) -> Array:
  """Standardized prediction from standardized features z [n, F] -> [n]."""
  if "w_hidden" in params:
    act = jnp.tanh if activation == "tanh" else jax.nn.gelu
    z = act(jnp.matmul(z, params["w_hidden"], precision=_HIGHEST) + params["b_hidden"])
  return jnp.matmul(z, params["w_out"], precision=_HIGHEST) + params["b_out"]


@functools.partial(jax.jit, static_argnames=("activation",))
def _predict(params: dict, x: Array, activation: str) -> Array:
  z = (x - params["x_mean"]) / params["x_std"]
  y = _forward(params, z, activation)
  return y * params["y_std"] + params["y_mean"]


def _check_x(spec: PredictorSpec, x) -> Array:
  x = jnp.asarray(x)
  if x.ndim != 2 or x.shape[1] != spec.n_features:
    raise ValueError(f"x must have shape [n, {spec.n_features}] (features "
                     f"{spec.feature_names}), got {x.shape}")
  _validate.check_finite("x", x)
  return x.astype(jnp.float32)


@dataclasses.dataclass(frozen=True, eq=False)
class DamagePredictor:
  """A fitted predictor.

  Attributes:
    spec: the :class:`PredictorSpec`.
    params: float32 arrays, shapes from :func:`param_shapes`, with the
      standardization statistics.
    train_loss, val_loss: mean squared error at ``best_step`` on the training
      and validation rows, in the target's units squared.
    best_step: optimizer updates of the kept parameters (0 = initialization).
  """

  spec: PredictorSpec
  params: dict
  train_loss: float
  val_loss: float
  best_step: int

  def __post_init__(self):
    if not isinstance(self.spec, PredictorSpec):
      raise ValueError(f"spec must be a PredictorSpec, got {type(self.spec).__name__}")
    want = param_shapes(self.spec)
    if not isinstance(self.params, dict) or set(self.params) != set(want):
      got = sorted(self.params) if isinstance(self.params, dict) else type(self.params).__name__
      raise ValueError(f"params must be a dict with keys {sorted(want)}, got {got}")
    params = {}
    for name, shape in want.items():
      arr = jnp.asarray(self.params[name], jnp.float32)
      if arr.shape != shape:
        raise ValueError(f"params[{name!r}] must have shape {shape}, got {arr.shape}")
      _validate.check_finite(f"params[{name!r}]", arr)
      params[name] = arr
    for name in ("x_std", "y_std"):
      _validate.check_in_range(f"params[{name!r}]", params[name], 0.0, math.inf, lo_open=True)
    object.__setattr__(self, "params", params)
    for name in ("train_loss", "val_loss"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, numbers.Real) or not v >= 0:
        raise ValueError(f"{name} must be a float >= 0, got {v!r}")
      object.__setattr__(self, name, float(v))
    object.__setattr__(self, "best_step", _validate.check_nonneg_int("best_step", self.best_step))

  def predict(self, x) -> Array:
    """Predicted target ``[n]`` (float32) for raw features ``x`` [n, n_features].

    Raises:
      ValueError: wrong shape, or (outside jit) non-finite ``x``.
    """
    return _predict(self.params, _check_x(self.spec, x), activation=self.spec.activation)


def _init(spec: PredictorSpec, key) -> dict:
  f, h = spec.n_features, spec.hidden
  if not h:
    return {"w_out": jnp.zeros((f,)), "b_out": jnp.zeros(())}
  k1, k2 = jax.random.split(key)
  return {"w_hidden": jax.random.normal(k1, (f, h)) / math.sqrt(f),
          "b_hidden": jnp.zeros((h,)),
          "w_out": jax.random.normal(k2, (h,)) / math.sqrt(h), "b_out": jnp.zeros(())}


def _train(spec, params, z_tr, y_tr, z_va, y_va, steps, learning_rate, weight_decay):
  """Full-batch AdamW for ``steps`` updates; the parameters of the best validation step."""
  decay_mask = {k: k.startswith("w_") for k in params}
  opt = optax.adamw(learning_rate, weight_decay=weight_decay, mask=decay_mask)

  def mse(p, z, y):
    return jnp.mean((_forward(p, z, spec.activation) - y) ** 2)

  def step(carry, _):
    p, state, best_p, best_val, best_tr, best_step, t = carry
    val = mse(p, z_va, y_va)
    tr, grads = jax.value_and_grad(mse)(p, z_tr, y_tr)
    better = val < best_val  # NaN never wins
    pick = lambda new, old: jnp.where(better, new, old)
    best_p = jax.tree_util.tree_map(pick, p, best_p)
    best_val, best_tr, best_step = pick(val, best_val), pick(tr, best_tr), pick(t, best_step)
    updates, state = opt.update(grads, state, p)
    return (optax.apply_updates(p, updates), state, best_p, best_val, best_tr, best_step,
            t + 1), None

  inf = jnp.array(jnp.inf, jnp.float32)
  carry = (params, opt.init(params), params, inf, inf, jnp.array(0), jnp.array(0))
  (p, _, best_p, best_val, best_tr, best_step, _), _ = jax.lax.scan(
      step, carry, None, length=steps)
  val, tr = mse(p, z_va, y_va), mse(p, z_tr, y_tr)  # after the last update
  better = val < best_val
  pick = lambda new, old: jnp.where(better, new, old)
  return (jax.tree_util.tree_map(pick, p, best_p), pick(val, best_val), pick(tr, best_tr),
          pick(steps, best_step))


_train_jit = jax.jit(_train, static_argnames=("spec", "steps"))


def fit(spec: PredictorSpec, x, y, *, seed: int = 0, steps: int = 2000,
        learning_rate: float = 1e-2, weight_decay: float = 1e-4,
        val_fraction: float = 0.2) -> DamagePredictor:
  """Fits a predictor to rows ``(x, y)`` (evaluation-mode data).

  A permutation seeded with ``seed`` holds out ``round(val_fraction * n)``
  rows; standardization uses the training rows; weight decay skips biases.

  Args:
    spec: the :class:`PredictorSpec`.
    x: [n, len(spec.feature_names)] finite features, in ``spec.feature_names`` order.
    y: [n] finite targets.
    seed: int >= 0, for the split and the initialization.
    steps: number of full-batch updates, int >= 1.
    learning_rate: AdamW step size, finite > 0.
    weight_decay: AdamW decoupled weight decay, finite >= 0.
    val_fraction: share of rows held out to choose the step, in (0, 1).

  Raises:
    ValueError: bad shapes or values (naming the argument and the allowed
      range), fewer than 10 rows, a split leaving fewer than 1 validation or
      2 training rows, a constant feature or target on the training rows, or
      no finite validation loss.
  """
  if not isinstance(spec, PredictorSpec):
    raise ValueError(f"spec must be a PredictorSpec, got {type(spec).__name__}")
  x = np.asarray(x, np.float64)
  if x.ndim != 2 or x.shape[1] != spec.n_features:
    raise ValueError(f"x must have shape [n, {spec.n_features}] (features "
                     f"{spec.feature_names}), got {x.shape}")
  n = x.shape[0]
  y = np.asarray(y, np.float64)
  if y.shape != (n,):
    raise ValueError(f"y must have shape [n={n}] like x, got {y.shape}")
  _validate.check_finite("x", x)
  _validate.check_finite("y", y)
  if n < MIN_ROWS:
    raise ValueError(f"x must have at least {MIN_ROWS} rows, got {n}")
  seed = _validate.check_nonneg_int("seed", seed)
  steps = _validate.check_positive_int("steps", steps)
  for name, value in (("learning_rate", learning_rate), ("weight_decay", weight_decay),
                      ("val_fraction", val_fraction)):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
      raise ValueError(f"{name} must be a float, got {value!r}")
  _validate.check_in_range("learning_rate", learning_rate, 0.0, math.inf, lo_open=True,
                         hi_open=True)
  _validate.check_in_range("weight_decay", weight_decay, 0.0, math.inf, hi_open=True)
  _validate.check_in_range("val_fraction", val_fraction, 0.0, 1.0, lo_open=True, hi_open=True)
  n_val = int(round(val_fraction * n))
  if n_val < 1 or n - n_val < 2:
    raise ValueError(f"val_fraction={val_fraction} leaves {n_val} validation and "
                     f"{n - n_val} training rows of {n}; need >= 1 and >= 2")
  perm = np.random.default_rng(seed).permutation(n)
  va, tr = perm[:n_val], perm[n_val:]
  x_mean, x_std = x[tr].mean(axis=0), x[tr].std(axis=0)
  y_mean, y_std = y[tr].mean(), y[tr].std()
  if not (x_std > 0).all():
    const = [spec.feature_names[i] for i in np.flatnonzero(~(x_std > 0))]
    raise ValueError(f"x: features {const} are constant on the training rows; drop them")
  if not y_std > 0:
    raise ValueError("y is constant on the training rows; nothing to fit")
  z = ((x - x_mean) / x_std).astype(np.float32)
  t = ((y - y_mean) / y_std).astype(np.float32)
  params = _init(spec, jax.random.key(seed))
  best, val, trn, best_step = _train_jit(spec, params, z[tr], t[tr], z[va], t[va], steps,
                                         float(learning_rate), float(weight_decay))
  if not math.isfinite(float(val)):
    raise ValueError(f"training gave no finite validation loss; lower learning_rate "
                     f"(got {learning_rate})")
  params = {**{k: np.asarray(v, np.float32) for k, v in best.items()},
            "x_mean": x_mean.astype(np.float32), "x_std": x_std.astype(np.float32),
            "y_mean": np.float32(y_mean), "y_std": np.float32(y_std)}
  return DamagePredictor(spec=spec, params=params, train_loss=float(trn) * y_std ** 2,
                         val_loss=float(val) * y_std ** 2, best_step=int(best_step))


def save(predictor: DamagePredictor, directory, *, overwrite: bool = False) -> str:
  """Writes ``predictor`` to ``directory`` atomically; returns the absolute path.

  FileExistsError if ``directory`` exists and ``overwrite`` is False.
  """
  if not isinstance(predictor, DamagePredictor):
    raise ValueError(f"predictor must be a DamagePredictor, got {type(predictor).__name__}")
  arrays = {k: np.asarray(v, np.float32) for k, v in predictor.params.items()}
  meta = {"kind": KIND, "format_version": FORMAT_VERSION, "spec": predictor.spec.to_json(),
          "train_loss": predictor.train_loss, "val_loss": predictor.val_loss,
          "best_step": predictor.best_step}
  return store.write_checkpoint(directory, arrays, meta, overwrite=overwrite)


def load(directory, *, expect_features: Optional[Sequence[str]] = None,
         model: Optional[str] = None, design: Optional[str] = None,
         budget: Optional[str] = None, target: Optional[str] = None) -> DamagePredictor:
  """Reads a predictor written by :func:`save`, checking what it was trained for.

  Args:
    directory: the artifact directory.
    expect_features: if given, the feature names in order.
    model, design, budget, target: if given, must equal the stored spec's.

  Raises:
    FileNotFoundError: nothing at ``directory``.
    ValueError: not a damage predictor, an unreadable ``format_version``, or
      an expectation that differs from the stored spec (e.g. "predictor was
      trained for design 'poisson_tail', not 'snapkv'").
  """
  path = os.path.abspath(os.fspath(directory))
  if not os.path.isdir(path):
    raise FileNotFoundError(f"no damage predictor at {path}")
  ckpt = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
  try:
    meta = ckpt.restore(path, args=ocp.args.Composite(metadata=ocp.args.JsonRestore())).metadata
  except Exception as err:  # orbax raises several types for a foreign directory
    raise ValueError(f"{path} is not a damage predictor (no readable metadata)") from err
  if not isinstance(meta, dict) or meta.get("kind") != KIND:
    raise ValueError(f"{path} is not a {KIND} artifact (kind "
                     f"{meta.get('kind') if isinstance(meta, dict) else None!r})")
  if meta.get("format_version") != FORMAT_VERSION:
    raise ValueError(f"format_version: {path} has version {meta.get('format_version')!r}; "
                     f"this code reads version {FORMAT_VERSION}")
  spec = PredictorSpec.from_json(meta["spec"])
  if expect_features is not None:
    if isinstance(expect_features, str):
      raise ValueError(f"expect_features must be a sequence of str, got {expect_features!r}")
    if tuple(expect_features) != spec.feature_names:
      raise ValueError(f"predictor was trained for features {list(spec.feature_names)}, not "
                       f"{list(expect_features)}")
  for name, want in (("model", model), ("design", design), ("budget", budget),
                     ("target", target)):
    if want is not None and want != getattr(spec, name):
      raise ValueError(f"predictor was trained for {name} {getattr(spec, name)!r}, not "
                       f"{want!r}")
  target_arrays = {k: np.zeros(s, np.float32) for k, s in param_shapes(spec).items()}
  arrays = ckpt.restore(path, args=ocp.args.Composite(
      arrays=ocp.args.StandardRestore(target_arrays))).arrays
  ckpt.close()
  return DamagePredictor(spec=spec, params=dict(arrays), train_loss=meta["train_loss"],
                         val_loss=meta["val_loss"], best_step=meta["best_step"])
