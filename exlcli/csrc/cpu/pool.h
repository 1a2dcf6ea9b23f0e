// A small pool of worker threads for the CPU kernels (csrc/cpu/pool.c).
#pragma once
#include <stdint.h>

// Runs task(ctx, begin, end) over [0, n) split into contiguous parts, one per thread (the caller's
// thread takes the first). Parts never overlap, so a task whose outputs depend only on their own
// index gives the same numbers with any number of threads. Single-threaded when the pool was not
// started or another caller holds it.
typedef void (*exl_task_fn)(void *ctx, int64_t begin, int64_t end);
void exl_parallel_for(exl_task_fn task, void *ctx, int64_t n);
