"""Units of work: which models run as one stacked group, how units are cut into chunks, and
whether threads pay.

# NOTE [ Stacked groups ]
# Models are stacked (vmapped as one, NOTE [ Engines ]) only when running the first model's code
# with another model's tensors is the same as running that model: the same module types in the
# same tree, the same plain attributes (hyperparameters such as ``in_features`` or
# ``negative_slope``; an attribute that is no simple value must be the very same object), the
# same parameter and buffer names, shapes, dtypes and devices, the same training flags. A model
# is left alone when vmap could not run it as its own forward would: a module hook, a buffer of a
# module in training mode (forward would update it), or a module or parameter that another entry
# also reaches (its compensated sum and attribute swap must stay per model).
# engine="stacked" stacks every group of two or more such models; engine="auto" only groups of
# small models, where stacking pays: 16 MLPs at 1 thread measured vmap against the plain loop
# at 1.44x for 0.57M parameter-rows (parameters x batch rows) per model, 1.05-1.08x at
# 0.9-1.7M, 0.84x at 6.7M; 64 tiny MLPs (55K) 7.3x. Measured again once Sequentials of Linear
# layers ran as batched matmuls (2 cores, interleaved, batched on every call against one by
# one, 16 MLPs of widths 128-1024 and 32 of width 64 at batches 16-1024): with 2 intra-op
# threads 1.2-2.0x up to 2.5M parameter-rows for models of at most 38K parameters, 0.9-1.4x
# at 6.7-10M (as often a loss as a win once measured one configuration a process: the
# allocator's state decides, NOTE [ Batched slices ] in _engines), but 0.93-0.97x at batch 16
# for models of 76-85K (the per-call stack copies every parameter in and every gradient out,
# whatever the batch) and 0.49-0.98x from 20M; with 1 thread 1.02-1.79x up to 2.3M for models
# of at most 38K (0.86-0.90x at 1.2-1.4M for those of 76-85K), 0.85-0.98x from 2.5M. 16 MLPs
# of width 128 at batch 64, auto's default: 0.80 -> 1.30x the plain loop once stacked.
# Hence: at most AUTO_STACK_MAX_PARAMS parameters a model, and at most
# AUTO_STACK_MAX_PARAM_ROWS parameter-rows (AUTO_STACK_MAX_PARAM_ROWS_ONE_THREAD on a budget of
# one thread). Groups that run as batched matmuls pay from AUTO_STACK_MIN_BATCHED models (48
# tiny MLPs of k architectures, auto stacking groups of 2 or more against 8 or more: 0.78x for
# groups of 2, 0.94x of 3, 1.09x of 4; the 64 tiny MLPs of 12 architectures of bench_speedup,
# groups of 5-6: 8.3 -> 6.4 ms a step, plain loop 6.4). Through vmap smaller groups pay less,
# for vmap's cost per group:
# 48 tiny MLPs in groups of k architectures, n_jobs=1, against the plain loop, stacked/autograd
# measured 0.33/0.58 (k=2), 0.48/0.62 (4), 0.58/0.61 (6), 0.65/0.60 (8): hence groups of 8.
# The frozen parameters and buffers are stacked on every call too, a copy that the models'
# compute does not pay for when they are large: 16 small MLPs with a buffer each, stacked
# against run one by one, measured 2.8 against 3.4 ms a step at 32K elements per buffer, even
# at 128K, and 13.5 against 3.7 ms at 512K (page faults of the 32 MB stack). "auto" stacks
# models of at most 64K such elements.
# On a GPU, where the small kernels of one model at a time leave it idle between launches,
# "auto" stacks identical models of any size: 16 MLPs of width 256 on an H100, stacked on every
# call, measured 5.2-5.9 ms a step against 7.7-8.7 for the plain loop at batch 64-1024 (vmap
# over stacked leaves 1.9-2.3, and 9.6-10.7 for parsum's models one by one).
#
# NOTE [ Threads that pay ]
# With n_jobs left unset, parsum chooses how the thread budget (NOTE [ Thread budget ] in
# _pool) is spent: on intra-op threads inside each model's kernels, or on workers that run
# different models side by side. Whatever the engine: an engine says how each model is run and
# pulled back, not on how many threads. Until 2026-12-05 only "auto" chose, and an explicit
# engine ("autograd", which the docs suggest to run identical models one by one) took the
# whole budget in workers: against that, on 2 cores (benchmarks/bench_against.py --engine,
# 30 rounds, benchmarks/results/threads-for-every-engine-2cores-fifty-eighth.txt), with
# "autograd" 64 tiny MLP classes 1.38x faster (0.65x -> 0.90x the plain loop), 64 tiny MLPs
# 1.25x, 16 small heads 1.25x, medium and large MLPs and CNNs 0.97-1.03x (noise); with
# "stacked" the 64 tiny MLPs 1.41x, with "vjp" the tiny classes 1.39x.
# - A budget of at most INTRA_OP_ONLY_BUDGET threads goes to intra-op threads: the models run
#   in the calling thread as one chunk with the whole budget, as the plain loop does, where
#   their kernels are large enough to split (NOTE [ Kernels too small for intra-op threads ];
#   a budget of 1 keeps the chunks an explicit n_jobs has, run one after the other: one thread
#   either way, and then the bits of an explicit n_jobs, x's gradient's included; 64 tiny
#   MLPs took 2-3% longer a step in 16 chunks than in one, with their outputs summed at once),
#   unless their chunks split evenly over 2 workers and the workers pay with the optimizer the
#   user runs. An ordinary optimizer step between calls runs on the caller's intra-op threads,
#   whose OpenMP threads then spin for 5-9 ms on the cores (NOTE [ Spinning intra-op
#   threads ] in _pool): the next call's helper shares a core with one. Measured on 2 cores,
#   interleaved (20 ms of untimed steps before each timed one), a step with torch.optim.Adam
#   (its default, per-tensor form on the CPU) after each call, against the plain loop with
#   the same: 16 MLPs of widths 128-512 at batch 64, one chunk 0.95x, 2 workers 0.86x; at
#   batch 256, 0.97x and 0.94x; 8 CNNs of widths 8-24 at batch 64, 0.96-0.99x and 0.92-1.05x
#   (six runs: even). Without an optimizer 2 workers won on all of them (the MLPs 1.10-1.12x one
#   chunk), which is what the default measured before (MLPs of kernel shares 2 to 6 and CNNs
#   on workers). With step_in_backward each model's step runs in its worker on one intra-op
#   thread, and the workers win with it: 1.05x, 1.07x and 1.04-1.07x the plain loop with Adam.
#   Ending the caller's OpenMP team before the workers start (NOTE [ The caller's OpenMP
#   team ] in _pool) gives them the core back: with Adam, the MLPs on 2 workers 0.94-0.97x
#   (batch 64) and 0.98-1.04x (256) the plain loop with Adam, one chunk 0.91x; without an
#   optimizer 0.97x against one chunk's 0.89x (batch 64; alternating processes).
#   So 2 workers take models where those with convolutions or recurrent layers do most of the
#   work (by the estimate below: their kernels split worse over intra-op threads, and an LSTM
#   runs all its steps in one operation without the GIL), and models whose kernel
#   share C / O (below) is at least WORKERS_MIN_KERNEL_SHARE, the latter only where the
#   caller's team can be ended or with step_in_backward. That share was 2.0 (the medium MLPs
#   at batch 32, share 1.1, had run 5.15 ms a step on workers against 4.80 in one chunk) until
#   MLPs written as classes of their own (benchmarks' distinct-medium, 16 of widths 128-488)
#   showed it a cliff: at batch 64, share 1.99, one chunk ran 0.88x the plain loop and 2
#   workers 1.05x. Measured again (2026-11-29, 2 cores, interleaved, 24 rounds, against the
#   faster plain loop; with torch.optim.Adam after each step in brackets), one chunk -> 2
#   workers: distinct-medium at batch 16 (share 0.50) 0.80 -> 0.91 (0.91 -> 1.04), 32 (1.00)
#   0.87 -> 1.01 (0.93 -> 1.04), 64 (1.99) 0.90 -> 1.05 (0.79 -> 0.98); the Sequential MLPs of
#   widths 128-512 at batch 32 (1.11) 0.92 -> 1.07 (0.97 -> 1.05); at batch 8 (share 0.25)
#   even, 0.77 and 0.76. Either only where the
#   chunks, claimed in their order by whichever worker is free, would finish within
#   MAX_IMBALANCE of an even split by estimated cost: two large models and a small one left a
#   worker idle (3 MLPs of widths 512, 512 and 512 with one layer fewer, batch 256: 2 workers
#   0.94x one chunk, estimated 1.08 of even; 24 MLPs of widths 32-64 and 8 of 512-768 at batch
#   128, 1.12 of even: 0.94x; 3 of widths 256-2048: 0.58-0.64x). Recurrent models on 2
#   workers against one chunk (2026-11-27, LSTMs or GRUs with a Linear head, batches of 4x5 to
#   64x20 steps, kernel shares 0.25 and below): 8 LSTMs of widths 4-18 1.11x, 16-30 1.26x,
#   16 GRUs of widths 16-46 1.71x (the plain loop on 2 intra-op threads 1.31x slower than on 1
#   there), where the estimate had kept one chunk; 8 LSTMs of widths 64-120 and 4 of 128-224,
#   on workers already, 1.02x and 0.98x.
# - A larger budget goes to workers, each with budget // chunks intra-op threads (1 with 16
#   chunks, 4 for 4 wide models on 16 cores, the fastest measured there). A model's Python work
#   (module calls, autograd bookkeeping) holds the GIL, so workers overlap only its kernels:
#   with G the models' GIL-held overhead and C their kernels, a step takes at least G and about
#   (G + C) / workers, so more than 1 + C / G workers add nothing but contention. Costs are
#   counted in parameter-rows (parameters times batch rows, NOTE [ Chunks ]); a model's whole
#   overhead O is MODEL_OVERHEAD_PARAM_ROWS, of which G is GIL_SHARE_OF_OVERHEAD (the rest,
#   dispatch and the autograd engine's C++, runs without the GIL); below C / O =
#   MIN_KERNEL_SHARE the forwards run in the calling thread (their pullbacks: NOTE
#   [ Pullbacks of small models ]), and no more than
#   MAX_USEFUL_WORKERS workers run, or half the budget where that is more (a guess for machines
#   beyond 16 cores, where a fixed 8 would leave most of them idle; only 16 were measured).
#   Measured on 16 cores (2026-11-27, torch 2.11, H200 machine, 16 cores without SMT;
#   benchmarks/results/speedup-16cores.txt), 16 MLPs of widths 128-512 ran fastest on 8
#   workers at batch 64 (7.81 ms; 9.03 on 4, 9.54 on 16, the hand split 7.15 on 8) and at
#   batch 256 (10.87 ms; 14.37 on 4, 13.08 on 16, the hand split 9.94 on 8 and 13.39 on 16),
#   where G = O (1 + C / O: 4 and 10 workers) chose 8.92 and 12.42 ms; 64 tiny MLPs ran
#   fastest on 1-2 (the 1-thread plain loop beat every split), where C / O is below
#   MIN_KERNEL_SHARE. A table read through ``take_rows`` counts the elements its last call
#   gathered, not its size: a model that samples 64 rows of a 65536-row table does the work of
#   64 rows. A convolution's weights count once per position of the input they slide over (its
#   positions over the stride): 8 small CNNs on 28x28 images at batch 8-16 ran 1.5x faster on
#   2 threads than on 1, which counting each weight once (0.07-0.15M parameter-rows a model)
#   missed.
#
# NOTE [ Threads without the GIL ]
# The rules above count the GIL: a model's Python runs on one thread at a time, so small models
# keep their forwards in the calling thread and the forwards take fewer workers than the
# pullbacks. A free-threaded interpreter (Python 3.13t and later, with torch's cp314t wheels)
# runs that Python side by side, and there the forwards take the pullbacks' workers. Only the
# workers change, never the chunks, so the bits are those of the GIL's interpreter and of any
# n_jobs. The GIL's state is read on every call and is part of the plan's key: such an
# interpreter enables the GIL when a module that needs it is imported (torch.optim imports
# torch._dynamo, which imports triton where it is installed, as with torch's CUDA wheels; a CPU
# wheel has none). Measured on 2 cores (2026-12-04, Python 3.14.4 built with --disable-gil,
# torch 2.13.0, triton removed; benchmarks/bench_against.py --rev HEAD, 30 interleaved rounds,
# one process): 64 tiny MLPs 1.173x the code before (1.53x the plain loop on 2 intra-op threads,
# 1.30x before), 64 tiny MLP classes 1.138x; the medium MLPs (workers already) 1.016x and
# identical tiny MLPs (stacked) 1.018x: unchanged. On that interpreter with PYTHON_GIL=1 the
# same code keeps its rules. Only 2 cores were measured: the pullbacks' worker counts, and the
# cap of NOTE [ Threads that pay ] on larger budgets, are still the GIL's.
#
# NOTE [ Forwards on fewer workers ]
# Workers chosen by parsum run the forwards on fewer threads than the pullbacks. A forward
# holds the GIL for nearly all of the models' GIL-held overhead G (their module calls; a
# pullback runs in the autograd engine's C++) and does about a third of their kernel work C
# (one matmul of a Linear's three), so by the bound of NOTE [ Threads that pay ] the forwards
# pay up to 1 + (C / 3) / G = 1 + C / O workers, the pullbacks up to 1 + C / G. The chunks and
# their order are the same on any number of threads: the bits do not change. Measured on 16
# cores (2026-11-30, the H200 machine, torch 2.11), 16 MLPs of widths 128-512 at batch 64 (C / O
# 2.2; 8 workers chosen): the forward's job took 2.06 ms on 4 threads, 2.42 on 8 and 2.90 on
# 16, its chunks 2.0x, 3.7x and 6.5x slower than one at a time, the pullbacks' 2.18, 1.73 and
# 2.04 ms (``benchmarks/bench_places.py``). The default with its forwards capped at 2, 3, 4 and
# 6 threads against uncapped, interleaved (25 rounds): 7.08, 6.41, 6.25, 6.28 against 6.48 ms;
# 16 MLP classes of widths 128-488 (C / O 2.0, 7 workers) 5.93, 5.69, 5.81, 5.77 against 6.06
# ms. Where the kernels weigh more a cap slowed the step: the MLPs at batch 256 (8.9) 14.5,
# 11.7, 11.3, 10.9 against 10.7 ms, 8 small CNNs (63) 43.8, 32.2, 29.5, 25.5 against 26.2. The
# rule gives the forwards 4 threads for the first, 3 for the second, all the workers for the
# last two. Against the code before, in one process (benchmarks/bench_against.py, 20 rounds):
# 1.020x and 1.021x at batch 64, where the CNNs, which it leaves alone, moved 1.028x: a gain the
# size of the noise there. On 2 threads it changes nothing (any share gives 2).
#
# NOTE [ Pullbacks of small models ]
# Models whose kernels weigh too little against their Python for workers in forward (C / O below
# MIN_KERNEL_SHARE: many tiny MLPs) keep their forwards in the calling thread, but not their
# pullbacks: a pullback runs in the autograd engine's C++, which holds no GIL, so threads overlap
# it whatever the kernels' size. What a worker costs is fixed (its job, its engine calls, their
# Python: NOTE [ Pullbacks in runs of chunks ] in _inline), so the pullbacks take one worker for
# each PULLBACK_WORKER_PARAM_ROWS of the models' estimated cost (MODEL_OVERHEAD_PARAM_ROWS a
# model plus their parameter-rows: a worker for about 6 tiny models), at most
# MAX_SMALL_PULLBACK_WORKERS. The chunks do not change, so neither do the bits. Measured on 2
# cores (2026-12-01, one process, interleaved in shuffled rounds; 2 pullback workers against
# the calling thread alone, everything else the same): MLP classes of widths 16-47 at batch 32,
# 8 of them 0.86-0.94x (they keep the calling thread: 1 worker's share), 12 0.997x, 16 1.047x,
# 24 1.124x, 64 (benchmarks' distinct-tiny) 1.16x; the 64 through ParallelSum, a compensated
# FlatGrad 1.106x, one model entered twice 1.139x; with x's gradient 1.202x, with a full
# backward hook on each model (Python in the pullbacks) 1.160x; 64 tiny Sequentials in stacked
# groups of chunk_size 6 1.077x. Against the code before (benchmarks/bench_against.py, 40
# rounds): distinct-tiny 1.15-1.20x (0.92-0.98x the plain loop, from 0.80-0.82x), at batch 16
# 1.12-1.20x; with torch.optim.Adam after each step 1.04x and 1.07x; with step_in_backward
# (one chunk: NOTE [ Kernels too small for intra-op threads ]) and 8 EmbeddingBags (one worker's
# share) unchanged. The backward of distinct-tiny alone: 8.35 -> 6.99 ms (the engine's work
# on two cores, and the parameters' None visits, NOTE [ Pullbacks joined later ] in _function,
# overlapping a helper's). More than 2 workers, on more cores, were not measured.
# Stacked groups of such models kept one chunk on a budget of 2 (NOTE [ Kernels too small for
# intra-op threads ]), their batched matmuls on both intra-op threads; with their pullbacks on
# workers, the chunks pay while a group stays under STACKED_INTRA_OP_MIN_PARAM_ROWS. The chunks
# against one chunk (one process, 40 rounds against the code before): 64 Sequentials of 12
# architectures (benchmarks' heterogeneous-tiny, groups of 0.02-1.1M parameter-rows at batch
# 32) 1.08x at batch 8 and at 32, 1.02x at 128 (up to 4.4M), 0.95x at 256 and 0.89x at 512;
# against one chunk in place (60 rounds) 2 groups of 32 Sequentials 1.08x, 8 of 8 1.07x, 4
# groups of 16 classes of their own (through vmap) 1.06x, all at batch 32; 4 groups of 16
# Sequentials at batch 128 0.99x.
# Models of their own (not stacked) went to one chunk on both intra-op threads as soon as one
# reached INTRA_OP_MIN_PARAM_ROWS, measured before their pullbacks went to workers: the 64 tiny
# classes from batch 64 (0.35M parameter-rows the largest) then ran 0.77x the 1-thread plain
# loop, at 128 0.61x. With their pullbacks on workers they keep their chunks below
# SMALL_INTRA_OP_MIN_PARAM_ROWS a model. Chunks against one chunk (2 cores, 2026-12-01, in
# place, 30 rounds): batch 64 1.26x, 128 1.37x, 256 (1.4M) 1.05x, 512 (2.8M) 0.93x, 1024 (5.6M,
# no longer too small for workers) 0.99x; against the code before (bench_against.py, 30
# rounds) 1.28x, 1.18x and 1.06x at batch 64, 128 and 256.
#
# NOTE [ Kernels too small for intra-op threads ]
# A budget of 2 spent on intra-op threads helps kernels only where they are large enough to
# split: an MLP's matmuls of 32 rows and widths under 50 are not, and a second thread then costs
# each parallel op its wake-up, and the core when the machine is busy. Where every unit has
# fewer than INTRA_OP_MIN_PARAM_ROWS parameter-rows and none is a stacked group, the default
# keeps the chunks of an explicit n_jobs in the calling thread, on one intra-op thread each, as
# a budget of 1 does, and gives an explicit n_jobs's bits. Measured on 2 cores (2026-11-29, in
# one process, each way on its own copy of the models, interleaved, 30-40 rounds, three runs,
# the last ``benchmarks/bench_intra_op.py``): 64 distinct MLP classes of widths 16-47 at batch
# 32 (0.18M parameter-rows the largest) 1.08x, 1.17x and 1.08x faster, at batch 16 1.04x,
# 1.14x and 1.05x, 8 EmbeddingBags with a head 0.99x, 1.08x and 0.97x (the second run on a
# busier machine: the plain loop 1.43x slower on 2 threads than on 1 there, 1.10x in the
# first); at batch 64 (0.35M) even, 16 MLP classes of widths 128-488 at batch 1 (0.47M) even.
# 64 tiny Sequential MLPs in stacked groups ran 0.95x at batch 8 (a group's matmuls are
# batched over its models): groups keep one chunk, unless their pullbacks go to workers (NOTE
# [ Pullbacks of small models ]). So do models whose optimizer steps in the
# backward: the steps of a chunk's small models run as one (NOTE [ One step over a chunk's
# small models ] in _fused), and in 16 chunks the tiny classes with one Adam each ran 0.93x,
# the EmbeddingBags 0.70x. With Adam stepped after the call, the tiny classes ran 1.01-1.19x
# (four runs; at batch 16 1.06-1.19x), the EmbeddingBags 0.98-1.05x (``bench_intra_op.py
# --adam``). A fourth run without Adam, in ``run_16cores.sh twocores`` (pinned to 2 cores,
# 20 rounds): 1.03x, 1.09x at batch 16, the EmbeddingBags 0.98x.
#
# NOTE [ Chunks ]
# Chunk boundaries depend on the models, the units, the batch rows, ``chunk_size`` and the thread
# budget alone, never on ``n_jobs``, so the order of additions, hence the bits, are the same for
# any number of workers. With ``chunk_size`` given, a chunk holds that many models. Without, the
# units are cut into min(MAX_CHUNKS, units) consecutive chunks of about equal estimated cost, so
# that no chunk holds far more work than another: with as many workers as chunks, the slowest
# chunk is the call's time; on a budget of fewer threads, into fewer
# (NOTE [ Chunks a thread ]). The estimate is computed from shapes only, never from timings,
# which differ between calls and would change the bits with them: a model costs its
# parameters' and frozen tensors' elements times the batch rows (a convolution's times the
# positions it slides over, NOTE [ Threads that pay ]; a sequence's layers' times its tokens,
# NOTE [ Tokens ]), plus MODEL_OVERHEAD_PARAM_ROWS for its Python and autograd work.
# Fitted here (1 thread, forward + backward of MLPs of 0.1M to 580M parameter-rows, 2 vCPUs):
# about 250 us a model plus 65 us per million parameter-rows, so the overhead weighs as about
# 4M parameter-rows. A table read through ``take_rows`` counts one row per batch row (its last
# call's rows would make the chunks depend on the data).
#
# NOTE [ Chunks a thread ]
# Every chunk costs its thread a claim, a task, its own compensated sum and its share of the
# pullbacks' engine calls, which under the GIL delay the other threads too. On 2 threads the
# MAX_CHUNKS chunks of 16 medium MLPs cost a step 0.5-1 ms more than 4 (2 cores, 2026-12-04,
# steps in a row: 6.99 ms in 16 chunks, 6.32 in 4; 7.15 and 6.24 for the classes of their own),
# where the two-phase ceiling took 5.2 and 4.8 ms. Fewer chunks balance worse where the units
# differ in cost: 24 small MLPs then 8 wide ones in 4 chunks of about equal estimated cost left
# one thread the costlier part (an estimated span 1.10x the even share, against 1.02x in 10
# chunks) and ran 0.94-0.95x as fast. So where no other rule chose the chunks, a call cuts
# between MAX_CHUNKS and CHUNKS_PER_THREAD a thread of the budget (``thread_chunks``) the
# number whose estimated time on the budget's threads is least: the span of the chunks' costs
# claimed costliest first, plus CHUNK_OVERHEAD_PARAM_ROWS a chunk spread over the threads
# (50 us against a model's 250). The choices above (one chunk on intra-op threads, a stepping
# call's chunks) are made on MAX_CHUNKS's chunks, as they were measured. The budget, not
# ``n_jobs``, decides, so every ``n_jobs`` has the same bits; the bits depend on the budget, as
# the intra-op threads already make them (NOTE [ Thread control ] in _pool). On 16 threads it
# changes nothing (2 a thread is more than MAX_CHUNKS). Against the code before, in one process
# (benchmarks/bench_against.py, 2 cores, 40 rounds, default; with 4 chunks where these cut 4,
# in the first runs): 16 MLPs of widths 128-512 at batch 64 1.08-1.09x (three runs; 4 chunks),
# their classes 1.10-1.13x (three; 4), 8 LSTMs 1.09-1.10x (two; 4), 8 transformer layers
# 1.055x (two; 4), 8 CNNs 1.04x and 1.09x (4), the 24 small and 8 wide MLPs 1.04x (8; 0.94x in
# 4), the 16 MLPs at batch 256 1.02x (9; 1.01x in 4), 64 tiny Sequentials 1.01x (6), 64 tiny
# classes 1.00-1.01x (two; 4), 16 identical MLPs 1.00x, 64 identical ones 0.985x; at n_jobs=2 the
# medium MLPs 1.08x, the tiny ones 1.03x, 8 EmbeddingBags 1.04x; at n_jobs=1 unchanged
# (0.99-1.00x: one thread runs its chunks in one pass, NOTE [ Chunks in one pass ] in
# _function).
"""

