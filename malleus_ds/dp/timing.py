"""What of a ``DeepSpeedEngine``'s forward and backward is communication, left out of the rank's
compute clock (``engine/clock.py``: ``ComputeClock.excluded``).

MalleusDPEngine times each ``forward`` and ``backward`` as a compute span. Inside them DeepSpeed
communicates, and a healthy rank waiting there for a slow peer must not read slow itself:

* every stage: ``engine.allreduce_gradients`` (the boundary's reduction: ZeRO-0's buffered
  all-reduce, ZeRO-1's ``reduce_gradients``, ZeRO-2/3's reduce epilogue);
* ZeRO-1/2 (``DeepSpeedZeroOptimizer``): ``reduce_ipg_grads``, the bucketed gradient
  reduction the backward hooks run, and ``independent_gradient_partition_epilogue`` (the last
  bucket's, at the end of a ZeRO-2 backward);
* ZeRO-3 (``DeepSpeedZeroOptimizer_Stage3``): the parameter coordinator's
  ``fetch_sub_module`` (each sub-module's parameter all-gather, launched and waited for, and
  the prefetches it starts; forward and backward), the optimizer's
  ``__reduce_and_partition_ipg_grads`` (the gradient reduce-scatter of a full bucket) and
  ``independent_gradient_partition_epilogue`` (the last buckets' reduce-scatter at the end of
  each backward).

DeepSpeed calls each of these through its instance (``self.name(...)``), so an instance
attribute of the same name (``exclude_calls``) shadows it. The copies into reduce buckets and
the partitioning of parameters after use stay in compute (local memory work).
"""
from __future__ import annotations

from ..engine.clock import ComputeClock, exclude_calls

#: the ZeRO optimizers' methods that reduce gradients inside backward (a private one as Python
#: stores it); each optimizer has some of them
OPTIMIZER_REDUCE = ("reduce_ipg_grads", "independent_gradient_partition_epilogue",
                    "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads")


def exclude_communication(engine, clock: ComputeClock) -> list[str]:
    """Wrap ``engine``'s communication inside forward and backward (module doc) in
    ``clock.excluded()``; returns what was wrapped, as ``owner.name`` (``engine``,
    ``optimizer``, ``coordinator``)."""
    done = [f"engine.{n}" for n in exclude_calls(engine, ["allreduce_gradients"], clock)]
    opt = engine.optimizer
    if opt is None:
        return done
    done += [f"optimizer.{n}" for n in exclude_calls(opt, OPTIMIZER_REDUCE, clock)]
    offload = getattr(opt, "parameter_offload", None)
    coordinator = getattr(offload, "param_coordinator", None)
    if coordinator is not None:
        done += [f"coordinator.{n}" for n in exclude_calls(coordinator, ["fetch_sub_module"],
                                                            clock)]
    return done
