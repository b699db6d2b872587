// layerstream — internal helpers shared by optim.cpp and adafactor.cpp.
#pragma once

#include <cstdint>
#include <functional>

#include "kernels.h"
#include "thread_pool.h"

namespace layerstream {
namespace optim {
namespace detail {

// Elements per task: a multiple of kQ8Block, and small enough for 32-bit
// element counters within a chunk (the random streams count elements from
// the chunk's start; the chunk's key covers its position). Fixed, so that
// results do not depend on the thread count.
constexpr int64_t kChunk = 65536;
static_assert(kChunk % kQ8Block == 0, "chunks hold whole 8-bit blocks");

// The kernels for this CPU (AVX2 when it has it; LS_OPTIM_ISA=generic forces
// the baseline ones).
const Kernels& kernels();
// The random-stream keys of the chunk of `tensor_key` starting at `begin`.
Keys chunk_keys(uint64_t seed, uint64_t tensor_key, int64_t step, int64_t begin);
// pool->run, or ThreadPool::shared() when pool is null.
void run_tasks(ThreadPool* pool, int64_t n, const std::function<void(int64_t)>& fn);

}  // namespace detail
}  // namespace optim
}  // namespace layerstream
