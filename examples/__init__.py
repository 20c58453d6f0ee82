"""Models of one's own that compose certkv_jax's eviction designs."""
