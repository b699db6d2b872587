// layerstream — the CUDA decoder of the lossless format (plain C++ header:
// callers need no CUDA includes). Implemented in lossless.cu, built into
// ls_cuda; its per-block code is core/lossless_device.h, which the tests also
// run on the CPU against the reference decoder (core/lossless.cpp).
#pragma once

#include <cstddef>

#include "core/lossless.h"
#include "core/lossless_device.h"

namespace layerstream {
namespace lossless {

// Decodes one coded tensor on the device, bit-identical to decode().
// `header` is read_header() of the same bytes, read on the host (it carries
// the layout and the code, so the launch needs no copy back; the engine reads
// it once from its host copy). `coded_dev`: the device copy of the coded
// buffer (coded_bytes >= header.layout.total_bytes(), 16-byte aligned;
// cudaMalloc memory and slot parts are); `out_dev`: numel elements of the
// header's dtype (bf16/f16 as raw 16-bit values, f32), 16-byte aligned.
// Enqueued on `cuda_stream` (a cudaStream_t; nullptr = the legacy default
// stream) on the stream's device, made current for the launch (the caller's
// restored); the call returns without waiting. One GPU thread per block of
// header.layout.block_elems elements; the buffer is trusted as read_header()
// validated it: a block whose bits are corrupt decodes to unspecified values
// but nothing outside the two buffers is read or written.
// Throws layerstream::Error on bad arguments (checked before any CUDA call)
// or a launch error (with cudaGetErrorString's text).
void decode_cuda(const Header& header, const void* coded_dev, size_t coded_bytes, void* out_dev,
                 void* cuda_stream);

// Decodes pieces of one tensor (analyze_pieces: equal element counts, so one
// layout, `shared`, the Layout of any of them; their codes and stream lengths
// differ and are read by the kernel from each piece's header in the device
// copy, which read_header() validated in the host copy). jobs[k]: piece k's
// coded buffer at coded_dev + coded_offset, its elements to out_dev +
// out_offset (both 16-byte aligned; pieces start on 256 bytes). One launch
// per 128 pieces (a thread block per 64 coded blocks of a piece), instead of
// one per piece: a routed call decodes its experts together. Same stream,
// device, trust and error rules as decode_cuda.
void decode_pieces_cuda(const Layout& shared, const void* coded_dev, const device::PieceJob* jobs,
                        size_t num_jobs, void* out_dev, void* cuda_stream);

}  // namespace lossless
}  // namespace layerstream
