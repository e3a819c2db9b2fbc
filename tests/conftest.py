"""Settings shared by every test module.

Under pytest-xdist each worker is its own process, and torch would give each one a thread per
core: two workers on two cores then run four busy threads, and OpenMP's spinning threads wait on
each other. Each worker here keeps to its share of the cores, and so do the processes it starts
(train.py, evaluate.py, torchrun) through OMP_NUM_THREADS, unless that is set already. vLLM's CPU
engine binds its own threads to cores, whatever OMP_NUM_THREADS says.
"""
import os

import torch

_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    _share = max(1, _cores // _workers)
    torch.set_num_threads(_share)
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))