from __future__ import annotations

import math
import operator
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from itertools import chain
from typing import Any, NamedTuple, cast

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from . import _config, _pool
from ._config import thread_budget
from ._engines import (
    GLOBAL_HOOKS,
    MODULE_INTERNALS,
    VMAP_FAILED,
    ModelParams,
    Unit,
    is_compiled,
    program_of,
)
from ._fused import MERGED_STEP_ELEMENTS
from ._sparse import any_sampled, sampled_elements

# engine="auto" stacks groups of at least AUTO_STACK_MIN_MODELS models (AUTO_STACK_MIN_BATCHED
# where they run as batched matmuls) of at most
# AUTO_STACK_MAX_PARAMS parameters, AUTO_STACK_MAX_PARAM_ROWS parameter-rows (on one thread
# AUTO_STACK_MAX_PARAM_ROWS_ONE_THREAD) and AUTO_STACK_MAX_STATE_ELEMENTS elements of frozen
# parameters and buffers each (NOTE [ Stacked groups ]).
AUTO_STACK_MAX_PARAMS = 65_536
AUTO_STACK_MAX_PARAM_ROWS = 4_000_000
AUTO_STACK_MAX_PARAM_ROWS_ONE_THREAD = 2_000_000
AUTO_STACK_MAX_STATE_ELEMENTS = 65_536
AUTO_STACK_MIN_MODELS = 8
AUTO_STACK_MIN_BATCHED = 4

