"""KV caches (method, section 12): one head's slot cache (``cache``), a model's caches
(``caches``), bytes per kept token (``memory``) and sequence sharding (``distributed``)."""

from certkv_jax.kv import cache
from certkv_jax.kv import caches
from certkv_jax.kv import distributed
from certkv_jax.kv import memory
