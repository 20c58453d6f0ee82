"""Old name of ``python -m experiments.coverage``, kept for a release."""

import runpy

if __name__ == "__main__":
  runpy.run_module("experiments.coverage", run_name="__main__", alter_sys=True)