# NOTE [ Batched groups once features first ]
# Groups that run as batched matmuls cost less since their layers run features first (NOTE
# [ Features first ] in _engines): the gradients are no longer copied out of a transposed
# layout. Measured again on 2 cores (interleaved, bench_stacking.py and single cases, stacked
# on every call against auto's one by one in the calling thread): with 2 threads 1.1-1.8x for
# models of 9K-301K parameters from 1.4M to 21.8M parameter-rows (85K parameters at batch 16:
# 1.56x, where the copies in and out had cost 0.93-0.97x before), 0.96-1.07x at 26.8-87M, and
# 0.42-0.52x for models of 1.1M parameters even at 4.5M (the stack copies 36 MB a call); with 1
# thread 1.12-1.31x for 85K parameters up to 6.7M, 0.88-0.97x from 9.2M, 0.92x for 301K
# parameters. Hence, where the budget leaves every model in the calling thread (at most
# INTRA_OP_ONLY_BUDGET threads: stacking takes no worker's work away), such groups go by
# AUTO_STACK_BATCHED_LIMITS. Larger budgets keep the limits above: unmeasured there.
AUTO_STACK_BATCHED_LIMITS = {1: (131_072, 6_000_000), 2: (327_680, 24_000_000)}

# NOTE [ Small groups of few layers ]
# A stacked group saves, for every model but its first, the calls of each of its layers,
# forward and backward; it costs, once a group, the stacking of its tensors in and of their
# gradients out, in Python and copies. Once Sequentials of known layers ran as a plain graph
# (NOTE [ Known layers in a plain graph ] in _plain_graph), whose models one by one cost far
# less than on the general path, small groups of few layers stopped paying on one thread.
# Measured on 2 cores (interleaved, groups stacked (engine "stacked") against one by one
# ("autograd"), both as a plain graph, 4 architectures of g models, inputs of 16 and 128
# features, hidden widths 16-256, batches 32-256), with L Linear layers a model, stacked / one
# by one on 1 thread: L=2, g=4 1.01-1.18 (slower), g=5 0.94-1.02, g=6 0.87-1.00, g=8 0.70-1.09
# (1.04-1.09 from 2.3M parameter-rows); L=3, g=4 0.94-1.02; L=4, g=4 0.89-1.03; one Linear,
# g=6 1.04-1.14, g=8 0.97-1.01, g=12 0.82-0.88. So on one thread a batched group is stacked
# only where (g - 1) * L >= AUTO_STACK_MIN_SAVED_LAYERS: one Linear from 9 models, L=2 from 5,
# L=3 from 4. On 2 threads the batched kernels also split over both where the small ones do
# not: L=2, g=4 0.93-1.08, and 16 heads of widths 32-80 over 128 features (4 groups of 4, L=2)
# one by one ran 0.93-0.97x as fast as stacked at batch 128-512 (bench_against.py): larger
# budgets keep AUTO_STACK_MIN_BATCHED.
#
# NOTE [ Small groups in a forward alone ]
# With grad disabled (an evaluation under no_grad or inference_mode) a group saves its layers'
# forward calls alone, with no backward's, and still stacks its tensors in, a cost that does
# not shrink with the batch. Measured on 2 cores under no_grad (interleaved, 40-60 rounds, 4
# architectures of g models, inputs of 16 and 128 features, widths 16-256; speed of the group
# stacked against one by one, both through the plain graph's forward): on 2 threads L=2, g=4
# 0.80-0.93 at batch 64 and 1.00-1.07 at 512, g=6 0.94-1.12, g=8 1.06-1.31; L=3, g=4
# 0.94-1.05; L=4, g=4 0.95-1.09; on 1 thread L=2, g=4 0.82-0.86 at batch 64 and 0.98-1.04 at
# 512, g=8 0.98-1.10; L=3, g=4 0.87-1.00. One Linear, whose group is a single matmul of every
# model's weight rows with the shared input (NOTE [ Features first ] in _engines), stacked from
# g=4 on 1 thread ran 1.31-1.99x as fast at batch 64-512 in the sweep, 0.94-1.12x at batch 64
# and 1.62-1.68x at 512 in two groups alone. So a forward alone on a budget of at most
# INTRA_OP_ONLY_BUDGET stacks one Linear from AUTO_STACK_MIN_BATCHED models, and on 2 threads
# groups at fewer than AUTO_STACK_FORWARD_ROWS rows (batch rows times tokens) by the layers
# they save, as one thread does. Against the code before in one process (bench_against.py
# --step eval, 80 rounds, three runs): 16 heads of widths 32-80 over 128 features (4 groups of
# 4, L=2) 1.11-1.14x faster at batch 64 (0.84-0.89x -> 0.96-0.99x the plain loop) and
# 1.02-1.12x at 128; at 256-1024 they stay stacked (unstacked, in an earlier version of the
# rule, 1.00-1.03x, 0.94-0.95x and 0.94-1.09x); 64 tiny MLPs in groups of 5-6 and 64 identical
# ones keep their groups; a training step is planned as before. Larger budgets: unmeasured.
AUTO_STACK_MIN_SAVED_LAYERS = 8
AUTO_STACK_FORWARD_ROWS = 256

