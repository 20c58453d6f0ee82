"""The certificate (method, sections 5 and 10-11): the per-call radius (``radius``), the
evaluation-mode truths, online signals, residual-stream damage and Monte Carlo checks."""

from certkv_jax.certificate import damage
from certkv_jax.certificate import diagnostics
from certkv_jax.certificate import montecarlo
from certkv_jax.certificate import radius
from certkv_jax.certificate import signals
from certkv_jax.certificate.radius import FORMS
from certkv_jax.certificate.radius import SMOOTHING_WINDOW
from certkv_jax.certificate.radius import smoothed_variance
from certkv_jax.certificate.radius import VarianceWindow
from certkv_jax.certificate.radius import smoothed_radius
from certkv_jax.certificate.radius import radius_from_stats
from certkv_jax.certificate.radius import certificate_radius
from certkv_jax.certificate.radius import anytime_delta
from certkv_jax.certificate.radius import aggregate
from certkv_jax.certificate.radius import subsample_mask
from certkv_jax.certificate.radius import subsampled_sum
from certkv_jax.certificate.radius import moving_window
