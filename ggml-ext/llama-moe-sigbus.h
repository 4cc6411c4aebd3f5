#pragma once

// pybmoe: a model file that shrinks under a running process, named. A read of a memory-mapped page
// past the file's new end raises SIGBUS, which kills the process with no message (exit 135). The
// handler here looks the faulting address up among the mapped ranges of the models loaded in this
// process; when it is one of theirs it writes one line (the file, the offset, the file's size now) to
// stderr and lets the signal kill the process as before (status 135 stays, for supervisors); any
// other SIGBUS goes to the handler that was there before (or the default).
//
// Holds: the table of mapped ranges (process-wide: a signal handler has no other state) and the
// handler. Must not hold: reads through the stream tier (they use pread and report a short read
// themselves, llama-moe-source.h).

#include <cstddef>
#include <cstdint>

struct llama_model;

// records the mapped ranges of `model`'s weights (every host tensor that reads the file through
// its memory map) with their files and offsets; installs the handler on the first call.
// Called once per model at the end of its load.
void llama_moe_sigbus_register(const llama_model & model);

// forgets the ranges registered for the model whose owner (llama_moe_tiers) is `owner`, before its
// mappings go
void llama_moe_sigbus_unregister(const void * owner);

// the line the handler writes for a fault at file offset `offs` of `path`, whose size is now `size`
// bytes (-1: unknown), into buf (at most n bytes, NUL-terminated); returns its length. Uses no
// allocation and no stdio (async-signal-safe), so the handler can call it.
size_t llama_moe_sigbus_format(char * buf, size_t n, const char * path, uint64_t offs, int64_t size);
