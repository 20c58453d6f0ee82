"""certkv_jax: KV-cache eviction that certifies its own attention error.

Public API (the method: docs/method.md):

* :func:`offset_attention` -- attention with Hajek offsets + certificate stats.
* :func:`certificate_radius` -- the per-call error radius.
* :func:`inclusion_probabilities` -- Eq. 2 Poisson inclusion probabilities.
* :mod:`certkv_jax.designs` -- eviction designs (deterministic and randomized).
* :mod:`certkv_jax.registry` -- the one table of designs by name.
* :mod:`certkv_jax.cache` -- the fixed-capacity KV-cache pytree of one head.
* :mod:`certkv_jax.caches` -- a model's stacked caches ([layers, batch, KV heads]).
* :mod:`certkv_jax.layer` -- the drop-in attention a model's layer calls.
* :mod:`certkv_jax.eviction` -- a design applied to every cache, state carried.
* :mod:`certkv_jax.budgets` -- budgets resolved into targets; the capacity rule.
* :mod:`certkv_jax.checked` -- checkify-checked versions of the above for
  bad input under ``jit`` (method, section 9, "Bad input").
* :mod:`certkv_jax.diagnostics` -- evaluation-mode truths (error, Assumption 2).
* :mod:`certkv_jax.calibration` -- split-conformal scaling of the radius.
* :mod:`certkv_jax.calibration_store` -- the fitted calibration as an orbax
  artifact (imported on first use: it loads orbax).
* :mod:`certkv_jax.signals` -- online warning signals from the kept set.
* :mod:`certkv_jax.damage` -- the per-head radius projected through the
  output projection: a per-layer bound on residual-stream damage.
"""

from certkv_jax import budgets
from certkv_jax import cache
from certkv_jax import caches
from certkv_jax import calibration
from certkv_jax import certificate
from certkv_jax import checked
from certkv_jax import damage
from certkv_jax import designs
from certkv_jax import diagnostics
from certkv_jax import eviction
from certkv_jax import keydiff
from certkv_jax import layer
from certkv_jax import registry
from certkv_jax import sampling
from certkv_jax import scores
from certkv_jax import signals
from certkv_jax.attention import AttentionConfig
from certkv_jax.attention import OffsetAttentionResult
from certkv_jax.attention import attention_probs
from certkv_jax.attention import offset_attention
from certkv_jax.cache import KVCache
from certkv_jax.cache import init_cache
from certkv_jax.calibration import ConformalScales
from certkv_jax.certificate import anytime_delta
from certkv_jax.certificate import certificate_radius
from certkv_jax.designs import EvictionDesign
from certkv_jax.sampling import inclusion_probabilities
from certkv_jax.signals import Signals

__version__ = "0.1.0"

__all__ = [
    "AttentionConfig",
    "KVCache",
    "EvictionDesign",
    "OffsetAttentionResult",
    "anytime_delta",
    "attention_probs",
    "budgets",
    "cache",
    "caches",
    "calibration",
    "calibration_store",
    "certificate",
    "certificate_radius",
    "checked",
    "damage",
    "designs",
    "diagnostics",
    "eviction",
    "keydiff",
    "layer",
    "registry",
    "inclusion_probabilities",
    "init_cache",
    "offset_attention",
    "sampling",
    "scores",
    "signals",
    "ConformalScales",
    "Signals",
]


def __getattr__(name):
  # calibration_store imports orbax (and tensorstore): load it on first use only.
  if name == "calibration_store":
    import importlib  # pylint: disable=import-outside-toplevel
    return importlib.import_module("certkv_jax.calibration_store")
  raise AttributeError(f"module 'certkv_jax' has no attribute {name!r}")
