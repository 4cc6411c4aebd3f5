# pybmoe: the engine files that patch 0003 compiles into libllama (one concern each; see
# docs/architecture.md). A new file is added here, not in the patch.
target_sources(llama PRIVATE
    ${PYBMOE_EXT_DIR}/llama-moe-base.cpp
    ${PYBMOE_EXT_DIR}/llama-moe-model.cpp
    ${PYBMOE_EXT_DIR}/llama-moe-memory.cpp
    ${PYBMOE_EXT_DIR}/llama-moe-kv.cpp
    ${PYBMOE_EXT_DIR}/llama-moe-governor.cpp
    ${PYBMOE_EXT_DIR}/llama-moe-governor-poll.cpp
    ${PYBMOE_EXT_DIR}/llama-moe-sigbus.cpp
    ${PYBMOE_EXT_DIR}/llama-moe-fit.cpp
    ${PYBMOE_EXT_DIR}/llama-moe-residency.cpp
    ${PYBMOE_EXT_DIR}/llama-moe-source.cpp
    ${PYBMOE_EXT_DIR}/llama-moe-frames.cpp
    ${PYBMOE_EXT_DIR}/llama-moe-inflight.cpp
    ${PYBMOE_EXT_DIR}/llama-moe-overlap.cpp
    ${PYBMOE_EXT_DIR}/llama-moe-waves.cpp
    ${PYBMOE_EXT_DIR}/llama-moe-vram.cpp
    ${PYBMOE_EXT_DIR}/llama-moe-vram-alloc.cpp
    ${PYBMOE_EXT_DIR}/llama-moe-vram-init.cpp
    ${PYBMOE_EXT_DIR}/llama-moe-vram-sizing.cpp
    ${PYBMOE_EXT_DIR}/llama-moe-stream.cpp
    ${PYBMOE_EXT_DIR}/llama-moe-stream-budget.cpp
    ${PYBMOE_EXT_DIR}/llama-moe-stream-init.cpp
    ${PYBMOE_EXT_DIR}/llama-moe-stream-sizing.cpp
    ${PYBMOE_EXT_DIR}/llama-moe-switches.cpp
    ${PYBMOE_EXT_DIR}/llama-moe-dense.cpp
    ${PYBMOE_EXT_DIR}/llama-moe-graph.cpp
    ${PYBMOE_EXT_DIR}/llama-moe-trace.cpp
    ${PYBMOE_EXT_DIR}/llama-moe-replay.cpp
    ${PYBMOE_EXT_DIR}/llama-moe-apply.cpp)
# the lazy KV buffer type implements ggml's buffer interface (ggml-backend-impl.h, in ggml's own sources)
set_source_files_properties(${PYBMOE_EXT_DIR}/llama-moe-kv.cpp PROPERTIES
    INCLUDE_DIRECTORIES ${CMAKE_CURRENT_SOURCE_DIR}/../ggml/src)
