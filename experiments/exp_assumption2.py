"""Old name of ``python -m experiments.assumption2``, kept for a release."""

import runpy

if __name__ == "__main__":
  runpy.run_module("experiments.assumption2", run_name="__main__", alter_sys=True)
