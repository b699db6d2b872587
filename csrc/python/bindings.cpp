// pybind11 bindings of the streaming engine: layerstream._C. Stateful objects
// only; the user-facing API lives in python/layerstream/.
#include <torch/extension.h>
#include <torch/csrc/autograd/python_hook.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

#include <cstring>
#include <typeinfo>

#include "core/crash_report.h"
#include "core/gguf.h"
#include "core/host_tier.h"
#include "core/io/quant_cache.h"
#include "core/lossless.h"
#include "core/io/source_file.h"
#include "core/safetensors.h"
#include "core/log.h"
#include "core/offload_policy.h"
#include "core/options.h"
#include "core/host_memory.h"
#include "core/planner.h"
#include "core/slot_layout.h"
#include "backends/sim/sim_backend.h"
#include "layerstream/engine.h"
#include "bindings_optim.h"

namespace py = pybind11;
using layerstream::ConvSpec;
using layerstream::Engine;
using layerstream::EngineOptions;
using layerstream::Checkpoint;
using layerstream::FileRange;
using layerstream::SourceFile;
using layerstream::TensorInfo;
namespace host_tier = layerstream::host_tier;
namespace quant_cache = layerstream::quant_cache;

namespace {

// The dict of a Python hook object, `base` being of the class its type name said
// (set_grad_hook_probe below). Without UBSan's vptr checks (of the cast and of the
// member read): they compare against the class's type_info, which torch does not
// export, so the extension of a sanitizer build (tools/sanitize.sh) did not load
// ("undefined symbol: _ZTIN5torch8autograd23PyFunctionTensorPreHookE").
template <class Derived, class Base>
__attribute__((no_sanitize("vptr"))) PyObject* hook_dict(const Base& base) {
  return static_cast<const Derived&>(base).dict;
}

// The element type of a weight the formats read: float32, bfloat16 or float16
// (the engine's own rule: src_dtype_of in torch/engine_impl.h).
// A dtype as Python spells it (torch.float64; LibTorch prints "Double"). Needs the GIL.
std::string py_dtype(torch::ScalarType t) { return py::str(py::cast(t)).cast<std::string>(); }

layerstream::quant::SrcDtype float_src_dtype(torch::ScalarType t, const std::string& what) {
  namespace quant = layerstream::quant;
  LS_CHECK(t == torch::kFloat || t == torch::kBFloat16 || t == torch::kHalf, what, " is ", py_dtype(t),
           "; only float32, bfloat16 and float16 weights are packed or coded");
  return t == torch::kFloat ? quant::SrcDtype::F32 : t == torch::kBFloat16 ? quant::SrcDtype::BF16
                                                                           : quant::SrcDtype::F16;
}

namespace options = layerstream::options;

// A Python int as int64, saturated, so that a huge value reaches the option's
// own range check (and its message) instead of pybind's conversion error.
int64_t int_arg(py::handle v, const char* what) {
  LS_CHECK(py::isinstance<py::int_>(v) && !py::isinstance<py::bool_>(v), what, " must be an integer, got ",
           py::str(py::repr(v)).cast<std::string>());
  int overflow = 0;
  const long long n = PyLong_AsLongLongAndOverflow(v.ptr(), &overflow);
  if (overflow) return overflow > 0 ? INT64_MAX : INT64_MIN;
  return n;
}

double float_arg(py::handle v, const char* what) {
  if (py::isinstance<py::int_>(v) && !py::isinstance<py::bool_>(v)) return static_cast<double>(int_arg(v, what));
  LS_CHECK(py::isinstance<py::float_>(v), what, " must be a number, got ", py::str(py::repr(v)).cast<std::string>());
  return v.cast<double>();
}

options::Budget budget_of(py::handle v) {
  options::Budget b;
  if (py::isinstance<py::str>(v)) {
    b = options::parse_budget(v.cast<std::string>());
  } else if (py::isinstance<py::int_>(v) && !py::isinstance<py::bool_>(v)) {
    const int64_t n = int_arg(v, "budget");
    LS_CHECK(n >= 0, "budget must be >= 0 bytes, got ", n);
    LS_CHECK(n < INT64_MAX, "budget of ", py::str(v).cast<std::string>(), " bytes is too large (at most 2^63 - 1 bytes)");
    b.bytes = static_cast<uint64_t>(n);
  } else {
    LS_CHECK(py::isinstance<py::float_>(v), "budget must be a size in bytes (e.g. 12 * 2**30 or '12GiB'), a "
             "share ('40%', or a number in (0, 1)) or 'auto', got ", py::str(py::repr(v)).cast<std::string>());
    b = options::budget_from_number(v.cast<double>());
  }
  return b;
}

// A stashed activation's token as autograd holds it (offload(activations=...)'s pack
// hook): dropped by this destructor when the graph that saved it is freed. In C++ so
// that no Python code runs there: a Ctrl-C landing in a Python __del__ raised its
// KeyboardInterrupt there, which Python swallows ("Exception ignored in ...") before the
// drop, and the host copy leaked, one per interrupt.
struct StashedActivation {
  std::shared_ptr<Engine> engine;
  int64_t token;
  StashedActivation(std::shared_ptr<Engine> e, int64_t t) : engine(std::move(e)), token(t) {}
  StashedActivation(const StashedActivation&) = delete;
  StashedActivation& operator=(const StashedActivation&) = delete;
  ~StashedActivation() {
    try {
      engine->drop_activation(token);
    } catch (...) {  // a destructor must not throw; the engine's own errors are logged there
    }
  }
};

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "layerstream C++ engine";
  static py::exception<layerstream::Error> exc(m, "LayerstreamError", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const layerstream::Error& e) {
      py::set_error(exc, e.message().c_str());
    }
  });

  // Python's hook objects stay registered on a tensor, their dicts emptied, after
  // handle.remove(): the engine asks whether one still holds a hook (engine.h).
  // torch exports no type_info of these classes: the object's type name says
  // which it is (Itanium ABI); any other object is a hook.
  layerstream::set_grad_hook_probe(
      {[](const torch::autograd::FunctionPreHook& h) {
         if (std::strcmp(typeid(h).name(), "N5torch8autograd23PyFunctionTensorPreHookE") != 0) return true;
         py::gil_scoped_acquire gil;
         return PyDict_Size(hook_dict<torch::autograd::PyFunctionTensorPreHook>(h)) > 0;
       },
       [](const torch::autograd::PostAccumulateGradHook& h) {
         if (std::strcmp(typeid(h).name(), "N5torch8autograd32PyFunctionTensorPostAccGradHooksE") != 0) return true;
         py::gil_scoped_acquire gil;
         return PyDict_Size(hook_dict<torch::autograd::PyFunctionTensorPostAccGradHooks>(h)) > 0;
       }});

  // LS_NATIVE_BACKTRACE=1: a crash prints its native stack before faulthandler's
  // Python one (core/crash_report.h).
  if (const char* v = std::getenv("LS_NATIVE_BACKTRACE"); v != nullptr && std::string(v) == "1")
    layerstream::install_crash_report();

  // Route library warnings to Python's warnings module.
  layerstream::set_warning_handler([](const std::string& msg) {
    if (!Py_IsInitialized()) return;
    py::gil_scoped_acquire gil;
    PyErr_WarnEx(PyExc_RuntimeWarning, ("layerstream: " + msg).c_str(), 1);
  });

  m.def(
      "resolve_device",
      [](const std::string& device) { return layerstream::resolve_device(device, layerstream::DeviceSpelling::Python); },
      py::arg("device"));
  // The option rules (core/options.h), for offload()'s arguments: a bad
  // argument is Python's ValueError, with the rule's message.
