"""Programmatic dependent launch (NVIDIA Hopper and later) for the kernels of a decode step.

A kernel launched with it (``launch_pdl=True``) may start while the kernel before it in the stream is
still finishing: its programs are placed and run their prologue, then wait in
:func:`wait_for_previous` until the previous kernel has completed and its writes are visible. At small
batches, where a step is hundreds of kernels of a few microseconds, that hides part of each launch.
Every kernel that takes ``PDL`` waits before it reads anything an earlier kernel wrote, so the order of
the stream holds from kernel to kernel. On by default (``launch.PDL``; timed in
benchmarks/results/engine_h200/round7/NOTES.md).
"""

import triton
import triton.language as tl


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """With ``PDL``: wait for the previous kernel in the stream to complete, then let the next kernel
    launch (it waits in turn before reading what this one writes). Nothing without."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
