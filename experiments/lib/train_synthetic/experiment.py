r"""Trains a small Llama-family model from scratch on synthetic key-value retrieval.

Builds a controlled testbed for the eviction designs: a model of the family in
``models`` (``LlamaConfig``; default 2 layers, hidden 64) learns to answer a
key-value lookup. Each sequence is ``n_pairs`` pairs ``k_1 v_1 ... k_n v_n``
(distinct random keys, random values), a query marker and one of the keys,
and the target is that key's value; the loss is the cross-entropy of the
answer token only (optax adamw, warmup-cosine schedule).

Checkpointing (orbax-checkpoint): every ``--checkpoint_every`` steps the whole
training state is saved -- parameters, optimizer state, the step and the data
PRNG key -- and a rerun with the same ``--out`` restores the latest checkpoint
and continues, so a killed run loses no step and repeats none: training ``2N``
steps in one go equals ``N`` steps, a restart and ``N`` more (the data of step
``s`` is drawn from the key carried in the state). The loss curve is appended
to ``--out/loss.jsonl`` (one row per logged step, atomic; rows past the
restored step are dropped on resume).

The command: ``python -m experiments.train_synthetic --out=/tmp/kv_train --steps=2000``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

from experiments.lib import plan_flags
from experiments.lib import results_io
from models import llama
from models.config import LlamaConfig

# Token ids: 0 pad, 1 query marker, then keys, then values.
QUERY = 1


def task_config(n_keys: int, n_values: int, layers: int = 2, hidden: int = 64, heads: int = 4,
                kv_heads: int = 2) -> LlamaConfig:
  """A small model for the task: vocabulary = 2 specials + keys + values."""
  return LlamaConfig(vocab_size=2 + n_keys + n_values, hidden=hidden, n_layers=layers,
                     n_heads=heads, n_kv_heads=kv_heads, head_dim=hidden // heads,
                     ffn_dim=4 * hidden, rope_theta=10000.0, rope_layout="half",
                     tie_embeddings=False)


def make_batch(key, batch: int, n_pairs: int, n_keys: int, n_values: int):
  """``(tokens [batch, 2 n_pairs + 2] int32, answer [batch] int32)``.

  Keys are distinct within a sequence; the last token is the queried key and
  ``answer`` its value (predicted at the last position).
  """
  if n_pairs > n_keys:
    raise ValueError(f"n_pairs ({n_pairs}) must be <= n_keys ({n_keys}) (distinct keys)")
  k_perm, k_val, k_q = jax.random.split(key, 3)
  keys = jnp.argsort(jax.random.uniform(k_perm, (batch, n_keys)), axis=1)[:, :n_pairs]
  values = jax.random.randint(k_val, (batch, n_pairs), 0, n_values)
  which = jax.random.randint(k_q, (batch,), 0, n_pairs)
  key_tok, val_tok = keys + 2, values + 2 + n_keys
  pairs = jnp.stack([key_tok, val_tok], axis=-1).reshape(batch, 2 * n_pairs)
  rows = jnp.arange(batch)
  query = jnp.stack([jnp.full((batch,), QUERY), key_tok[rows, which]], axis=-1)
  tokens = jnp.concatenate([pairs, query], axis=1).astype(jnp.int32)
  return tokens, val_tok[rows, which].astype(jnp.int32)


def make_optimizer(lr: float, weight_decay: float, total_steps: int):
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, lr, warmup_steps=max(1, min(100, total_steps // 10)), decay_steps=max(2, total_steps),
      end_value=lr * 0.1)
  return optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(schedule, weight_decay=weight_decay))


def init_state(config: LlamaConfig, optimizer, seed) -> dict:
  """The whole training state: step, params, optimizer state, data key."""
  init_key, data_key = jax.random.split(jax.random.PRNGKey(seed))
  params = llama.init_params(config, init_key)
  return {"step": jnp.zeros((), jnp.int32), "params": params,
          "opt_state": optimizer.init(params), "data_key": data_key}


@functools.lru_cache(maxsize=8)
def compiled_step(config: LlamaConfig, lr: float, weight_decay: float, schedule_steps: int,
                  batch: int, n_pairs: int, n_keys: int, n_values: int):
  """``(jitted init_state(seed), jitted train_step)``, shared by runs with the same settings
  (a resumed run in the same process does not compile again)."""
  optimizer = make_optimizer(lr, weight_decay, schedule_steps)
  init = jax.jit(functools.partial(init_state, config, optimizer))
  return init, make_train_step(config, optimizer, batch, n_pairs, n_keys, n_values)


def make_train_step(config: LlamaConfig, optimizer, batch: int, n_pairs: int, n_keys: int,
                    n_values: int):
  model = llama.LlamaModel(config)

  def loss_fn(params, tokens, answer):
    logits = model.apply(params, tokens)[:, -1]
    logp = jax.nn.log_softmax(logits)
    loss = -jnp.mean(jnp.take_along_axis(logp, answer[:, None], axis=1))
    acc = jnp.mean(jnp.argmax(logits, axis=-1) == answer)
    return loss, acc

  @jax.jit
  def train_step(state):
    data_key, sub = jax.random.split(state["data_key"])
    tokens, answer = make_batch(sub, batch, n_pairs, n_keys, n_values)
    (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], tokens,
                                                                   answer)
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    new = {"step": state["step"] + 1, "params": params, "opt_state": opt_state,
           "data_key": data_key}
    return new, {"loss": loss, "accuracy": acc}

  return train_step


@dataclasses.dataclass(frozen=True)
class Settings:
  """The task, model and optimisation of :func:`train` (each setting a flag)."""

  batch: int = plan_flags.setting(32, "Sequences per step.")
  n_pairs: int = plan_flags.setting(8, "Key-value pairs per sequence.")
  n_keys: int = plan_flags.setting(64, "Key vocabulary size.")
  n_values: int = plan_flags.setting(64, "Value vocabulary size.")
  layers: int = plan_flags.setting(2, "Decoder layers.")
  hidden: int = plan_flags.setting(64, "Residual width.")
  heads: int = plan_flags.setting(4, "Query heads.")
  kv_heads: int = plan_flags.setting(2, "KV heads (GQA).")
  lr: float = plan_flags.setting(3e-3, "Peak learning rate (adamw, warmup-cosine).")
  weight_decay: float = plan_flags.setting(0.01, "adamw weight decay.")
  checkpoint_every: int = plan_flags.setting(200, "Save a checkpoint every this many steps.")
  log_every: int = plan_flags.setting(50, "Log and record the loss every this many steps.")
  seed: int = plan_flags.setting(0, "Seed of the initialisation and of the data.")
  # Length of the learning-rate schedule (None: the run's steps); must be the same across
  # restarts for resumption to be exact.
  schedule_steps: int | None = None


def train(out: str, steps: int, settings: Settings = Settings(), *,
          stop_after: int | None = None) -> dict:
  """Trains (or resumes) up to ``steps`` steps; returns the final state.

  Args:
    out: directory of the checkpoints and the loss log; rerunning with the
      same ``out`` resumes from its latest checkpoint.
    steps: total steps of the run.
    settings: the task, model and optimisation (:class:`Settings`).
    stop_after: stop (after checkpointing) once this step is reached, as if
      killed there; for tests of resumption.
  """
  s = settings
  batch, n_pairs, n_keys, n_values = s.batch, s.n_pairs, s.n_keys, s.n_values
  log_every, checkpoint_every = s.log_every, s.checkpoint_every
  config = task_config(n_keys, n_values, s.layers, s.hidden, s.heads, s.kv_heads)
  init, train_step = compiled_step(config, s.lr, s.weight_decay, s.schedule_steps or steps,
                                   batch, n_pairs, n_keys, n_values)
  state = init(s.seed)
  os.makedirs(out, exist_ok=True)
  manager = ocp.CheckpointManager(
      os.path.abspath(os.path.join(out, "checkpoints")),
      options=ocp.CheckpointManagerOptions(max_to_keep=3, create=True))
  latest = manager.latest_step()
  if latest is not None:
    state = manager.restore(latest, args=ocp.args.StandardRestore(state))
    logging.info("resumed from step %d in %s", int(state["step"]), out)
  start = int(state["step"])
  loss_path = os.path.join(out, "loss.jsonl")
  log_rows = [r for r in results_io.read_rows(loss_path) if r["step"] <= start]
  t0, end = time.time(), steps if stop_after is None else min(steps, stop_after)
  for step in range(start + 1, end + 1):
    state, metrics = train_step(state)
    if step % log_every == 0 or step == end:
      row = {"step": step, "loss": float(metrics["loss"]),
             "accuracy": float(metrics["accuracy"]), "seconds": round(time.time() - t0, 2)}
      log_rows.append(row)
      results_io.atomic_write_text(loss_path, "".join(json.dumps(r) + "\n" for r in log_rows))
      logging.info("step %d/%d loss %.4f acc %.3f (%.1f steps/s)", step, steps, row["loss"],
                   row["accuracy"], (step - start) / max(time.time() - t0, 1e-9))
    if step % checkpoint_every == 0 or step == end:
      manager.save(step, args=ocp.args.StandardSave(state))
  manager.wait_until_finished()
  manager.close()
  return state


def train_and_report(out: str, steps: int, settings: Settings = Settings()) -> dict:
  """The command: :func:`train` (or resume), then prints the loss curve and the chance
  loss; returns the final state."""
  state = train(out, steps, settings)
  rows = results_io.read_rows(os.path.join(out, "loss.jsonl"))
  print(f"trained to step {int(state['step'])}; loss curve (step, loss, accuracy):")
  for r in rows:
    print(f"  {r['step']:6d}  {r['loss']:.4f}  {r['accuracy']:.3f}")
  print(f"chance loss: {np.log(settings.n_values):.4f}")
  return state
