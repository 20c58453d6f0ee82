"""The experiment library; the commands in ``experiments/`` (``run_all``, ``exp_*``,
``bench_*``, ...) are thin absl mains that parse their flags and call one function here.

* inputs: ``tasks``, ``loaders``, ``scoring``, ``prompts``; the model: ``model_loading``;
  the designs' shared settings over ``certkv_jax.designs.registry``: ``design_defaults``;
* the suite (method, section 8): ``suite/`` (``settings``: what runs, and the flags
  the suite's scripts share; ``rows``: row collection; ``report``: ``report.md``;
  ``runner``: ``run_all``'s plans and run), ``analyses/`` (one module per analysis);
* one subpackage per study: ``validity/`` (``collect``, ``calls``, ``report``,
  ``run``), ``damage/`` (``tokens``, ``collect``, ``analysis``, ``report``),
  ``streaming_loss/`` (``core``, ``experiment``, ``report``), ``bench/``
  (``kernels``, ``decode`` + ``decode_report``, ``sharding``); the generate
  command's library is ``models.text``;
* one module per other experiment: ``theorem1``, ``overhead``, ``demo``,
  ``montecarlo_certificate``, ``train_synthetic``;
* shared: ``stats/`` (statistics), ``plots``, ``results_io``; ``results_doc/``
  renders ``docs/results.md``.

Nothing here parses the command line: functions take parsed values.
"""
