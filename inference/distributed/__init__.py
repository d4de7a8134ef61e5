"""Tensor and expert parallelism on torch.distributed (docs/parallelism.md).

`parallel.Parallel` says how a model is split and runs its collectives (the model code's side);
`group.RankGroup` is rank 0's side of a group of rank processes serving one engine,
`follower.run_follower` a follower's, and `step_broadcast` the step protocol between them.
Only `Parallel` is imported here: the model code imports this package, and the group's modules
import the engine's.
"""

from inference.distributed.parallel import Parallel

__all__ = ["Parallel"]
