"""Predict a configuration's throughput, idle time and staleness before renting the machines.

A discrete-event model of asyncgrpo's pipeline (`simulate.py`: engines that batch
continuously, the admission throttle, the trainer, weight syncs) driven by component
costs (`costs.py`) that are fitted from a run directory (`calibrate.py`) or written in
a small YAML. `asyncgrpo plan` (`cli.py`) runs a grid of layouts through it. Pure
Python and numpy: planning a cluster needs no torch.
"""

from asyncgrpo.plan.costs import Costs, Lengths, PlanInputError
from asyncgrpo.plan.predict import predict
from asyncgrpo.plan.simulate import Deployment, Prediction, TraceRecorder

__all__ = [
    "Costs",
    "Deployment",
    "Lengths",
    "PlanInputError",
    "Prediction",
    "TraceRecorder",
    "predict",
]
