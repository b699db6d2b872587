#include "core/crash_report.h"

#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>

namespace layerstream {
namespace {

struct Watched {
  int sig;
  const char* name;
};
constexpr Watched kWatched[] = {
    {SIGSEGV, "SIGSEGV"}, {SIGBUS, "SIGBUS"}, {SIGILL, "SIGILL"}, {SIGFPE, "SIGFPE"}, {SIGABRT, "SIGABRT"}};
constexpr int kNumWatched = sizeof kWatched / sizeof kWatched[0];

struct sigaction g_previous[kNumWatched];
std::atomic<bool> g_reported{false};

// write(2) only: no allocation, no stdio (the crash may be inside either).
void put(const char* s) {
  size_t n = std::strlen(s);
  while (n > 0) {
    const ssize_t w = ::write(2, s, n);
    if (w <= 0) return;
    s += w;
    n -= static_cast<size_t>(w);
  }
}

void put_number(uintptr_t v, unsigned base) {
  char buf[32];
  int i = sizeof buf - 1;
  buf[i] = '\0';
  do {
    buf[--i] = "0123456789abcdef"[v % base];
    v /= base;
  } while (v != 0 && i > 0);
  put(buf + i);
}

void put_frame(int index, void* pc) {
  put("  #");
  put_number(static_cast<uintptr_t>(index), 10);
  put(" ");
  Dl_info d;
  if (::dladdr(pc, &d) != 0 && d.dli_fname != nullptr) {
    put(d.dli_fname);
    put("+0x");
    put_number(reinterpret_cast<uintptr_t>(pc) - reinterpret_cast<uintptr_t>(d.dli_fbase), 16);
    if (d.dli_sname != nullptr) {
      put(" (");
      put(d.dli_sname);
      put("+0x");
      put_number(reinterpret_cast<uintptr_t>(pc) - reinterpret_cast<uintptr_t>(d.dli_saddr), 16);
      put(")");
    }
  } else {
    put("0x");
    put_number(reinterpret_cast<uintptr_t>(pc), 16);
  }
  put("\n");
}

void on_fatal_signal(int sig, siginfo_t* info, void*) {
  int w = 0;
  while (w < kNumWatched && kWatched[w].sig != sig) ++w;
  if (!g_reported.exchange(true)) {  // once: a second thread's crash adds nothing readable
    put("layerstream: fatal signal ");
    put_number(static_cast<uintptr_t>(sig), 10);
    put(w < kNumWatched ? " (" : "");
    put(w < kNumWatched ? kWatched[w].name : "");
    put(w < kNumWatched ? ")" : "");
    put(" at address 0x");
    put_number(reinterpret_cast<uintptr_t>(info != nullptr ? info->si_addr : nullptr), 16);
    put("; native stack, innermost first (library+offset: addr2line -f -C -e LIBRARY OFFSET):\n");
    void* frames[64];
    const int n = ::backtrace(frames, 64);
    for (int i = 0; i < n; ++i) put_frame(i, frames[i]);
  }
  // The handler that was there before (faulthandler's, or the default) takes over:
  // a fault re-runs its instruction when this returns and meets it; a signal that
  // was sent (abort(), kill) is sent again.
  if (w < kNumWatched) ::sigaction(sig, &g_previous[w], nullptr);
  if (info == nullptr || info->si_code <= 0 || sig == SIGABRT) ::raise(sig);
}

}  // namespace

void install_crash_report() {
  static std::once_flag once;
  std::call_once(once, [] {
    // backtrace() loads libgcc_s on first use: here, not in the handler.
    void* warm[1];
    (void)::backtrace(warm, 1);
    // A stack for the handler, so that a stack overflow of this thread can be
    // reported; unless the thread has one (Python's faulthandler sets one).
    stack_t cur{};
    if (::sigaltstack(nullptr, &cur) == 0 && (cur.ss_flags & SS_DISABLE) != 0) {
      static char alt_stack[1 << 16];
      stack_t ss{};
      ss.ss_sp = alt_stack;
      ss.ss_size = sizeof alt_stack;
      (void)::sigaltstack(&ss, nullptr);
    }
    for (int i = 0; i < kNumWatched; ++i) {
      struct sigaction sa {};
      sa.sa_sigaction = on_fatal_signal;
      sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
      sigemptyset(&sa.sa_mask);
      ::sigaction(kWatched[i].sig, &sa, &g_previous[i]);
    }
  });
}

}  // namespace layerstream
