"""A RULER-style leaderboard of the eviction designs (``python -m experiments.leaderboard``).

:mod:`.experiment` (plan, units, shared prefills, rows) and :mod:`.report`
(scores per task and ratio, coverage, summary.json, the plot).
"""
