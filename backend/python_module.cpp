// lionbit._C: the backend class and a few build facts for Python.
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "backend/bits/isa.h"
#include "backend/kernel_bindings.hpp"
#include "backend/lionbit_backend.hpp"
#ifdef LIONBIT_WITH_CUDA
#include "backend/kernel_bindings_cuda.hpp"
#endif

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "lionbit: a c10d backend with a 1-bit sign all-reduce";
  // c10d::Backend and c10d::Work are registered by torch; make sure they are
  // before this module derives from them.
  py::module_::import("torch.distributed");

  py::class_<
      lionbit::LionBitBackend,
      c10d::Backend,
      c10::intrusive_ptr<lionbit::LionBitBackend>>(m, "LionBitBackend")
      .def(
          py::init([](const c10::intrusive_ptr<c10d::Backend>& forward,
                      const c10::intrusive_ptr<c10d::Backend>& sign,
                      int rank,
                      int size,
                      std::chrono::milliseconds timeout,
                      std::optional<c10::intrusive_ptr<c10d::Backend>> forward_cuda,
                      std::optional<c10::intrusive_ptr<c10d::Backend>> sign_cuda) {
            return c10::make_intrusive<lionbit::LionBitBackend>(
                forward, sign, rank, size, timeout,
                forward_cuda.value_or(c10::intrusive_ptr<c10d::Backend>()),
                sign_cuda.value_or(c10::intrusive_ptr<c10d::Backend>()));
          }),
          py::arg("forward"),
          py::arg("sign"),
          py::arg("rank"),
          py::arg("size"),
          py::arg("timeout"),
          py::arg("forward_cuda") = py::none(),
          py::arg("sign_cuda") = py::none())
      .def(
          "all_reduce_sign",
          &lionbit::LionBitBackend::allreduceSign,
          py::arg("tensor"),
          py::arg("op") = "vote",
          py::call_guard<py::gil_scoped_release>())
      .def(
          "all_reduce_sign_packed",
          &lionbit::LionBitBackend::allreduceSignPacked,
          py::arg("sign"),
          py::arg("zero"),
          py::arg("numel"),
          py::arg("nans"),
          py::arg("out"),
          py::arg("op") = "vote",
          py::call_guard<py::gil_scoped_release>())
      .def(
          "all_reduce_sign_packed_device",
          &lionbit::LionBitBackend::allreduceSignPackedDevice,
          py::arg("sign"),
          py::arg("zero"),
          py::arg("counts"),
          py::arg("numel"),
          py::arg("out"),
          py::arg("op") = "vote",
          py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("cuda_transport", &lionbit::LionBitBackend::cudaTransport)
      .def(
          "reduce_scatter_sign_packed",
          &lionbit::LionBitBackend::reduceScatterSignPacked,
          py::arg("sign"),
          py::arg("zero"),
          py::arg("shard_numel"),
          py::arg("nans"),
          py::arg("out"),
          py::arg("op") = "vote",
          py::call_guard<py::gil_scoped_release>())
      .def(
          "stats",
          [](lionbit::LionBitBackend& self) { return self.stats().snapshot(); })
      .def(
          "reset_stats",
          [](lionbit::LionBitBackend& self) { self.stats().reset(); })
      .def_property_readonly(
          "forward_backend", &lionbit::LionBitBackend::forwardBackend);

  m.attr("__version__") = LIONBIT_VERSION;
  m.attr("torch_version") = LIONBIT_TORCH_VERSION;
#ifdef LIONBIT_WITH_CUDA
  m.attr("built_with_cuda") = true;
#else
  m.attr("built_with_cuda") = false;
#endif
  m.def(
      "pack_signs_into",
      &lionbit::pack_signs_into,
      py::arg("t"),
      py::arg("sign"),
      py::arg("zero"),
      py::arg("bit_offset"));
  m.def(
      "lion_direction_into",
      &lionbit::lion_direction_into,
      py::arg("g"),
      py::arg("m"),
      py::arg("b1"),
      py::arg("omb1"),
      py::arg("b2"),
      py::arg("omb2"),
      py::arg("sign"),
      py::arg("zero"),
      py::arg("bit_offset"),
      py::arg("update_momentum") = true,
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "lion_apply",
      &lionbit::lion_apply,
      py::arg("x"),
      py::arg("delta"),
      py::arg("lr"),
      py::arg("decay"),
      py::call_guard<py::gil_scoped_release>());
  m.def("lion_fused_supported", &lionbit::lion_fused_supported);
#ifdef LIONBIT_WITH_CUDA
  m.def(
      "pack_signs_into_device",
      &lionbit::pack_signs_into_device,
      py::arg("t"),
      py::arg("sign"),
      py::arg("zero"),
      py::arg("counts"),
      py::arg("bit_offset"));
  m.def(
      "lion_direction_into_device",
      &lionbit::lion_direction_into_device,
      py::arg("g"),
      py::arg("m"),
      py::arg("b1"),
      py::arg("omb1"),
      py::arg("b2"),
      py::arg("omb2"),
      py::arg("sign"),
      py::arg("zero"),
      py::arg("counts"),
      py::arg("bit_offset"));
  m.def(
      "lion_apply_device",
      &lionbit::lion_apply_device,
      py::arg("x"),
      py::arg("delta"),
      py::arg("lr"),
      py::arg("decay"));
#endif
  m.def(
      "_shutdown_workers",
      &lionbit::LionBitBackend::shutdownAllWorkers,
      py::call_guard<py::gil_scoped_release>());
  m.def("cpu_isa", [] { return lionbit::bits::isa_name(lionbit::bits::default_isa()); });
}
