// pybmoe: route replay (--moe-route-replay FILE). See llama-moe-replay.h.
//
// Holds: the trace's parse and checks, the buffers that feed the graph, the sequences' streams, and the C API
// entry point. Must not hold: any tier's state or trace writing.

#include "llama-moe-model.h"

#include "llama-batch.h"
#include "llama-impl.h"
#include "llama-model.h"

#include "ggml.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>

// reads a trace's rows (what --moe-trace writes) into ids ([n_tok][n_layer][n_used], -1 = not in the trace);
// the error with its line, or empty
static std::string llama_moe_replay_parse(std::istream & in, int32_t n_layer, int32_t n_used, int32_t n_expert,
                                          const std::vector<bool> & is_moe, std::vector<int32_t> & ids, int64_t & n_tok) {
    // rows: workload,phase,ubatch,token,layer,rank,expert,hit[,ram_hit] (what --moe-trace writes); a token is
    // a (workload, token) pair, in the order of first appearance. Every field is checked: a row that is
    // not exactly that (another column order, a stray field, text after a number, a number out of range,
    // a last line cut off) refuses the file with its line, rather than replaying a misread routing.
    static const std::string columns = "workload,phase,ubatch,token,layer,rank,expert,hit";
    std::map<std::pair<std::string, long long>, int64_t> tok_of;
    const int64_t row = (int64_t) n_layer * n_used;
    std::string line;
    std::vector<std::string> fld;
    size_t n_fields = 0; // 8 or 9 once the column line has been read; 0: either
    long long lineno = 0;
    std::string err;
    // the integer in s within [lo, hi]; false (with err set) when s is not an integer or out of range
    auto int_field = [&](const std::string & s, const char * name, long long lo, long long hi, long long & v) {
        const char * b = s.c_str();
        char * e = nullptr;
        errno = 0;
        v = s.empty() ? 0 : strtoll(b, &e, 10);
        if (s.empty() || e == b || *e != '\0' || errno == ERANGE) {
            err = format("line %lld: %s '%.40s' is not an integer", lineno, name, b);
            return false;
        }
        if (v < lo || v > hi) {
            err = format("line %lld: %s %lld, expected %lld .. %lld", lineno, name, v, lo, hi);
            return false;
        }
        return true;
    };
    while (err.empty() && std::getline(in, line)) {
        lineno++;
        const bool ended = !in.eof(); // getline stopped at a '\n' (at the end of the file it sets eof)
        if (lineno == 1 && line.compare(0, 3, "\xEF\xBB\xBF") == 0) {
            line.erase(0, 3); // a UTF-8 byte-order mark
        }
        if (!line.empty() && line.back() == '\r') {
            line.pop_back();
        }
        if (line.find('\0') != std::string::npos) {
            err = format("line %lld holds a NUL byte; a trace is CSV text", lineno);
            break;
        }
        if (!ended && !line.empty()) {
            err = format("line %lld has no line end: the file is cut off (every row ends in a newline)", lineno);
            break;
        }
        if (line.empty() || line[0] == '#') {
            continue;
        }
        if (line.compare(0, 9, "workload,") == 0) {
            if (line == columns) {
                n_fields = 8;
            } else if (line == columns + ",ram_hit") {
                n_fields = 9;
            } else {
                err = format("line %lld: the columns are '%.120s', expected %s[,ram_hit]", lineno, line.c_str(),
                        columns.c_str());
            }
            continue;
        }
        fld.clear();
        for (size_t b = 0;;) {
            const size_t c = line.find(',', b);
            fld.push_back(line.substr(b, c == std::string::npos ? std::string::npos : c - b));
            if (c == std::string::npos) {
                break;
            }
            b = c + 1;
        }
        if ((fld.size() != 8 && fld.size() != 9) || (n_fields != 0 && fld.size() != n_fields)) {
            err = format("line %lld is not a trace row (workload,phase,ubatch,token,layer,rank,expert,hit%s): %zu fields",
                    lineno, n_fields == 9 ? ",ram_hit" : "", fld.size());
            break;
        }
        if (fld[1] != "prefill" && fld[1] != "decode") {
            err = format("line %lld: phase '%.40s', expected prefill or decode", lineno, fld[1].c_str());
            break;
        }
        long long ub, tok, layer, rank, expert, hit, ram_hit = -1;
        if (!int_field(fld[2], "ubatch", 0, INT64_MAX, ub) || !int_field(fld[3], "token", 0, INT64_MAX, tok) ||
            !int_field(fld[4], "layer", LLONG_MIN, LLONG_MAX, layer) || !int_field(fld[5], "rank", LLONG_MIN, LLONG_MAX, rank) ||
            !int_field(fld[6], "expert", LLONG_MIN, LLONG_MAX, expert) || !int_field(fld[7], "hit", -1, 1, hit) ||
            (fld.size() == 9 && !int_field(fld[8], "ram_hit", -1, 1, ram_hit))) {
            break;
        }
        if (layer < 0 || layer >= n_layer || !is_moe[layer]) {
            err = format("line %lld: layer %lld is not a MoE layer of this model (%d layers)", lineno, layer, n_layer);
            break;
        }
        if (rank < 0 || rank >= n_used) {
            err = format("line %lld: rank %lld, but the model's top-k is %d; the trace is of another shape", lineno, rank, n_used);
            break;
        }
        if (expert < 0 || expert >= n_expert) {
            err = format("line %lld: expert %lld, but the model has %d experts per layer", lineno, expert, n_expert);
            break;
        }
        auto [it, fresh] = tok_of.try_emplace({ fld[0], tok }, (int64_t) tok_of.size());
        if (fresh) {
            ids.resize(ids.size() + row, -1);
        }
        ids[it->second * row + (int64_t) layer * n_used + rank] = (int32_t) expert;
    }
    if (err.empty() && in.bad()) {
        err = format("read error after line %lld", lineno);
    }
    if (err.empty() && tok_of.empty()) {
        err = "no trace rows";
    }
    n_tok = (int64_t) tok_of.size();
    return err;
}

