// pybmoe-test-residency: drives llama-moe-residency.{h,cpp} over a routing trace exactly as the VRAM
// tier does, and prints its hit or miss per lookup, so that a test can hold it against
// pybmoe.routing.sim (layer-lru, or pool) event for event (tests/routing/test_residency.py).
//
//   pybmoe-test-residency TRACE.csv N_EXPERT TOP_K SLOTS INSERTS MAX_BATCH [ADMIT_WINDOW [POOL]]
//
// POOL >= 0: every layer of the trace is one bank of POOL resident slots (the pool, SLOTS unused) with
// llama_moe_pool_stage_slots staging slots; -1 (the default): SLOTS per layer.
//
// TRACE.csv: the engine's trace format (workload,phase,ubatch,token,layer,rank,expert[,hit]; lines
// starting with '#' and the header are skipped). Per workload (a cold start each), ubatch by ubatch
// in file order, each layer's lookups in (token, rank) order are one layer step, served when the
// ubatch has at most MAX_BATCH tokens; after each ubatch the tier's protocol runs: end_ubatch,
// settle, schedule (llama_moe_vram: account -> settle -> publish -> schedule).
//
// Output: one line per trace row, in file order: 1 hit, 0 miss, -1 not served; then a last line
// "# lookups=N hits=H misses=M moves=U steps=S". Exit status 0, or 2 on bad input.

#include "llama-moe-residency.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <vector>

struct row {
    int32_t workload; // index in order of first appearance
    int64_t ubatch;
    int64_t token;
    int32_t layer;
    int32_t rank;
    int32_t expert;
};

static int usage(const char * why) {
    fprintf(stderr, "pybmoe-test-residency: %s\nusage: pybmoe-test-residency TRACE.csv N_EXPERT TOP_K SLOTS INSERTS MAX_BATCH [ADMIT_WINDOW [POOL]]\n", why);
    return 2;
}

