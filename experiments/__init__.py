"""Thin absl-flag scripts over certkv_jax; each writes results under --out."""
