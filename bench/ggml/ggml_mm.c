// ggml_mm: time ggml's quantized matmul (ggml_mul_mat of a quantized weight
// [N x K] by float32 activations [K x M]) the way llama.cpp runs it on a CPU,
// for `mixbits bench --vs-ggml`. Our own harness; it only calls ggml's public
// API (ggml.h, ggml-cpu.h, ggml-backend.h). Built by bench/ggml/build.sh.
//
//   ggml_mm --info
//   ggml_mm [--types q4_0,q4_K,...] [--shapes 4096x4096,...] [--m 1,8,128]
//           [--threads 1] [--min-time 0.3] [--max-reps 200] [--layout plain,repack]
//           [--cold-mb 0]
//
// Per (shape, type) the weight is filled from Gaussian floats (scaled by
// 1/sqrt(K)) quantized with ggml_quantize_chunk, i.e. ggml's own quantizer.
// Per M the activations are Gaussian float32: their conversion to the weight
// type's vec_dot type (q8_0 / q8_K) happens inside the op, as in llama.cpp,
// and is timed. Layouts: "plain" is the weight in an ordinary CPU buffer;
// "repack" is the CPU_REPACK extra buffer type llama.cpp uses by default
// (interleaved rows, e.g. q4_0 8x8 / q4_K 8x8 / q2_K 8x8 on AVX2) where this
// ggml supports that type on this CPU, else reported as unsupported.
// Each measurement: 2 warm-up calls, then repetitions until --min-time of
// wall time and at least 3; it reports median and minimum of CPU time
// (clock_gettime(CLOCK_PROCESS_CPUTIME_ID)) and of wall time (CLOCK_MONOTONIC).
// With --cold-mb C > 0 the weight is held in enough copies (same values,
// distinct memory; at most 64) to fill C MiB, and consecutive calls take
// the copies in turn: each call's weight was last read C MiB of other
// weights ago, so it comes from DRAM as in a decode step that reads every
// layer once (`mixbits bench --cold` passes the same C and does the same).
// No cache flush: that would also evict the callers' code and data, which
// a decode step keeps warm.
// Output: one JSON object on stdout.

#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#define MAX_LIST 64
#ifndef GGML_MM_SOURCE
#define GGML_MM_SOURCE "unknown"
#endif

static double now(clockid_t c) {
    struct timespec ts;
    clock_gettime(c, &ts);
    return (double) ts.tv_sec + 1e-9 * (double) ts.tv_nsec;
}

static int cmp_double(const void * a, const void * b) {
    double x = *(const double *) a, y = *(const double *) b;
    return (x > y) - (x < y);
}

// xorshift64* + Box-Muller: reproducible Gaussian floats without libc rand.
static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static double uniform01(void) {
    rng_state ^= rng_state >> 12; rng_state ^= rng_state << 25; rng_state ^= rng_state >> 27;
    return ((rng_state * 2685821657736338717ull) >> 11) * (1.0 / 9007199254740992.0);
}
static void fill_gauss(float * x, size_t n, float scale) {
    for (size_t i = 0; i < n; i += 2) {
        double u1 = uniform01(), u2 = uniform01();
        if (u1 < 1e-300) u1 = 1e-300;
        double r = sqrt(-2.0 * log(u1)), t = 6.283185307179586 * u2;
        x[i] = (float) (scale * r * cos(t));
        if (i + 1 < n) x[i + 1] = (float) (scale * r * sin(t));
    }
}

static int parse_ints(const char * s, long * out) {
    int n = 0;
    char * buf = strdup(s), * save = NULL;
    for (char * t = strtok_r(buf, ",", &save); t && n < MAX_LIST; t = strtok_r(NULL, ",", &save)) out[n++] = atol(t);
    free(buf);
    return n;
}

static int parse_shapes(const char * s, long * ns, long * ks) {
    int n = 0;
    char * buf = strdup(s), * save = NULL;
    for (char * t = strtok_r(buf, ",", &save); t && n < MAX_LIST; t = strtok_r(NULL, ",", &save)) {
        char * x = strchr(t, 'x');
        if (!x) x = strchr(t, 'X');
        if (!x) { fprintf(stderr, "bad shape %s (want NxK)\n", t); exit(2); }
        ns[n] = atol(t); ks[n] = atol(x + 1); n++;
    }
    free(buf);
    return n;
}

