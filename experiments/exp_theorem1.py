"""Old name of ``python -m experiments.theorem1``, kept for a release."""

import runpy

if __name__ == "__main__":
  runpy.run_module("experiments.theorem1", run_name="__main__", alter_sys=True)
