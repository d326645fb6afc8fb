"""Measuring this machine as the planner's `cpu` device profile: `python -m experiments.calibrate`
(run from a checkout; needs the `calibrate` extra, scipy, for the link fit).

measure.py   the programs timed: matmul and memory rates, collectives between a small GPT's
             blocks, matmul rates by shape, every device training its own copy of that GPT
profile.py   fitting the ring formulas (scipy's non-negative least squares) and the efficiency
             to those times, and storing the profile where `python -m jddp.plan --device=cpu`
             reads it (jddp/planner/devices.py)
"""
