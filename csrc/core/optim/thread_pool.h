// layerstream — a small persistent thread pool for the host optimizers.
//
// The optimizer kernels split a step into fixed-size chunks of elements
// (independent of the number of threads, so results never depend on it) and
// run the chunks on a pool of worker threads plus the calling thread.
// Creating threads per call (as quant.cpp's packing does, once per weight)
// would cost tens of microseconds per call; an optimizer step of a streamed
// layer runs once per layer per step, so the workers persist.
//
// Ownership: a ThreadPool owns its worker threads and joins them in its
// destructor. shared() is one process-wide pool, created on first use and
// never destroyed (it is leaked on purpose so that no worker is joined during
// static destruction); a child forked after that gets a new one on first use
// (the parent's workers are not in the child).
// Thread safety: run() may be called from any thread; concurrent calls run
// one after another (each takes the whole pool). run() must not be called
// from inside a task of the same pool (it would wait for itself; this is
// detected and refused).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace layerstream {
namespace optim {

class ThreadPool {
 public:
  // `threads` >= 1 is the total parallelism, the calling thread included
  // (threads - 1 workers are started).
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs fn(t) for every t in [0, tasks), spread over the workers and the
  // calling thread; returns when all are done. If tasks throw, the first
  // exception (lowest task index) is rethrown after all tasks finished.
  void run(int64_t tasks, const std::function<void(int64_t)>& fn);

  // The process-wide pool: std::thread::hardware_concurrency() threads, or
  // the value of set_shared_threads() called before first use.
  static ThreadPool& shared();
  // Sets the size of shared() (>= 1). Throws if shared() was already created
  // with another size.
  static void set_shared_threads(int threads);

 private:
  void worker_loop();
  void work_on_current(int64_t tasks);

  std::vector<std::thread> workers_;
  std::mutex run_mu_;  // one run() at a time
  std::mutex mu_;
  std::condition_variable wake_, done_;
  uint64_t generation_ = 0;
  bool stop_ = false;
  // The current job (valid while a run() is in progress).
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t tasks_ = 0;
  int64_t next_ = 0;      // next task index to hand out (under mu_)
  int busy_ = 0;          // workers still inside the current job
  int64_t error_task_ = -1;
  std::exception_ptr error_;
};

}  // namespace optim
}  // namespace layerstream
