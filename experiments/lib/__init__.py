"""The experiment library: tasks, loaders, scoring, statistics, the suite
runner, reports, plots and result I/O.

The commands in ``experiments/`` (``run_all``, ``exp_*``, ``bench_*``, ...) are
thin absl mains over this package; nothing here parses flags.
"""