#define LS_VALUE_ERRORS(expr)                   \
  try {                                         \
    return expr;                                \
  } catch (const layerstream::Error& e) {       \
    throw py::value_error(e.message());         \
  }
  // A size in bytes (host_budget=, pinned_budget=, an activation budget): whole
  // bytes, no shares; errors name the option (`what`).
  m.def("parse_size", [](py::handle v, const std::string& what) {
    try {
      if (py::isinstance<py::str>(v)) return layerstream::parse_bytes(v.cast<std::string>());
      const char* expected = "expected a whole number of bytes in [0, 2^63), e.g. 16 * 2**30, 1.5e9 or '16GiB'";
      if (py::isinstance<py::int_>(v) && !py::isinstance<py::bool_>(v)) {
        const int64_t n = int_arg(v, "it");  // saturates at the int64 limits
        LS_CHECK(n >= 0 && n < INT64_MAX, expected);
        return static_cast<uint64_t>(n);
      }
      const double d = float_arg(v, "it");
      LS_CHECK(std::isfinite(d) && d >= 0 && d < 9223372036854775808.0 && std::floor(d) == d, expected);
      return static_cast<uint64_t>(d);
    } catch (const layerstream::Error& e) {
      throw py::value_error(what + "=" + py::str(py::repr(v)).cast<std::string>() + ": " + e.message());
    }
  }, py::arg("value"), py::arg("what") = "size", "a size in bytes given as a number or a size text");
  m.def("parse_budget", [](py::handle v) {
    try {
      const options::Budget b = budget_of(v);
      return py::make_tuple(b.fraction, b.bytes, b.share);
    } catch (const layerstream::Error& e) {
      throw py::value_error(e.message());
    }
  }, py::arg("budget"),
        "(is_share, bytes, share) of a budget given as bytes, a size text, a share or 'auto'");
  m.def("budget_bytes", [](py::handle v, uint64_t free_bytes) {
    LS_VALUE_ERRORS(options::budget_bytes(budget_of(v), free_bytes))
  }, py::arg("budget"), py::arg("free_bytes"), "bytes of a budget on a device with free_bytes free");
  m.attr("SIM_DEVICE_MEMORY") = static_cast<uint64_t>(layerstream::kDefaultDeviceMemory);
  // The effective (dequant_dtype, compute_dtype) names, "" = none (options::check_dtypes).
  m.def("check_dtypes", [](const std::string& dequant, const std::string& compute) {
    auto name = [](std::optional<layerstream::quant::OutDtype> t) { return t ? std::string(layerstream::quant::to_string(*t)) : std::string(); };
    try {
      const auto d = options::check_dtypes(dequant, compute);
      return std::make_pair(name(d.dequant), name(d.compute));
    } catch (const layerstream::Error& e) {
      throw py::value_error(e.message());
    }
  }, py::arg("dequant_dtype"), py::arg("compute_dtype"));
  m.def("check_group_alive", &options::check_group_alive, py::arg("alive"), py::arg("group_name"));
  m.def("check_prefetch", [](py::handle v) { LS_VALUE_ERRORS(options::check_prefetch(int_arg(v, "prefetch"))) });
  m.def("check_slots", [](py::handle v) { LS_VALUE_ERRORS(options::check_slots(int_arg(v, "slots"), false)) });
  m.def("check_link_gbps", [](py::handle v) {
    LS_VALUE_ERRORS(options::check_link_gbps(float_arg(v, "sim_link_gbps")))
  });
  m.def("check_latency_us", [](py::handle v) {
    LS_VALUE_ERRORS(options::check_latency_us(float_arg(v, "sim_latency_us")))
  });
