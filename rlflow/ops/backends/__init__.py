"""Fused implementations of ``rlflow.ops`` per device kind (``registry.fused``): ``cpu`` (C kernels
built as torch operators), ``cuda`` (torch paths without host syncs or copies), ``npu`` (torch_npu's
fused operators; not run here). Imported by ``rlflow.ops.registry`` only; model code never imports them."""