int main(int argc, char ** argv) {
    if (argc < 7 || argc > 9) {
        return usage("expected 6 to 8 arguments");
    }
    const int32_t n_expert  = atoi(argv[2]);
    const int32_t n_used    = atoi(argv[3]);
    const int32_t n_slots   = atoi(argv[4]);
    const int32_t n_inserts = atoi(argv[5]);
    const int32_t max_batch = atoi(argv[6]);
    const int32_t admit     = argc >= 8 ? atoi(argv[7]) : 0; // the admission window, steps (0 = always)
    const int32_t n_pool    = argc >= 9 ? atoi(argv[8]) : -1;
    if (n_expert <= 0 || n_used <= 0 || n_slots < 0 || n_slots > n_expert || n_inserts < 0 || max_batch < 1 || admit < 0 ||
        n_pool < -1) {
        return usage("bad N_EXPERT, TOP_K, SLOTS, INSERTS, MAX_BATCH, ADMIT_WINDOW or POOL");
    }
    FILE * f = fopen(argv[1], "rb");
    if (f == nullptr) {
        return usage("cannot read the trace");
    }
    std::vector<row> rows;
    std::map<std::string, int32_t> wl_of;
    std::set<int32_t> layer_ids;
    char line[512];
    long long lineno = 0;
    while (fgets(line, sizeof(line), f)) {
        lineno++;
        if (line[0] == '#' || line[0] == '\n' || strncmp(line, "workload,", 9) == 0) {
            continue;
        }
        char workload[256], phase[32];
        long long ub, tok;
        int layer, rank, expert;
        if (sscanf(line, "%255[^,],%31[^,],%lld,%lld,%d,%d,%d", workload, phase, &ub, &tok, &layer, &rank, &expert) != 7 ||
            expert < 0 || expert >= n_expert || layer < 0) {
            fprintf(stderr, "pybmoe-test-residency: %s:%lld: not a trace row of %d experts\n", argv[1], lineno, n_expert);
            fclose(f);
            return 2;
        }
        auto it = wl_of.try_emplace(workload, (int32_t) wl_of.size()).first;
        rows.push_back({ it->second, ub, tok, layer, rank, expert });
        layer_ids.insert(layer);
    }
    fclose(f);

    // the ubatches of each workload in order of first appearance; the rows of each (ubatch, layer)
    // in (token, rank) order
    std::vector<size_t> order(rows.size());
    for (size_t i = 0; i < rows.size(); ++i) {
        order[i] = i;
    }
    std::map<std::pair<int32_t, int64_t>, size_t> first_of_ub;
    for (size_t i = 0; i < rows.size(); ++i) {
        first_of_ub.try_emplace({ rows[i].workload, rows[i].ubatch }, i);
    }
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
        const row & x = rows[a];
        const row & y = rows[b];
        const size_t ua = first_of_ub.at({ x.workload, x.ubatch });
        const size_t ub = first_of_ub.at({ y.workload, y.ubatch });
        if (x.workload != y.workload) return x.workload < y.workload;
        if (ua != ub)                 return ua < ub;
        if (x.layer != y.layer)       return x.layer < y.layer;
        if (x.token != y.token)       return x.token < y.token;
        return x.rank < y.rank;
    });

    const std::vector<int32_t> layers(layer_ids.begin(), layer_ids.end());
    std::map<int32_t, int32_t> ir_of;
    for (size_t i = 0; i < layers.size(); ++i) {
        ir_of[layers[i]] = (int32_t) i;
    }
    const int32_t n_layer = (int32_t) layers.size();
    const int32_t n_bank  = n_pool < 0 ? 0 : std::min(n_pool, n_layer * n_expert);
    const int32_t n_stage = n_pool < 0 ? llama_moe_stage_slots(n_expert, n_used, n_slots, n_inserts, max_batch)
                                       : llama_moe_pool_stage_slots(n_layer, n_expert, n_used, n_bank);

    std::vector<int8_t> out(rows.size(), -1);
    uint64_t n_moves = 0, n_steps = 0;
    llama_moe_residency res;
    int32_t cur_wl = -1;
    for (size_t b = 0; b < order.size(); ) {
        // one ubatch: order[b .. e)
        const row & r0 = rows[order[b]];
        size_t e = b;
        std::set<int64_t> tokens;
        while (e < order.size() && rows[order[e]].workload == r0.workload && rows[order[e]].ubatch == r0.ubatch) {
            tokens.insert(rows[order[e]].token);
            e++;
        }
        if (r0.workload != cur_wl) {
            // a workload starts from a cold tier
            n_steps += res.n_steps;
            res = {};
            res.n_inserts = n_inserts;
            res.admit_window = admit;
            std::vector<int32_t> ils;
            for (size_t i = 0; i < layers.size(); ++i) {
                ils.push_back(n_pool < 0 ? res.add_layer(n_expert, n_slots, n_stage) : res.add_layer(n_expert, 0, 0));
            }
            if (n_pool >= 0) {
                res.add_bank(ils, n_bank, n_stage, n_used);
            }
            cur_wl = r0.workload;
        }
        const bool served = (n_pool < 0 ? n_slots : n_bank) > 0 && (int64_t) tokens.size() <= max_batch;
        std::vector<bool> looked(layers.size(), false);
        for (size_t i = b; i < e; ) {
            const int32_t il = rows[order[i]].layer;
            size_t j = i;
            std::vector<int32_t> ids;
            while (j < e && rows[order[j]].layer == il) {
                ids.push_back(rows[order[j]].expert);
                j++;
            }
            if (served) {
                const int32_t ir = ir_of.at(il);
                res.lookup(ir, ids.data(), (int64_t) ids.size());
                looked[ir] = true;
                const auto & l = res.layers[ir];
                for (size_t k = i; k < j; ++k) {
                    out[order[k]] = l.hits_now[k - i];
                }
            }
            i = j;
        }
        for (size_t ir = 0; ir < layers.size(); ++ir) {
            if (!looked[ir]) {
                res.skip((int32_t) ir);
            }
        }
        res.end_ubatch(served);
        n_moves += res.moving.size();
        res.settle();
        res.schedule();
        b = e;
    }
    n_steps += res.n_steps;

    uint64_t hits = 0, misses = 0;
    std::string text;
    text.reserve(rows.size() * 3);
    for (int8_t v : out) {
        hits   += v == 1;
        misses += v == 0;
        text += v == 1 ? "1\n" : v == 0 ? "0\n" : "-1\n";
    }
    fwrite(text.data(), 1, text.size(), stdout);
    printf("# lookups=%llu hits=%llu misses=%llu moves=%llu steps=%llu\n", (unsigned long long) (hits + misses),
           (unsigned long long) hits, (unsigned long long) misses, (unsigned long long) n_moves, (unsigned long long) n_steps);
    return 0;
}
