"""certkv_jax: KV-cache eviction that certifies its own attention error.

The method is docs/method.md. Subpackages:

* :mod:`certkv_jax.designs` -- eviction designs: the framework and factories, their parts,
  scores, tail sampling, budgets, per-head allocation and the registry of names.
* :mod:`certkv_jax.kv` -- one head's slot cache, a model's caches, bytes per kept token,
  sequence sharding.
* :mod:`certkv_jax.attention` -- offset attention and one layer's certified attention.
* :mod:`certkv_jax.certificate` -- the per-call radius, evaluation-mode truths, online
  signals, residual-stream damage, Monte Carlo checks.
* :mod:`certkv_jax.calibration` -- split-conformal and source-robust scaling of the radius;
  the fitted artifact (``calibration.store``, imported on use: it loads orbax).

The verbs a model calls: :mod:`certkv_jax.layer` (attend) and :mod:`certkv_jax.eviction`
(evict); :mod:`certkv_jax.checked` runs them with checkify checks (method, section 9).
"""

from certkv_jax import attention
from certkv_jax.attention.offset import attention_probs
from certkv_jax.attention.offset import AttentionConfig
from certkv_jax.attention.offset import offset_attention
from certkv_jax.attention.offset import OffsetAttentionResult
from certkv_jax import calibration
from certkv_jax.calibration.conformal import ConformalScales
from certkv_jax import certificate
from certkv_jax.certificate.radius import anytime_delta
from certkv_jax.certificate.radius import certificate_radius
from certkv_jax.certificate.signals import Signals
from certkv_jax import checked
from certkv_jax import designs
from certkv_jax.designs.framework import EvictionDesign
from certkv_jax.designs.sampling import inclusion_probabilities
from certkv_jax import eviction
from certkv_jax import kv
from certkv_jax.kv.cache import init_cache
from certkv_jax.kv.cache import KVCache
from certkv_jax import layer

__version__ = "0.1.0"

__all__ = [
    "AttentionConfig",
    "ConformalScales",
    "EvictionDesign",
    "KVCache",
    "OffsetAttentionResult",
    "Signals",
    "anytime_delta",
    "attention",
    "attention_probs",
    "calibration",
    "certificate",
    "certificate_radius",
    "checked",
    "designs",
    "eviction",
    "inclusion_probabilities",
    "init_cache",
    "kv",
    "layer",
    "offset_attention",
]
