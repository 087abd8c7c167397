"""Dry runs: rlflow's own code executed for one rank of a full-size world, on tensors without memory.

Tensors live on the ``meta`` device (shapes and dtypes, no storage to fill) and torch.distributed runs its
``fake`` backend over a world of the full size (every collective returns at once; torchtitan and PyTorch's own
tests trace distributed programs the same way), so one process executes what a rank of 16 or 384 devices
would: the same plans, buckets, packing, collectives, forwards, backwards and optimizer steps.

    trace.py    ``Watch``: a dispatch mode recording each collective (op, group, shapes, dtypes) in issue order
                and the live device bytes (their peak, per stage, after each plan step); ``fake_world``
    values.py   ``Values``: the values of small meta tensors the step reads on the host (token counts, split
                sizes), and ``Choices``, what the numbers would choose (balanced routing, responses' ends)
    world.py    ``mismatched``: a world's traces checked against each other (a hang or corrupt weights)
    run.py      ``transition`` (the allgather-swap alone) and ``step`` (one RL step of ``runtime.step``; on meta
                tensors, or a fake NPU's: ``StepCase.device``)
    real.py     ``real``: the same step on real tensors to compare with (``real_dock``: the dock its ranks share;
                ``real_pools``: the step on separate pools; ``balanced_routing``: routed as the dry run routes;
                ``as_the_recipe``: the process's host memory kept as the recipe's)
    cost.py     what a traced step costs at a device's rates (``predict``, ``whole_step``; ``DATASHEETS``:
                accelerators' published ones)
    calibrate.py  ``measure``: the rates of the device at hand, by micro-benchmark (its link in a process group)
    npu.py      ``model_program``: a model's forward, backward and generation as an NPU runs them (the NPU
                backend's entries, torch_npu stood in for), on fake tensors of a fake ``npu`` device (a process
                of its own: ``python -m rlflow.dryrun.npu``); the whole step on it: ``StepCase(device="npu")``
    npu_kernels.py  the stood-in NPU kernels as ``torch.library`` ops (shapes, and FLOPs for the cost model)

See docs/dryrun.md.
"""

from rlflow.dryrun.real import as_the_recipe, balanced_routing, real, real_dock, real_pools
from rlflow.dryrun.run import DryFlow, StepCase, staged, step, transition
from rlflow.dryrun.trace import Collective, RankTrace, Watch, fake_world
from rlflow.dryrun.values import Choices, Values
from rlflow.dryrun.world import mismatched

__all__ = ["Choices", "Collective", "DryFlow", "RankTrace", "StepCase", "Values", "Watch", "as_the_recipe",
           "balanced_routing", "fake_world", "mismatched", "real", "real_dock", "real_pools", "staged", "step",
           "transition"]
