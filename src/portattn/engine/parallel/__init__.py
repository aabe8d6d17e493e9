"""Tensor-parallel orchestration, the engine's side: ``driver`` (rank 0 starts the ranks, sends each
step and stops them), ``worker`` (the other ranks), ``protocol`` (the per-step message) and
``process_group`` (the process groups and their set-up). What the layers are built for (the
:class:`~portattn.distributed.TPGroup` and its collectives) stays in :mod:`portattn.distributed`."""
