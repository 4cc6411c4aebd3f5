// pybmoe-make-synth: writes a big synthetic qwen3moe GGUF of a given shape, fast.
//
// The Python generator (pybmoe.models) draws normal weights and quantizes them with numpy, which
// takes minutes for a model of tens of GB. This tool writes the same tensor layout with uniform
// random weights generated directly in the storage type, on every core, streaming to the file:
//
//   pybmoe-make-synth OUT --vocab VOCAB.gguf [--n-layer 48] [--n-expert 128] [--top-k 8]
//       [--n-embd 2048] [--n-ff-exp 768] [--n-head 32] [--n-head-kv 4] [--head-dim 128]
//       [--type q8_0|q4_0|q4_k|f16] [--seed 0] [--threads N] [--n-ctx-train 4096] [--dry-run]
//
// Tensors (ggml order, ne0 first), as pybmoe.models writes them:
//   token_embd.weight {n_embd, n_vocab} (the output head is tied to it), output_norm.weight;
//   per block: attn_norm, attn_q/k/v, attn_output, attn_q_norm, attn_k_norm, ffn_norm,
//   ffn_gate_inp (the router, F32), ffn_gate_exps / ffn_up_exps {n_embd, n_ff_exp, n_expert},
//   ffn_down_exps {n_ff_exp, n_embd, n_expert}.
// Matrices use --type (a row length that the type's 32-element blocks do not divide falls back
// to q8_0, then f16); norms are 1.0f; the router is F32.
//
// Values: every quantized block has one fixed f16 scale per tensor and uniformly random quants,
// so that the weights' standard deviation is 1/sqrt(fan_in) (the router's 2/sqrt(fan_in), wide
// enough for a non-degenerate top-k). Q8_0 quants avoid -128. The random stream is splitmix64,
// seeded per (seed, tensor, row chunk), so the bytes do not depend on the thread count. The workers
// fill a shared mapping of the file (--no-mmap: pwrite), so the data goes to the page cache once.
//
// The tokenizer.* pairs are copied from VOCAB (models/ggml-vocab-qwen2.gguf of the pinned tree).
// The file is written to OUT.tmp and renamed at the end. stdout gets one summary line:
//   pybmoe-make-synth: OUT bytes=B expert_bytes=E dense_bytes=D expert_tensors_bytes=X seconds=S
// where E is one expert of one layer (gate + up + down slices), D the bytes of all non-expert
// tensors, X the bytes of all expert tensors.
#include "ggml.h"
#include "gguf.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