static enum ggml_type type_by_name(const char * name) {
    for (int t = 0; t < GGML_TYPE_COUNT; t++) {
        const char * tn = ggml_type_name((enum ggml_type) t);
        if (tn && ggml_blck_size((enum ggml_type) t) > 0 && strcmp(tn, name) == 0) return (enum ggml_type) t;
    }
    fprintf(stderr, "unknown ggml type %s\n", name);
    exit(2);
}

static ggml_backend_buffer_type_t repack_buft(ggml_backend_dev_t dev) {
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
    ggml_backend_dev_get_extra_bufts_t get =
        (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
    if (!get) return NULL;
    for (ggml_backend_buffer_type_t * b = get(dev); b && *b; b++) {
        if (strstr(ggml_backend_buft_name(*b), "REPACK")) return *b;
    }
    return NULL;
}

static void print_info(void) {
    printf("{\"ggml_version\": \"%s\", \"ggml_source\": \"%s\", \"cpu\": {"
           "\"avx\": %d, \"avx2\": %d, \"fma\": %d, \"f16c\": %d, \"bmi2\": %d, \"avx_vnni\": %d, "
           "\"avx512\": %d, \"avx512_vbmi\": %d, \"avx512_vnni\": %d, \"avx512_bf16\": %d, "
           "\"amx_int8\": %d, \"neon\": %d, \"dotprod\": %d, \"llamafile\": %d}",
           ggml_version(), GGML_MM_SOURCE, ggml_cpu_has_avx(), ggml_cpu_has_avx2(), ggml_cpu_has_fma(),
           ggml_cpu_has_f16c(), ggml_cpu_has_bmi2(), ggml_cpu_has_avx_vnni(), ggml_cpu_has_avx512(),
           ggml_cpu_has_avx512_vbmi(), ggml_cpu_has_avx512_vnni(), ggml_cpu_has_avx512_bf16(),
           ggml_cpu_has_amx_int8(), ggml_cpu_has_neon(), ggml_cpu_has_dotprod(), ggml_cpu_has_llamafile());
}

int main(int argc, char ** argv) {
    const char * types_s = "q4_0,q4_K,q3_K,q2_K,q8_0";
    const char * shapes_s = "4096x4096,11008x4096,4096x11008";
    const char * ms_s = "1,2,4,8,16,128";
    const char * layouts_s = "plain,repack";
    int n_threads = 1, max_reps = 200, info_only = 0;
    long cold_mb = 0;
    double min_time = 0.3;
    for (int i = 1; i < argc; i++) {
        const char * a = argv[i];
        const char * v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--info")) { info_only = 1; continue; }
        if (!v) { fprintf(stderr, "usage: see the top of ggml_mm.c (%s needs a value)\n", a); return 2; }
        if (!strcmp(a, "--types")) types_s = v;
        else if (!strcmp(a, "--shapes")) shapes_s = v;
        else if (!strcmp(a, "--m")) ms_s = v;
        else if (!strcmp(a, "--layout")) layouts_s = v;
        else if (!strcmp(a, "--threads")) n_threads = atoi(v);
        else if (!strcmp(a, "--min-time")) min_time = atof(v);
        else if (!strcmp(a, "--max-reps")) max_reps = atoi(v);
        else if (!strcmp(a, "--cold-mb")) cold_mb = atol(v);
        else { fprintf(stderr, "unknown option %s\n", a); return 2; }
        i++;
    }
    if (max_reps < 3) max_reps = 3;
    if (cold_mb < 0) { fprintf(stderr, "--cold-mb must be >= 0\n"); return 2; }
    ggml_cpu_init();
    print_info();
    if (info_only) { printf("}\n"); return 0; }

    long ns[MAX_LIST], ks[MAX_LIST], ms[MAX_LIST];
    int n_shapes = parse_shapes(shapes_s, ns, ks), n_ms = parse_ints(ms_s, ms);
    enum ggml_type types[MAX_LIST];
    int n_types = 0;
    {
        char * buf = strdup(types_s), * save = NULL;
        for (char * t = strtok_r(buf, ",", &save); t && n_types < MAX_LIST; t = strtok_r(NULL, ",", &save))
            types[n_types++] = type_by_name(t);
        free(buf);
    }
    int want_plain = strstr(layouts_s, "plain") != NULL, want_repack = strstr(layouts_s, "repack") != NULL;

    ggml_backend_t be = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(be, n_threads);
    struct ggml_threadpool_params tpp = ggml_threadpool_params_default(n_threads);
    struct ggml_threadpool * tp = ggml_threadpool_new(&tpp);
    ggml_backend_cpu_set_threadpool(be, tp);
    ggml_backend_dev_t dev = ggml_backend_get_device(be);
    ggml_backend_buffer_type_t cpu_buft = ggml_backend_get_default_buffer_type(be);
    ggml_backend_buffer_type_t rp_buft = repack_buft(dev);

    printf(", \"threads\": %d, \"min_time_s\": %g, \"cold_mb\": %ld, \"repack_buffer\": \"%s\", \"results\": [",
           n_threads, min_time, cold_mb, rp_buft ? ggml_backend_buft_name(rp_buft) : "");
    int first = 1;
    double * cpu_t = malloc(sizeof(double) * (size_t) max_reps);
    double * wall_t = malloc(sizeof(double) * (size_t) max_reps);

    for (int si = 0; si < n_shapes; si++) {
        const long N = ns[si], K = ks[si];
        float * wf = malloc(sizeof(float) * (size_t) N * (size_t) K);
        rng_state = 0x9E3779B97F4A7C15ull ^ (uint64_t) (N * 1000003 + K);
        fill_gauss(wf, (size_t) N * (size_t) K, (float) (1.0 / sqrt((double) K)));
        for (int ti = 0; ti < n_types; ti++) {
            const enum ggml_type type = types[ti];
            if (K % ggml_blck_size(type) != 0) {
                fprintf(stderr, "skip %s: K=%ld not a multiple of %ld\n", ggml_type_name(type), K,
                        (long) ggml_blck_size(type));
                continue;
            }
            const size_t row = ggml_row_size(type, K);
            int n_copies = 1;
            if (cold_mb > 0) {
                const size_t want = ((size_t) cold_mb << 20) / (row * (size_t) N) + 1;
                n_copies = want > MAX_LIST ? MAX_LIST : (int) want;
            }
            void * wq = malloc(row * (size_t) N);
            double tq = now(CLOCK_MONOTONIC);
            ggml_quantize_chunk(type, wf, wq, 0, N, K, NULL);
            tq = now(CLOCK_MONOTONIC) - tq;
            // dequantized first rows, for the accuracy check
            const int NCHK = N < 8 ? (int) N : 8;
            float * wdq = malloc(sizeof(float) * (size_t) NCHK * (size_t) K);
            const struct ggml_type_traits * tr = ggml_get_type_traits(type);
            for (int r = 0; r < NCHK; r++) tr->to_float((const char *) wq + (size_t) r * row, wdq + (size_t) r * K, K);

            for (int li = 0; li < 2; li++) {
                const int repack = li == 1;
                if ((repack && !want_repack) || (!repack && !want_plain)) continue;
                if (repack && !rp_buft) continue;
                struct ggml_init_params wp = {ggml_tensor_overhead() * (size_t) (n_copies + 1), NULL, true};
                struct ggml_context * wctx = ggml_init(wp);
                struct ggml_tensor * ws[MAX_LIST];
                for (int c = 0; c < n_copies; c++) ws[c] = ggml_new_tensor_2d(wctx, type, K, N);
                ggml_backend_buffer_t wbuf = ggml_backend_alloc_ctx_tensors_from_buft(wctx, repack ? rp_buft : cpu_buft);
                int weight_set = 0;
                for (int mi = 0; mi < n_ms; mi++) {
                    const long M = ms[mi];
                    struct ggml_init_params p = {(ggml_tensor_overhead() + ggml_graph_overhead()) * (size_t) (n_copies + 2),
                                                 NULL, true};
                    struct ggml_context * ctx = ggml_init(p);
                    struct ggml_tensor * x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, K, M);
                    // one graph per weight copy, all on the same x
                    struct ggml_cgraph * gfs[MAX_LIST];
                    struct ggml_tensor * y = NULL;
                    for (int c = 0; c < n_copies; c++) {
                        struct ggml_tensor * yc = ggml_mul_mat(ctx, ws[c], x);
                        gfs[c] = ggml_new_graph(ctx);
                        ggml_build_forward_expand(gfs[c], yc);
                        if (c == 0) y = yc;
                    }
                    ggml_backend_buffer_t xbuf = ggml_backend_alloc_ctx_tensors(ctx, be);
                    const char * layout = repack ? "repack" : "plain";
                    if (!ggml_backend_supports_op(be, y) || (repack && !ggml_backend_dev_supports_op(dev, y))) {
                        printf("%s\n{\"type\": \"%s\", \"layout\": \"%s\", \"n\": %ld, \"k\": %ld, \"m\": %ld, "
                               "\"unsupported\": true}", first ? "" : ",", ggml_type_name(type), layout, N, K, M);
                        first = 0;
                        ggml_backend_buffer_free(xbuf);
                        ggml_free(ctx);
                        continue;
                    }
                    if (!weight_set) {  // the repack buffer converts the layout here
                        for (int c = 0; c < n_copies; c++) ggml_backend_tensor_set(ws[c], wq, 0, row * (size_t) N);
                        weight_set = 1;
                    }
                    float * xf = malloc(sizeof(float) * (size_t) K * (size_t) M);
                    rng_state = 0xD1B54A32D192ED03ull ^ (uint64_t) (M * 7919 + K);
                    fill_gauss(xf, (size_t) K * (size_t) M, 1.0f);
                    ggml_backend_tensor_set(x, xf, 0, sizeof(float) * (size_t) K * (size_t) M);

                    // warm-up (also sizes the backend's work buffer once)
                    for (int r = 0; r < 2; r++)
                        for (int c = 0; c < n_copies; c++) ggml_backend_graph_compute(be, gfs[c]);
                    int reps = 0;
                    const double start = now(CLOCK_MONOTONIC);
                    while (reps < max_reps && (reps < 3 || now(CLOCK_MONOTONIC) - start < min_time)) {
                        const double c0 = now(CLOCK_PROCESS_CPUTIME_ID), w0 = now(CLOCK_MONOTONIC);
                        ggml_backend_graph_compute(be, gfs[reps % n_copies]);
                        const double w1 = now(CLOCK_MONOTONIC), c1 = now(CLOCK_PROCESS_CPUTIME_ID);
                        cpu_t[reps] = c1 - c0;
                        wall_t[reps] = w1 - w0;
                        reps++;
                    }
                    qsort(cpu_t, (size_t) reps, sizeof(double), cmp_double);
                    qsort(wall_t, (size_t) reps, sizeof(double), cmp_double);

                    // accuracy against the dequantized weight in float64
                    float * yo = malloc(sizeof(float) * (size_t) N * (size_t) M);
                    ggml_backend_tensor_get(y, yo, 0, sizeof(float) * (size_t) N * (size_t) M);
                    double num = 0, den = 0;
                    for (long m = 0; m < M; m++)
                        for (int r = 0; r < NCHK; r++) {
                            double s = 0;
                            for (long kk = 0; kk < K; kk++) s += (double) wdq[(size_t) r * K + kk] * xf[(size_t) m * K + kk];
                            const double d = yo[(size_t) m * N + r] - s;
                            num += d * d; den += s * s;
                        }
                    printf("%s\n{\"type\": \"%s\", \"layout\": \"%s\", \"n\": %ld, \"k\": %ld, \"m\": %ld, "
                           "\"bpw\": %.4f, \"weight_bytes\": %zu, \"copies\": %d, \"reps\": %d, "
                           "\"cpu_median_s\": %.9g, \"cpu_min_s\": %.9g, \"wall_median_s\": %.9g, \"wall_min_s\": %.9g, "
                           "\"rel_err_vs_dequant\": %.3g, \"quantize_s\": %.3g}",
                           first ? "" : ",", ggml_type_name(type), layout, N, K, M,
                           8.0 * (double) row / (double) K, row * (size_t) N, n_copies, reps,
                           cpu_t[reps / 2], cpu_t[0], wall_t[reps / 2], wall_t[0],
                           den > 0 ? sqrt(num / den) : 0.0, tq);
                    first = 0;
                    fflush(stdout);
                    free(yo);
                    free(xf);
                    ggml_backend_buffer_free(xbuf);
                    ggml_free(ctx);
                }
                ggml_backend_buffer_free(wbuf);
                ggml_free(wctx);
            }
            free(wdq);
            free(wq);
        }
        free(wf);
    }
    printf("\n]}\n");
    free(cpu_t);
    free(wall_t);
    ggml_backend_free(be);
    ggml_threadpool_free(tp);
    return 0;
}
