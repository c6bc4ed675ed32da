"""Helper threads that call torch ops without starting a second OpenMP thread pool.

torch runs its CPU ops on the OpenMP pool of the thread that calls them. A helper thread (a tier copy
worker, the storage I/O thread) that runs a large `index_copy_` gets a pool of its own: its threads
spin-wait after every op on the same cores as the scheduler's pool, and with 2 cores that slowed every
decode step by 1.3-1.75x (docs/benchmarks.md, issue 19). A helper's page copies are small enough that
one thread does them well, so it calls `run_ops_on_this_thread_only()` once, first thing.
"""

from __future__ import annotations

import ctypes
import logging

import torch

logger = logging.getLogger(__name__)


def run_ops_on_this_thread_only() -> bool:
    """Make torch CPU ops called from this thread run on it alone; False where the runtime cannot.

    OpenMP's thread count (`omp_set_num_threads`) is a per-thread setting; torch's own
    `torch.set_num_threads` is process-wide and would slow the scheduler, so it is not used. torch sets
    each thread's count from its process-wide one the first time the thread asks for it, so ask first.
    """
    torch.get_num_threads()
    try:
        set_threads = ctypes.CDLL(None).omp_set_num_threads   # the runtime torch loaded (libgomp)
    except (AttributeError, OSError):   # a torch built without OpenMP has no second pool to avoid
        logger.debug("no OpenMP runtime in this process: helper threads keep torch's defaults")
        return False
    set_threads(1)
    return True
