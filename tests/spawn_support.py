"""torch.multiprocessing.spawn for gloo rank workers, each process ended by os._exit once its worker returned.

On these VMs the gloo group's threads sometimes abort the interpreter's own exit after the work is done
("terminate called without an active exception", SIGABRT), failing a test whose ranks all finished:
a rank that returned has written what the test reads, so nothing is left for teardown to do. A worker
that raises still fails the run with its traceback (spawn's own wrapper sees the exception)."""
import os
import sys

import torch.multiprocessing as mp


def _run_then_exit(rank, fn, args):
    fn(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn, args, nprocs):
    mp.spawn(_run_then_exit, args=(fn, tuple(args)), nprocs=nprocs, join=True)
