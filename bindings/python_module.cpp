// lionbit._C: the backend class, the kernels on tensors and a few build facts
// for Python.
#include <optional>

#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "signbits/count.h"
#include "signbits/isa.h"
#include "signbits/zeros.h"
#include "backend/phase2.hpp"
#include "bindings/kernel_bindings.hpp"
#include "bindings/storage_swap.hpp"
#include "backend/lionbit_backend.hpp"
#include "backend/sign_request.hpp"
#include "backend/sign_errors.hpp"
#ifdef LIONBIT_WITH_CUDA
#include "bindings/kernel_bindings_cuda.hpp"
#endif

namespace py = pybind11;

namespace lionbit {
namespace {

// The holder of Python's reference to a LionBitBackend. The backend's
// destructor joins threads (lionbit's worker, the inner Gloo backends') that
// may need the GIL to drop tensors Python shares, and torch may drop the
// last reference from Python with the GIL held (the object's deallocation,
// destroy_process_group, the interpreter's teardown): so the reference is
// released with the GIL let go, as torch binds its own backends.
template <typename T>
class ReleasedWithoutGil {
 public:
  ReleasedWithoutGil() = default;
  ReleasedWithoutGil(const ReleasedWithoutGil&) = default;
  ReleasedWithoutGil(ReleasedWithoutGil&&) noexcept = default;
  ReleasedWithoutGil& operator=(const ReleasedWithoutGil&) = default;
  ReleasedWithoutGil& operator=(ReleasedWithoutGil&&) noexcept = default;
  /* implicit */ ReleasedWithoutGil(c10::intrusive_ptr<T> p) : ptr_(std::move(p)) {}
  // pybind11 wraps an object it has just allocated through this one.
  explicit ReleasedWithoutGil(T* fresh)
      : ptr_(c10::intrusive_ptr<T>::unsafe_steal_from_new(fresh)) {}
  ~ReleasedWithoutGil() {
    if (!ptr_) {
      return;
    }
    if (Py_IsInitialized() != 0 && PyGILState_Check() != 0) {
      py::gil_scoped_release no_gil;
      ptr_.reset();
    } else {
      ptr_.reset();
    }
  }
  T* get() const noexcept { return ptr_.get(); }

 private:
  c10::intrusive_ptr<T> ptr_;
};

// Raises lionbit.errors.<name>(message, ranks) (a ValueError with .ranks).
void raise_ranks_error(const char* name, const RanksError& e) {
  const py::object cls = py::module_::import("lionbit.errors").attr(name);
  const py::object err = cls(e.what_without_backtrace(), e.ranks());
  PyErr_SetObject(cls.ptr(), err.ptr());
}

// The typed outcomes of backend/sign_errors.hpp as Python exceptions, wherever
// they surface: a Work's or a Future's wait(), or a direct call. Registered
// after torch's translators (this module imports torch first), so it sees
// them before torch turns every c10::ValueError into a plain ValueError.
void translate_outcomes(std::exception_ptr p) {
  try {
    if (p) {
      std::rethrow_exception(p);
    }
  } catch (const NonFiniteInputError& e) {
    raise_ranks_error("NonFiniteInput", e);
  } catch (const PeerRejectedError& e) {
    raise_ranks_error("PeerRejected", e);
  }
}

// A lionbit backend's options as Python sees them (`backend.options`):
// torch's own, with a copy. torch 2.11's split_group deep-copies the parent
// backend's options before handing them to the split, and torch binds its
// Options class without one.
struct CopyableOptions : c10d::Backend::Options {
  explicit CopyableOptions(const c10d::Backend::Options& o) : c10d::Backend::Options(o) {}
};

// A split's child (LionBitBackend::split), made by lionbit's Python creator
// as new_group's backends are: the inner Gloo and NCCL communicators over
// `store`. torch may call split with the GIL held or released.
c10::intrusive_ptr<LionBitBackend> make_split_child(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    std::chrono::milliseconds timeout,
    const std::vector<int>& global_ranks) {
  py::gil_scoped_acquire gil;
  const py::object made = py::module_::import("lionbit._backend")
                              .attr("backend_over")(store, rank, size, timeout, global_ranks);
  return c10::intrusive_ptr<LionBitBackend>::reclaim_copy(made.cast<LionBitBackend*>());
}

} // namespace
} // namespace lionbit

PYBIND11_DECLARE_HOLDER_TYPE(T, lionbit::ReleasedWithoutGil<T>, true);

