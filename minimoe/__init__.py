"""minimoe: routing in Mixture-of-Experts layers, as a runnable textbook.

* :mod:`minimoe.ops`      -- the mathematics, as pure functions on tensors
* :mod:`minimoe.routers`  -- one module per router, built by name
* :class:`MoELayer`       -- the layer that runs any router
* :mod:`minimoe.losses`, :mod:`minimoe.metrics` -- auxiliary losses and balance metrics
"""
from . import losses, metrics, ops, routers
from .layers import Experts, MoELayer, reroute
from .routing import Routing

__version__ = "0.1.0"
__all__ = ["MoELayer", "Experts", "Routing", "reroute", "ops", "routers", "losses", "metrics", "__version__"]
