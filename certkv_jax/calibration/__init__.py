"""Calibration of the radius (method, section 10): split conformal (``conformal``), the
source-robust scheme, the orbax artifact (``store``, imported on use) and the damage predictor."""

from certkv_jax.calibration import conformal
from certkv_jax.calibration import damage_predictor
from certkv_jax.calibration import robust
from certkv_jax.calibration.conformal import ConformalScales
from certkv_jax.calibration.conformal import conformal_rank
from certkv_jax.calibration.conformal import min_finite_calls
from certkv_jax.calibration.conformal import conformal_quantile
from certkv_jax.calibration.conformal import conformity_scores
from certkv_jax.calibration.conformal import check_groups
from certkv_jax.calibration.conformal import fit_scales
from certkv_jax.calibration.conformal import apply_scales
from certkv_jax.calibration.conformal import coverage_and_sharpness
