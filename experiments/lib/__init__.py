"""The experiment library; the commands in ``experiments/`` (``run_all``, ``exp_*``,
``bench_*``, ...) are thin absl mains that parse their flags and call one function here.

* inputs: ``tasks``, ``loaders``, ``scoring``; the model: ``model_loading``;
* the suite (method, section 8): ``suite_settings`` (what runs, and the flags the
  suite's scripts share), ``suite`` (row collection), ``analyses/`` (one
  module per analysis), ``suite_report`` (``report.md``), ``suite_runner``
  (``run_all``'s plans and run);
* one module per other experiment: ``theorem1``, ``overhead``,
  ``streaming_loss`` (+ ``_experiment``, ``_report``), ``demo``,
  ``montecarlo_certificate``, ``train_synthetic``, ``bench_kernels``,
  ``bench_sharding``;
* shared: ``stats/`` (statistics), ``plots``, ``results_io``.

Nothing here parses the command line: functions take parsed values.
"""
