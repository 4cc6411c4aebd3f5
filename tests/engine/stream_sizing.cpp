// Drives ggml-ext/llama-moe-stream-sizing.cpp alone (tests/engine/test_stream_sizing.py): the input's
// fields as key=value arguments (bytes and counts), the sizing's fields on one line as key=value.

#include "llama-moe-stream-sizing.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

int main(int argc, char ** argv) {
    llama_moe_stream_sizing_input in;
    for (int i = 1; i < argc; ++i) {
        const char * eq = strchr(argv[i], '=');
        if (eq == nullptr) {
            fprintf(stderr, "not key=value: %s\n", argv[i]);
            return 2;
        }
        const std::string k(argv[i], eq - argv[i]);
        const long long v = atoll(eq + 1);
        if      (k == "is_auto")        { in.is_auto = v != 0; }
        else if (k == "budget")         { in.budget_bytes = v; }
        else if (k == "floor")          { in.floor_bytes = v; }
        else if (k == "ceil")           { in.ceil_bytes = v; }
        else if (k == "avail")          { in.avail_bytes = v; }
        else if (k == "limit")          { in.limit_bytes = v; }
        else if (k == "dense")          { in.dense_bytes = v; }
        else if (k == "entry")          { in.entry_bytes = v; }
        else if (k == "entry_cost")     { in.entry_cost = v; }
        else if (k == "n_entries")      { in.n_entries = v; }
        else if (k == "total")          { in.total_bytes = v; }
        else if (k == "n_expert")       { in.n_expert = (int32_t) v; }
        else if (k == "min_entries")    { in.min_entries = v; }
        else if (k == "least_entries")  { in.least_entries = v; }
        else if (k == "prefetch")       { in.prefetch_set = true; in.prefetch_asked = v; }
        else { fprintf(stderr, "unknown key: %s\n", k.c_str()); return 2; }
    }
    const llama_moe_stream_sizing o = llama_moe_stream_size(in);
    printf("status=%d budget=%lld floor=%lld floor_asked=%lld prefetch=%lld room_entries=%lld cap_entries=%lld "
           "entries=%lld floor_gave_way=%d in_waves=%d clamped_to_total=%d\n", (int) o.status, (long long) o.budget_bytes,
           (long long) o.floor_bytes, (long long) o.floor_asked, (long long) o.prefetch_entries, (long long) o.room_entries,
           (long long) o.cap_entries, (long long) o.entries, o.floor_gave_way ? 1 : 0, o.in_waves ? 1 : 0,
           o.clamped_to_total ? 1 : 0);
    return 0;
}