#undef LS_VALUE_ERRORS
  layerstream_bindings::bind_optim(m);

  namespace quant = layerstream::quant;
  auto fmt = [](const std::string& f) {
    return f.empty() || f == "none" ? quant::Format::None : quant::parse_format(f);
  };
  // "" when `format` can pack a rows x cols weight, else the reason: every
  // format reads the dtypes float_src_dtype takes (checked when `dtype`, a
  // torch dtype, is given: a float8 weight streams as it is); lossless codes
  // any shape.
  m.def("quant_check", [fmt](const std::string& format, int64_t rows, int64_t cols,
                             const py::object& dtype) -> std::string {
    try {
      if (!dtype.is_none()) float_src_dtype(torch::python::detail::py_object_to_dtype(dtype), "the tensor");
      if (fmt(format) == quant::Format::Lossless) return "";
      quant::layout_for(fmt(format), rows, cols);
      return "";
    } catch (const layerstream::Error& e) {
      return e.message();
    }
  }, py::arg("format"), py::arg("rows"), py::arg("cols"), py::arg("dtype") = py::none());
  // A quantize= name as parse_format reads it (any case, fp8's other names, "" and
  // "none"), in its one spelling: "int8", "fp8", "nf4", "int4", "lossless" or "none";
  // parse_format's error (a GGUF name's says where those weights come from) otherwise.
  m.def("quant_format", [fmt](const std::string& format) { return std::string(quant::to_string(fmt(format))); },
        py::arg("format"));
  m.def("quant_formats", [] { return std::vector<std::string>{"int8", "fp8", "nf4", "int4", "lossless"}; });
  // The lossless format (core/lossless.h) on a contiguous CPU float32 /
  // bfloat16 / float16 tensor: its exact coded size; the coded bytes; and the
  // decoding of coded bytes into a tensor of the source's shape and dtype.
  auto lossless_src = [](const torch::Tensor& t) {
    LS_CHECK(t.device().is_cpu() && t.is_contiguous(), "lossless: needs a contiguous CPU tensor");
    return float_src_dtype(t.scalar_type(), "lossless: the tensor");
  };
  m.def("lossless_coded_bytes", [lossless_src](const torch::Tensor& t) {
    const quant::SrcDtype d = lossless_src(t);
    py::gil_scoped_release nogil;
    return layerstream::lossless::analyze(d, t.data_ptr(), t.numel()).total_bytes();
  }, py::arg("tensor"));
  // A tensor group's tensor streamed with `experts` experts (0: not indexed
  // by expert): its coded bytes as add_group() codes it, in pieces
  // (lossless::expert_pieces), the bytes it takes in the host store and on the bus.
  m.def("lossless_group_part_bytes", [lossless_src](const torch::Tensor& t, int64_t experts) {
    const quant::SrcDtype d = lossless_src(t);
    const int64_t count = layerstream::lossless::expert_pieces(d, t.numel(), t.dim() ? t.size(0) : 0, experts);
    py::gil_scoped_release nogil;
    return layerstream::lossless::analyze_pieces(d, t.data_ptr(), t.numel(), count).total_bytes();
  }, py::arg("tensor"), py::arg("experts"));
  // The most bytes its coded form can take, whatever its values: what a
  // trainable coded weight reserves (Note [Trainable coded weights]); a
  // group's tensor with `experts` experts: its pieces' (as add_group()).
  m.def("lossless_max_bytes", [lossless_src](const torch::Tensor& t, int64_t experts) {
    const quant::SrcDtype d = lossless_src(t);
    const int64_t count = layerstream::lossless::expert_pieces(d, t.numel(), t.dim() ? t.size(0) : 0, experts);
    return layerstream::lossless::max_pieces_bytes(d, t.numel(), count);
  }, py::arg("tensor"), py::arg("experts") = 0);
  m.def("lossless_encode", [lossless_src](const torch::Tensor& t, int threads) {
    const quant::SrcDtype d = lossless_src(t);
    torch::Tensor out;
    {
      py::gil_scoped_release nogil;
      const auto a = layerstream::lossless::analyze(d, t.data_ptr(), t.numel(), threads);
      out = torch::empty({static_cast<int64_t>(a.total_bytes())}, torch::kUInt8);
      layerstream::lossless::encode(a, t.data_ptr(), out.data_ptr(), a.total_bytes(), threads);
    }
    return out;
  }, py::arg("tensor"), py::arg("threads") = 0);
  m.def("lossless_decode", [lossless_src](const torch::Tensor& coded, torch::Tensor out, int threads) {
    LS_CHECK(coded.device().is_cpu() && coded.is_contiguous() && coded.scalar_type() == torch::kUInt8,
             "lossless_decode: the coded bytes are a contiguous CPU uint8 tensor");
    lossless_src(out);
    py::gil_scoped_release nogil;
    layerstream::lossless::decode(coded.data_ptr(), static_cast<size_t>(coded.numel()), out.data_ptr(),
                                  static_cast<size_t>(out.numel()) * out.element_size(), threads);
  }, py::arg("coded"), py::arg("out"), py::arg("threads") = 0);
  m.def("nf4_codes", [] { return std::vector<float>(quant::kNF4Codes, quant::kNF4Codes + 16); });
  m.def("quant_packed_bytes", [](const std::string& format, int64_t rows, int64_t cols) {
    return quant::layout_for(quant::parse_packed_format(format), rows, cols).total_bytes();
  });
  // Tied weights (core/offload_policy.h). candidates: (name, module id,
  // [(role, tensor id, streams_shared)]); owners: {tensor id: [(module id,
  // param, qualified name)]}. Returns (kept indices, groups, resident reasons).
  m.def("analyse_ties",
        [](const std::vector<std::tuple<std::string, uint64_t, std::vector<std::tuple<std::string, uint64_t, bool>>>>&
               candidates,
           const std::map<uint64_t, std::vector<std::tuple<uint64_t, std::string, std::string>>>& owners) {
          std::vector<layerstream::policy::TieCandidate> cs;
          for (const auto& [name, module, params] : candidates) {
            layerstream::policy::TieCandidate c{name, module, {}};
            for (const auto& [role, tensor, streams] : params) c.params.push_back({role, tensor, streams});
            cs.push_back(std::move(c));
          }
          std::map<uint64_t, std::vector<layerstream::policy::TieOwner>> os;
          for (const auto& [tensor, who] : owners)
            for (const auto& [module, param, qualified] : who) os[tensor].push_back({module, param, qualified});
          const auto r = layerstream::policy::analyse_ties(cs, os);
          return py::make_tuple(r.kept, r.groups, r.resident);
        },
        py::arg("candidates"), py::arg("owners"));
  // Mixture-of-experts routing thresholds (core/offload_policy.h).
  m.def("picks_may_route", &layerstream::policy::picks_may_route, py::arg("picks"), py::arg("experts"));
  m.def("fetch_some_experts", &layerstream::policy::fetch_some_experts, py::arg("distinct"), py::arg("experts"));
  // A layer's bytes in a slot (core/slot_layout.h): parts = [(bus, written)].
  m.def("slot_layout", [](const std::vector<std::pair<uint64_t, uint64_t>>& parts) {
    std::vector<layerstream::slot_layout::Part> ps;
    for (const auto& [bus, written] : parts) ps.push_back({bus, written});
    const auto l = layerstream::slot_layout::of(ps);
    py::dict d;
    d["bus_bytes"] = l.bus_bytes;
    d["workspace_bytes"] = l.workspace_bytes;
    d["slot_bytes"] = l.slot_bytes();
    d["workspace_offsets"] = l.workspace_offsets;
    return d;
  }, py::arg("parts"));

  m.def(
      "check_saved_version",
      [](const torch::Tensor& t, uint32_t saved) {
        layerstream::check_saved_version(layerstream::version_of(t), saved, t.sizes());
      },
      py::arg("tensor"), py::arg("saved_version"));
  m.def("tensor_checksum", &layerstream::tensor_checksum, py::arg("tensor"));  // layerstream/engine.h
  m.def("resident_quantized_rounds", &layerstream::resident_quantized_rounds, py::arg("weight"),
        py::arg("dequant"));  // layerstream/engine.h
  m.def("shared_write_refusal", &layerstream::shared_write_refusal, py::arg("what"),
        py::arg("how"));  // layerstream/engine.h
  m.def("quantized_values", &layerstream::quantized_values, py::arg("weight"), py::arg("rows"), py::arg("cols"),
        py::arg("format"), py::arg("dequant") = std::nullopt,
        py::call_guard<py::gil_scoped_release>());  // layerstream/engine.h
  m.def("in_ram_reasons", &host_tier::in_ram_reasons, py::arg("linear"), py::arg("frozen"),
        py::arg("as_stored"), py::arg("format"), py::arg("cache_dir"));  // core/host_tier.h
  // The host budget plan (core/host_tier.h): layers = [(name, bytes,
  // from_file, grad_bytes)]; budgets in bytes, -1 = unlimited.
  m.def("host_tier_plan",
        [](const std::vector<std::tuple<std::string, uint64_t, bool, uint64_t>>& layers, int64_t host_budget,
           int64_t pinned_budget, int prefetch) {
          std::vector<host_tier::Layer> ls;
          for (const auto& [name, bytes, from_file, grad] : layers) ls.push_back({name, bytes, from_file, grad});
          const host_tier::Plan p = host_tier::plan(ls, host_budget, pinned_budget, prefetch);
          py::dict d;
          d["on_disk"] = p.on_disk;
          d["store_bytes"] = p.store_bytes;
          d["disk_bytes"] = p.disk_bytes;
          d["staging_bytes"] = p.staging_bytes;
          d["grad_staging_bytes"] = p.grad_staging_bytes;
          d["staging_pinned"] = p.staging_pinned;
          d["store_pinned_cap"] = p.store_pinned_cap;
          d["pageable_store_bytes"] = p.pageable_store_bytes;
          d["spare_host_bytes"] = p.spare_host_bytes;
          d["spare_pinned_bytes"] = p.spare_pinned_bytes;
          d["grad_pinned_cap"] = p.grad_pinned_cap;
          return d;
        },
        py::arg("layers"), py::arg("host_budget"), py::arg("pinned_budget"), py::arg("prefetch"));
  // The host bytes of a layer's gradient staging buffer (core/slot_layout.h).
  m.def("gradient_staging_bytes", &layerstream::slot_layout::gradient_bytes, py::arg("weight_bytes"),
        py::arg("bias_bytes"));
  m.def("default_host_budget", &host_tier::default_host_budget);
  m.def("default_pinned_budget", &host_tier::default_pinned_budget);
  // A file's identity as recorded when its header was read (read_checkpoint's
  // "identity"); Python only passes it on: the comparison is SourceFile's.
  py::class_<layerstream::FileIdentity>(m, "FileIdentity")
      .def(py::init<>())
      .def_readonly("size", &layerstream::FileIdentity::size)
      .def_readonly("mtime_ns", &layerstream::FileIdentity::mtime_ns)
      .def_readonly("inode", &layerstream::FileIdentity::inode)
      .def_readonly("device", &layerstream::FileIdentity::device)
      .def("recorded", &layerstream::FileIdentity::recorded)
      .def("__eq__", &layerstream::FileIdentity::operator==);
  // A safetensors checkpoint's headers (core/safetensors.h): {"files": [...],
  // "tensors": [{name, dtype, shape, file (absolute), offset (in the file), nbytes,
  // identity (FileIdentity: the file as its header was read)}], "metadata": {...}};
  // never reads the weights.
  m.def("read_checkpoint", [](const std::string& path) {
    const Checkpoint ck = layerstream::read_checkpoint(path);
    py::list tensors;
    for (const TensorInfo& t : ck.tensors) {
      py::dict d;
      d["name"] = t.name;
      d["dtype"] = t.dtype;
      d["shape"] = t.shape;
      d["file"] = t.file;
      d["offset"] = t.file_offset;
      d["nbytes"] = t.nbytes;
      d["identity"] = t.identity;
      tensors.append(d);
    }
    py::dict out;
    out["files"] = ck.files;
    out["tensors"] = tensors;
    out["metadata"] = ck.metadata;
    return out;
  }, py::arg("path"));
  // Reads bytes of a file into a contiguous CPU tensor's memory, checked (against
  // `identity` when recorded) and in large chunks on reader threads
  // (core/io/source_file.h).
  m.def("read_file_into", [](const std::string& path, uint64_t offset, torch::Tensor dst, const std::string& tensor,
                             const layerstream::FileIdentity& identity) {
    LS_CHECK(dst.device().is_cpu() && dst.is_contiguous(), "read_file_into needs a contiguous CPU tensor");
    auto f = SourceFile::open(path, identity);
    py::gil_scoped_release nogil;
    f->read(dst.data_ptr(), offset, static_cast<uint64_t>(dst.numel()) * dst.element_size(), tensor,
            &SourceFile::readers());
  }, py::arg("path"), py::arg("offset"), py::arg("dst"), py::arg("tensor"),
     py::arg("identity") = layerstream::FileIdentity());
  m.def("drop_page_cache", [](const std::string& path) { SourceFile::open(path)->drop_page_cache(); },
        py::arg("path"));
  // The quantization cache file of the disk tier (core/io/quant_cache.h):
  // items are FileRanges of dense weights with their dtype and [rows, cols];
  // returns {"path", "built", "reason", "ranges": [FileRange of the packed bytes]}.
  m.def("quant_cache", [](const std::string& dir, const std::string& format,
                          const std::vector<std::tuple<FileRange, py::object, int64_t, int64_t>>& items) {
    std::vector<quant_cache::Item> in;
    for (const auto& [r, dtype, rows, cols] : items) {
      const quant::SrcDtype d = float_src_dtype(torch::python::detail::py_object_to_dtype(dtype),
                                                r.path + ": tensor '" + r.tensor + "'");
      in.push_back({r.tensor, r.path, r.offset, r.bytes, d, rows, cols, r.identity});
    }
    quant_cache::Result res;
    {
      py::gil_scoped_release nogil;
      res = quant_cache::ensure(dir, quant::parse_format(format), in);
    }
    py::list ranges;
    for (size_t i = 0; i < in.size(); ++i)
      ranges.append(FileRange{res.path, res.items[i].offset, res.items[i].bytes, in[i].tensor, res.identity,
                              SourceFile::Kind::QuantCache, res.items[i].checksum});
    py::dict out;
    out["path"] = res.path;
    out["built"] = res.built;
    out["reason"] = res.reason;
    out["ranges"] = ranges;
    return out;
  }, py::arg("dir"), py::arg("format"), py::arg("items"));

  // A .gguf file's header (core/gguf.h): metadata and tensor records; the
  // data is read by the caller at each record's absolute `offset`.
  m.def("gguf_type_unreadable", &layerstream::gguf_type_unreadable, py::arg("path"), py::arg("tensor"),
        py::arg("type_name"));  // core/gguf.h
  m.def("gguf_read", [](const std::string& path) {
    const layerstream::GgufFile g = layerstream::read_gguf(path);
    py::dict d;
    d["version"] = g.version;
    d["alignment"] = g.alignment;
    d["data_offset"] = g.data_offset;
    d["file_bytes"] = g.file_bytes;
    py::dict meta;
    for (const auto& [k, v] : g.metadata) meta[py::str(k)] = v;
    d["metadata"] = meta;
    py::list tensors;
    for (const auto& t : g.tensors) {
      py::dict e;
      e["name"] = t.name;
      e["shape"] = t.shape;
      e["type"] = t.type_name;
      e["type_id"] = t.type;
      e["offset"] = t.offset;
      e["nbytes"] = t.nbytes;
      const quant::Format f = layerstream::ggml_type_format(t.type);
      e["format"] = f == quant::Format::None ? std::string() : std::string(quant::to_string(f));
      tensors.append(e);
    }
    d["tensors"] = tensors;
    return d;
  });
  // The CPU reference dequantization of a packed tensor whose bytes are
  // `packed` (uint8, the layout's total_bytes(), or for the GGUF formats just
  // its blocks): a new [rows, cols] tensor of `dtype` (float32/bfloat16/float16).
  m.def("dequantize_packed", [](const std::string& format, torch::Tensor packed, int64_t rows, int64_t cols,
                                torch::ScalarType dtype) {
    const quant::PackedLayout L = quant::layout_for(quant::parse_packed_format(format), rows, cols);
    LS_CHECK(packed.device().is_cpu() && packed.scalar_type() == torch::kUInt8, "dequantize_packed: the packed "
             "bytes must be a CPU uint8 tensor, got ", py_dtype(packed.scalar_type()), " on ", packed.device());
    torch::Tensor src = packed.contiguous();
    const size_t need = quant::is_gguf(L.format) ? L.data_bytes : L.total_bytes();
    LS_CHECK(static_cast<size_t>(src.numel()) == need, "dequantize_packed: a ", quant::to_string(L.format),
             " tensor [", rows, ", ", cols, "] is ", need, " bytes, got ", src.numel());
    const quant::OutDtype od = dtype == torch::kFloat ? quant::OutDtype::F32
                               : dtype == torch::kBFloat16 ? quant::OutDtype::BF16
                               : dtype == torch::kHalf ? quant::OutDtype::F16
                               : (LS_FAIL("dequantize_packed: dtype must be float32, bfloat16 or float16, got ",
                                          dtype), quant::OutDtype::F32);
    torch::Tensor out = torch::empty({rows, cols}, torch::TensorOptions().dtype(dtype));
    {
      py::gil_scoped_release nogil;
      quant::dequantize_cpu(L, src.data_ptr(), out.data_ptr(), od, 0);
    }
    return out;
  });

  // Bytes as the planner prints them (1536 -> "1.50 KiB").
  m.def("format_bytes", [](uint64_t bytes) { return layerstream::format_bytes(bytes); }, py::arg("bytes"));
  // The placement planner (core/planner.h): which layers stay resident.
  // layers, in execution order: (name, bus bytes, slot bytes (0 = bus bytes),
  // resident bytes, FLOPs, trainable, narrow write, train bytes): PlannerLayer's fields.
  // ties: (layer, the layer whose weight it shares, the shared bytes), PlannerLayer::tied_layer / tied_bytes.
  using PlannedLayers =
      std::vector<std::tuple<std::string, uint64_t, uint64_t, uint64_t, double, bool, bool, uint64_t>>;
  using PlannedTies = std::vector<std::tuple<size_t, int, uint64_t>>;
  auto planner_input = [](uint64_t budget, const PlannedLayers& layers, uint64_t fixed, uint64_t fixed_train,
                          const PlannedTies& ties) {
    layerstream::PlannerInput in;
    in.budget_bytes = budget;
    in.fixed_resident_bytes = fixed;
    in.fixed_train_bytes = fixed_train;
    for (const auto& [name, bytes, slot_bytes, resident, flops, trainable, narrow_write, train] : layers) {
      layerstream::PlannerLayer l;
      l.name = name;
      l.bytes = bytes;
      l.slot_bytes = slot_bytes;
      l.resident_bytes = resident;
      l.flops = flops;
      l.trainable = trainable;
      l.narrow_write = narrow_write;
      l.train_bytes = train;
      in.layers.push_back(l);
    }
    for (const auto& [layer, tied_layer, tied_bytes] : ties) {
      LS_CHECK(layer < in.layers.size(), "planner: a tie names layer #", layer, " of ", in.layers.size());
      in.layers[layer].tied_layer = tied_layer;
      in.layers[layer].tied_bytes = tied_bytes;
    }
    return in;
  };
  auto plan_dict = [](const layerstream::Plan& plan) {
    py::dict d;
    py::list resident;
    for (const auto& l : plan.layers)
      if (l.resident) resident.append(l.name);
    d["resident"] = resident;
    d["num_slots"] = plan.num_slots;
    d["prefetch_depth"] = plan.prefetch_depth;
    d["slot_bytes"] = plan.slot_bytes;
    d["resident_bytes"] = plan.resident_bytes;
    d["fixed_resident_bytes"] = plan.fixed_resident_bytes;
    d["train_bytes"] = plan.train_bytes;
    d["device_bytes"] = plan.device_bytes;
    d["budget_bytes"] = plan.budget_bytes;
    d["explain"] = plan.explain();
    d["explain_host_budget"] = plan.explain(/*host_budget=*/true);  // the host line as "without a host budget"
    d["json"] = plan.to_json();
    return d;
  };
  // offload()'s rule: slots first, residency with what is left (plan_slots_first).
  // `as_stored`: indices of layers streamed as stored whatever quantize= asked
  // (PlannerLayer::as_stored: the "too small" error does not suggest quantizing).
  // `stored_slots`: (layer, its slot streamed as stored), PlannerLayer::stored_slot_bytes.
  m.def(
      "plan_slots_first",
      [planner_input, plan_dict](uint64_t budget, const PlannedLayers& layers, uint64_t fixed, int prefetch,
                                 int slots, double link_bytes_per_s, bool training, uint64_t fixed_train,
                                 const PlannedTies& ties, const std::vector<size_t>& as_stored,
                                 const std::vector<std::pair<size_t, uint64_t>>& stored_slots) {
        layerstream::PlannerInput in = planner_input(budget, layers, fixed, fixed_train, ties);
        for (size_t i : as_stored) {
          LS_CHECK(i < in.layers.size(), "planner: as_stored names layer #", i, " of ", in.layers.size());
          in.layers[i].as_stored = true;
        }
        for (const auto& [i, bytes] : stored_slots) {
          LS_CHECK(i < in.layers.size(), "planner: stored_slots names layer #", i, " of ", in.layers.size());
          in.layers[i].stored_slot_bytes = bytes;
        }
        in.link_bytes_per_s = link_bytes_per_s;  // the copy times (0: unknown)
        in.training = training;
        return plan_dict(layerstream::plan_slots_first(in, prefetch, slots));
      },
      py::arg("budget"), py::arg("layers"), py::arg("fixed_resident_bytes"), py::arg("prefetch"),
      py::arg("slots") = 0, py::arg("link_bytes_per_s") = 0.0, py::arg("training") = false,
      py::arg("fixed_train_bytes") = 0, py::arg("ties") = PlannedTies(),
      py::arg("as_stored") = std::vector<size_t>(),
      py::arg("stored_slots") = std::vector<std::pair<size_t, uint64_t>>());
  // This machine's memory (core/host_memory.h): {total_bytes, available_bytes}, 0 = unknown.
  m.def("host_memory", [] {
    const layerstream::HostMemory h = layerstream::host_memory();
    py::dict d;
    d["total_bytes"] = h.total_bytes;
    d["available_bytes"] = h.available_bytes;
    return d;
  });

  // The engine's options (layerstream/engine.h EngineOptions), checked when an
  // Engine is made.
  py::class_<EngineOptions>(m, "EngineOptions")
      .def(py::init<>())
      .def_readwrite("device", &EngineOptions::device)
      .def_readwrite("budget_bytes", &EngineOptions::budget_bytes)
      .def_readwrite("prefetch", &EngineOptions::prefetch)
      .def_readwrite("slots", &EngineOptions::slots)
      .def_readwrite("sim_h2d_gbps", &EngineOptions::sim_h2d_gbps)
      .def_readwrite("sim_d2h_gbps", &EngineOptions::sim_d2h_gbps)
      .def_readwrite("sim_latency_us", &EngineOptions::sim_latency_us)
      .def_readwrite("checker", &EngineOptions::checker)
      .def_readwrite("abort_on_ordering_error", &EngineOptions::abort_on_ordering_error)
      .def_readwrite("pin_memory", &EngineOptions::pin_memory)
      .def_readwrite("cache_across_steps", &EngineOptions::cache_across_steps)
      .def_readwrite("trace", &EngineOptions::trace)
      .def_readwrite("dequant_dtype", &EngineOptions::dequant_dtype)
      .def_readwrite("compute_dtype", &EngineOptions::compute_dtype)
      .def_readwrite("activation_min_bytes", &EngineOptions::activation_min_bytes)
      .def_readwrite("activation_host_cap", &EngineOptions::activation_host_cap)
      .def_readwrite("activation_pinned_cap", &EngineOptions::activation_pinned_cap)
      .def_readwrite("grad_staging_pinned_cap", &EngineOptions::grad_staging_pinned_cap)
      .def_readwrite("store_pinned_cap", &EngineOptions::store_pinned_cap)
      .def_readwrite("staging_bytes", &EngineOptions::staging_bytes)
      .def_readwrite("staging_pinned", &EngineOptions::staging_pinned)
      .def_readwrite("reader_threads", &EngineOptions::reader_threads);

  py::class_<FileRange>(m, "FileRange")
      .def(py::init([](const std::string& path, uint64_t offset, uint64_t bytes, const std::string& tensor,
                       const layerstream::FileIdentity& identity) {
             FileRange r;
             r.path = path;
             r.offset = offset;
             r.bytes = bytes;
             r.tensor = tensor;
             r.identity = identity;
             return r;
           }),
           py::arg("path"), py::arg("offset"), py::arg("bytes"), py::arg("tensor"),
           py::arg("identity") = layerstream::FileIdentity())
      .def_readonly("path", &FileRange::path)
      .def_readonly("offset", &FileRange::offset)
      .def_readonly("bytes", &FileRange::bytes)
      .def_readonly("tensor", &FileRange::tensor)
      .def_readonly("identity", &FileRange::identity)
      .def_readonly("checksum", &FileRange::checksum);  // None, or what the first read checks

  // A host region shared by the processes of one node (core/shared_region.h).
  py::class_<layerstream::SharedRegion, std::shared_ptr<layerstream::SharedRegion>>(m, "SharedRegion")
      .def_static("create", &layerstream::SharedRegion::create, py::arg("capacity"), py::arg("label"))
      .def_static("open", &layerstream::SharedRegion::open, py::arg("pid"), py::arg("fd"), py::arg("capacity"))
      .def_property_readonly("pid", &layerstream::SharedRegion::pid)
      .def_property_readonly("fd", &layerstream::SharedRegion::fd)
      .def_property_readonly("capacity", &layerstream::SharedRegion::capacity)
      .def_property_readonly("used", &layerstream::SharedRegion::used)
      .def_property_readonly("creator", &layerstream::SharedRegion::creator)
      .def_static("page_size", &layerstream::SharedRegion::page_size)
      .def("close_fd", &layerstream::SharedRegion::close_fd);
  py::class_<StashedActivation, std::unique_ptr<StashedActivation>>(m, "StashedActivation")
      .def(py::init<std::shared_ptr<Engine>, int64_t>(), py::arg("engine"), py::arg("token"))
      .def_readonly("engine", &StashedActivation::engine)
      .def_readonly("token", &StashedActivation::token);
  py::class_<Engine, std::shared_ptr<Engine>>(m, "Engine")
      .def(py::init([](const EngineOptions& opts) { return Engine::create(opts); }), py::arg("options"))
      // {field: value} of EngineOptions (an unknown field is refused).
      .def(py::init([](const py::dict& fields) {
             py::object opts = py::module_::import("layerstream._C").attr("EngineOptions")();
             for (auto item : fields) {
               const std::string k = py::cast<std::string>(item.first);
               LS_CHECK(py::hasattr(opts, k.c_str()), "unknown engine option '", k, "'");
               opts.attr(k.c_str()) = item.second;
             }
             return Engine::create(opts.cast<EngineOptions>());
           }),
           py::arg("options") = py::dict())
      .def("read_file",
           [](Engine& e, const FileRange& src, const std::vector<int64_t>& shape, py::object dtype,
              py::object file_dtype) {
             const torch::ScalarType t = torch::python::detail::py_object_to_dtype(dtype);
             std::optional<torch::ScalarType> f;
             if (!file_dtype.is_none()) f = torch::python::detail::py_object_to_dtype(file_dtype);
             py::gil_scoped_release nogil;
             return e.read_file(src, shape, t, f);
           },
           py::arg("src"), py::arg("shape"), py::arg("dtype"), py::arg("file_dtype") = py::none())
      .def("add_linear_on_disk",
           [fmt](Engine& e, const std::string& name, torch::Tensor w, const FileRange& wsrc,
              std::optional<torch::Tensor> b, std::optional<FileRange> bsrc, const std::string& quantize) {
             return e.add_linear_on_disk(name, w, wsrc, b.value_or(torch::Tensor()), bsrc, fmt(quantize));
           },
           py::arg("name"), py::arg("weight"), py::arg("weight_file"), py::arg("bias") = py::none(),
           py::arg("bias_file") = py::none(), py::arg("quantize") = "")
      .def("add_linear",
           [fmt](Engine& e, const std::string& name, torch::Tensor w, std::optional<torch::Tensor> b,
                 const std::string& quantize) {
             return e.add_linear(name, w, b.value_or(torch::Tensor()), fmt(quantize));
           },
           py::arg("name"), py::arg("weight"), py::arg("bias") = py::none(),
           py::arg("quantize") = "")
      .def("add_linear_int8",
           [](Engine& e, const std::string& name, torch::Tensor data,
              torch::Tensor scales, std::optional<torch::Tensor> bias, py::object dense_dtype) {
             const auto dt = torch::python::detail::py_object_to_dtype(dense_dtype);
             return e.add_linear_int8(name, data, scales, bias.value_or(torch::Tensor()), dt);
           },
           py::arg("name"), py::arg("data"), py::arg("scales"),
           py::arg("bias"), py::arg("dense_dtype"))
      .def("add_linear_packed",
           [](Engine& e, const std::string& name, const std::string& format, torch::Tensor codes,
                 torch::Tensor scales, std::optional<torch::Tensor> bias, int64_t rows, int64_t cols,
                 py::object dense_dtype) {
             const auto dt = torch::python::detail::py_object_to_dtype(dense_dtype);
             return e.add_linear_packed(name, quant::parse_packed_format(format), codes, scales,
                                        bias.value_or(torch::Tensor()),
                                        rows, cols, dt);
           },
           py::arg("name"), py::arg("format"), py::arg("codes"), py::arg("scales"), py::arg("bias"),
           py::arg("rows"), py::arg("cols"), py::arg("dense_dtype"))
      .def(
          "add_conv",
          [](Engine& e, const std::string& name, torch::Tensor w, std::optional<torch::Tensor> ob, int dims,
             std::vector<int64_t> stride, std::vector<int64_t> padding, bool same,
             std::vector<int64_t> dilation, int64_t groups, const std::string& quantize) {
            torch::Tensor b = ob.value_or(torch::Tensor());
            ConvSpec s;
            s.dims = dims;
            s.stride = std::move(stride);
            s.padding = std::move(padding);
            s.same = same;
            s.dilation = std::move(dilation);
            s.groups = groups;
            return e.add_conv(name, w, b, s, quantize.empty() || quantize == "none"
                                                    ? layerstream::quant::Format::None
                                                    : layerstream::quant::parse_format(quantize));
          },
          py::arg("name"), py::arg("weight"), py::arg("bias"), py::arg("dims"), py::arg("stride"),
          py::arg("padding"), py::arg("same"), py::arg("dilation"), py::arg("groups"),
          py::arg("quantize") = "")
      .def("linear", &Engine::linear, py::arg("layer"), py::arg("x"),
           py::arg("grads_via_autograd") = false)
      .def("conv", &Engine::conv, py::arg("layer"), py::arg("x"), py::arg("grads_via_autograd") = false)
      .def("add_embedding", &Engine::add_embedding, py::arg("name"), py::arg("weight"),
           py::arg("padding_idx") = -1, py::arg("scale_grad_by_freq") = false, py::arg("sparse") = false)
      .def("embedding", &Engine::embedding, py::arg("layer"), py::arg("ids"))
      .def("add_group",
           [fmt](Engine& e, const std::string& name, const std::vector<torch::Tensor>& tensors,
                 const std::string& quantize, int64_t experts,
                 const std::vector<std::optional<std::pair<std::string, torch::Tensor>>>& prepacked) {
             // prepacked: per tensor, None or (GGUF format name, its bytes).
             std::vector<Engine::PrepackedPart> parts;
             for (const auto& p : prepacked)
               parts.push_back(p ? Engine::PrepackedPart{quant::parse_packed_format(p->first), p->second}
                                 : Engine::PrepackedPart{});
             return e.add_group(name, tensors, fmt(quantize), experts, parts);
           },
           py::arg("name"), py::arg("tensors"), py::arg("quantize") = "", py::arg("experts") = 0,
           py::arg("prepacked") = std::vector<std::optional<std::pair<std::string, torch::Tensor>>>{})
      .def("dequantized_part", &Engine::dequantized_part, py::arg("layer"), py::arg("part"))
      .def("requantize_part", &Engine::requantize_part, py::arg("layer"), py::arg("part"), py::arg("dense"))
      .def("fetch", &Engine::fetch, py::arg("layer"), py::arg("experts") = std::vector<int64_t>{})
      .def("release", &Engine::release, py::arg("token"))
      .def("synchronize", &Engine::synchronize, py::call_guard<py::gil_scoped_release>())
      .def("begin_call", &Engine::begin_call, py::call_guard<py::gil_scoped_release>())
      .def("suspend", &Engine::suspend, py::call_guard<py::gil_scoped_release>())
      .def("resume", &Engine::resume, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("suspended", &Engine::suspended)
      // A torch.distributed group by its name (ProcessGroup.group_name, in the
      // registry torch keeps); "" for none.
      .def("set_gradient_group",
           [](Engine& e, const std::string& group_name) {
             e.set_gradient_group(group_name.empty() ? c10::intrusive_ptr<c10d::ProcessGroup>()
                                                     : c10d::resolve_process_group(group_name));
           },
           py::arg("group_name"))
      .def("set_gradient_sync", &Engine::set_gradient_sync, py::arg("sync"))
      .def("average_gradient", [](Engine& e, int layer, torch::Tensor g) { e.average_gradient(layer, g); },
           py::arg("layer"), py::arg("grad"), py::call_guard<py::gil_scoped_release>())
      .def("share_host_store", &Engine::share_host_store, py::arg("region"), py::arg("writer"),
           py::arg("trainable"))
      .def_property_readonly("host_store_digest", &Engine::host_store_digest)
      .def("host_store_shared", &Engine::host_store_shared, py::arg("trainable"))
      .def("detach",
           [](Engine& e, const std::vector<std::string>& devices) {
             std::vector<torch::Device> d;
             for (const auto& s : devices) d.emplace_back(s);
             e.detach(d);
           })
      .def("stats",
           [](const Engine& e) {
             py::dict d;  // ints, and floats for the float fields
             e.stats().for_each([&d](const char* name, auto value) { d[name] = value; });
             return d;
           })
      .def("ordering_errors", &Engine::ordering_errors)
      .def_property_readonly("device", &Engine::device_name)
      .def_property_readonly("compute_device",
                             [](const Engine& e) { return e.compute_device().str(); })
      .def_property_readonly("num_layers", &Engine::num_layers)
      // The `engine` argument of the torch.ops.layerstream operators (engine.h).
      .def_property_readonly("id", &Engine::id)
      .def("op_spec", &Engine::op_spec, py::arg("layer"))
      .def("begin_activations", &Engine::begin_activations, py::arg("device_budget"))
      // It may wait for earlier copies to the host (Note [Copies in flight]): without the GIL.
      .def("stash_activation", &Engine::stash_activation, py::arg("tensor"),
           py::call_guard<py::gil_scoped_release>())
      .def("restore_activation", &Engine::restore_activation, py::arg("token"), py::arg("order_compute") = true)
      .def("drop_activation", &Engine::drop_activation, py::arg("token"), py::arg("order_reuse") = true)
      .def("layer_name", &Engine::layer_name)
      .def("layer_bytes", &Engine::layer_bytes)
      .def("layer_format", &Engine::layer_format)
      .def("unsettled_step", &Engine::unsettled_step)
      .def("trace_json", &Engine::trace_json)
      .def("step_stats",
           [](const Engine& e) {
             py::list out;
             for (const auto& [st, overlap] : e.step_stats()) {
               py::dict d;
               d["step"] = st.step;
               d["acquires"] = st.acquires;
               d["hits"] = st.hits;
               d["misses"] = st.misses;
               d["h2d_bytes"] = st.h2d_bytes;
               d["d2h_bytes"] = st.d2h_bytes;
               d["stall_seconds"] = st.host_wait_seconds;
               d["max_slots_held"] = st.max_slots_held;
               d["slot_utilisation"] = st.slot_utilisation();
               d["overlap_fraction"] = overlap;
               d["duration_seconds"] = st.end_us > st.start_us ? (st.end_us - st.start_us) * 1e-6 : 0.0;
               out.append(d);
             }
             return out;
           })
      .def("dequantized_weight", &Engine::dequantized_weight)
      .def("packed_codes", &Engine::packed_codes)
      .def("watch_weight", &Engine::watch_weight)
      .def("requantize", &Engine::requantize)
      .def("requantize_refusal", &Engine::requantize_refusal, py::arg("layer"), py::arg("part") = -1)
      .def_property_readonly("detached", &Engine::detached);
}
