#include "core/optim/thread_pool.h"

#include <pthread.h>

#include <algorithm>

#include "core/error.h"

namespace layerstream {
namespace optim {

namespace {
// The pool whose task the current thread is running (nested run() check).
thread_local const ThreadPool* t_inside = nullptr;

std::mutex g_shared_mu;
ThreadPool* g_shared = nullptr;
int g_shared_threads = 0;  // 0: hardware_concurrency()

// Note [A forked child gets a pool of its own]
// fork() copies the pool but not its workers: a child's run() (an optimizer step,
// lossless coding in a child that offloads its own model) would wait forever for
// them. So in the child the parent's pool is forgotten (leaked: joining it would wait
// for the same absent threads) and shared() makes a new one on first use. The lock
// is held across fork() so the child finds it free and g_shared consistent.
std::once_flag g_fork_handlers;
void lock_before_fork() { g_shared_mu.lock(); }
void unlock_in_parent() { g_shared_mu.unlock(); }
void forget_in_child() {
  g_shared = nullptr;
  g_shared_mu.unlock();
}
}  // namespace

ThreadPool::ThreadPool(int threads) {
  LS_CHECK(threads >= 1, "a thread pool needs at least 1 thread, got ", threads);
  workers_.reserve(static_cast<size_t>(threads - 1));
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& w : workers_) w.join();
}

// Takes task indices until none is left; records the first failure.
void ThreadPool::work_on_current(int64_t tasks) {
  const ThreadPool* outer = t_inside;
  t_inside = this;
  for (;;) {
    int64_t t;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (next_ >= tasks) break;
      t = next_++;
    }
    try {
      (*fn_)(t);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      if (error_task_ < 0 || t < error_task_) {
        error_task_ = t;
        error_ = std::current_exception();
      }
    }
  }
  t_inside = outer;
}

void ThreadPool::worker_loop() {
  uint64_t seen = 0;
  for (;;) {
    int64_t tasks;
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      tasks = tasks_;
    }
    work_on_current(tasks);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (--busy_ == 0) done_.notify_all();
    }
  }
}

void ThreadPool::run(int64_t tasks, const std::function<void(int64_t)>& fn) {
  LS_CHECK(t_inside != this, "ThreadPool::run called from one of its own tasks (it would wait for itself)");
  if (tasks <= 0) return;
  std::lock_guard<std::mutex> run_lock(run_mu_);
  if (workers_.empty() || tasks == 1) {
    const ThreadPool* outer = t_inside;
    t_inside = this;
    struct Restore {
      const ThreadPool* outer;
      ~Restore() { t_inside = outer; }
    } restore{outer};
    for (int64_t t = 0; t < tasks; ++t) fn(t);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    tasks_ = tasks;
    next_ = 0;
    busy_ = static_cast<int>(workers_.size());
    error_task_ = -1;
    error_ = nullptr;
    ++generation_;
  }
  wake_.notify_all();
  work_on_current(tasks);
  std::exception_ptr error;
  {
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [&] { return busy_ == 0; });
    fn_ = nullptr;
    error = error_;
    error_ = nullptr;
  }
  if (error) std::rethrow_exception(error);
}

ThreadPool& ThreadPool::shared() {
  std::call_once(g_fork_handlers, [] { pthread_atfork(lock_before_fork, unlock_in_parent, forget_in_child); });
  std::lock_guard<std::mutex> lock(g_shared_mu);
  if (!g_shared) {
    int n = g_shared_threads;
    if (n <= 0) {
      const unsigned hw = std::thread::hardware_concurrency();
      n = hw == 0 ? 1 : static_cast<int>(std::min(hw, 256u));
    }
    g_shared = new ThreadPool(n);  // never destroyed: see the header
  }
  return *g_shared;
}

void ThreadPool::set_shared_threads(int threads) {
  LS_CHECK(threads >= 1, "the optimizer thread count must be >= 1, got ", threads);
  std::lock_guard<std::mutex> lock(g_shared_mu);
  if (g_shared) {
    LS_CHECK(g_shared->threads() == threads, "the optimizers' thread pool already runs with ",
             g_shared->threads(), " threads; set the count before the first optimizer step");
    return;
  }
  g_shared_threads = threads;
}

}  // namespace optim
}  // namespace layerstream