# NOTE [ Stacked storage sizes ]
# Models in ``stack_`` storage are stacked already: their batched forward copies no parameter
# in and no gradient out, and running them one by one instead costs more than it costs models
# of their own (the gradients then gather into the stacked buffers). So "auto" batches them up
# to larger sizes than the groups it stacks on every call. Measured on 2 cores (interleaved,
# bench_stacking.py; 16 MLPs of widths 128-1024 and 32 of width 64, batches 16-1024), batched
# against one by one in stack_ storage: with 2 intra-op threads 1.0-4.6x up to 39M
# parameter-rows a model, 0.89-1.07x at 79-87M; with 1 thread 1.03-3.5x up to 6.7M (0.97x once
# at 5.4M), 0.87-0.97x at 9-87M but 1.14x at 79M. On a GPU any size, as for auto's groups.
# That is for models that run as batched matmuls; through vmap (16 two-layer residual blocks
# of widths 128-512) batched/one by one measured 1.34-1.44x up to 4.4M and 0.84-0.96x from
# 8.6M with 2 threads, 1.26x at 1.1M and 0.96x at 4.4M with one: those go by the limits of
# auto's groups (NOTE [ Stacked groups ]).
AUTO_STACK_STORAGE_MAX_PARAM_ROWS = 40_000_000
AUTO_STACK_STORAGE_MAX_PARAM_ROWS_ONE_THREAD = 8_000_000


# NOTE [ Layers vmap loops over ]
# vmap has no batching rule for the operation that does most of an EmbeddingBag's work
# (``aten::_embedding_bag``, torch 2.11-2.15): it runs that operation once per model and stacks
# the results, and warns on every call ("There is a performance drop because we have not yet
# implemented the batching rule ..."). A stacked group of models built on it is one by one
# with extra copies, so "auto" leaves them unstacked: 8 identical models of an EmbeddingBag of
# 1000 x 32 and a Linear head, batch 64 x 8, 2 cores, 1.51 ms a step stacked, 1.08 one by one.
# Models with another operation vmap loops over stay stacked where the rest pays: 8
# TransformerEncoderLayers of width 16 (``scaled_dot_product_attention`` loops) 2.82 ms
# stacked, 4.09 one by one (torch's warning then shows; engine="autograd" avoids it).
LOOPED_UNDER_VMAP: tuple[type[nn.Module], ...] = (nn.EmbeddingBag,)

# Chunks of about equal estimated cost, at most MAX_CHUNKS and CHUNKS_PER_THREAD a thread of
# the budget (NOTE [ Chunks ]).
MAX_CHUNKS = 16
CHUNKS_PER_THREAD = 2
# What a chunk costs beyond its models (NOTE [ Chunks a thread ]): about 50 us, forward and
# backward, against a model's 250.
CHUNK_OVERHEAD_PARAM_ROWS = 800_000
# A thread's chunks where optimizers step in the backward (NOTE [ Chunks of models that step ]).
STEPPING_CHUNKS_PER_THREAD = 2
MAX_ESTIMATES = 64  # what a model's findings keep (``estimate``)
MODEL_OVERHEAD_PARAM_ROWS = 4_000_000
# A chunk left to the caller at the end of a job (NOTE [ The caller's last chunk ] in _pool):
# at most a model whose kernels weigh half its overhead, about 0.4 ms forward and backward.
CALLERS_LAST_PARAM_ROWS = 6_000_000

# NOTE [ Threads that pay ]: budgets up to this go to intra-op threads; below this share of
# kernel work over Python overhead the models run in the calling thread.
INTRA_OP_ONLY_BUDGET = 2
MIN_KERNEL_SHARE = 0.25
GIL_SHARE_OF_OVERHEAD = 1 / 3
MAX_USEFUL_WORKERS = 8
# NOTE [ Threads that pay ]: from this kernel share a budget of 2 goes to workers (with the
# caller's team ended, or step_in_backward), where the chunks split within MAX_IMBALANCE of
# evenly: between the shares measured even (0.25) and faster on workers (0.50).
WORKERS_MIN_KERNEL_SHARE = 0.4
# NOTE [ Known layers on one thread ] in _plain_graph: models of known layers whose kernel work
# is below this share of their Python run in one chunk, as a plain graph.
PLAIN_GRAPH_MAX_KERNEL_SHARE = 2.0
MAX_IMBALANCE = 1.05
# NOTE [ Pullbacks of small models ]: a pullback worker for each this many parameter-rows of
# the models' estimated cost (MODEL_OVERHEAD_PARAM_ROWS a model and their own), at most this
# many workers.
PULLBACK_WORKER_PARAM_ROWS = 24_000_000
MAX_SMALL_PULLBACK_WORKERS = 2
# NOTE [ Pullbacks of small models ]: on a budget of 2, stacked groups of such models keep their
# chunks (pullbacks on workers) below this many parameter-rows a group, and one chunk on both
# intra-op threads from it.
STACKED_INTRA_OP_MIN_PARAM_ROWS = 4_000_000
# NOTE [ Kernels too small for intra-op threads ]: below this many parameter-rows in every
# unit (none stacked, no step in the backward), a budget of 2 keeps the models on one
# intra-op thread.
INTRA_OP_MIN_PARAM_ROWS = 262_144
# NOTE [ Pullbacks of small models ]: on a budget of 2, models too small for forward workers
# whose pullbacks go to workers keep their chunks below this many parameter-rows a model.
SMALL_INTRA_OP_MIN_PARAM_ROWS = 2_000_000


def storage_stack_limit(device: torch.device, budget: int, batched: bool) -> int | None:
    """The parameter-rows a model up to which engine="auto" runs models in ``stack_`` storage
    as one batched forward on ``budget`` threads, ``batched`` if they run as batched matmuls
    (NOTE [ Stacked storage sizes ]); None: any."""
    if device.type == "cuda":
        return None
    if not batched:
        return _group_param_rows(budget)
    if budget > 1:
        return AUTO_STACK_STORAGE_MAX_PARAM_ROWS
    return AUTO_STACK_STORAGE_MAX_PARAM_ROWS_ONE_THREAD


# NOTE [ Global module hooks and stacked groups ]
# A global module hook (``register_module_forward_hook`` and the like: ModuleTracker's,
# FlopCounterMode's, a user's activation logger) runs, in the plain loop, for every module of
# every model. A stacked group runs none of its models' modules: Sequentials of known layers as
# batched matmuls (NOTE [ Batched layers ] in _engines), which called no hook at all (8
# identical MLPs with a hook scaling each Linear's output by 1.5 summed to values off by 1.6 to
# 6, silently), others through vmap over shadow modules, whose hooks ran once a group on the
# shadows (3 calls where the plain loop makes 24). So while one is registered no group is
# stacked, whatever the engine: the models run one by one, through their own modules, and
# models in ``stack_`` storage too, for that call, their gradients gathered into the stack's
# buffers as for models too large to stack (``ONE_BY_ONE`` in _stack); the next call without
# a hook stacks them again. The hook's presence is part of the plan's key. The same holds under
# a torch function or dispatch mode other than the default device's (``modes_stay_here`` in
# _pool): a group's batched matmuls call ``addmm`` and ``baddbmm`` where each model calls
# ``F.linear``, so a mode that rounds every ``F.linear``'s output (fake quantization) saw none
# of them (8 MLPs off by 1.6, silently).


def module_calls_watched() -> bool:
    """Whether a global module hook is registered or a mode is on in this thread: then no
    models are stacked (NOTE [ Global module hooks and stacked groups ])."""
    return any(GLOBAL_HOOKS) or _pool.modes_stay_here()


def plan_units(
    models: Sequence[Callable[..., Any]],
    model_params: Sequence[ModelParams],
    engine: str,
    batch: Batch,
    chunk_size: int | None,
    budget: int | None = None,
    key_of: Callable[[int], Hashable | None] | None = None,
    forward_only: bool = False,
) -> list[Unit]:
    """The units of a call, in the order of their first model, ``auto``'s groups sized for
    ``budget`` threads (default: this thread's, ``_config.thread_budget``) and for a forward
    alone where ``forward_only`` (grad disabled); ``key_of(i)``: model i's ``structure_key``
    where it is known already."""
    if engine in ("autograd", "vjp"):
        return [Unit((i,), engine) for i in range(len(models))]
    if module_calls_watched():
        return [Unit((i,), "autograd") for i in range(len(models))]
    auto = engine == "auto"
    min_models = AUTO_STACK_MIN_BATCHED if auto else 2
    # Models of one parameter layout first: the sharing check and structure keys cost far more,
    # and this runs on every call, so only layouts with enough models get them.
    layouts: dict[Hashable, list[int]] = {}
    for i, (model, mp) in enumerate(zip(models, model_params)):
        if isinstance(model, nn.Module) and mp.tensors and not (auto and model in VMAP_FAILED):
            layouts.setdefault(_layout(model, mp), []).append(i)
    candidates = [same for same in layouts.values() if len(same) >= min_models]
    stackable = set(_stackable(models, model_params)) if candidates else set()
    groups: dict[Hashable, list[int]] = {}
    for same_layout in candidates:
        members = [
            i
            for i in same_layout
            if i in stackable
            and (not auto or _small_enough(models[i], model_params[i], batch, budget))
        ]
        if len(members) < min_models:
            continue
        for i in members:
            key = structure_key(model_params[i]) if key_of is None else key_of(i)
            if key is not None:
                groups.setdefault(key, []).append(i)
    group_of: dict[int, tuple[int, ...]] = {}
    for members in groups.values():
        first = members[0]
        layers = (
            estimate(model_params[first], "batched", _batched_layers, models[first]) if auto else 0
        )
        batched = layers > 0
        if len(members) < (auto_min_group(batched) if auto else min_models):
            continue
        if batched and len(members) < _min_batched_group(
            model_params[first], layers, budget, batch, forward_only
        ):
            continue  # NOTE [ Small groups of few layers ]
        size = chunk_size or len(members)
        for start in range(0, len(members), size):
            piece = tuple(members[start : start + size])
            if len(piece) > 1:
                for i in piece:
                    group_of[i] = piece
    units = []
    for i in range(len(models)):
        found = group_of.get(i)
        if found is None:
            units.append(Unit((i,), "autograd"))
        elif found[0] == i:
            units.append(Unit(found, "stacked"))
    return units


