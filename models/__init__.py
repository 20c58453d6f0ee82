"""Flax decoder models that run a certkv_jax design in every attention layer.

The Llama-family decoder and checkpoint loading arrive with issue 4; the
package exists now so that the four-package layout installs and the BUILD
targets are stable.
"""