namespace {

struct Args {
    std::string out, vocab;
    int n_layer = 48, n_expert = 128, top_k = 8, n_embd = 2048, n_ff_exp = 768;
    int n_head = 32, n_head_kv = 4, head_dim = 128, n_ctx_train = 4096;
    std::string type = "q8_0";
    uint64_t seed = 0;
    int threads = 0;
    bool dry_run = false;
    bool use_mmap = true;
};

void usage() {
    fprintf(stderr,
            "usage: pybmoe-make-synth OUT --vocab VOCAB.gguf [--n-layer N] [--n-expert N] [--top-k N]\n"
            "       [--n-embd N] [--n-ff-exp N] [--n-head N] [--n-head-kv N] [--head-dim N]\n"
            "       [--type q8_0|q4_0|q4_k|f16] [--seed S] [--threads N] [--n-ctx-train N] [--dry-run] [--no-mmap]\n");
}

bool parse(int argc, char ** argv, Args & a) {
    for (int i = 1; i < argc; ++i) {
        std::string k = argv[i];
        auto next = [&](void) -> const char * {
            if (i + 1 >= argc) {
                fprintf(stderr, "pybmoe-make-synth: %s needs a value\n", k.c_str());
                exit(2);
            }
            return argv[++i];
        };
        auto num = [&](int & v, int lo) {
            const char * s = next();
            char * end = nullptr;
            long x = strtol(s, &end, 10);
            if (*s == 0 || *end != 0 || x < lo || x > (1L << 30)) {
                fprintf(stderr, "pybmoe-make-synth: %s=%s is not an integer >= %d\n", k.c_str(), s, lo);
                exit(2);
            }
            v = (int) x;
        };
        if (k == "--vocab") a.vocab = next();
        else if (k == "--n-layer") num(a.n_layer, 1);
        else if (k == "--n-expert") num(a.n_expert, 2);
        else if (k == "--top-k") num(a.top_k, 1);
        else if (k == "--n-embd") num(a.n_embd, 1);
        else if (k == "--n-ff-exp") num(a.n_ff_exp, 1);
        else if (k == "--n-head") num(a.n_head, 1);
        else if (k == "--n-head-kv") num(a.n_head_kv, 1);
        else if (k == "--head-dim") num(a.head_dim, 2);
        else if (k == "--n-ctx-train") num(a.n_ctx_train, 1);
        else if (k == "--threads") num(a.threads, 1);
        else if (k == "--seed") { int s = 0; num(s, 0); a.seed = (uint64_t) s; }
        else if (k == "--type") a.type = next();
        else if (k == "--dry-run") a.dry_run = true;
        else if (k == "--no-mmap") a.use_mmap = false;
        else if (k == "-h" || k == "--help") { usage(); exit(0); }
        else if (!k.empty() && k[0] != '-' && a.out.empty()) a.out = k;
        else {
            fprintf(stderr, "pybmoe-make-synth: unknown argument '%s'\n", k.c_str());
            usage();
            return false;
        }
    }
    if (a.out.empty() || a.vocab.empty()) {
        usage();
        return false;
    }
    if (a.type != "q8_0" && a.type != "q4_0" && a.type != "q4_k" && a.type != "f16") {
        fprintf(stderr, "pybmoe-make-synth: --type %s is not supported; accepted: q8_0, q4_0, q4_k, f16\n", a.type.c_str());
        return false;
    }
    if (a.top_k > a.n_expert || a.n_expert > 1024 || a.n_layer > 512) {
        fprintf(stderr, "pybmoe-make-synth: need top-k <= n-expert <= 1024 and n-layer <= 512\n");
        return false;
    }
    if (a.n_head % a.n_head_kv || a.head_dim % 2) {
        fprintf(stderr, "pybmoe-make-synth: n-head-kv must divide n-head and head-dim must be even\n");
        return false;
    }
    return true;
}

uint64_t splitmix64(uint64_t & s) {
    uint64_t z = (s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

enum class Fill { ONES, ROUTER, WEIGHT };

struct Plan {
    std::string name;
    ggml_type type;
    int64_t ne[4];
    int n_dims;
    Fill fill;
    bool expert;
};

// the type of a matrix with rows of n elements: want, else q8_0, else f16
ggml_type fit(ggml_type want, int64_t n) {
    for (ggml_type t : {want, GGML_TYPE_Q8_0, GGML_TYPE_F16}) {
        if (n % ggml_blck_size(t) == 0) return t;
    }
    return GGML_TYPE_F16;
}

std::vector<Plan> plan(const Args & a, int64_t n_vocab, ggml_type q) {
    const int64_t E = a.n_embd, F = a.n_ff_exp, X = a.n_expert;
    const int64_t nq = (int64_t) a.n_head * a.head_dim, nkv = (int64_t) a.n_head_kv * a.head_dim;
    std::vector<Plan> p;
    auto add = [&](const std::string & n, ggml_type t, std::vector<int64_t> ne, Fill f, bool ex = false) {
        Plan x{n, t, {1, 1, 1, 1}, (int) ne.size(), f, ex};
        for (size_t i = 0; i < ne.size(); ++i) x.ne[i] = ne[i];
        p.push_back(x);
    };
    add("token_embd.weight", fit(q, E), {E, n_vocab}, Fill::WEIGHT);
    add("output_norm.weight", GGML_TYPE_F32, {E}, Fill::ONES);
    for (int il = 0; il < a.n_layer; ++il) {
        const std::string b = "blk." + std::to_string(il) + ".";
        add(b + "attn_norm.weight", GGML_TYPE_F32, {E}, Fill::ONES);
        add(b + "attn_q.weight", fit(q, E), {E, nq}, Fill::WEIGHT);
        add(b + "attn_k.weight", fit(q, E), {E, nkv}, Fill::WEIGHT);
        add(b + "attn_v.weight", fit(q, E), {E, nkv}, Fill::WEIGHT);
        add(b + "attn_output.weight", fit(q, nq), {nq, E}, Fill::WEIGHT);
        add(b + "attn_q_norm.weight", GGML_TYPE_F32, {a.head_dim}, Fill::ONES);
        add(b + "attn_k_norm.weight", GGML_TYPE_F32, {a.head_dim}, Fill::ONES);
        add(b + "ffn_norm.weight", GGML_TYPE_F32, {E}, Fill::ONES);
        add(b + "ffn_gate_inp.weight", GGML_TYPE_F32, {E, X}, Fill::ROUTER);
        add(b + "ffn_gate_exps.weight", fit(q, E), {E, F, X}, Fill::WEIGHT, true);
        add(b + "ffn_up_exps.weight", fit(q, E), {E, F, X}, Fill::WEIGHT, true);
        add(b + "ffn_down_exps.weight", fit(q, F), {F, E, X}, Fill::WEIGHT, true);
    }
    return p;
}

// One chunk of n_rows rows of a tensor into buf (row_bytes each), from the random stream seed.
void fill_rows(const Plan & t, uint64_t seed, int64_t n_rows, uint8_t * buf) {
    const int64_t ne0 = t.ne[0];
    const size_t rb = ggml_row_size(t.type, ne0);
    const size_t n = rb * (size_t) n_rows;
    const double fan_in = (double) ne0;
    if (t.fill == Fill::ONES) {
        float * f = (float *) buf;
        for (size_t i = 0; i < n / 4; ++i) f[i] = 1.0f;
        return;
    }
    uint64_t s = seed;
    // raw random bytes first, then the per-type fix-ups
    {
        size_t i = 0;
        for (; i + 8 <= n; i += 8) {
            uint64_t r = splitmix64(s);
            memcpy(buf + i, &r, 8);
        }
        if (i < n) {
            uint64_t r = splitmix64(s);
            memcpy(buf + i, &r, n - i);
        }
    }
    const double std_w = (t.fill == Fill::ROUTER ? 2.0 : 1.0) / std::sqrt(fan_in);
    switch (t.type) {
        case GGML_TYPE_F32: {  // uniform in [-a, a): std a/sqrt(3)
            const float a = (float) (std_w * std::sqrt(3.0));
            uint32_t * u = (uint32_t *) buf;
            float * f = (float *) buf;
            for (size_t i = 0; i < n / 4; ++i) f[i] = a * ((float) (u[i] >> 8) * (2.0f / 16777216.0f) - 1.0f);
        } break;
        case GGML_TYPE_F16: {
            const float a = (float) (std_w * std::sqrt(3.0));
            uint16_t * u = (uint16_t *) buf;
            ggml_fp16_t * h = (ggml_fp16_t *) buf;
            for (size_t i = 0; i < n / 2; ++i) h[i] = ggml_fp32_to_fp16(a * ((float) u[i] * (2.0f / 65536.0f) - 1.0f));
        } break;
        case GGML_TYPE_Q8_0: {  // block: f16 d, int8 qs[32]; uniform over [-127, 127]: std 73.9
            const ggml_fp16_t d = ggml_fp32_to_fp16((float) (std_w / 73.9));
            const size_t bs = ggml_type_size(GGML_TYPE_Q8_0);
            for (size_t o = 0; o < n; o += bs) {
                memcpy(buf + o, &d, 2);
                uint8_t * q = buf + o + 2;
                for (int j = 0; j < 32; ++j) q[j] = q[j] == 0x80 ? 0x81 : q[j];
            }
        } break;
        case GGML_TYPE_Q4_K: {  // block: f16 d, f16 dmin, 12 scale bytes, 128 bytes of nibbles; every
            // sub-block scale 1, dmin 0: x = d * nibble, std 4.61 (a nonzero mean: random weights either way)
            const ggml_fp16_t d = ggml_fp32_to_fp16((float) (std_w / 4.61));
            const ggml_fp16_t z = ggml_fp32_to_fp16(0.0f);
            const size_t bs = ggml_type_size(GGML_TYPE_Q4_K);
            for (size_t o = 0; o < n; o += bs) {
                memcpy(buf + o, &d, 2);
                memcpy(buf + o + 2, &z, 2);
                memset(buf + o + 4, 0x01, 12);
            }
        } break;
        case GGML_TYPE_Q4_0: {  // block: f16 d, 16 bytes of nibbles; x = d * (nibble - 8): std 4.61
            const ggml_fp16_t d = ggml_fp32_to_fp16((float) (std_w / 4.61));
            const size_t bs = ggml_type_size(GGML_TYPE_Q4_0);
            for (size_t o = 0; o < n; o += bs) memcpy(buf + o, &d, 2);
        } break;
        default:
            fprintf(stderr, "pybmoe-make-synth: unexpected type %s\n", ggml_type_name(t.type));
            abort();
    }
}

bool pwrite_all(int fd, const uint8_t * p, size_t n, off_t off) {
    while (n > 0) {
        ssize_t w = pwrite(fd, p, n, off);
        if (w < 0) {
            if (errno == EINTR) continue;
            return false;
        }
        p += w;
        n -= (size_t) w;
        off += w;
    }
    return true;
}

}  // namespace

int main(int argc, char ** argv) {
    Args a;
    if (!parse(argc, argv, a)) return 2;
    const ggml_type q = a.type == "q8_0" ? GGML_TYPE_Q8_0 : a.type == "q4_0" ? GGML_TYPE_Q4_0 :
                        a.type == "q4_k" ? GGML_TYPE_Q4_K : GGML_TYPE_F16;
    for (int v : {a.n_embd, a.n_ff_exp}) {
        if (v % ggml_blck_size(q)) {
            fprintf(stderr, "pybmoe-make-synth: n-embd and n-ff-exp must be multiples of %lld for %s (got %d)\n",
                    (long long) ggml_blck_size(q), a.type.c_str(), v);
            return 2;
        }
    }

    // tokenizer pairs from the vocab file
    gguf_init_params vp = {/*no_alloc =*/ true, /*ctx =*/ nullptr};
    gguf_context * vocab = gguf_init_from_file(a.vocab.c_str(), vp);
    if (!vocab) {
        fprintf(stderr, "pybmoe-make-synth: cannot read the vocab file %s\n", a.vocab.c_str());
        return 2;
    }
    const int64_t tok_id = gguf_find_key(vocab, "tokenizer.ggml.tokens");
    if (tok_id < 0) {
        fprintf(stderr, "pybmoe-make-synth: %s has no tokenizer.ggml.tokens\n", a.vocab.c_str());
        return 2;
    }
    const int64_t n_vocab = (int64_t) gguf_get_arr_n(vocab, tok_id);

    gguf_context * g = gguf_init_empty();
    const std::string arch = "qwen3moe";
    char name[160];
    snprintf(name, sizeof name, "pybmoe-synth-%s-L%d-E%d-K%d-D%d-F%d-%s-s%llu", arch.c_str(), a.n_layer, a.n_expert,
             a.top_k, a.n_embd, a.n_ff_exp, a.type.c_str(), (unsigned long long) a.seed);
    gguf_set_val_str(g, "general.architecture", arch.c_str());
    gguf_set_val_str(g, "general.name", name);
    // llama_ftype: MOSTLY_F16 = 1, MOSTLY_Q4_0 = 2, MOSTLY_Q8_0 = 7, MOSTLY_Q4_K_S = 14
    gguf_set_val_u32(g, "general.file_type", q == GGML_TYPE_F16 ? 1 : q == GGML_TYPE_Q4_0 ? 2 : q == GGML_TYPE_Q4_K ? 14 : 7);
    gguf_set_val_u32(g, "general.quantization_version", GGML_QNT_VERSION);
    auto u32 = [&](const char * k, int v) { gguf_set_val_u32(g, (arch + "." + k).c_str(), (uint32_t) v); };
    u32("context_length", a.n_ctx_train);
    u32("embedding_length", a.n_embd);
    u32("block_count", a.n_layer);
    u32("feed_forward_length", a.n_ff_exp * a.top_k);
    u32("expert_feed_forward_length", a.n_ff_exp);
    u32("expert_count", a.n_expert);
    u32("expert_used_count", a.top_k);
    u32("attention.head_count", a.n_head);
    u32("attention.head_count_kv", a.n_head_kv);
    u32("attention.key_length", a.head_dim);
    u32("attention.value_length", a.head_dim);
    gguf_set_val_f32(g, (arch + ".rope.freq_base").c_str(), 1000000.0f);
    gguf_set_val_f32(g, (arch + ".attention.layer_norm_rms_epsilon").c_str(), 1e-6f);
    {
        gguf_context * tmp = gguf_init_empty();
        gguf_set_kv(tmp, vocab);
        for (int64_t i = gguf_get_n_kv(tmp) - 1; i >= 0; --i) {
            const std::string k = gguf_get_key(tmp, i);
            if (k.rfind("tokenizer.", 0) != 0) gguf_remove_key(tmp, k.c_str());
        }
        gguf_set_kv(g, tmp);
        gguf_free(tmp);
    }
    gguf_free(vocab);

    const std::vector<Plan> tensors = plan(a, n_vocab, q);
    ggml_init_params ip = {/*mem_size =*/ ggml_tensor_overhead() * (tensors.size() + 1), /*mem_buffer =*/ nullptr,
                           /*no_alloc =*/ true};
    ggml_context * ctx = ggml_init(ip);
    size_t expert_bytes_all = 0, dense_bytes = 0;
    for (const Plan & t : tensors) {
        ggml_tensor * x = ggml_new_tensor(ctx, t.type, t.n_dims, t.ne);
        ggml_set_name(x, t.name.c_str());
        gguf_add_tensor(g, x);
        (t.expert ? expert_bytes_all : dense_bytes) += ggml_nbytes(x);
    }
    const size_t expert_bytes = expert_bytes_all / ((size_t) a.n_layer * a.n_expert);
    const size_t meta = gguf_get_meta_size(g);
    const size_t align = gguf_get_alignment(g);
    const int64_t last = (int64_t) tensors.size() - 1;
    const size_t total = meta + gguf_get_tensor_offset(g, last) +
                         GGML_PAD(gguf_get_tensor_size(g, last), align);
    fprintf(stderr, "pybmoe-make-synth: %s: %s, %.2f GiB (%.2f GiB of experts, %.3f MiB per expert)\n",
            a.out.c_str(), name, total / 1073741824.0, expert_bytes_all / 1073741824.0, expert_bytes / 1048576.0);
    if (a.dry_run) {
        printf("pybmoe-make-synth: %s bytes=%zu expert_bytes=%zu dense_bytes=%zu expert_tensors_bytes=%zu seconds=0\n",
               a.out.c_str(), total, expert_bytes, dense_bytes, expert_bytes_all);
        return 0;
    }

    const auto t0 = std::chrono::steady_clock::now();
    const std::string tmp_path = a.out + ".tmp";
    int fd = open(tmp_path.c_str(), O_CREAT | O_TRUNC | O_RDWR, 0644);
    if (fd < 0) {
        fprintf(stderr, "pybmoe-make-synth: cannot create %s: %s\n", tmp_path.c_str(), strerror(errno));
        return 1;
    }
    if (ftruncate(fd, (off_t) total) != 0) {
        fprintf(stderr, "pybmoe-make-synth: cannot size %s to %zu bytes: %s\n", tmp_path.c_str(), total,
                strerror(errno));
        close(fd);
        unlink(tmp_path.c_str());
        return 1;
    }
    {
        std::vector<uint8_t> m(meta);
        gguf_get_meta_data(g, m.data());
        if (!pwrite_all(fd, m.data(), m.size(), 0)) {
            fprintf(stderr, "pybmoe-make-synth: write failed: %s\n", strerror(errno));
            close(fd);
            unlink(tmp_path.c_str());
            return 1;
        }
    }

    // jobs: row chunks of about 4 MiB
    struct Job { int tensor; int64_t row0, n_rows; };
    std::vector<Job> jobs;
    const size_t chunk = 4u << 20;
    for (size_t i = 0; i < tensors.size(); ++i) {
        const Plan & t = tensors[i];
        const size_t rb = ggml_row_size(t.type, t.ne[0]);
        const int64_t rows = t.ne[1] * t.ne[2] * t.ne[3];
        const int64_t per = std::max<int64_t>(1, (int64_t) (chunk / rb));
        for (int64_t r = 0; r < rows; r += per) jobs.push_back({(int) i, r, std::min(per, rows - r)});
    }
    // the workers fill a shared mapping of the file in place (page faults scale across threads,
    // buffered writes to one file serialise on its inode lock); --no-mmap: pwrite from buffers
    uint8_t * map = nullptr;
    if (a.use_mmap) {
        void * p = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED) {
            fprintf(stderr, "pybmoe-make-synth: mmap failed (%s); writing with pwrite\n", strerror(errno));
        } else {
            map = (uint8_t *) p;
        }
    }
    int n_threads = a.threads > 0 ? a.threads : (int) std::max(1u, std::thread::hardware_concurrency());
    std::atomic<size_t> next{0};
    std::atomic<bool> failed{false};
    auto worker = [&]() {
        std::vector<uint8_t> buf;
        for (;;) {
            const size_t j = next.fetch_add(1);
            if (j >= jobs.size() || failed.load()) return;
            const Job & jb = jobs[j];
            const Plan & t = tensors[jb.tensor];
            const size_t rb = ggml_row_size(t.type, t.ne[0]);
            const size_t off = meta + gguf_get_tensor_offset(g, jb.tensor) + rb * (size_t) jb.row0;
            uint8_t * dst = map ? map + off : nullptr;
            if (!dst) {
                buf.resize(rb * (size_t) jb.n_rows);
                dst = buf.data();
            }
            uint64_t s = a.seed * 0x100000001b3ULL + 0x632be59bd9b4e019ULL;
            s ^= (uint64_t) jb.tensor * 0xd6e8feb86659fd93ULL;
            splitmix64(s);
            s ^= (uint64_t) jb.row0 * 0xa0761d6478bd642fULL;
            const uint64_t seed = splitmix64(s);
            fill_rows(t, seed, jb.n_rows, dst);
            if (!map && !pwrite_all(fd, dst, rb * (size_t) jb.n_rows, (off_t) off)) failed.store(true);
        }
    };
    std::vector<std::thread> pool;
    for (int i = 0; i < n_threads; ++i) pool.emplace_back(worker);
    for (auto & th : pool) th.join();
    if (map && munmap(map, total) != 0) failed.store(true);
    if (failed.load() || close(fd) != 0) {
        fprintf(stderr, "pybmoe-make-synth: writing %s failed: %s\n", tmp_path.c_str(), strerror(errno));
        unlink(tmp_path.c_str());
        return 1;
    }
    if (rename(tmp_path.c_str(), a.out.c_str()) != 0) {
        fprintf(stderr, "pybmoe-make-synth: cannot rename %s: %s\n", tmp_path.c_str(), strerror(errno));
        return 1;
    }
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    fprintf(stderr, "pybmoe-make-synth: %s: %.2f GiB written in %.1f s (%.2f GB/s, %d threads)\n", a.out.c_str(),
            total / 1073741824.0, sec, total / sec / 1e9, n_threads);
    printf("pybmoe-make-synth: %s bytes=%zu expert_bytes=%zu dense_bytes=%zu expert_tensors_bytes=%zu seconds=%.2f\n",
           a.out.c_str(), total, expert_bytes, dense_bytes, expert_bytes_all, sec);
    ggml_free(ctx);
    gguf_free(g);
    return 0;
}
