// A small pool of worker threads for the CPU kernels (csrc/cpu/pool.c).
#pragma once
#include <stdint.h>

// Starts threads - 1 workers, once; returns the number of threads that share a job.
int exl_pool_start(int threads);

// Runs task(ctx, begin, end) over [0, n) split into contiguous chunks that the caller's thread and the
// workers claim one at a time, and returns once every chunk has run. Chunks never overlap, so a task
// whose outputs depend only on their own index gives the same numbers with any number of threads.
// Single-threaded when the pool was not started or another caller holds it.
typedef void (*exl_task_fn)(void *ctx, int64_t begin, int64_t end);
void exl_parallel_for(exl_task_fn task, void *ctx, int64_t n);

// exl_parallel_for cut into `chunks` chunks (at most n, and 65,535) rather than a few per thread: for one long job
// (the experts' one call, moe.c), where a worker preempted in the middle of a long chunk would hold the caller up.
void exl_parallel_for_chunks(exl_task_fn task, void *ctx, int64_t n, int64_t chunks);