int32_t llama_moe_replay::open(const llama_model & model, const char * path, int32_t n_ubatch) {
    const auto & hp = model.hparams;
    const int32_t n_layer  = (int32_t) model.layers.size();
    const int32_t n_expert = (int32_t) hp.n_expert;
    const int32_t n_used   = (int32_t) hp.n_expert_used();
    std::vector<bool> is_moe(n_layer, false);
    int n_moe = 0;
    for (int il = 0; il < n_layer; ++il) {
        is_moe[il] = llama_moe_is_moe_layer(model.layers[il]);
        n_moe += is_moe[il];
    }
    if (n_moe == 0) {
        LLAMA_LOG_ERROR("%s: moe-route-replay: the model has no MoE layers to replay %s into\n", "llama_model_moe_route_replay_open", path);
        return -1;
    }
    errno = 0;
    std::ifstream in(path, std::ios::binary);
    if (!in) {
        LLAMA_LOG_ERROR("%s: moe-route-replay: cannot read %s: %s\n", "llama_model_moe_route_replay_open", path,
                        errno ? std::strerror(errno) : "cannot open the file");
        return -1;
    }
    std::vector<int32_t> ids; // [n_tok][n_layer][n_used], -1 = not in the trace
    int64_t n_rows_tok = 0;
    std::string err = llama_moe_replay_parse(in, n_layer, n_used, n_expert, is_moe, ids, n_rows_tok);
    const int64_t row = (int64_t) n_layer * n_used;
    if (!err.empty()) {
        LLAMA_LOG_ERROR("%s: moe-route-replay: %s: %s\n", "llama_model_moe_route_replay_open", path, err.c_str());
        return -1;
    }
    for (int il = 0; il < n_layer && err.empty(); ++il) {
        bool any = false;
        for (int64_t t = 0; is_moe[il] && !any && t < n_rows_tok; ++t) {
            any = ids[t * row + (int64_t) il * n_used] >= 0;
        }
        if (is_moe[il] && !any) {
            err = format("MoE layer %d has no rows; the trace is of another shape (the model has %d MoE layers)", il, n_moe);
        }
    }
    if (!err.empty()) {
        LLAMA_LOG_ERROR("%s: moe-route-replay: %s: %s\n", "llama_model_moe_route_replay_open", path, err.c_str());
        return -1;
    }
    // a (token, layer) the trace lacks (a layer that computed only the outputs) repeats the layer's
    // previous token, or experts 0..k-1 at the start: those rows are not computed when the batching matches
    const int64_t n_tok = n_rows_tok;
    int64_t n_filled = 0;
    for (int64_t t = 0; t < n_tok; ++t) {
        for (int il = 0; il < n_layer; ++il) {
            if (!is_moe[il]) {
                continue;
            }
            int32_t * dst = ids.data() + t * row + (int64_t) il * n_used;
            bool complete = true;
            for (int k = 0; k < n_used; ++k) {
                complete = complete && dst[k] >= 0;
            }
            if (!complete) {
                n_filled++;
                for (int k = 0; k < n_used; ++k) {
                    dst[k] = t > 0 ? dst[k - row] : k;
                }
            }
        }
    }

    ggml_init_params params = { (size_t) n_moe * ggml_tensor_overhead() + 1, nullptr, true };
    ctx.reset(ggml_init(params));
    tensor_of_il.assign(n_layer, -1);
    for (int il = 0; il < n_layer; ++il) {
        if (is_moe[il]) {
            ggml_tensor * t = ggml_new_tensor_2d(ctx.get(), GGML_TYPE_I32, n_used, n_ubatch);
            ggml_format_name(t, "blk.%d.ffn_moe_replay", il);
            tensor_of_il[il] = (int32_t) tensors.size();
            tensors.push_back(t);
        }
    }
    buf.reset(ggml_backend_alloc_ctx_tensors_from_buft(ctx.get(), ggml_backend_cpu_buffer_type()));
    GGML_ASSERT(buf);
    this->ids     = std::move(ids);
    this->n_layer = n_layer;
    this->n_used  = n_used;
    cap     = n_ubatch;
    this->path    = path;
    seq_ids.clear();
    seq_count.clear();
    this->n_tok   = n_tok;
    LLAMA_LOG("%s: moe-route-replay: %d MoE layers take their experts from %s (%lld tokens, %lld layer rows "
            "filled from the previous token); the routing weights stay the router's\n", "llama_model_moe_route_replay_open", n_moe, path,
            (long long) n_tok, (long long) n_filled);
    return n_moe;
}

