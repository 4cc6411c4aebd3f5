// pybmoe-test-skip: self-checking test of the MUL_MAT_ID skip table (src[3]).
//
//   pybmoe-test-skip [RPC_ENDPOINT]
//
// 1. CPU kernels: a MUL_MAT_ID with a skip table must write exact zeros for the rows of skipped
//    experts and, for every other row, exactly the bytes of the unsplit MUL_MAT_ID. Checked for
//    F32, F16, Q8_0 and Q4_0 weights, 1..9 tokens, skip tables with 0..all experts resident.
// 2. Devices: ggml_backend_dev_supports_op / offload_op must refuse a MUL_MAT_ID with a skip table on
//    every non-CPU device (the RPC device at RPC_ENDPOINT when given) and still accept it without.
// 3. Duplicate expert ids (the cache's dummy slot repeats within a token's row): the CPU repack
//    MUL_MAT_ID (weights in the CPU_REPACK buffer) must equal the generic one for ids drawn with
//    replacement, with one repeated pair per row, and with half the ids on one expert (the dummy
//    slot), at 1..32 tokens, for every type this CPU repacks.
// Prints one line per failure and "N passed, M failed" at the end; exit status 0 when all pass.

#include "ggml.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml-rpc.h"
#include "ggml-alloc.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

static int n_pass = 0;
static int n_fail = 0;

static void check(bool ok, const char * what) {
    if (ok) {
        n_pass++;
    } else {
        n_fail++;
        printf("FAIL: %s\n", what);
    }
}

static void test_cpu(ggml_type type, int n_tokens, int n_resident, std::mt19937 & rng) {
    const int n_expert = 8, n_used = 4, k = 64, m = 32;
    ggml_init_params ip = { 64u << 20, nullptr, false };
    ggml_context * ctx = ggml_init(ip);

    ggml_tensor * as  = ggml_new_tensor_3d(ctx, type, k, m, n_expert);
    ggml_tensor * b   = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, k, 1, n_tokens);
    ggml_tensor * ids = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, n_used, n_tokens);
    ggml_tensor * tbl = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n_expert);

    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<float> w(k * m * n_expert);
    for (auto & x : w) { x = u(rng); }
    if (type == GGML_TYPE_F32) {
        memcpy(as->data, w.data(), ggml_nbytes(as));
    } else {
        ggml_quantize_chunk(type, w.data(), as->data, 0, m * n_expert, k, nullptr);
    }
    for (int64_t i = 0; i < ggml_nelements(b); ++i) { ((float *) b->data)[i] = u(rng); }
    for (int t = 0; t < n_tokens; ++t) {
        std::vector<int> perm(n_expert);
        for (int e = 0; e < n_expert; ++e) { perm[e] = e; }
        std::shuffle(perm.begin(), perm.end(), rng);
        for (int j = 0; j < n_used; ++j) { ((int32_t *) ids->data)[t * n_used + j] = perm[j]; }
    }
    // the first n_resident experts have slots 0..n_resident-1, the rest the dummy slot n_slots
    const int n_slots = 5;
    for (int e = 0; e < n_expert; ++e) {
        ((int32_t *) tbl->data)[e] = e < n_resident ? e % n_slots : n_slots;
    }

    ggml_tensor * full = ggml_mul_mat_id(ctx, as, b, ids);
    ggml_tensor * host = ggml_mul_mat_id(ctx, as, b, ids);
    ggml_mul_mat_id_set_skip(host, tbl, n_slots);
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, full);
    ggml_build_forward_expand(gf, host);
    // poison the output so an unwritten row cannot pass as zeros
    memset(host->data, 0xff, ggml_nbytes(host));
    ggml_graph_compute_with_ctx(ctx, gf, 2);

    bool zeros_ok = true, rows_ok = true;
    for (int t = 0; t < n_tokens; ++t) {
        for (int j = 0; j < n_used; ++j) {
            const int e = ((int32_t *) ids->data)[t * n_used + j];
            const float * rf = (const float *) ((char *) full->data + j * full->nb[1] + t * full->nb[2]);
            const float * rh = (const float *) ((char *) host->data + j * host->nb[1] + t * host->nb[2]);
            if (e < n_resident && n_resident > 0) {
                for (int i = 0; i < m; ++i) { zeros_ok = zeros_ok && rh[i] == 0.0f && !std::signbit(rh[i]); }
            } else {
                rows_ok = rows_ok && memcmp(rf, rh, m * sizeof(float)) == 0;
            }
        }
    }
    char what[128];
    snprintf(what, sizeof(what), "cpu %s tokens=%d resident=%d: skipped rows are +0", ggml_type_name(type), n_tokens, n_resident);
    check(zeros_ok, what);
    snprintf(what, sizeof(what), "cpu %s tokens=%d resident=%d: other rows bit-equal", ggml_type_name(type), n_tokens, n_resident);
    check(rows_ok, what);
    ggml_free(ctx);
}

