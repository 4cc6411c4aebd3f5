// pybmoe: the tiers' environment switches (llama-moe-switches.h).

#include "llama-moe-switches.h"

#include "llama-moe-overlap.h"

#include <cstdlib>
#include <cstring>

static const char * llama_moe_env(const char * name) {
    const char * v = getenv(name);
    return v != nullptr && v[0] != '\0' ? v : nullptr;
}

bool llama_moe_stream_switches_read(llama_moe_stream_switches & out, std::string & err, std::vector<std::string> & warns) {
    out = llama_moe_stream_switches();
    if (const char * v = llama_moe_env("PYBMOE_MOE_STREAM_POLICY")) {
        if (strcmp(v, "global-lru-scan") != 0 && strcmp(v, "global-lru") != 0) {
            err = std::string("PYBMOE_MOE_STREAM_POLICY=") + v + "; accepted: global-lru-scan (the default), global-lru";
            return false;
        }
        out.scan_guard = strcmp(v, "global-lru-scan") == 0;
    }
    if (const char * v = getenv("PYBMOE_MOE_STREAM_WAVES")) {
        out.waves = atoi(v) != 0;
    }
    if (const char * v = getenv("PYBMOE_MOE_STREAM_PREFETCH")) {
        out.prefetch_set = true;
        out.prefetch     = atoll(v);
    }
    if (const char * v = getenv("PYBMOE_MOE_STREAM_FRAMES")) {
        out.frames = strcmp(v, "memfd") == 0 ? LLAMA_MOE_FRAMES_MEMFD : atoi(v) == 0 ? LLAMA_MOE_FRAMES_OFF : LLAMA_MOE_FRAMES_ON;
    }
    if (const char * v = llama_moe_env("PYBMOE_MOE_STREAM_OVERLAP"); v != nullptr && strcmp(v, "auto") != 0) {
        if (strcmp(v, "0") == 0 || strcmp(v, "1") == 0) {
            out.overlap = v[0] - '0';
        } else {
            warns.push_back(std::string("PYBMOE_MOE_STREAM_OVERLAP=") + v + "; accepted: 0, 1 or auto; using auto");
        }
    }
    if (const char * v = llama_moe_env("PYBMOE_MOE_STREAM_OVERLAP_TRIAL")) {
        char * end = nullptr;
        const long n = strtol(v, &end, 10);
        if (*end != '\0' || n < 1 || n > 1000) {
            warns.push_back(std::string("PYBMOE_MOE_STREAM_OVERLAP_TRIAL=") + v + "; accepted: 1 .. 1000 decode tokens each way; "
                    "using " + std::to_string(llama_moe_overlap_trial().n_each));
        } else {
            out.overlap_trial = (int32_t) n;
        }
    }
    if (const char * v = getenv("PYBMOE_MOE_STREAM_NO_ODIRECT")) {
        out.no_odirect = atoi(v) != 0;
    }
    if (const char * v = llama_moe_env("PYBMOE_MOE_STREAM_ELASTIC")) {
        if (strcmp(v, "0") != 0 && strcmp(v, "1") != 0) {
            err = std::string("PYBMOE_MOE_STREAM_ELASTIC=") + v + "; accepted: 1 (the default) or 0 (the static plan)";
            return false;
        }
        out.elastic = v[0] == '1';
    }
    return true;
}
