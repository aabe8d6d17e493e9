"""A pytest plugin (``-p wide_on``, this folder on PYTHONPATH) that switches ``mla_decode_launch.WIDE`` on in
every process of the run, xdist's workers included."""

import portattn.kernels.triton.mla_decode_launch as launch

launch.WIDE = True
