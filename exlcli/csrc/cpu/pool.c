// Worker threads for the CPU kernels. A step of the model calls a kernel a few hundred times, each
// for tens of microseconds, so workers spin for a while after each job (a wake-up through the
// kernel would cost as much as the job) and only then sleep on a condition variable.
//
// A job is cut into chunks that the caller and the workers claim one at a time. The caller never
// waits for a worker that has not started: it claims what is left itself, and only waits for chunks
// already running. On a machine busy with other work the kernels then run at single-thread speed
// instead of stalling.
#define _GNU_SOURCE
#include "pool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#define cpu_relax() __builtin_ia32_pause()
#else
#define cpu_relax() ((void)0)
#endif

#define MAX_WORKERS 31
#define SPIN_NS 300000        // how long an idle worker spins before it sleeps
#define CHUNKS_PER_THREAD 4
#define MAX_CHUNKS 0xffff  // a job's chunks fit 16 bits of the claim word
_Static_assert((MAX_WORKERS + 1) * CHUNKS_PER_THREAD <= MAX_CHUNKS, "a job's chunks fit 16 bits of the claim word");

static int n_workers;
static pthread_mutex_t busy = PTHREAD_MUTEX_INITIALIZER;  // one job at a time
static pthread_mutex_t sleep_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static atomic_uint_fast64_t claim;  // (job sequence << 32) | (the job's chunks << 16) | next chunk
static atomic_long done;            // chunks of the current job finished
static atomic_int sleepers;

static exl_task_fn job_task;
static void *job_ctx;
static int64_t job_n, job_chunks;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

// Claims and runs chunks of job `seq` until none is left (or the job is no longer `seq`).
// The chunk count comes from the claim word, not from job_chunks: once a job's last chunk is claimed
// and done, the caller may return and post the next job, rewriting job_chunks (and job_n, job_task)
// before it publishes the new sequence. A worker comparing its stale word's chunk index with the new
// count could then claim a chunk of a finished job, run it with the next job's task, and count it as
// done for that job, which then returned with a chunk still running. A successful claim of chunk c <
// chunks of job seq means seq is not finished, so its fields stay put until this chunk is counted.
static void run_chunks(uint64_t seq) {
    for (;;) {
        uint64_t v = atomic_load_explicit(&claim, memory_order_acquire);
        int64_t c = (int64_t)(v & 0xffffu), chunks = (int64_t)((v >> 16) & 0xffffu);
        if ((v >> 32) != seq || c >= chunks) return;
        if (!atomic_compare_exchange_weak_explicit(&claim, &v, v + 1, memory_order_acq_rel,
                                                   memory_order_relaxed))
            continue;
        int64_t begin = job_n * c / chunks, end = job_n * (c + 1) / chunks;
        if (begin < end) job_task(job_ctx, begin, end);
        atomic_fetch_add_explicit(&done, 1, memory_order_release);
    }
}

static void *worker_main(void *arg) {
    (void)arg;
    uint64_t seen = 0;  // no job was posted before the pool started
    for (;;) {
        int64_t idle_since = now_ns();
        long spins = 0;
        uint64_t seq;
        while ((seq = atomic_load_explicit(&claim, memory_order_acquire) >> 32) == seen) {
            cpu_relax();
            if ((++spins & 255) == 0 && now_ns() - idle_since > SPIN_NS) {
                pthread_mutex_lock(&sleep_mu);
                atomic_fetch_add(&sleepers, 1);  // seq_cst: pairs with the poster's load of sleepers
                while ((atomic_load(&claim) >> 32) == seen) pthread_cond_wait(&wake, &sleep_mu);
                atomic_fetch_sub(&sleepers, 1);
                pthread_mutex_unlock(&sleep_mu);
            }
        }
        seen = seq;
        run_chunks(seq);
    }
    return NULL;
}

static void forget_workers_in_child(void) { n_workers = 0; }  // fork() keeps only the caller

// Starts threads - 1 workers, once; returns the number of threads that share a job.
int exl_pool_start(int threads) {
    static int started;
    if (!started) {
        started = 1;
        pthread_atfork(NULL, NULL, forget_workers_in_child);
        for (int i = 0; i < threads - 1 && i < MAX_WORKERS; i++) {
            pthread_t t;
            if (pthread_create(&t, NULL, worker_main, NULL) != 0) break;
            pthread_detach(t);
            n_workers++;
        }
    }
    return n_workers + 1;
}

void exl_parallel_for(exl_task_fn task, void *ctx, int64_t n) {
    exl_parallel_for_chunks(task, ctx, n, (int64_t)(n_workers + 1) * CHUNKS_PER_THREAD);
}

void exl_parallel_for_chunks(exl_task_fn task, void *ctx, int64_t n, int64_t chunks) {
    if (n_workers == 0 || n < 2 || pthread_mutex_trylock(&busy) != 0) {
        task(ctx, 0, n);
        return;
    }
    if (chunks < 1) chunks = 1;
    if (chunks > MAX_CHUNKS) chunks = MAX_CHUNKS;  // 16 bits of the claim word
    job_task = task;
    job_ctx = ctx;
    job_n = n;
    job_chunks = chunks < n ? chunks : n;
    atomic_store(&done, 0);
    uint64_t seq = (atomic_load(&claim) >> 32) + 1;
    // seq_cst, then the load below: a worker going to sleep sees it
    atomic_store(&claim, (seq << 32) | ((uint64_t)job_chunks << 16));
    if (atomic_load(&sleepers) > 0) {
        pthread_mutex_lock(&sleep_mu);
        pthread_cond_broadcast(&wake);
        pthread_mutex_unlock(&sleep_mu);
    }
    run_chunks(seq);
    while (atomic_load_explicit(&done, memory_order_acquire) < job_chunks) cpu_relax();
    pthread_mutex_unlock(&busy);
}
