// Posts many small jobs to the CPU kernels' thread pool (exlcli/csrc/cpu/pool.c) and counts what went
// wrong: a job whose parallel_for returned before each of its indices had run, an index run twice, or a
// task that started for a job after its parallel_for had returned. Prints the three counts.
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

#include "pool.h"

#define MAX_N 32
#define RING 512

typedef struct {
    int spin;                 // busy work per index, so that chunks overlap in time
    atomic_int runs[MAX_N];   // how often each index ran
    atomic_int returned;      // parallel_for returned
    atomic_int late;          // tasks that started after that
} Job;

static void task(void *ctx, int64_t begin, int64_t end) {
    Job *job = ctx;
    if (atomic_load(&job->returned)) atomic_fetch_add(&job->late, 1);
    for (int64_t i = begin; i < end; i++) {
        for (volatile int s = 0; s < job->spin; s++) {
        }
        atomic_fetch_add(&job->runs[i], 1);
    }
}

int main(int argc, char **argv) {
    long jobs = argc > 1 ? atol(argv[1]) : 100000;
    exl_pool_start(2);
    Job *ring = calloc(RING, sizeof(Job));
    long early = 0, twice = 0, late = 0;
    unsigned r = 12345;
    for (long j = 0; j < jobs; j++) {
        Job *job = &ring[j % RING];
        late += atomic_load(&job->late);  // the job that used this slot RING jobs ago
        r = r * 1103515245u + 12345u;
        const int n = 2 + (int)((r >> 8) % (MAX_N - 2));
        job->spin = (int)((r >> 16) % 200);
        for (int i = 0; i < MAX_N; i++) atomic_store(&job->runs[i], 0);
        atomic_store(&job->late, 0);
        atomic_store(&job->returned, 0);
        exl_parallel_for(task, job, n);
        for (int i = 0; i < n; i++) {
            const int runs = atomic_load(&job->runs[i]);
            early += runs == 0;
            twice += runs > 1;
        }
        atomic_store(&job->returned, 1);
    }
    printf("%ld %ld %ld\n", early, twice, late);
    return 0;
}
