r"""A RULER-style leaderboard: every eviction design on RULER's synthetic tasks.

The 11 RULER tasks that need no outside data (``experiments.lib.ruler``;
qa_1 and qa_2 need SQuAD and HotpotQA and are left out), scored with
string_match_all at RULER's maximum generation lengths, for the full cache
and every design at kvpress's compression ratios (the share of the cache
removed), with the question outside the compressed context (``streaming``,
kvpress's default) and inside it (``query_aware``). One prefill serves every
design. Rows go to ``--out/rows.jsonl`` (resumable; progress with an ETA);
when complete, ``--out/report.md``, ``summary.json`` (``score[design][ratio]``)
and ``score.png`` are written (:mod:`experiments.lib.leaderboard`).

  python -m experiments.leaderboard --out=/tmp/lb --tasks=niah_single_1,vt \
      --context_lens=1024 --n_examples=2 --designs=full,snapkv --ratios=0.5 \
      --regimes=streaming

The full leaderboard: every task at 4k tokens, a subset at 8k::

  python -m experiments.leaderboard --out=DIR --context_lens=4096,8192 \
      --tasks_at=8192:niah_single_1+niah_multikey_1+niah_multivalue+vt
"""

import os
import time

from absl import app
from absl import flags

from experiments.lib import design_defaults
from experiments.lib import model_loading
from experiments.lib import results_io
from experiments.lib import ruler
from experiments.lib.leaderboard import experiment
from experiments.lib.leaderboard import report

FLAGS = flags.FLAGS

flags.DEFINE_string("out", None, "Output directory.", required=True)
flags.DEFINE_string("model", model_loading.DEFAULT_MODEL, "Model ('smollm2' or a Hugging "
                    "Face safetensors directory).")
flags.DEFINE_list("tasks", list(ruler.TASKS), "RULER tasks (experiments.lib.ruler.TASKS).")
flags.DEFINE_list("context_lens", ["4096"], "Tokens per example: prompt + RULER's generation "
                  "budget.")
flags.DEFINE_list("tasks_at", [], "CONTEXT:task+task...: only these tasks at that context "
                  "length, e.g. 8192:niah_single_1+niah_multikey_1+vt.")
flags.DEFINE_integer("n_examples", 10, "Examples per task and context length.")
flags.DEFINE_list("designs", list(design_defaults.names()), "Designs, or variants "
                  "design[:setting=value][+allocation] (experiments.lib.variants: adakv, "
                  "cert, ...); the full cache always runs, as the reference.")
flags.DEFINE_list("ratios", [str(r) for r in experiment.DEFAULT_RATIOS], "Compression ratios: "
                  "the share of the cache removed (budget = 1 - ratio).")
flags.DEFINE_list("regimes", list(experiment.REGIMES), "streaming (question after the "
                  "compressed context) and/or query_aware (inside it).")
flags.DEFINE_integer("chunk", 0, "Streaming: evict after every this many context tokens (0: "
                     "the whole context at once, as kvpress; one prefill for every design).")
flags.DEFINE_integer("group", 1, "Examples per batched call (each at every ratio).")
flags.DEFINE_string("haystack", None, "Text file for the essay haystack and word lists "
                    f"(default {os.path.relpath(ruler.DEFAULT_HAYSTACK)}).")
flags.DEFINE_integer("max_new_tokens", 0, "Tokens to generate (0: RULER's per task).")
flags.DEFINE_bool("use_chat", True, "Wrap prompts in the tokenizer's chat template.")
flags.DEFINE_integer("seed", 0, "Seed of the examples and the randomized designs.")
flags.DEFINE_integer("max_units", -1, "Stop after this many units (-1: all); rerun resumes.")
flags.DEFINE_bool("equal_memory", False, "Ratios remove a share of the kept bytes (keys, "
                  "values and per-slot metadata), not of the tokens: designs at equal memory.")
flags.DEFINE_bool("coverage", True, "Run randomized designs in evaluation mode (a shadow full "
                  "cache: every decode call's true error beside its radius).")
model_loading.define_dtype_flag()
flags.DEFINE_bool("report_only", False, "Write the report from the rows on file; run nothing "
                  "(designs without every row are listed as not run).")


def _tasks_at(entries) -> tuple:
  out = []
  for e in entries:
    c, sep, tasks = e.partition(":")
    if not sep or not c.strip().isdigit() or not tasks:
      raise ValueError(f"--tasks_at entries must be CONTEXT:task+task..., got {e!r}")
    out.append((int(c), tuple(tasks.split("+"))))
  return tuple(out)


def main(argv):
  del argv
  results_io.quiet_library_logs(FLAGS)
  plan = experiment.Plan(
      tasks=tuple(FLAGS.tasks), context_lens=tuple(int(c) for c in FLAGS.context_lens),
      tasks_at=_tasks_at(FLAGS.tasks_at), n_examples=FLAGS.n_examples,
      designs=tuple(FLAGS.designs), ratios=tuple(float(r) for r in FLAGS.ratios),
      regimes=tuple(FLAGS.regimes), chunk=FLAGS.chunk, group=FLAGS.group, seed=FLAGS.seed,
      haystack=FLAGS.haystack, max_new_tokens=FLAGS.max_new_tokens or None,
      use_chat=FLAGS.use_chat, equal_memory=FLAGS.equal_memory, coverage=FLAGS.coverage,
      dtype=FLAGS.dtype, max_units=None if FLAGS.max_units < 0 else FLAGS.max_units).check()
  t0 = time.time()
  params, config, tok = model_loading.load_model(FLAGS.model, plan.dtype)
  name = model_loading.model_name(FLAGS.model)
  if FLAGS.report_only:
    rows = results_io.read_rows(os.path.join(FLAGS.out, experiment.ROWS_FILE))
  else:
    rows = experiment.run(params, config, tok, FLAGS.out, plan, model=name)
  summary = report.write(rows, FLAGS.out, plan, n_kv_heads=config.n_kv_heads, model=name)
  results_io.print_summary(summary, t0)


if __name__ == "__main__":
  app.run(main)
