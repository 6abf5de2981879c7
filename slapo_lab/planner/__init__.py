"""The planner: device profiles, per-block cost profiles, per-rank memory and step time, and the layout search.

* :mod:`.devices` -- :class:`DeviceProfile`, built-in accelerators, :func:`calibrate`;
* :mod:`.profile` -- one meta forward/backward per tensor-parallel degree, per distinct block (cached);
* :mod:`.model` -- :class:`Layout`, :class:`Cluster`, :func:`estimate` -> :class:`Estimate`;
* :mod:`.search` -- :func:`auto_plan` -> :class:`Plan` (ranked candidates and grouped rejections).
"""

from .devices import DEVICES, DeviceProfile, calibrate, device_profile
from .model import Cluster, Estimate, Layout, estimate
from .profile import ModelProfile, PartProfile, profile_model
from .search import Plan, Rejection, auto_plan

__all__ = [
    "DEVICES",
    "Cluster",
    "DeviceProfile",
    "Estimate",
    "Layout",
    "ModelProfile",
    "PartProfile",
    "Plan",
    "Rejection",
    "auto_plan",
    "calibrate",
    "device_profile",
    "estimate",
    "profile_model",
]
