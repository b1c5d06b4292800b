/* SPDX-License-Identifier: Apache-2.0 */
/* bench_fence: what the daemon boundary costs a job that does nothing.
 *
 *   bench_fence [--n N]                      (MOK_SOCKET: a mokd with the cuda engine)
 *
 * 1. hops: the stream memory operations a job through mokd is ordered by,
 *    in one process: stream A writes a 64-bit word, stream B waits for it
 *    and writes a second word, A waits for that (one round trip = two
 *    hops), N times, with the words in host memory mapped for the device
 *    (where the session's sync page is) and in device memory.
 * 2. empty jobs: a tiny kernel on the client's stream, then (through mokd)
 *    an empty job ordered on that stream (mok_submit_nop_on_stream: the
 *    client's fence write, the daemon's wait for it, its done write, the
 *    client's wait for that), timed with events on the stream:
 *      sync   each iteration waited for (the GPU idles between jobs: the
 *             daemon noticing the job is on the critical path);
 *      piped  N iterations back to back, one wait at the end (the client
 *             runs ahead, as a trainer does).
 *    The same loop without the job is the baseline; the difference is the
 *    microseconds a job pays for the boundary.
 * Prints one line per measurement; exit status 0 when every call worked.
 */
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../harness/check_client.h"
#include "mok.h"


typedef CUresult (*write64_fn)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
typedef CUresult (*wait64_fn)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
static write64_fn write64;
static wait64_fn wait64;

static void load_driver(void) {
  cudaDriverEntryPointQueryResult q;
  CK(cudaGetDriverEntryPointByVersion("cuStreamWriteValue64", (void **)&write64, 12000,
                                              cudaEnableDefault, &q));
  CK(cudaGetDriverEntryPointByVersion("cuStreamWaitValue64", (void **)&wait64, 12000,
                                              cudaEnableDefault, &q));
  if (!write64 || !wait64) {
    fprintf(stderr, "bench_fence: no stream memory operations in this driver\n");
    exit(1);
  }
}

static double now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static int cmp_f(const void *a, const void *b) {
  float x = *(const float *)a, y = *(const float *)b;
  return x < y ? -1 : x > y;
}

/* Round trips between two streams through two words at w (device address). */
static double hop_round_trip_us(CUdeviceptr w, int n) {
  cudaStream_t a, b;
  CK(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  CK(cudaMemset((void *)w, 0, 16));
  CK(cudaDeviceSynchronize());
  double t0 = now_us();
  for (int i = 1; i <= n; i++) {
    if (write64(a, w, (cuuint64_t)i, 0) || wait64(b, w, (cuuint64_t)i, CU_STREAM_WAIT_VALUE_GEQ) ||
        write64(b, w + 8, (cuuint64_t)i, 0) ||
        wait64(a, w + 8, (cuuint64_t)i, CU_STREAM_WAIT_VALUE_GEQ)) {
      fprintf(stderr, "bench_fence: a stream memory operation failed\n");
      exit(1);
    }
  }
  CK(cudaStreamSynchronize(a));
  double us = (now_us() - t0) / n;
  cudaStreamDestroy(a);
  cudaStreamDestroy(b);
  return us;
}

__global__ void touch(int *p) { p[threadIdx.x] += 1; }

/* One iteration: the tiny kernel, and the empty job when c != NULL. */
static void iteration(cudaStream_t s, int *buf, mok_client *c) {
  touch<<<1, 32, 0, s>>>(buf);
  if (c) {
    MK(mok_submit_nop_on_stream(c, s, NULL));
  }
}

/* Median us of one iteration waited for each time; mean of n back to back. */
static void loop_us(cudaStream_t s, int *buf, mok_client *c, int n, float *ret_sync,
                    float *ret_piped) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  float *t = (float *)malloc(sizeof(float) * n);
  for (int i = 0; i < 50; i++) iteration(s, buf, c); /* warm-up */
  CK(cudaStreamSynchronize(s));
  for (int i = 0; i < n; i++) {
    CK(cudaEventRecord(e0, s));
    iteration(s, buf, c);
    CK(cudaEventRecord(e1, s));
    CK(cudaEventSynchronize(e1));
    CK(cudaEventElapsedTime(&t[i], e0, e1));
  }
  qsort(t, n, sizeof *t, cmp_f);
  *ret_sync = t[n / 2] * 1000.0f;
  CK(cudaEventRecord(e0, s));
  for (int i = 0; i < n; i++) iteration(s, buf, c);
  CK(cudaEventRecord(e1, s));
  CK(cudaEventSynchronize(e1));
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, e0, e1));
  *ret_piped = ms * 1000.0f / n;
  if (c && mok_sync(c, 30000) != MOK_OK) {
    fprintf(stderr, "bench_fence: a job failed: %s\n", mok_last_error());
    exit(1);
  }
  free(t);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
}

int main(int argc, char **argv) {
  int n = 2000;
  for (int i = 1; i + 1 < argc; i += 2)
    if (!strcmp(argv[i], "--n")) n = atoi(argv[i + 1]);
  if (n < 10) n = 10;
  CK(cudaSetDevice(0));
  CK(cudaFree(NULL));
  load_driver();

  /* 1. hops, host-mapped and device words */
  void *host = NULL, *hdev = NULL, *dev = NULL;
  CK(cudaHostAlloc(&host, 4096, cudaHostAllocMapped | cudaHostAllocPortable));
  CK(cudaHostGetDevicePointer(&hdev, host, 0));
  CK(cudaMalloc(&dev, 4096));
  double h_us = hop_round_trip_us((CUdeviceptr)(uintptr_t)hdev, n);
  double d_us = hop_round_trip_us((CUdeviceptr)(uintptr_t)dev, n);
  printf("hops: round trip between two streams (2 hops): host-mapped words %.2f us, device "
         "words %.2f us\n", h_us, d_us);

  /* 2. empty jobs */
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  int *buf = NULL;
  CK(cudaMalloc((void **)&buf, 128));
  CK(cudaMemset(buf, 0, 128));
  float base_sync, base_piped;
  loop_us(s, buf, NULL, n, &base_sync, &base_piped);
  mok_client *c = NULL;
  int r = mok_connect(NULL, "bench_fence", &c);
  if (r != MOK_OK) {
    fprintf(stderr, "bench_fence: mok_connect: %s (%s)\n", mok_status_name(r), mok_last_error());
    return 1;
  }
  float job_sync, job_piped;
  loop_us(s, buf, c, n, &job_sync, &job_piped);
  printf("empty job (%s, %s): sync %.1f us (kernel alone %.1f: +%.1f us a job); piped %.1f us "
         "(alone %.1f: +%.1f us a job)\n",
         mok_client_engine(c), getenv("CUDA_MPS_PIPE_DIRECTORY") ? "MPS" : "no MPS", job_sync,
         base_sync, job_sync - base_sync, job_piped, base_piped, job_piped - base_piped);
  mok_close(c);
  cudaFree(buf);
  cudaFree(dev);
  cudaFreeHost(host);
  return 0;
}
