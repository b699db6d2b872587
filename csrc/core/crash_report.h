// layerstream — the native stack of a crash, for a report.
//
// A process that dies of SIGSEGV inside the engine tells Python's faulthandler
// only the Python line that called into it (the H200 run of 2026-12-04: a
// benchmark peer died "in _C.plan_slots_first" and nothing said where in C++).
// install_crash_report() adds handlers for SIGSEGV, SIGBUS, SIGILL, SIGFPE and
// SIGABRT that write, to stderr, the signal, the faulting address and the
// native frames, each as "library+offset (symbol+offset)", which addr2line
// maps to a source line on a copy of the same library. Then the handler that
// was there before runs (faulthandler's Python traceback, or the default:
// the process still dies of the signal, with its exit status).
//
// The Python module installs it when LS_NATIVE_BACKTRACE=1 is set (the GPU
// proof's peers set it); C++ users call it themselves. It writes with write(2)
// only, but backtrace() and dladdr() are not async-signal-safe: a crash inside
// the allocator or the loader may print less. It is a diagnostic, off by default.
// Thread safety: call once, from any thread; the handlers run on the crashing thread.
#pragma once

namespace layerstream {

// Installs the handlers (on an alternate signal stack for this thread when it has
// none, so that a stack overflow can be reported too). Idempotent: later calls do nothing.
void install_crash_report();

}  // namespace layerstream
