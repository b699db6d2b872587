// layerstream._C: the host optimizers (layerstream/host_optim.h) for
// python/layerstream/optim.py. See bindings_optim.h.
#include "bindings_optim.h"

#include <torch/extension.h>

#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "layerstream/engine.h"
#include "layerstream/host_optim.h"

namespace py = pybind11;
using layerstream::Engine;

namespace layerstream_bindings {
namespace {

// AdamWOverlap / AdafactorOverlap::settle for Python: (clip coefficient, total norm,
// whether the loss-scaled step was skipped).
template <class Overlap>
py::tuple settle_overlap(Overlap& self, double other_sum_of_squares, bool skip) {
  double norm = std::nan("");
  float coef;
  {
    py::gil_scoped_release nogil;
    coef = self.settle(other_sum_of_squares, &norm, skip);
  }
  return py::make_tuple(coef, norm, self.skipped());
}

}  // namespace

// Lists are parallel, one entry per parameter; None stands for an absent tensor.
void bind_optim(py::module& m) {
  namespace o = layerstream::optim;
  using OptT = std::optional<torch::Tensor>;
  auto opt = [](const torch::Tensor& t) -> py::object { return t.defined() ? py::cast(t) : py::none(); };
  // A bad argument is Python's ValueError, as in torch.optim.
  auto value_error = [](const auto& fn) {
    try {
      fn();
    } catch (const layerstream::Error& e) {
      throw py::value_error(e.message());
    }
  };
  m.def("optim_check_adamw", [value_error](double lr, double beta1, double beta2, double eps, double wd) {
    value_error([&] { o::check_adamw(o::AdamWConfig{lr, beta1, beta2, eps, wd}); });
  });
  m.def("optim_state_precision", [value_error](const std::string& name) {
    std::string out;
    value_error([&] { out = o::state_format_name(o::parse_state_format(name)); });
    return out;
  }, "the canonical name ('fp32', 'bf16', '8bit') of a state precision");
  m.def("optim_train_bytes", [value_error](const std::string& spec, const std::vector<int64_t>& shape,
                                           uint64_t elem_bytes) {
    uint64_t out = 0;
    value_error([&] { out = o::train_bytes(o::parse_train_spec(spec), shape, elem_bytes); });
    return out;
  }, "offload(train=spec): the gradient and optimizer-state bytes of a trainable tensor kept on the device "
     "(core/optim/optim.h train_bytes); ValueError for an unknown spec");
  // optim::note_uncounted_training: offload() notes the parameters; the note's end()
  // is its handle's detach; the optimizers ask optim_uncounted at their first step.
  py::class_<std::atomic<bool>, std::shared_ptr<std::atomic<bool>>>(m, "UncountedNote")
      .def("end", [](std::atomic<bool>& live) { live = false; });
  m.def("optim_note_uncounted", &o::note_uncounted_training,
        "notes trainable parameters an offload() budget kept on the device without train=");
  m.def("optim_uncounted", &o::uncounted_training, "a parameter optim_note_uncounted noted, not yet detached");
  m.def("optim_adamw_init_states", [opt](const torch::Tensor& p, const std::string& fmt) {
    const o::AdamWStates s = o::adamw_init_states(p, o::parse_state_format(fmt));
    return py::make_tuple(s.exp_avg, s.exp_avg_sq, opt(s.exp_avg_absmax), opt(s.exp_avg_sq_absmax));
  });
  m.def("optim_adamw_adopt_states", [opt](const torch::Tensor& p, const std::string& fmt, OptT m1, OptT m2,
                                          OptT a1, OptT a2, const std::string& name) {
    const o::AdamWStates s = o::adamw_adopt_states(
        p, o::parse_state_format(fmt),
        o::AdamWStates{m1.value_or(torch::Tensor()), m2.value_or(torch::Tensor()), a1.value_or(torch::Tensor()),
                       a2.value_or(torch::Tensor())},
        name);
    return py::make_tuple(s.exp_avg, s.exp_avg_sq, opt(s.exp_avg_absmax), opt(s.exp_avg_sq_absmax));
  });
  m.def(
      "optim_adamw_step",
      [](double lr, double beta1, double beta2, double eps, double wd, const std::string& fmt,
         const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& grads,
         const std::vector<torch::Tensor>& exp_avgs, const std::vector<torch::Tensor>& exp_avg_sqs,
         const std::vector<OptT>& absmax_m, const std::vector<OptT>& absmax_v, const std::vector<int64_t>& steps,
         const std::vector<uint64_t>& keys, float grad_scale, uint64_t seed) {
        const size_t n = params.size();
        LS_CHECK(exp_avgs.size() == n && exp_avg_sqs.size() == n && absmax_m.size() == n && absmax_v.size() == n,
                 "internal: optim_adamw_step needs one state of each kind per parameter");
        std::vector<o::AdamWStates> states(n);
        for (size_t i = 0; i < n; ++i)
          states[i] = o::AdamWStates{exp_avgs[i], exp_avg_sqs[i], absmax_m[i].value_or(torch::Tensor()),
                                     absmax_v[i].value_or(torch::Tensor())};
        py::gil_scoped_release nogil;
        o::adamw_step(o::AdamWConfig{lr, beta1, beta2, eps, wd}, o::parse_state_format(fmt), params, grads, states,
                      steps, keys, grad_scale, seed);
      });
  auto af_config = [](py::object lr, double eps1, double eps2, double clip_threshold, double decay_rate,
                      py::object beta1, double wd, bool scale_parameter, bool relative_step, bool warmup_init) {
    o::AdafactorConfig c;
    c.lr = lr.is_none() ? -1.0 : lr.cast<double>();
    c.eps1 = eps1;
    c.eps2 = eps2;
    c.clip_threshold = clip_threshold;
    c.decay_rate = decay_rate;
    c.beta1 = beta1.is_none() ? -1.0 : beta1.cast<double>();
    c.weight_decay = wd;
    c.scale_parameter = scale_parameter;
    c.relative_step = relative_step;
    c.warmup_init = warmup_init;
    return c;
  };
  m.def("optim_check_adafactor", [af_config, value_error](py::object lr, double eps1, double eps2, double clip,
                                                          double decay, py::object beta1, double wd, bool sp, bool rs,
                                                          bool wi) {
    value_error([&] {
      if (!lr.is_none()) LS_CHECK(lr.cast<double>() >= 0.0, "Adafactor: lr must be >= 0, got ", lr.cast<double>());
      if (!beta1.is_none())
        LS_CHECK(beta1.cast<double>() >= 0.0, "Adafactor: beta1 must be in [0, 1) or None, got ", beta1.cast<double>());
      o::check_adafactor(af_config(lr, eps1, eps2, clip, decay, beta1, wd, sp, rs, wi));
    });
  });
  m.def("optim_adafactor_init_states", [opt](const torch::Tensor& p, bool first_moment) {
    o::AdafactorConfig c;
    c.beta1 = first_moment ? 0.0 : -1.0;
    const o::AdafactorStates s = o::adafactor_init_states(p, c);
    return py::make_tuple(opt(s.exp_avg_sq_row), opt(s.exp_avg_sq_col), opt(s.exp_avg_sq), opt(s.exp_avg));
  });
  m.def(
      "optim_adafactor_step",
      [af_config](py::object lr, double eps1, double eps2, double clip, double decay, py::object beta1, double wd,
                  bool sp, bool rs, bool wi, const std::vector<torch::Tensor>& params,
                  const std::vector<torch::Tensor>& grads, const std::vector<OptT>& rows, const std::vector<OptT>& cols,
                  const std::vector<OptT>& vs, const std::vector<OptT>& ms, const std::vector<int64_t>& steps,
                  const std::vector<uint64_t>& keys, float grad_scale, uint64_t seed) {
        const o::AdafactorConfig c = af_config(lr, eps1, eps2, clip, decay, beta1, wd, sp, rs, wi);
        const size_t n = params.size();
        LS_CHECK(rows.size() == n && cols.size() == n && vs.size() == n && ms.size() == n,
                 "internal: optim_adafactor_step needs one state of each kind per parameter");
        std::vector<o::AdafactorStates> states(n);
        for (size_t i = 0; i < n; ++i)
          states[i] = o::AdafactorStates{rows[i].value_or(torch::Tensor()), cols[i].value_or(torch::Tensor()),
                                         vs[i].value_or(torch::Tensor()), ms[i].value_or(torch::Tensor())};
        py::gil_scoped_release nogil;
        return o::adafactor_step(c, params, grads, states, steps, keys, grad_scale, seed);
      });
  // The arithmetic parameters off the host get (resident layers on a GPU), callable on any
  // device: the tests compare it with torch's and transformers' classes on the host.
  m.def(
      "optim_adafactor_step_torch",
      [af_config](py::object lr, double eps1, double eps2, double clip, double decay, py::object beta1, double wd,
                  bool sp, bool rs, bool wi, const torch::Tensor& param, const torch::Tensor& grad, OptT row, OptT col,
                  OptT v, OptT m, int64_t step, float grad_scale) {
        const o::AdafactorConfig c = af_config(lr, eps1, eps2, clip, decay, beta1, wd, sp, rs, wi);
        const o::AdafactorStates st{row.value_or(torch::Tensor()), col.value_or(torch::Tensor()),
                                    v.value_or(torch::Tensor()), m.value_or(torch::Tensor())};
        py::gil_scoped_release nogil;
        return o::adafactor_step_torch(c, param, grad, st, step, grad_scale);
      });
  m.def(
      "optim_adamw_step_torch",
      [](double lr, double beta1, double beta2, double eps, double wd, const torch::Tensor& param,
         const torch::Tensor& grad, const torch::Tensor& exp_avg, const torch::Tensor& exp_avg_sq, int64_t step,
         float grad_scale) {
        py::gil_scoped_release nogil;
        o::adamw_step_torch(o::AdamWConfig{lr, beta1, beta2, eps, wd}, param, grad,
                            o::AdamWStates{exp_avg, exp_avg_sq, {}, {}}, step, grad_scale);
      });
  m.def("optim_grad_norm", &o::grad_norm, py::call_guard<py::gil_scoped_release>(),
        "the total 2-norm of the gradients (host ones by the C++ kernels), as a Python float");
  m.def("optim_clip_coefficient", &o::clip_coefficient, py::arg("total_norm"), py::arg("max_norm"));
  m.def("optim_check_param_dtypes", &o::check_param_dtypes, py::arg("params"), py::arg("group"));
  m.def("optim_check_group", &o::check_group, py::arg("params"), py::arg("grads"), py::arg("group"),
        py::arg("positions") = std::vector<int64_t>{}, py::arg("cpp") = false);
  m.def("optim_bytes_per_element", [](const std::string& param, const std::string& grad, const std::string& fmt) {
    auto dt = [](const std::string& s) { return s == "bfloat16" ? o::Dtype::BF16 : o::Dtype::F32; };
    return o::adamw_bytes_per_element(dt(param), dt(grad), o::parse_state_format(fmt));
  });
  // One AdamW step overlapped with a backward (layerstream/host_optim.h, AdamWOverlap).
  // groups: (lr, beta1, beta2, eps, weight_decay, state precision, seed);
  // params: (param, exp_avg, exp_avg_sq, absmax or None, absmax or None, step, key, group,
  // lo, hi) with [lo, hi) the elements stepped (hi < 0: all).
  using GroupT = std::tuple<double, double, double, double, double, std::string, uint64_t>;
  using ParamT = std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, OptT, OptT, torch::Tensor, uint64_t, size_t,
                            int64_t, int64_t>;
  py::class_<o::OverlapBackups, std::shared_ptr<o::OverlapBackups>>(m, "OverlapBackups")
      .def(py::init<>())
      .def_property_readonly("bytes", &o::OverlapBackups::bytes);
  py::class_<o::AdamWOverlap>(m, "AdamWOverlap")
      .def(py::init([](std::shared_ptr<Engine> engine, const std::vector<GroupT>& groups,
                       const std::vector<ParamT>& params, std::optional<double> max_norm, int64_t speculation_bytes,
                       std::shared_ptr<o::OverlapBackups> backups, bool keep_grads,
                       std::optional<double> loss_scale) {
             std::vector<o::AdamWOverlap::Group> gs;
             for (const auto& [lr, b1, b2, eps, wd, fmt, seed] : groups)
               gs.push_back({o::AdamWConfig{lr, b1, b2, eps, wd}, o::parse_state_format(fmt), seed});
             std::vector<o::AdamWOverlap::Param> ps;
             for (const auto& [p, m1, m2, a1, a2, step, key, group, lo, hi] : params)
               ps.push_back({p, o::AdamWStates{m1, m2, a1.value_or(torch::Tensor()), a2.value_or(torch::Tensor())}, step,
                             key, group, lo, hi});
             return std::make_unique<o::AdamWOverlap>(std::move(engine), std::move(gs), std::move(ps), max_norm,
                                                      speculation_bytes, std::move(backups), keep_grads, loss_scale);
           }),
           py::arg("engine"), py::arg("groups"), py::arg("params"), py::arg("max_grad_norm"),
           py::arg("speculation_bytes"), py::arg("backups"), py::arg("keep_grads") = false,
           py::arg("loss_scale") = py::none())
      .def("wait", &o::AdamWOverlap::wait, py::call_guard<py::gil_scoped_release>())
      .def("settle", &settle_overlap<o::AdamWOverlap>, py::arg("other_sum_of_squares"), py::arg("skip") = false)
      .def_property("sum_of_squares", &o::AdamWOverlap::sum_of_squares, &o::AdamWOverlap::set_sum_of_squares)
      .def("abort", &o::AdamWOverlap::abort, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("layer_params", &o::AdamWOverlap::layer_params)
      .def_property_readonly("fused_params", &o::AdamWOverlap::fused_params);
  // One Adafactor step overlapped with a backward (AdafactorOverlap). groups: (config,
  // seed) with config the 10 values optim_adafactor_step starts with; params: (param,
  // exp_avg_sq_row, exp_avg_sq_col, exp_avg_sq, exp_avg (each or None), step, RMS tensor,
  // key, group, owned).
  using AfParamT = std::tuple<torch::Tensor, OptT, OptT, OptT, OptT, int64_t, torch::Tensor, uint64_t, size_t, bool>;
  py::class_<o::AdafactorOverlap>(m, "AdafactorOverlap")
      .def(py::init([af_config](std::shared_ptr<Engine> engine, const std::vector<std::pair<py::tuple, uint64_t>>& groups,
                                const std::vector<AfParamT>& params, std::optional<double> max_norm,
                                bool keep_grads, std::optional<double> loss_scale) {
             std::vector<o::AdafactorOverlap::Group> gs;
             for (const auto& [c, seed] : groups) {
               LS_CHECK(c.size() == 10, "internal: an Adafactor config has 10 values");
               gs.push_back({af_config(c[0], c[1].cast<double>(), c[2].cast<double>(), c[3].cast<double>(),
                                       c[4].cast<double>(), c[5], c[6].cast<double>(), c[7].cast<bool>(),
                                       c[8].cast<bool>(), c[9].cast<bool>()),
                             seed});
             }
             std::vector<o::AdafactorOverlap::Param> ps;
             for (const auto& [p, row, col, v, m1, step, rms, key, group, owned] : params)
               ps.push_back({p,
                             o::AdafactorStates{row.value_or(torch::Tensor()), col.value_or(torch::Tensor()),
                                                v.value_or(torch::Tensor()), m1.value_or(torch::Tensor())},
                             step, rms, key, group, owned});
             return std::make_unique<o::AdafactorOverlap>(std::move(engine), std::move(gs), std::move(ps), max_norm,
                                                          keep_grads, loss_scale);
           }),
           py::arg("engine"), py::arg("groups"), py::arg("params"), py::arg("max_grad_norm"),
           py::arg("keep_grads") = false, py::arg("loss_scale") = py::none())
      .def("wait", &o::AdafactorOverlap::wait, py::call_guard<py::gil_scoped_release>())
      .def_property("sum_of_squares", &o::AdafactorOverlap::sum_of_squares, &o::AdafactorOverlap::set_sum_of_squares)
      .def("settle", &settle_overlap<o::AdafactorOverlap>, py::arg("other_sum_of_squares"), py::arg("skip") = false)
      .def("abort", &o::AdafactorOverlap::abort, py::call_guard<py::gil_scoped_release>());
  m.attr("OVERLAP_STEPPED") = static_cast<int>(o::AdamWOverlap::kStepped);  // a plan's wait() status
  m.attr("OVERLAP_OTHER_RANK") = static_cast<int>(o::AdamWOverlap::kOtherRank);
  m.def("optim_q8_block", [] { return o::kQ8Block; });
  m.def("optim_kernel_isa", [] { return std::string(o::kernel_isa()); });
  m.def("optim_threads", [] { return o::ThreadPool::shared().threads(); });
  m.def("optim_set_threads", &o::ThreadPool::set_shared_threads, py::arg("threads"));
}

}  // namespace layerstream_bindings