PYBIND11_MODULE(_C, m) {
  m.doc() = "lionbit: a c10d backend with a 1-bit sign all-reduce";
  // c10d::Backend and c10d::Work are registered by torch; make sure they are
  // before this module derives from them.
  py::module_::import("torch.distributed");
  py::register_exception_translator(&lionbit::translate_outcomes);
  lionbit::LionBitBackend::setMaker(&lionbit::make_split_child);

  // One sign collective, described (backend/sign_request.hpp): the one way
  // Python calls the sign path, LionBitBackend.call(request). The entry
  // points users and tests call by name fill one (python/lionbit/_backend.py).
  py::class_<lionbit::SignRequest>(m, "SignRequest")
      .def(
          py::init([](const std::string& collective, std::string op, std::string tie_break,
                      int64_t tie_seed, std::string hierarchy, std::optional<at::Tensor> tensor,
                      std::optional<at::Tensor> sign, std::optional<at::Tensor> zero,
                      std::optional<at::Tensor> planes, int64_t value_bits, int64_t numel,
                      int64_t nans, std::optional<at::Tensor> out, bool out_planes,
                      std::optional<at::Tensor> nans_tally,
                      std::optional<std::shared_ptr<lionbit::Agreement>> agreement) {
            lionbit::Collective kind;
            if (collective == "all_reduce") {
              kind = lionbit::Collective::kAllReduce;
            } else if (collective == "reduce_scatter") {
              kind = lionbit::Collective::kReduceScatter;
            } else {
              throw py::value_error(
                  "lionbit.SignRequest: argument 'collective' is '" + collective +
                  "'; expected 'all_reduce' or 'reduce_scatter'");
            }
            lionbit::SignRequest r{
                kind, std::move(op), std::move(tie_break), tie_seed, std::move(hierarchy)};
            r.tensor = tensor.value_or(at::Tensor());
            r.sign = sign.value_or(at::Tensor());
            r.zero = zero.value_or(at::Tensor());
            r.planes = planes.value_or(at::Tensor());
            r.value_bits = value_bits;
            r.numel = numel;
            r.nans = nans;
            r.out = out.value_or(at::Tensor());
            r.out_planes = out_planes;
            r.nans_tally = nans_tally.value_or(at::Tensor());
            r.agreement = agreement.value_or(nullptr);
            return r;
          }),
          py::kw_only(), py::arg("collective"), py::arg("op") = "vote",
          py::arg("tie_break") = "zero", py::arg("tie_seed") = -1, py::arg("hierarchy") = "flat",
          py::arg("tensor") = py::none(), py::arg("sign") = py::none(),
          py::arg("zero") = py::none(), py::arg("planes") = py::none(), py::arg("value_bits") = 0,
          py::arg("numel") = 0, py::arg("nans") = 0, py::arg("out") = py::none(),
          py::arg("out_planes") = false, py::arg("nans_tally") = py::none(),
          py::arg("agreement") = py::none());

  // A call's agreement (backend/agreement.hpp): pass one in a SignRequest,
  // then wait() (without the GIL) for every rank's header round to agree,
  // or for the call's error where it failed first.
  py::class_<lionbit::Agreement, std::shared_ptr<lionbit::Agreement>>(m, "Agreement")
      .def(py::init<>())
      .def("wait", &lionbit::Agreement::wait, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("at_header", &lionbit::Agreement::at_header);

  py::class_<
      lionbit::CopyableOptions, c10d::Backend::Options,
      c10::intrusive_ptr<lionbit::CopyableOptions>>(m, "BackendOptions")
      .def("__deepcopy__", [](const lionbit::CopyableOptions& self, const py::dict& /* memo */) {
        return c10::make_intrusive<lionbit::CopyableOptions>(self);
      });

  py::class_<
      lionbit::LionBitBackend, c10d::Backend, lionbit::ReleasedWithoutGil<lionbit::LionBitBackend>>(
      m, "LionBitBackend")
      .def(
          py::init([](const c10::intrusive_ptr<c10d::Backend>& forward,
                      const c10::intrusive_ptr<c10d::Backend>& sign, int rank, int size,
                      std::chrono::milliseconds timeout,
                      std::optional<c10::intrusive_ptr<c10d::Backend>> forward_cuda,
                      std::optional<c10::intrusive_ptr<c10d::Backend>> sign_cuda,
                      const std::vector<int>& global_ranks) {
            return lionbit::ReleasedWithoutGil<lionbit::LionBitBackend>(
                c10::make_intrusive<lionbit::LionBitBackend>(
                    forward, sign, rank, size, timeout,
                    forward_cuda.value_or(c10::intrusive_ptr<c10d::Backend>()),
                    sign_cuda.value_or(c10::intrusive_ptr<c10d::Backend>()), global_ranks));
          }),
          py::arg("forward"), py::arg("sign"), py::arg("rank"), py::arg("size"), py::arg("timeout"),
          py::arg("forward_cuda") = py::none(), py::arg("sign_cuda") = py::none(),
          py::arg("global_ranks") = std::vector<int>{})
      .def(
          "call", &lionbit::LionBitBackend::call, py::arg("request"),
          py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("cuda_transport", &lionbit::LionBitBackend::cudaTransport)
      .def(
          "set_hierarchy", &lionbit::LionBitBackend::setHierarchy, py::arg("node"),
          py::arg("cross"), py::arg("order"), py::arg("node_ranks"))
      .def_property_readonly("has_hierarchy", &lionbit::LionBitBackend::hasHierarchy)
      .def("hierarchy_stats", &lionbit::LionBitBackend::hierarchyStats)
      .def("reset_hierarchy_stats", &lionbit::LionBitBackend::resetHierarchyStats)
      .def("stats", [](lionbit::LionBitBackend& self) { return self.stats().snapshot(); })
      .def("reset_stats", [](lionbit::LionBitBackend& self) { self.stats().reset(); })
      // What torch 2.11's split_group copies (copy.deepcopy) and hands the
      // split (torch 2.15 binds it on every backend).
      .def_property_readonly(
          "options",
          [](lionbit::LionBitBackend& self) {
            return c10::make_intrusive<lionbit::CopyableOptions>(*self.getBackendOptions());
          })
      // new_group's ranks outside the new group call this on a parent that
      // supports splitting (so that NCCL's split of the parent's
      // communicator sees every rank); lionbit's groups never split their
      // parent's communicators, so there is nothing to take part in.
      .def(
          "perform_nocolor_split", [](lionbit::LionBitBackend&, const py::object&) {},
          py::arg("device"));

  m.attr("__version__") = LIONBIT_VERSION;
  m.attr("torch_version") = LIONBIT_TORCH_VERSION;
#ifdef LIONBIT_WITH_CUDA
  m.attr("built_with_cuda") = true;
#else
  m.attr("built_with_cuda") = false;
#endif
  m.def(
      "pack_signs_into", &lionbit::pack_signs_into, py::arg("t"), py::arg("sign"), py::arg("zero"),
      py::arg("bit_offset"), py::call_guard<py::gil_scoped_release>());
  m.def(
      "lion_direction_into", &lionbit::lion_direction_into, py::arg("g"), py::arg("m"),
      py::arg("b1"), py::arg("omb1"), py::arg("b2"), py::arg("omb2"), py::arg("sign"),
      py::arg("zero"), py::arg("bit_offset"), py::arg("update_momentum") = true,
      py::arg("m_out") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def(
      "lion_apply", &lionbit::lion_apply, py::arg("x"), py::arg("delta"), py::arg("lr"),
      py::arg("decay"), py::call_guard<py::gil_scoped_release>());
  m.def(
      "lion_apply_planes", &lionbit::lion_apply_planes, py::arg("x"), py::arg("sign"),
      py::arg("zero"), py::arg("bit_offset"), py::arg("lr"), py::arg("decay"),
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "lion_direction_list", &lionbit::lion_direction_list, py::arg("gs"), py::arg("ms"),
      py::arg("b1"), py::arg("omb1"), py::arg("b2"), py::arg("omb2"), py::arg("sign"),
      py::arg("zero"), py::arg("bit_offsets"), py::arg("update_momentum"),
      py::arg("starts") = py::none(), py::arg("lengths") = py::none(),
      py::arg("m_outs") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def(
      "lion_apply_list", &lionbit::lion_apply_list, py::arg("xs"), py::arg("deltas"), py::arg("lr"),
      py::arg("decay"), py::call_guard<py::gil_scoped_release>());
  m.def(
      "lion_apply_planes_list", &lionbit::lion_apply_planes_list, py::arg("xs"), py::arg("sign"),
      py::arg("zero"), py::arg("bit_offsets"), py::arg("lr"), py::arg("decay"),
      py::arg("starts") = py::none(), py::arg("lengths") = py::none(),
      py::call_guard<py::gil_scoped_release>());
  m.def("lion_fused_supported", &lionbit::lion_fused_supported);
  m.def(
      "swap_storages", &lionbit::swap_storages, py::arg("tensors"), py::arg("buffers"),
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "pack_levels_into", &lionbit::pack_levels_into, py::arg("c"), py::arg("factor"),
      py::arg("bits"), py::arg("planes"), py::arg("bit_offset"),
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "lion_level_abs_sum", &lionbit::lion_level_abs_sum, py::arg("g"), py::arg("m"), py::arg("b1"),
      py::arg("omb1"), py::call_guard<py::gil_scoped_release>());
  m.def(
      "lion_pack_levels_into", &lionbit::lion_pack_levels_into, py::arg("g"), py::arg("m"),
      py::arg("b1"), py::arg("omb1"), py::arg("b2"), py::arg("omb2"), py::arg("factor"),
      py::arg("bits"), py::arg("planes"), py::arg("bit_offset"), py::arg("update_momentum") = false,
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "tie_words", &lionbit::tie_words, py::arg("words"), py::arg("tie_break"), py::arg("seed"),
      py::arg("first_word") = 0);
#ifdef LIONBIT_WITH_CUDA
  m.def(
      "lion_direction_into_device", &lionbit::lion_direction_into_device, py::arg("g"),
      py::arg("m"), py::arg("b1"), py::arg("omb1"), py::arg("b2"), py::arg("omb2"), py::arg("sign"),
      py::arg("zero"), py::arg("counts"), py::arg("bit_offset"), py::arg("update_momentum") = true,
      py::arg("m_out") = py::none());
  m.def(
      "lion_apply_device", &lionbit::lion_apply_device, py::arg("x"), py::arg("delta"),
      py::arg("lr"), py::arg("decay"));
  m.def(
      "lion_direction_list_device", &lionbit::lion_direction_list_device, py::arg("gs"),
      py::arg("ms"), py::arg("b1"), py::arg("omb1"), py::arg("b2"), py::arg("omb2"),
      py::arg("sign"), py::arg("zero"), py::arg("counts"), py::arg("bit_offsets"),
      py::arg("update_momentum"), py::arg("starts") = py::none(), py::arg("lengths") = py::none(),
      py::arg("m_outs") = py::none());
  m.def(
      "lion_apply_list_device", &lionbit::lion_apply_list_device, py::arg("xs"), py::arg("deltas"),
      py::arg("lr"), py::arg("decay"));
  m.def(
      "lion_apply_planes_list_device", &lionbit::lion_apply_planes_list_device, py::arg("xs"),
      py::arg("sign"), py::arg("zero"), py::arg("bit_offsets"), py::arg("lr"), py::arg("decay"),
      py::arg("starts") = py::none(), py::arg("lengths") = py::none());
#endif
  m.def(
      "_shutdown_workers", &lionbit::LionBitBackend::shutdownAllWorkers,
      py::call_guard<py::gil_scoped_release>());
  m.def("cpu_isa", [] { return lionbit::bits::isa_name(lionbit::bits::default_isa()); });
  m.def(
      "check_kernel_sets", &lionbit::check_kernel_sets, py::arg("candidate"), py::arg("reference"),
      py::arg("device") = "cpu", py::arg("seed") = 0, py::call_guard<py::gil_scoped_release>());
  m.def("kernel_set_name", &lionbit::kernel_set_name, py::arg("device"));
  // The wire's layout as the collectives compute it, for lionbit.estimate's
  // statement of it to be checked against (tests/python/test_wire_model.py).
  m.def(
      "wire_layout",
      [](uint64_t numel, int world_size, uint64_t chunk_request, bool gpu) {
        TORCH_CHECK_VALUE(world_size > 0, "wire_layout: world_size must be positive");
        namespace bits = lionbit::bits;
        const uint64_t fallback = bits::default_chunk_elems(world_size, gpu);
        const uint64_t chunk = bits::chunk_elems_for(
            chunk_request > 0 ? chunk_request : fallback, world_size);
        const uint64_t chunks = (numel + chunk - 1) / chunk;
        const uint64_t last = numel - (chunks > 0 ? (chunks - 1) * chunk : 0);
        const size_t sw = bits::shard_words(std::min(numel, chunk), world_size);
        auto bytes = [&](lionbit::Phase2Format f, int planes) {
          lionbit::Phase2 p{f, world_size, sw, planes};
          return p.message_bytes();
        };
        py::dict d;
        d["default_chunk_elems"] = fallback;
        d["chunk_elems"] = chunk;
        d["chunks"] = chunks;
        d["shard_words"] = sw;
        d["last_shard_words"] = bits::shard_words(last, world_size);
        d["header_bytes"] = sizeof(bits::WireHeader);
        d["vote_message_bytes"] = bytes(lionbit::Phase2Format::kVoteSigns, 0);
        d["trit_message_bytes"] = bytes(lionbit::Phase2Format::kVoteTrits, 0);
        d["count_planes"] = bits::code_planes(world_size, false);
        d["count_message_bytes"] = bytes(
            lionbit::Phase2Format::kCounts, bits::code_planes(world_size, false));
        return d;
      },
      py::arg("numel"), py::arg("world_size"), py::arg("chunk_request") = 0,
      py::arg("gpu") = false);
  m.def(
      "zero_encoding_bytes",
      [](uint64_t capacity, size_t words, std::optional<uint64_t> runs, uint64_t packed) {
        return lionbit::bits::zero_encoding_bytes(
            lionbit::bits::ZeroCode{capacity, runs.value_or(capacity), packed}, words);
      },
      py::arg("capacity"), py::arg("words"), py::arg("runs") = py::none(), py::arg("packed") = 0);
}
