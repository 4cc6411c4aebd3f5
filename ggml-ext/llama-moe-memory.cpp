// pybmoe: the memory the process may still use. See llama-moe-memory.h.
//
// Holds: the readers of /proc/meminfo and the cgroup files. Must not hold: sizing rules.

#include "llama-moe-memory.h"

#include "llama-impl.h"

#include <algorithm>
#include <cstdlib>
#include <fstream>

uint64_t llama_moe_mem_avail::avail() const {
    uint64_t a = meminfo;
    if (cgroup_limit > 0) {
        const uint64_t used = cgroup_usage > cgroup_file ? cgroup_usage - cgroup_file : 0;
        const uint64_t c = cgroup_limit > used ? cgroup_limit - used : 0;
        a = a ? std::min(a, c) : c;
    }
    return a;
}

uint64_t llama_moe_mem_avail::free_now() const {
    uint64_t a = meminfo;
    if (cgroup_limit > 0) {
        const uint64_t unmapped = cgroup_file > cgroup_mapped ? cgroup_file - cgroup_mapped : 0;
        const uint64_t used = cgroup_usage > unmapped ? cgroup_usage - unmapped : 0;
        const uint64_t c = cgroup_limit > used ? cgroup_limit - used : 0;
        a = a ? std::min(a, c) : c;
    }
    return a;
}

uint64_t llama_moe_mem_avail::limit() const {
    if (cgroup_limit > 0) {
        return memtotal ? std::min(cgroup_limit, memtotal) : cgroup_limit;
    }
    return memtotal;
}

std::string llama_moe_mem_avail::describe() const {
    const double mib = 1024.0 * 1024.0;
    std::string s = format("MemAvailable %.0f MiB", meminfo / mib);
    if (cgroup_limit) {
        s += format(", cgroup %s limit %.0f MiB, usage %.0f MiB of which %.0f MiB page cache", cgroup.c_str(),
                cgroup_limit / mib, cgroup_usage / mib, cgroup_file / mib);
    }
    if (!root.empty()) {
        s += format(" (read under PYBMOE_MEM_ROOT=%s)", root.c_str());
    }
    return s;
}

static uint64_t llama_moe_read_u64(const std::string & path) {
    std::ifstream f(path);
    std::string s;
    if (!(f >> s) || s == "max") {
        return 0;
    }
    return strtoull(s.c_str(), nullptr, 10);
}

// the values of `key` and `key2` in a "key value" stat file
static void llama_moe_stat_fields(const std::string & path, const std::string & key, uint64_t & v1,
                                  const std::string & key2, uint64_t & v2) {
    std::ifstream f(path);
    std::string k;
    uint64_t v;
    while (f >> k >> v) {
        if (k == key) {
            v1 = v;
        } else if (k == key2) {
            v2 = v;
        }
    }
}

llama_moe_mem_avail llama_moe_read_mem_avail() {
    llama_moe_mem_avail m;
    const char * env = getenv("PYBMOE_MEM_ROOT");
    m.root = env && *env ? env : "";
    {
        std::ifstream f(m.root + "/proc/meminfo");
        std::string line;
        while (std::getline(f, line)) {
            if (line.rfind("MemAvailable:", 0) == 0) {
                m.meminfo = strtoull(line.c_str() + 13, nullptr, 10) * 1024; // kB
            } else if (line.rfind("MemTotal:", 0) == 0) {
                m.memtotal = strtoull(line.c_str() + 9, nullptr, 10) * 1024;
            }
        }
    }
    std::ifstream f(m.root + "/proc/self/cgroup");
    std::string line;
    while (std::getline(f, line)) {
        // v2: "0::/path"; v1: "N:memory:/path" (or "N:...,memory,...:/path")
        const size_t a = line.find(':');
        const size_t b = a == std::string::npos ? a : line.find(':', a + 1);
        if (b == std::string::npos) {
            continue;
        }
        const std::string ctrl = line.substr(a + 1, b - a - 1);
        const std::string rel  = line.substr(b + 1);
        uint64_t limit = 0, usage = 0, file = 0, mapped = 0;
        std::string dir;
        if (ctrl.empty()) {
            dir      = m.root + "/sys/fs/cgroup" + rel;
            limit    = llama_moe_read_u64(dir + "/memory.max");
            usage    = llama_moe_read_u64(dir + "/memory.current");
            llama_moe_stat_fields(dir + "/memory.stat", "file", file, "file_mapped", mapped);
        } else if (("," + ctrl + ",").find(",memory,") != std::string::npos) {
            dir      = m.root + "/sys/fs/cgroup/memory" + rel;
            limit    = llama_moe_read_u64(dir + "/memory.limit_in_bytes");
            usage    = llama_moe_read_u64(dir + "/memory.usage_in_bytes");
            llama_moe_stat_fields(dir + "/memory.stat", "total_cache", file, "total_mapped_file", mapped);
        } else {
            continue;
        }
        // v1 writes a huge number for "no limit"
        if (limit > 0 && limit < (1ull << 60) && (m.cgroup_limit == 0 || limit < m.cgroup_limit)) {
            m.cgroup_limit = limit;
            m.cgroup_usage = usage;
            m.cgroup_file  = file;
            m.cgroup_mapped = mapped;
            m.cgroup = dir;
        }
    }
    return m;
}