static void test_devices() {
    ggml_init_params ip = { 1u << 20, nullptr, true };
    ggml_context * ctx = ggml_init(ip);
    ggml_tensor * as   = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, 64, 32, 8);
    ggml_tensor * b    = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, 64, 1, 64);
    ggml_tensor * ids  = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, 4, 64);
    ggml_tensor * tbl  = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, 8);
    ggml_tensor * plain = ggml_mul_mat_id(ctx, as, b, ids);
    ggml_tensor * skip  = ggml_mul_mat_id(ctx, as, b, ids);
    ggml_mul_mat_id_set_skip(skip, tbl, 4);

    int n_other = 0;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        char what[160];
        if (ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU) {
            snprintf(what, sizeof(what), "%s (CPU) supports MUL_MAT_ID with a skip table", ggml_backend_dev_name(dev));
            check(ggml_backend_dev_supports_op(dev, skip), what);
            continue;
        }
        n_other++;
        snprintf(what, sizeof(what), "%s refuses MUL_MAT_ID with a skip table", ggml_backend_dev_name(dev));
        check(!ggml_backend_dev_supports_op(dev, skip), what);
        snprintf(what, sizeof(what), "%s does not offload MUL_MAT_ID with a skip table", ggml_backend_dev_name(dev));
        check(!ggml_backend_dev_offload_op(dev, skip), what);
        snprintf(what, sizeof(what), "%s still supports plain MUL_MAT_ID", ggml_backend_dev_name(dev));
        check(ggml_backend_dev_supports_op(dev, plain), what);
    }
    printf("devices checked: %zu (%d non-CPU)\n", ggml_backend_dev_count(), n_other);
    ggml_free(ctx);
}