int64_t llama_moe_replay::token_of(size_t i, uint64_t j, uint32_t n_seq_max) const {
    const uint64_t n    = (uint64_t) n_tok;
    const uint64_t len  = std::max<uint64_t>(1, n / std::max<uint32_t>(1, n_seq_max)); // one stream's tokens
    const uint64_t from = (uint64_t) i * len;
    return (int64_t) ((from + j % len) % n);
}

// the sequence of a ubatch's t-th token (its first, where it belongs to several)
static int32_t llama_moe_replay_seq(const llama_ubatch & ubatch, int64_t t) {
    return ubatch.n_seq_id && ubatch.n_seq_id[t] > 0 ? ubatch.seq_id[t][0] : 0;
}

size_t llama_moe_replay::stream_of(int32_t seq_id, uint32_t n_seq_max) {
    for (size_t i = 0; i < seq_ids.size(); ++i) {
        if (seq_ids[i] == seq_id) {
            return i;
        }
    }
    // more sequences than the context holds cannot run; a sequence past them shares the last stream
    if (seq_ids.size() >= std::max<uint32_t>(1, n_seq_max)) {
        return seq_ids.size() - 1;
    }
    seq_ids.push_back(seq_id);
    seq_count.push_back(0);
    return seq_ids.size() - 1;
}

