"""Statistics for the experiment suite (numpy only; method, sections 6-8).

One module per concern; the public names are re-exported here, so callers
write ``from experiments.lib import stats`` and ``stats.roc_auc(...)``:

* :mod:`.roc`: :func:`roc_auc` (Mann-Whitney, ties count 1/2),
  :func:`roc_curve`, the failure-prediction / attribution wrappers
  :func:`failure_auc`, :func:`attribution_auc` and their within-stratum
  versions.
* :mod:`.intervals`: :func:`bootstrap_ci` (percentile bootstrap, paired over
  examples, optionally stratified), :func:`cluster_bootstrap_ci` (resamples
  whole groups, e.g. all decode calls of one example), :func:`wilson_interval`.
* :mod:`.certificate`: :func:`coverage_curve` (empirical coverage vs nominal
  ``1 - delta`` with Wilson intervals), :func:`coverage_by_bins` (coverage as
  a function of the Assumption-2 ratio ``R``), :func:`sharpness`,
  :func:`log_r_regression` (OLS of ``log R`` with standard errors).
* :mod:`.gating`: :func:`gating_curve`, :func:`oracle_share`, :func:`gain_captured_ratio`.
* :mod:`.verdicts`: :func:`verdict`: a paper's claimed range against our interval.
"""

# pylint: disable=g-importing-member
from experiments.lib.stats.certificate import BinnedCoverage
from experiments.lib.stats.certificate import coverage_by_bins
from experiments.lib.stats.certificate import coverage_curve
from experiments.lib.stats.certificate import CoverageCurve
from experiments.lib.stats.certificate import log_r_regression
from experiments.lib.stats.certificate import LogRRegression
from experiments.lib.stats.certificate import radius_bernstein
from experiments.lib.stats.certificate import sharpness
from experiments.lib.stats.gating import gain_captured_ratio
from experiments.lib.stats.gating import gain_from_correct
from experiments.lib.stats.gating import gating_curve
from experiments.lib.stats.gating import oracle_share
from experiments.lib.stats.intervals import bootstrap_ci
from experiments.lib.stats.intervals import cluster_bootstrap_ci
from experiments.lib.stats.intervals import Interval
from experiments.lib.stats.intervals import wilson_interval
from experiments.lib.stats.roc import attribution_auc
from experiments.lib.stats.roc import average_ranks
from experiments.lib.stats.roc import failure_auc
from experiments.lib.stats.roc import roc_auc
from experiments.lib.stats.roc import roc_curve
from experiments.lib.stats.roc import RocCurve
from experiments.lib.stats.roc import stratified_attribution_auc
from experiments.lib.stats.roc import stratified_auc
from experiments.lib.stats.verdicts import DIRECTIONS
from experiments.lib.stats.verdicts import verdict
from experiments.lib.stats.verdicts import VERDICTS