static ggml_backend_buffer_type_t cpu_repack_buft() {
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(cpu);
    auto get = (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
    for (ggml_backend_buffer_type_t * p = get ? get(cpu) : nullptr; p && *p; ++p) {
        if (strcmp(ggml_backend_buft_name(*p), "CPU_REPACK") == 0) {
            return *p;
        }
    }
    return nullptr;
}

// ids: 0 = a permutation prefix (no duplicates), 1 = drawn with replacement, 2 = one repeated pair per row,
// 3 = each id replaced by the last expert with probability 1/2 (the cache's misses all map to the dummy slot)
static void test_repack_dup(ggml_backend_t cpu, ggml_backend_buffer_type_t repack, ggml_type type, int n_tokens,
                            int dup, std::mt19937 & rng) {
    const int n_expert = 8, n_used = 4, k = 256, m = 64;
    const ggml_init_params ip = { 16 * ggml_tensor_overhead() + ggml_graph_overhead(), nullptr, true };
    ggml_context * ctx_w = ggml_init(ip);  // the repacked weights
    ggml_context * ctx_p = ggml_init(ip);  // plain weights and the inputs
    ggml_context * ctx_g = ggml_init(ip);  // the graph
    ggml_tensor * as_r = ggml_new_tensor_3d(ctx_w, type, k, m, n_expert);
    ggml_tensor * as_p = ggml_new_tensor_3d(ctx_p, type, k, m, n_expert);
    ggml_tensor * b    = ggml_new_tensor_3d(ctx_p, GGML_TYPE_F32, k, 1, n_tokens);
    ggml_tensor * ids  = ggml_new_tensor_2d(ctx_p, GGML_TYPE_I32, n_used, n_tokens);
    ggml_backend_buffer_t buf_w = ggml_backend_alloc_ctx_tensors_from_buft(ctx_w, repack);
    ggml_backend_buffer_t buf_p = ggml_backend_alloc_ctx_tensors_from_buft(ctx_p, ggml_backend_cpu_buffer_type());
    ggml_tensor * out_r = ggml_mul_mat_id(ctx_g, as_r, b, ids);
    ggml_tensor * out_p = ggml_mul_mat_id(ctx_g, as_p, b, ids);
    char what[160];
    snprintf(what, sizeof(what), "repack %s tokens=%d ids=%s", ggml_type_name(type), n_tokens,
             dup == 0 ? "distinct" : dup == 1 ? "with-replacement" : dup == 2 ? "repeated-pair" : "dummy-slot");
    if (!ggml_backend_supports_op(cpu, out_r) || as_r->extra == nullptr) {
        ggml_free(ctx_g);
        ggml_backend_buffer_free(buf_w); ggml_backend_buffer_free(buf_p);
        ggml_free(ctx_w); ggml_free(ctx_p);
        return; // this CPU does not repack the type
    }
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<float> w((size_t) k * m * n_expert);
    for (auto & x : w) { x = u(rng); }
    std::vector<uint8_t> q(ggml_nbytes(as_p));
    ggml_quantize_chunk(type, w.data(), q.data(), 0, m * n_expert, k, nullptr);
    ggml_backend_tensor_set(as_p, q.data(), 0, q.size());
    ggml_backend_tensor_set(as_r, q.data(), 0, q.size()); // repacks
    std::vector<float> bv(ggml_nelements(b));
    for (auto & x : bv) { x = u(rng); }
    ggml_backend_tensor_set(b, bv.data(), 0, ggml_nbytes(b));
    std::vector<int32_t> iv(n_used * n_tokens);
    std::uniform_int_distribution<int> pick(0, n_expert - 1);
    for (int t = 0; t < n_tokens; ++t) {
        std::vector<int> perm(n_expert);
        for (int e = 0; e < n_expert; ++e) { perm[e] = e; }
        std::shuffle(perm.begin(), perm.end(), rng);
        for (int j = 0; j < n_used; ++j) {
            iv[t * n_used + j] = dup == 1 ? pick(rng) : perm[j];
        }
        if (dup == 2) {
            iv[t * n_used + 1] = iv[t * n_used + 0];
        }
        for (int j = 0; dup == 3 && j < n_used; ++j) {
            if (rng() & 1) {
                iv[t * n_used + j] = n_expert - 1;
            }
        }
    }
    ggml_backend_tensor_set(ids, iv.data(), 0, ggml_nbytes(ids));

    ggml_cgraph * gf = ggml_new_graph(ctx_g);
    ggml_build_forward_expand(gf, out_r);
    ggml_build_forward_expand(gf, out_p);
    ggml_gallocr_t galloc = ggml_gallocr_new(ggml_backend_cpu_buffer_type());
    ggml_gallocr_alloc_graph(galloc, gf);
    std::vector<float> poison(ggml_nelements(out_r), NAN);
    ggml_backend_tensor_set(out_r, poison.data(), 0, ggml_nbytes(out_r)); // an unwritten row cannot pass
    ggml_backend_graph_compute(cpu, gf);
    std::vector<float> r(ggml_nelements(out_r)), p(ggml_nelements(out_p));
    ggml_backend_tensor_get(out_r, r.data(), 0, ggml_nbytes(out_r));
    ggml_backend_tensor_get(out_p, p.data(), 0, ggml_nbytes(out_p));
    double err = 0.0, ref = 0.0;
    for (size_t i = 0; i < r.size(); ++i) {
        err += (r[i] - p[i]) * (double) (r[i] - p[i]);
        ref += p[i] * (double) p[i];
    }
    const double nmse = std::isfinite(err) ? err / std::max(ref, 1e-30) : INFINITY;
    snprintf(what + strlen(what), sizeof(what) - strlen(what), ": equals the generic kernel (nmse %.2e)", nmse);
    check(nmse < 1e-6, what);
    ggml_gallocr_free(galloc);
    ggml_free(ctx_g);
    ggml_backend_buffer_free(buf_w);
    ggml_backend_buffer_free(buf_p);
    ggml_free(ctx_w);
    ggml_free(ctx_p);
}

int main(int argc, char ** argv) {
    ggml_backend_load_all();
    if (argc > 1) {
        ggml_backend_reg_t reg = ggml_backend_rpc_add_server(argv[1]);
        if (reg == nullptr) {
            printf("FAIL: cannot reach the RPC server at %s\n", argv[1]);
            return 1;
        }
        ggml_backend_register(reg);
    }
    std::mt19937 rng(42);
    for (ggml_type type : { GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_Q8_0, GGML_TYPE_Q4_0 }) {
        for (int n_tokens : { 1, 3, 9 }) {
            for (int n_resident : { 0, 1, 4, 8 }) {
                test_cpu(type, n_tokens, n_resident, rng);
            }
        }
    }
    test_devices();
    if (ggml_backend_buffer_type_t repack = cpu_repack_buft()) {
        ggml_backend_t cpu = ggml_backend_cpu_init();
        ggml_backend_cpu_set_n_threads(cpu, 2);
        const int before = n_pass + n_fail;
        for (ggml_type type : { GGML_TYPE_Q4_0, GGML_TYPE_Q4_K, GGML_TYPE_Q8_0, GGML_TYPE_IQ4_NL }) {
            for (int n_tokens : { 1, 2, 7, 9, 16, 32 }) {
                for (int dup : { 0, 1, 2, 3 }) {
                    test_repack_dup(cpu, repack, type, n_tokens, dup, rng);
                }
            }
        }
        printf("repack checks: %d\n", n_pass + n_fail - before);
        ggml_backend_free(cpu);
    } else {
        printf("repack checks: 0 (this CPU has no CPU_REPACK buffer type)\n");
    }
    printf("%d passed, %d failed\n", n_pass, n_fail);
    return n_fail == 0 ? 0 : 1;
}