def _layout(model: nn.Module, mp: ModelParams) -> Hashable:
    """A model's class and its parameters' shapes, kept by its findings: identical models
    share it (``plan_units``)."""
    return cast(Hashable, estimate(mp, "layout", _layout_now, model, mp))


def _layout_now(model: nn.Module, mp: ModelParams) -> Hashable:
    """``_layout``, found now."""
    return type(model), tuple(p.shape for p in mp.tensors)


def _batched_layers(model: Any) -> int:
    """The Linear layers of such a model where a stacked group of them runs as batched matmuls
    (NOTE [ Batched layers ] in _engines); 0 where it does not."""
    program = program_of(model) if isinstance(model, nn.Module) else None
    return 0 if program is None else sum(isinstance(step, tuple) for step in program)


def auto_min_group(batched: bool) -> int:
    """The fewest identical models engine="auto" stacks, ``batched`` if they run as batched
    matmuls, which pay from fewer than vmap (NOTE [ Stacked groups ])."""
    return AUTO_STACK_MIN_BATCHED if batched else AUTO_STACK_MIN_MODELS


def _min_batched_group(
    mp: ModelParams, layers: int, budget: int | None, batch: Batch, forward_only: bool = False
) -> int:
    """The fewest models like ``mp``, of ``layers`` Linear layers, that engine="auto" stacks
    as batched matmuls on ``budget`` threads of the CPU (NOTE [ Small groups of few layers ]):
    on one, by their layers; for a forward alone on at most INTRA_OP_ONLY_BUDGET, one Linear
    from AUTO_STACK_MIN_BATCHED and, below AUTO_STACK_FORWARD_ROWS rows, more layers by their
    layers on two threads too (NOTE [ Small groups in a forward alone ])."""
    if mp.tensors[0].device.type != "cpu":
        return AUTO_STACK_MIN_BATCHED
    budget = thread_budget() if budget is None else budget
    if forward_only and budget <= INTRA_OP_ONLY_BUDGET:
        if layers == 1:
            return AUTO_STACK_MIN_BATCHED
        if budget > 1 and batch.rows * batch.tokens >= AUTO_STACK_FORWARD_ROWS:
            return AUTO_STACK_MIN_BATCHED
    elif budget > 1:
        return AUTO_STACK_MIN_BATCHED
    return max(AUTO_STACK_MIN_BATCHED, 1 + -(-AUTO_STACK_MIN_SAVED_LAYERS // layers))


def _group_param_rows(budget: int) -> int:
    """The parameter-rows a model up to which engine="auto" stacks a group on every call on
    ``budget`` threads (NOTE [ Stacked groups ])."""
    return AUTO_STACK_MAX_PARAM_ROWS if budget > 1 else AUTO_STACK_MAX_PARAM_ROWS_ONE_THREAD


def _small_enough(model: Any, mp: ModelParams, batch: Batch, budget: int | None) -> bool:
    """Whether engine="auto" stacks this model (NOTE [ Stacked groups ], NOTE [ Batched groups
    once features first ], NOTE [ Layers vmap loops over ]); kept by its findings unless a
    take_rows table was read (its rows are not the findings')."""
    if budget is None:
        budget = thread_budget()
    if any_sampled():
        return _small_enough_now(model, mp, batch, budget)
    return cast(
        bool,
        estimate(mp, ("small", batch, budget), _small_enough_now, model, mp, batch, budget),
    )


def _small_enough_now(model: Any, mp: ModelParams, batch: Batch, budget: int) -> bool:
    """``_small_enough``, found now."""
    if any(isinstance(m, LOOPED_UNDER_VMAP) for m in mp.modules):
        return False
    if mp.tensors[0].device.type == "cuda":
        return True  # kernels launched one model at a time cost more than batched ones
    max_params, max_rows = AUTO_STACK_MAX_PARAMS, _group_param_rows(budget)
    if budget in AUTO_STACK_BATCHED_LIMITS and _batched_layers(model) > 0:
        max_params, max_rows = AUTO_STACK_BATCHED_LIMITS[budget]
    return (
        sum([t.numel() for t in mp.tensors]) <= max_params
        and _param_rows(mp, batch, last_call=False) <= max_rows
        and sum([t.numel() for t in mp.state]) <= AUTO_STACK_MAX_STATE_ELEMENTS
    )


class Batch(NamedTuple):
    """What the cost estimates know of a call's input: its rows (the first dim of the first
    tensor argument), the positions a convolution slides over (the product of that tensor's
    dims after the second; 1 for a matrix) and, for a sequence of three dims, its tokens a row
    (the middle dim) and their width (the last; NOTE [ Tokens ])."""

    rows: int
    positions: int = 1
    tokens: int = 1
    width: int = 0

    @classmethod
    def of(cls, tensors: Sequence[Tensor]) -> Batch:
        first = next((t for t in tensors if t.dim() > 0), None)
        if first is None:
            return cls(1)
        if first.dim() == 3:
            rows, tokens, width = first.shape
            return cls(rows, width, tokens, width)
        return cls(first.shape[0], math.prod(first.shape[2:]))


def useful_workers(model_params: Sequence[ModelParams], batch: Batch, budget: int) -> int:
    """The most workers that pay for these models on ``budget`` threads: 1 + C / G, at most
    MAX_USEFUL_WORKERS or half the budget, whichever is more (NOTE [ Threads that pay ])."""
    share = _kernel_share(model_params, batch)
    if share < MIN_KERNEL_SHARE:  # NOTE [ Pullbacks of small models ]
        return small_pullback_workers(model_params, batch)
    cap = max(MAX_USEFUL_WORKERS, budget // 2)
    return min(cap, math.ceil(1 + share / GIL_SHARE_OF_OVERHEAD))


def too_small_for_workers(model_params: Sequence[ModelParams], batch: Batch) -> bool:
    """Whether the models' kernels weigh too little against their Python for their forwards to
    pay on workers (C / O below MIN_KERNEL_SHARE, NOTE [ Threads that pay ])."""
    return _kernel_share(model_params, batch) < MIN_KERNEL_SHARE


def small_pullback_workers(model_params: Sequence[ModelParams], batch: Batch) -> int:
    """The workers that pay for the pullbacks of models too small for workers in forward: one
    for each PULLBACK_WORKER_PARAM_ROWS of their estimated cost, at most
    MAX_SMALL_PULLBACK_WORKERS (NOTE [ Pullbacks of small models ])."""
    total = sum(estimated_costs(model_params, batch))
    return max(1, min(MAX_SMALL_PULLBACK_WORKERS, total // PULLBACK_WORKER_PARAM_ROWS))


def one_thread_pays(model_params: Sequence[ModelParams], batch: Batch, budget: int) -> bool:
    """Whether models of known layers run faster as a plain graph in the calling thread, on the
    budget's intra-op threads, than on workers: C / O below PLAIN_GRAPH_MAX_KERNEL_SHARE, on a
    budget of at most INTRA_OP_ONLY_BUDGET (NOTE [ Known layers on one thread ] in
    _plain_graph)."""
    return (
        budget <= INTRA_OP_ONLY_BUDGET
        and _kernel_share(model_params, batch) < PLAIN_GRAPH_MAX_KERNEL_SHARE
    )


def useful_forward_workers(model_params: Sequence[ModelParams], batch: Batch, workers: int) -> int:
    """Of ``workers``, those that pay for the forwards alone: 1 + C / O (NOTE [ Forwards on
    fewer workers ]); all of them where no GIL holds the models' Python (NOTE [ Threads
    without the GIL ])."""
    if not _config.gil_enabled():
        return workers
    share = _kernel_share(model_params, batch)
    if share < MIN_KERNEL_SHARE:  # NOTE [ Pullbacks of small models ]
        return 1
    return max(1, min(workers, math.ceil(1 + share)))


def _kernel_share(
    model_params: Sequence[ModelParams], batch: Batch, last_call: bool = True
) -> float:
    """C / O: the models' kernel work over their Python overhead, as estimated from shapes (a
    take_rows table's rows as ``_param_rows`` counts them with ``last_call``)."""
    if any_sampled():
        kernels = sum(_param_rows(mp, batch, last_call=last_call) for mp in model_params)
    else:  # the rows of the trainable parameters alone, kept by the findings
        kernels = sum(_rows(mp, batch) for mp in model_params)
    overhead = MODEL_OVERHEAD_PARAM_ROWS * len(model_params)
    return kernels / overhead if overhead else math.inf


def intra_op_only(
    model_params: Sequence[ModelParams],
    batch: Batch,
    budget: int,
    units: Sequence[Unit],
    chunks: Sequence[range],
    order: Sequence[int],
    stepping: bool,
) -> bool:
    """Whether ``auto`` spends the budget on intra-op threads alone, the models in one chunk
    in the calling thread rather than ``chunks`` (claimed in ``order``) on workers: a budget
    of 2 up to INTRA_OP_ONLY_BUDGET, unless the chunks split evenly over the budget's workers
    and convolutions do most of the work or the kernel share is at least
    WORKERS_MIN_KERNEL_SHARE, the latter where the caller's OpenMP team is ended before the
    workers start or the optimizer steps in the backward (``stepping``; NOTE [ Threads that
    pay ]). Not for a budget of 1, which keeps the chunks of an explicit n_jobs and its bits,
    nor for kernels too small for a second intra-op thread unless the optimizer steps in the
    backward (``intra_op_pays``)."""
    if budget <= 1 or budget > INTRA_OP_ONLY_BUDGET:
        return False
    if not stepping:
        # NOTE [ Pullbacks of small models ]: their stacked groups keep their chunks where the
        # pullbacks pay on workers
        on_workers = (
            too_small_for_workers(model_params, batch)
            and small_pullback_workers(model_params, batch) > 1
        )
        if not intra_op_pays(units, model_params, batch, on_workers):
            return False
    if not _split_evenly(units, chunks, order, model_params, batch, budget):
        return True
    long_kernels = [_runs_long_kernels(mp, batch) for mp in model_params]
    if any(long_kernels):
        costs = [_rows(mp, batch) for mp in model_params]
        if 2 * sum(c for c, long in zip(costs, long_kernels) if long) >= sum(costs):
            return False
    # Without the caller's team released, its spinning threads take the helper's core after
    # an optimizer step (NOTE [ The caller's OpenMP team ] in _pool).
    paid = stepping or _pool.releases_callers_team()
    # One row per take_rows row of the batch: the chunks, hence the bits, must not depend on
    # the rows an earlier call drew (the workers' count, which leaves the bits alone, may).
    share = _kernel_share(model_params, batch, last_call=False)
    return not (paid and share >= WORKERS_MIN_KERNEL_SHARE)


def intra_op_pays(
    units: Sequence[Unit],
    model_params: Sequence[ModelParams],
    batch: Batch,
    pullbacks_on_workers: bool = False,
) -> bool:
    """Whether the models' kernels are large enough for a second intra-op thread to pay, or
    some of them run as a stacked group (NOTE [ Kernels too small for intra-op threads ]).
    Where the pullbacks would go to workers (NOTE [ Pullbacks of small models ]), only a group
    of STACKED_INTRA_OP_MIN_PARAM_ROWS or more, or a model of SMALL_INTRA_OP_MIN_PARAM_ROWS or
    more, is. A table read by take_rows counts one row per batch row: the chunks, hence the
    bits, must not depend on the rows a call drew."""
    for unit in units:
        if unit.engine == "stacked":
            if not pullbacks_on_workers:
                return True
            limit = STACKED_INTRA_OP_MIN_PARAM_ROWS
        elif pullbacks_on_workers:
            limit = SMALL_INTRA_OP_MIN_PARAM_ROWS
        else:
            limit = INTRA_OP_MIN_PARAM_ROWS
        if _unit_param_rows(unit, model_params, batch) >= limit:
            return True
    return False


def _unit_param_rows(unit: Unit, model_params: Sequence[ModelParams], batch: Batch) -> int:
    """A unit's parameter-rows, a take_rows table's counted one a batch row (as ``intra_op_pays``
    counts them)."""
    return sum(_rows(model_params[i], batch) for i in unit.models)


def _runs_long_kernels(mp: ModelParams, batch: Batch) -> bool:
    """Whether the model has convolutions or recurrent layers, whose kernels run long without
    the GIL and split worse over intra-op threads (NOTE [ Threads that pay ])."""
    return bool(_conv_positions(mp, batch)) or any(isinstance(m, nn.RNNBase) for m in mp.modules)


def _split_evenly(
    units: Sequence[Unit],
    chunks: Sequence[range],
    order: Sequence[int],
    model_params: Sequence[ModelParams],
    batch: Batch,
    workers: int,
) -> bool:
    """Whether ``workers`` threads claiming the chunks in ``order`` (each the next one as soon
    as it is free) would finish within MAX_IMBALANCE of an even split, by estimated cost."""
    costs = chunk_costs(units, chunks, model_params, batch)
    span = _claimed_span([costs[k] for k in order], workers)
    return span <= MAX_IMBALANCE * sum(costs) / workers


def _claimed_span(costs: Sequence[int], workers: int) -> int:
    """The estimated time of ``workers`` threads claiming chunks of ``costs`` in that order,
    each the next one as soon as it is free: the busiest thread's total."""
    busy_until = [0] * workers
    for cost in costs:
        busy_until[busy_until.index(min(busy_until))] += cost
    return max(busy_until)


def chunk_units(units: Sequence[Unit], chunk_size: int) -> list[range]:
    """Consecutive units, as many per chunk as fit in ``chunk_size`` models (at least one)."""
    chunks: list[range] = []
    start = count = 0
    for u, unit in enumerate(units):
        if count and count + len(unit.models) > chunk_size:
            chunks.append(range(start, u))
            start, count = u, 0
        count += len(unit.models)
    chunks.append(range(start, len(units)))
    return chunks


def estimate(mp: ModelParams, key: Hashable, make: Callable[..., Any], *args: Any) -> Any:
    """``make(*args)``, kept by the model's findings under ``key`` (at most MAX_ESTIMATES:
    batch shapes may vary call by call). Findings live as long as the walk that made them,
    which sets planned from their models' own walks reuse (NOTE [ Structure keys kept by
    models' own walks ] in _plans). The arguments, not a closure over them: planning asks for
    each estimate several times a model and call, where making one each time cost more than
    the lookup."""
    found = mp.estimated.get(key)
    if found is None:
        if len(mp.estimated) >= MAX_ESTIMATES:
            mp.estimated.clear()
        found = mp.estimated[key] = make(*args)
    return found


def estimated_cost(mp: ModelParams, batch: Batch) -> int:
    """A model's cost in parameter-rows, from shapes alone (NOTE [ Chunks ])."""
    return cast(int, estimate(mp, batch, _cost_now, mp, batch))


def estimated_costs(model_params: Sequence[ModelParams], batch: Batch) -> list[int]:
    """Every model's ``estimated_cost``: planning a call reads them several times, a set of
    models drawn anew each call every call (NOTE [ Models planned one by one ] in _plans)."""
    return [estimated_cost(mp, batch) for mp in model_params]


def _cost_now(mp: ModelParams, batch: Batch) -> int:
    """``estimated_cost``, found now."""
    tensors = [*mp.tensors, *mp.state]
    return MODEL_OVERHEAD_PARAM_ROWS + _param_rows(mp, batch, tensors, last_call=False)


def chunk_limit(budget: int) -> int:
    """The fewest chunks ``thread_chunks`` cuts on a budget of ``budget`` threads."""
    return min(MAX_CHUNKS, CHUNKS_PER_THREAD * max(1, budget))


def thread_chunks(
    units: Sequence[Unit],
    model_params: Sequence[ModelParams],
    batch: Batch,
    costs: Sequence[int],
    budget: int,
) -> list[range]:
    """The chunks, from MAX_CHUNKS down to ``chunk_limit(budget)``, whose estimated time on
    ``budget`` threads is least: the costliest-first span of their costs plus each chunk's
    overhead over the threads (NOTE [ Chunks a thread ]); ``costs``: the models'
    ``estimated_costs``."""
    threads = max(1, budget)
    best: list[range] = []
    least = 0.0
    most = min(MAX_CHUNKS, len(units))
    for k in range(most, min(most, chunk_limit(budget)) - 1, -1):
        chunks = cost_chunks(units, costs, k)
        own = sorted(chunk_costs(units, chunks, model_params, batch, costs), reverse=True)
        time = _claimed_span(own, threads) + len(chunks) * CHUNK_OVERHEAD_PARAM_ROWS / threads
        if not best or time < least:
            best, least = chunks, time
    return best


def chunks_of(
    units: Sequence[Unit],
    model_params: Sequence[ModelParams],
    batch: Batch,
    chunk_size: int | None,
    max_chunks: int | None = None,
    costs: Sequence[int] | None = None,
) -> list[range]:
    """A call's chunks: ``chunk_size`` models each, else at most ``max_chunks`` (default
    MAX_CHUNKS) of about equal cost (NOTE [ Chunks ]); ``costs``: the models'
    ``estimated_costs``, where the caller has them."""
    if chunk_size:
        return chunk_units(units, chunk_size)
    if max_chunks == 1:
        return [range(len(units))]
    return cost_chunks(units, costs or estimated_costs(model_params, batch), max_chunks)


# NOTE [ Chunks of models that step ]
# Where optimizers step in the backward, each chunk's pullback is an engine call of its own
# (its gradients go to the steps as it ends: NOTE [ One engine call per chunk ] in _engines),
# and its models step together (NOTE [ One step over a chunk's small models ] in _fused), so
# every chunk costs an engine call and an optimizer step of its own: 16 MLP classes of widths
# 128-488 at batch 64 on 2 threads, in 16 chunks of one model, spent 15 ms of CPU in their
# chunks a step, against 12.4 in 4 chunks of 2-6 models (the threads as busy either way). Such
# a call therefore keeps STEPPING_CHUNKS_PER_THREAD chunks a thread of the budget (two let a
# thread that drew the larger chunk leave the next to the other), of about equal cost, cut
# further where one would hold more than MERGED_STEP_ELEMENTS trainable elements (a chunk's
# engine call gives every model's gradients at once: no more of them than the steps waiting in
# a chunk hold), and never more chunks than without steps. The chunks depend
# on the budget, never on ``n_jobs``: every n_jobs has the same bits. Where ``auto`` puts the
# models in one chunk on intra-op threads (NOTE [ Threads that pay ]), that choice is made on
# the chunks as they would be without steps, and stands.
# With the chunks claimed costliest first (NOTE [ Steps after a failure ] in _function), one Adam a
# model, against the code before (2 cores, benchmarks/bench_against.py --sib, two runs of 30 and 20
# rounds, 2026-12-01; a third, 30 rounds, gave 1.08x, 0.98x, 1.06x, 1.07x and 1.14x for the classes,
# Sequentials at batch 256, CNNs, transformer layers and LSTMs; results in
# benchmarks/results/sib-chunks-2cores.txt): the 16 MLP classes 1.09x and 1.12x (0.88x -> 0.96-0.99x
# the plain loop with one Adam over every parameter), 8 CNNs 1.07x and 1.06x, 8 transformer layers
# 1.06x and 1.05x, 8 LSTMs 1.14x and 1.19x, 16 Sequentials of widths 128-512 at batch 256 0.99x and
# 0.98x, at batch 64 1.00x, 24 small and 8 wide MLPs 0.98x, 4 wide MLPs 1.02x; the models whose
# default keeps one chunk unchanged (64 tiny classes 0.98x, 8 EmbeddingBags 0.99x). With 3 chunks a
# thread instead of 2: 1.07x, 1.06x and 1.03x for the classes, LSTMs and transformer layers, 0.99x
# for the CNNs; 4 a thread: 1.03x, 1.00x, 1.02x, 0.99x. Claimed in chunk order, 2 a thread lost 4%
# for the Sequentials at batch 256, whose widest model's chunk started last.


def stepping_chunks(
    units: Sequence[Unit],
    model_params: Sequence[ModelParams],
    costs: Sequence[int],
    budget: int,
    chunks: list[range],
) -> list[range]:
    """The chunks of a call whose optimizers step in the backward, in place of ``chunks`` (NOTE
    [ Chunks of models that step ]); ``costs``: the models' ``estimated_costs``."""
    k = STEPPING_CHUNKS_PER_THREAD * max(1, budget)
    if len(chunks) <= k:
        return chunks
    elements = [
        sum(t.numel() for i in unit.models for t in model_params[i].tensors if t.requires_grad)
        for unit in units
    ]
    bounded: list[range] = []
    for chunk in cost_chunks(units, costs, k):
        start, held = chunk.start, 0
        for u in chunk:
            if u > start and held + elements[u] > MERGED_STEP_ELEMENTS:
                bounded.append(range(start, u))
                start, held = u, 0
            held += elements[u]
        bounded.append(range(start, chunk.stop))
    return bounded if len(bounded) < len(chunks) else chunks


def cost_chunks(
    units: Sequence[Unit], model_costs: Sequence[int], max_chunks: int | None = None
) -> list[range]:
    """Consecutive units in ``min(MAX_CHUNKS, len(units))`` chunks of about equal cost
    (NOTE [ Chunks ]).

    A unit first goes to chunk ``floor(k * midpoint / total)``, its midpoint being the cost of
    the units before it plus half its own: every chunk gets about ``total / k``, and a unit
    costlier than that gets a chunk of its own. Then the costliest chunks of several units are
    halved until there are k: workers that claim chunks as they finish balance better with
    more of them, and with no more models than MAX_CHUNKS, each gets a chunk of its own.
    """
    costs = [sum(model_costs[i] for i in unit.models) for unit in units]
    total, k = sum(costs), min(max_chunks or MAX_CHUNKS, len(units))
    chunks: list[range] = []
    start = before = current = 0
    for u, cost in enumerate(costs):
        index = (2 * before + cost) * k // (2 * total)
        if index != current and u > start:
            chunks.append(range(start, u))
            start = u
        current = index
        before += cost
    chunks.append(range(start, len(units)))
    totals = [sum(costs[u] for u in chunk) for chunk in chunks]
    while len(chunks) < k:  # one chunk has two units at least, as len(units) >= k
        c = max((c for c in range(len(chunks)) if len(chunks[c]) > 1), key=totals.__getitem__)
        chunk, whole = chunks[c], totals[c]
        cut, before = chunk.start + 1, costs[chunk.start]
        while cut < chunk.stop - 1 and 2 * before + costs[cut] <= whole:
            before += costs[cut]  # the second part starts at the first unit past the middle
            cut += 1
        chunks[c : c + 1] = [range(chunk.start, cut), range(cut, chunk.stop)]
        totals[c : c + 1] = [sum(costs[chunk.start : cut]), sum(costs[cut : chunk.stop])]
    return chunks


# NOTE [ Costliest chunks first ]
# Threads claim chunks as they finish their last one. Claimed in chunk order, the costliest
# chunk may come last and run alone at the end: 8 small CNNs of widths 8-24 (the widest last)
# on 2 threads gave one thread 36 ms of forwards and the other 25 (a balanced split: 29 and 32),
# and parsum at n_jobs=2 took 60 ms a step against 53 for the two-phase ceiling over two
# balanced shares (benchmarks' TwoPhase). The threads therefore claim the chunks costliest
# first (the longest-processing-time rule). Measured at n_jobs=2 on 2 cores, the two orders
# interleaved in one process: those CNNs 59.1 -> 53.4 ms a step at batch 64, 17.0 -> 16.0 at
# batch 16, 244 -> 228 at batch 256. Where the models' Python overhead weighs more, chunk order
# once measured faster (16 MLPs of widths 128-512 at batch 64: 6.40 -> 6.60 ms), and only
# kernel-heavy models were ordered; since the models run with less Python (NOTE [ Direct
# programs ] in _engines) the order pays there too: at batch 64 the helper's last chunk was
# most often the costliest (1.7 ms of backward), the caller waiting 0.21 ms a backward for it,
# and costliest first measured 1.001-1.011x (four runs of 150-300 rounds; 1.002x at the
# default budget), at batch 256 1.013x, 64 tiny MLPs on 2 workers 1.010x, 16 identical MLPs
# (chunks of one cost) 1.002x. Which thread
# runs a chunk changes no bits: results are combined in chunk order, a chunk that finishes
# before those in front of it waiting for them (at most one partial sum per chunk). After a
# failure the chunks before it still start, so that the failure named is the first in chunk
# order; what they wrote is undone with the rest. Optimizer steps cannot be undone: a backward
# with step_in_backward stops stepping at a failure (NOTE [ Steps after a failure ] in
# _function); it kept chunk order until then.


def costliest_first(
    units: Sequence[Unit],
    chunks: Sequence[range],
    model_params: Sequence[ModelParams],
    batch: Batch,
    costs: Sequence[int] | None = None,
) -> tuple[int, ...]:
    """The order threads claim the chunks in: costliest first, ties in chunk order (NOTE
    [ Costliest chunks first ]); ``costs`` as ``chunk_costs`` takes them."""
    totals = chunk_costs(units, chunks, model_params, batch, costs)
    return tuple(sorted(range(len(chunks)), key=lambda k: -totals[k]))


def small_last_chunk(
    units: Sequence[Unit],
    chunks: Sequence[range],
    model_params: Sequence[ModelParams],
    batch: Batch,
    order: Sequence[int],
    costs: Sequence[int] | None = None,
) -> bool:
    """Whether the last chunk in ``order`` is small enough to leave to the calling thread
    (NOTE [ The caller's last chunk ] in _pool); ``costs`` as ``chunk_costs`` takes them."""
    totals = chunk_costs(units, chunks, model_params, batch, costs)
    return totals[order[-1]] <= CALLERS_LAST_PARAM_ROWS


def chunk_costs(
    units: Sequence[Unit],
    chunks: Sequence[range],
    model_params: Sequence[ModelParams],
    batch: Batch,
    costs: Sequence[int] | None = None,
) -> list[int]:
    """Each chunk's estimated cost, the sum of its models' (NOTE [ Chunks ]); ``costs``: the
    models' ``estimated_costs``, where the caller has them."""
    costs = costs or estimated_costs(model_params, batch)
    return [sum(costs[i] for u in chunk for i in units[u].models) for chunk in chunks]


def _rows(mp: ModelParams, batch: Batch) -> int:
    """``_param_rows`` of the trainable parameters, a take_rows table's counted one a batch
    row: kept by the model's findings where no table is read by take_rows (a set of models
    drawn anew each call asks for every model's several times; NOTE [ Models planned one by
    one ] in _plans)."""
    if any_sampled():
        return _param_rows(mp, batch, last_call=False)
    # Nothing sampled: last_call changes nothing.
    return cast(int, estimate(mp, ("rows", batch), _param_rows, mp, batch))


def _param_rows(
    mp: ModelParams, batch: Batch, tensors: Sequence[Tensor] | None = None, last_call: bool = True
) -> int:
    """Elements of ``tensors`` (default: the trainable parameters) times the batch rows, a
    convolution's times its positions. A table read by take_rows counts its rows touched: the
    elements its last call gathered with ``last_call``, else one row per batch row (a cost
    that must not depend on the data)."""
    tensors = mp.tensors if tensors is None else tensors
    positions = _conv_positions(mp, batch)
    tables = _embedding_tables(mp)
    rows = batch.rows * _tokens(mp, batch) if not positions else batch.rows
    if not positions and not tables and not any_sampled():  # the common case
        return sum([t.numel() for t in tensors]) * rows
    total = 0
    for t in tensors:
        gathered = sampled_elements(t)
        if gathered is None and id(t) in tables:  # NOTE [ Embedding tables ]
            total += t.numel() // max(t.shape[0], 1) * rows
        elif gathered is None:
            total += t.numel() * rows * positions.get(id(t), 1)
        elif last_call:
            total += gathered
        else:
            total += t.numel() // max(t.shape[0], 1) * batch.rows
    return total


# NOTE [ Embedding tables ]
# An nn.Embedding or nn.EmbeddingBag reads a row of its table for each id, not the whole table:
# counted whole, 8 EmbeddingBags of 1000 rows with a head looked like models with kernels large
# enough for workers (a kernel share of 0.50), which ran them at 0.48x the plain loop against
# 0.63x in the calling thread (2 cores). Their weights count one row per batch row (and token),
# as a table read through take_rows does before its first call.


def _embedding_tables(mp: ModelParams) -> set[int]:
    """The ids of the model's embedding tables (NOTE [ Embedding tables ])."""
    return {
        id(m.weight)
        for m in mp.modules
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and isinstance(m.weight, Tensor)
    }


# NOTE [ Tokens ]
# A Linear, a recurrent layer or an attention applied to a sequence of shape (rows, tokens,
# width) does its work once per token: 8 TransformerEncoderLayers of width 64 (feed-forward
# 64-176) on 16 tokens counted as 16 or 64 rows looked like models whose Python outweighs their
# kernels, and the default kept them on one chunk (2 cores: 8.22 ms a step at batch 16 and 19.06
# at 64, against 7.56 and 17.48 on 2 workers). Where the first such layer of a model reads the
# input's width (a model that flattens the sequence first does not), its parameters count once
# per token. Convolutions keep their positions (a Conv1d reads (rows, channels, length)).


def _tokens(mp: ModelParams, batch: Batch) -> int:
    """The tokens each parameter of the model works on a row (NOTE [ Tokens ])."""
    if batch.tokens == 1:
        return 1
    for module in mp.modules:
        width = _input_width(module)
        if width is not None:
            return batch.tokens if width == batch.width else 1
    return 1


def _input_width(module: nn.Module) -> int | None:
    """The width of the tokens a layer that works once per token reads; None for others."""
    if isinstance(module, nn.Linear):
        return module.in_features
    if isinstance(module, nn.RNNBase):
        return module.input_size
    if isinstance(module, nn.MultiheadAttention):
        return module.embed_dim
    return None


def _conv_positions(mp: ModelParams, batch: Batch) -> dict[int, int]:
    """Per convolution weight and bias (by id), the positions it is applied at: the input's
    positions over the stride. Deeper convolutions see fewer after pooling, so this
    overestimates them, by less than counting each weight once underestimates all of them."""
    if batch.positions == 1:
        return {}
    found: dict[int, int] = {}
    for module in mp.modules:
        if isinstance(module, nn.modules.conv._ConvNd):
            n = max(1, batch.positions // math.prod(module.stride))
            for t in module._parameters.values():
                if t is not None:
                    found[id(t)] = n
    return found


def _stackable(
    models: Sequence[Callable[..., Any]], model_params: Sequence[ModelParams]
) -> list[int]:
    """Modules with trainable parameters that no other entry shares a module or parameter with."""
    modules = chain.from_iterable(map(_modules_of, model_params))
    ids = list(map(id, chain(modules, chain.from_iterable(map(_tensors_of, model_params)))))
    # Usually nothing is shared: no count, nor a per-model check, needed
    shared = len(set(ids)) != len(ids)
    users = Counter(ids) if shared else Counter()
    return [
        i
        for i, (model, mp) in enumerate(zip(models, model_params))
        if isinstance(model, nn.Module)
        and mp.tensors
        and (
            not shared
            or all(users[id(t)] == 1 for t in [*mp.modules, *mp.tensors] if _holds_state(t))
        )
    ]


_modules_of = operator.attrgetter("modules")
_tensors_of = operator.attrgetter("tensors")


def _holds_state(t: Any) -> bool:
    # A module without parameters and buffers (an activation) may be shared harmlessly.
    return not isinstance(t, nn.Module) or bool(t._parameters or t._buffers)


# NOTE [ Forwards of their own and stacked groups ]
# A module whose instance was given a ``forward`` of its own (``layer.forward = f``) runs it when
# called. A group of Sequentials runs as batched matmuls (NOTE [ Batched layers ] in _engines),
# which call no module: 8 MLPs whose first Linear had the same ``f`` assigned (one function, so
# one structure key) summed to values off by 1.3, silently, and in ``stack_`` storage one
# assigned after stacking went unseen as well (off by 0.98). Such a module keeps its model out
# of every group, as a hook does, and a stack's check looks for one in every module's
# attributes (``_record`` in _stack; about 10 us for 64 tiny MLPs): the stack then runs them
# one by one.


def structure_key(mp: ModelParams) -> Hashable | None:
    """What two models must share to run as one stacked group; None if this one cannot."""
    if mp.loose:  # functional_call swaps parameters and buffers, not plain attributes
        return None
    parts: list[Hashable] = []
    for module in mp.modules:
        if isinstance(module, torch.jit.ScriptModule):  # functional_call cannot run TorchScript
            return None
        if is_compiled(module):  # NOTE [ Compiled modules ] in _engines
            return None
        attributes = vars(module)  # this runs for every candidate model on every call
        if (
            # a forward of its own, which a group's batched layers would not call (NOTE
            # [ Forwards of their own and stacked groups ])
            "forward" in attributes
            or attributes["_forward_hooks"]
            or attributes["_forward_pre_hooks"]
            or attributes["_backward_hooks"]
            or attributes["_backward_pre_hooks"]
            or (attributes["training"] and attributes["_buffers"])
        ):
            return None
        own = attributes.keys() - MODULE_INTERNALS  # a module's own settings
        config = tuple([(k, _value_key(attributes[k])) for k in sorted(own)]) if own else ()
        parts.append((type(module), attributes["training"], tuple(attributes["_modules"]), config))
    parts.append(tuple([_tensor_key(n, p) for n, p in zip(mp.names, mp.tensors)]))
    parts.append(tuple([_tensor_key(n, t) for n, t in zip(mp.state_names, mp.state)]))
    return tuple(parts)


def unstackable(model: nn.Module, mp: ModelParams) -> str:
    """Why ``structure_key`` has no key for ``model`` (``mp``: its walk), in words, for a
    refusal to stack it."""
    if mp.loose:
        return f"its tensor attribute {mp.loose[0]!r} requires grad (make it a parameter)"
    called = _module_labels(model)
    for module in mp.modules:
        at = called.get(id(module), "root module")
        if at != "root module":
            at += f" ({type(module).__name__})"
        if isinstance(module, torch.jit.ScriptModule):
            return f"its {at} is a TorchScript module"
        if is_compiled(module):
            return f"its {at} is compiled (torch.compile: stack the models first, then compile)"
        attributes = vars(module)
        if "forward" in attributes:
            return f"its {at} has a forward assigned to it, which a stacked forward would not call"
        for hooks, what in (
            ("_forward_hooks", "a forward hook"),
            ("_forward_pre_hooks", "a forward pre-hook"),
            ("_backward_hooks", "a backward hook"),
            ("_backward_pre_hooks", "a backward pre-hook"),
        ):
            if attributes[hooks]:
                return f"its {at} has {what}"
        if attributes["training"] and attributes["_buffers"]:
            return (
                f"its {at} holds buffers in training mode (BatchNorm: call eval() first or "
                "train it unstacked)"
            )
    return (
        "it has a module hook, a forward assigned to a module, a tensor attribute that requires "
        "grad, a TorchScript or compiled module, or a module with buffers in training mode"
    )


def _module_labels(model: nn.Module) -> dict[int, str]:
    """How a refusal names each of ``model``'s modules, by id: "module '0.1'", "root module"."""
    return {
        id(m): f"module '{name}'" if name else "root module"
        for name, m in model.named_modules(remove_duplicate=False)
    }


def first_difference(
    model0: nn.Module, first: ModelParams, model: nn.Module, other: ModelParams
) -> str:
    """Where ``model`` (``other``: its walk) first differs from ``model0`` among what
    ``structure_key`` compares, in words, for a refusal to stack them."""
    where0, where = _module_labels(model0), _module_labels(model)
    if len(first.modules) != len(other.modules):
        return f"in its modules: {len(other.modules)} where models[0] has {len(first.modules)}"
    for a, b in zip(first.modules, other.modules):
        at, at0 = where.get(id(b), "root module"), where0.get(id(a), "root module")
        if type(a) is not type(b):
            if type(a).__name__ != type(b).__name__:
                return (
                    f"in its modules: its {at} is a {type(b).__name__} where models[0]'s {at0} "
                    f"is a {type(a).__name__}"
                )
            why = ""
            if parametrize.is_parametrized(b):  # a class made for each module it parametrizes
                why = " (torch.nn.utils.parametrize makes a class for each module it parametrizes)"
            return (
                f"in its modules: its {at} is a {type(b).__name__} of another class than "
                f"models[0]'s {at0}{why}"
            )
        if a.training != b.training:
            mode = {True: "training", False: "eval"}
            return (
                f"in training flags: its {at} is in {mode[b.training]} mode where models[0]'s "
                f"is in {mode[a.training]} mode"
            )
        if list(a._modules) != list(b._modules):
            return (
                f"in its modules: its {at} holds {list(b._modules)} where models[0]'s holds "
                f"{list(a._modules)}"
            )
        settings, settings0 = vars(b), vars(a)
        for key in sorted((settings.keys() | settings0.keys()) - MODULE_INTERNALS):
            if key not in settings or key not in settings0:
                has, lacks = ("it", "models[0]") if key in settings else ("models[0]", "it")
                return f"in settings: {has} has {key!r} in its {at}, which {lacks} lacks"
            value, value0 = settings[key], settings0[key]
            if _value_key(value) != _value_key(value0):
                return (
                    f"in settings: its {at} has {key}={value!r:.60} where models[0]'s has "
                    f"{key}={value0!r:.60}"
                )
    trainable = dict.fromkeys(first.names, True) | dict.fromkeys(first.state_names, False)
    others = dict.fromkeys(other.names, True) | dict.fromkeys(other.state_names, False)
    if trainable.keys() == others.keys():
        for name, grad in trainable.items():
            if others[name] != grad:
                state = {True: "trainable", False: "frozen"}
                return (
                    f"in requires_grad: its {name!r} is {state[others[name]]} where models[0]'s "
                    f"is {state[grad]}"
                )
    pairs = [(first.names, first.tensors, other.names, other.tensors)]
    pairs.append((first.state_names, first.state, other.state_names, other.state))
    for names0, tensors0, names, tensors in pairs:
        for name0, t0, name, t in zip(names0, tensors0, names, tensors):
            if name != name0:
                return f"in parameter names: {name!r} where models[0] has {name0!r}"
            for what in ("shape", "dtype", "device", "layout"):
                value, value0 = getattr(t, what), getattr(t0, what)
                if value != value0:
                    if what == "shape":
                        value, value0 = tuple(value), tuple(value0)
                    return (
                        f"in {what}: its {name!r} has {what} {value} where models[0]'s has {value0}"
                    )
        if len(names) != len(names0):
            has, lacks = ("it", "models[0]") if len(names) > len(names0) else ("models[0]", "it")
            name = (names if len(names) > len(names0) else names0)[min(len(names), len(names0))]
            return f"in parameter names: {has} has {name!r}, which {lacks} lacks"
    return "in its modules, settings, training flags or parameter names, shapes, dtypes or devices"


def _tensor_key(name: str, t: Tensor) -> Hashable:
    return (name, t.shape, t.dtype, t.device, t.layout)  # torch.Size hashes as a tuple


def _value_key(v: Any) -> Hashable:
    if v is None or isinstance(v, (bool, int, float, str, torch.dtype, torch.device)):
        return (type(v), v)
    if isinstance(v, tuple):
        return tuple(_value_key(x) for x in v)
    return ("object", id(v))
