"""A GPT-2-style decoder that uses certkv_jax through its drop-in attention."""