void llama_moe_replay::fill(const llama_ubatch & ubatch, uint32_t n_seq_max) {
    n_streams = std::max<uint32_t>(1, n_seq_max);
    if ((int64_t) ubatch.n_tokens > cap) {
        return; // not replayed (graph_ids keeps the router's routing), and no sequence moves on
    }
    const int64_t row = (int64_t) n_layer * n_used;
    const int64_t n   = (int64_t) ubatch.n_tokens;
    // the stream token of each row: a sequence's tokens in this ubatch follow each other in its stream
    std::vector<int64_t>  tok(n);
    std::vector<uint64_t> next(seq_count);
    for (int64_t t = 0; t < n; ++t) {
        const size_t i = stream_of(llama_moe_replay_seq(ubatch, t), n_streams);
        next.resize(seq_count.size(), 0);
        tok[t] = token_of(i, next[i]++, n_streams);
    }
    for (int32_t il = 0; il < (int32_t) tensor_of_il.size(); ++il) {
        if (tensor_of_il[il] < 0) {
            continue;
        }
        int32_t * dst = (int32_t *) tensors[tensor_of_il[il]]->data;
        for (int64_t t = 0; t < n; ++t) {
            memcpy(dst + t * n_used, ids.data() + tok[t] * row + (int64_t) il * n_used, n_used * sizeof(int32_t));
        }
    }
}

void llama_moe_replay::advance(const llama_ubatch & ubatch) {
    if ((int64_t) ubatch.n_tokens > cap) {
        return;
    }
    const int64_t  n   = (int64_t) ubatch.n_tokens;
    const uint64_t len = std::max<uint64_t>(1, (uint64_t) n_tok / n_streams);
    for (int64_t t = 0; t < n; ++t) {
        const int32_t seq = llama_moe_replay_seq(ubatch, t);
        const size_t  i   = stream_of(seq, n_streams);
        if (++seq_count[i] == len + 1 && !wrapped) {
            wrapped = true;
            if (n_streams == 1) {
                LLAMA_LOG_WARN("%s: moe-route-replay: WARNING the trace %s ran out after %lld tokens; wrapping to its start "
                        "(pass 2)\n", "llama_moe_replay_advance", path.c_str(), (long long) n_tok);
            } else {
                LLAMA_LOG_WARN("%s: moe-route-replay: WARNING sequence %d used the %llu tokens of its stream of %s (the trace's "
                        "%lld tokens cut into %u streams, one a sequence); wrapping to its start (a longer trace keeps "
                        "them apart)\n", "llama_moe_replay_advance", seq, (unsigned long long) len, path.c_str(),
                        (long long) n_tok, n_streams);
            }
        }
    }
}

ggml_tensor * llama_moe_replay::graph_ids(const llama_moe_log & log, ggml_context * ctx0, ggml_tensor * selected, int il,
                                          int64_t n_ubatch) const {
    if (il < 0 || il >= (int) tensor_of_il.size() ||
        tensor_of_il[il] < 0) {
        return selected;
    }
    const int64_t n_rows = selected->ne[1];
    if (selected->ne[0] != n_used || n_ubatch > cap || n_rows > n_ubatch) {
        log.once("replay-cap", "WARNING route replay skips graphs of more than %lld tokens (the ubatch it "
                "was opened with) or of another top-k; those use the router's own routing", (long long) cap);
        return selected;
    }
    ggml_tensor * t = tensors[tensor_of_il[il]];
    // a layer that computes fewer rows than the ubatch (the last one computes only the outputs) takes
    // the ubatch's last tokens, as the trace writer records it for the usual single output
    ggml_tensor * out = ggml_view_2d(ctx0, t, n_used, n_rows, t->nb[1], (size_t) (n_ubatch - n_rows) * t->nb[1]);
    ggml_format_name(out, "blk.%d.ffn_moe_topk_replay", il);
    return out;
}

int32_t llama_model_moe_route_replay_open(llama_model * model, const char * path, int32_t n_ubatch) {
    llama_moe_tiers * mc = model ? model->moe_cache : nullptr;
    if (path == nullptr || path[0] == '\0') {
        return 0;
    }
    if (mc == nullptr) {
        LLAMA_LOG_ERROR("%s: moe-route-replay: the model was not loaded from a GGUF path\n", __func__);
        return -1;
    }
    if (mc->replay.on()) {
        LLAMA_LOG_ERROR("%s: moe-route-replay: already replaying %s\n", __func__, mc->replay.path.c_str());
        return -1;
    }
    if (n_ubatch <= 0) {
        LLAMA_LOG_ERROR("%s: moe-route-replay: n_ubatch must be > 0, got %d\n", __func__, n_ubatch);
        return -1;
    }
    return mc->replay.open(*model, path, n_ubatch);
}
