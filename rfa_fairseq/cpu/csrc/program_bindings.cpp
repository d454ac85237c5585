// The Python face of the decoder's program (decode_program.h) and of the native search (native_search.h): every
// tensor a call takes a pointer of is checked with the GIL held, then the GIL is released (threads that decode
// different parts of a batch run at once). Absent tensors are None.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <omp.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>

#include "decode_program.h"
#include "native_search.h"

namespace py = pybind11;

// MKL's per-thread thread count, its C interface (mkl_service.h's mkl_set_num_threads_local; the lower-case symbol is
// the Fortran one, which takes a pointer), exported by torch's x86 builds, which link MKL; absent elsewhere: weak
extern "C" int MKL_Set_Num_Threads_Local(int) __attribute__((weak));

void bind_decode_program(py::module_& m) {
  m.def(
      "limit_this_thread",
      [](int64_t threads) {
        TORCH_CHECK(threads > 0, "limit_this_thread: threads must be positive, got ", threads);
        // torch applies its global thread count to a thread on its first parallel call, once per library (the flag is
        // an inline function's thread_local: libtorch's copy and this module's): take both first, so that neither
        // undoes the limit later
        at::get_num_threads();
        at::internal::lazy_init_num_threads();
        omp_set_num_threads(static_cast<int>(threads));
        if (MKL_Set_Num_Threads_Local != nullptr) MKL_Set_Num_Threads_Local(static_cast<int>(threads));
      },
      py::arg("threads"),
      "the calling thread's OpenMP and MKL teams (torch's ops, the native step, its GEMMs) from now on: per-thread "
      "settings (the OpenMP ICV, MKL's local count), other threads keep theirs");
  py::class_<NativeBatch>(m, "NativeBatch")
      .def(py::init<const py::list&, const py::object&>(), py::arg("layer_caches"), py::arg("output") = py::none(),
           "a batch's caches (and its own output projection, a PackedLinear, or None: the runtime's)");
  py::class_<NativeSearch>(m, "NativeSearch")
      .def(py::init<const py::handle&>(), py::arg("record"),
           "the search's buffers and constants, read whole from its NativeSearchRecord (a field missing or unknown: "
           "an error naming it)")
      .def_static("fields", &NativeSearch::field_names, "the search record's fields, as the native search declares them");
  py::class_<SearchRun>(m, "SearchRun")
      .def_readonly("last_step", &SearchRun::last_step, "the last step run")
      .def_readonly("finished", &SearchRun::finished, "the places finished after it")
      .def_readonly("steps", &SearchRun::steps, "how many steps ran (the rows' parity turned once each)");
  py::class_<DecodeProgram>(m, "DecodeProgram")
      .def(py::init<const py::object&, std::shared_ptr<LinearLibrary>>(), py::arg("runtime"), py::arg("library"))
      .def(
          "decode",
          [](const DecodeProgram& program, const NativeBatch& batch, const at::Tensor& tokens,
             const std::optional<at::Tensor>& positions, const std::optional<at::Tensor>& order, int64_t read,
             bool first, bool padded_inputs, const std::optional<at::Tensor>& weights, int64_t beam) {
            program.check_decode(batch, tokens, or_undefined(positions), or_undefined(order), read, first,
                                 or_undefined(weights), beam);
            py::gil_scoped_release release;
            at::NoGradGuard no_grad;
            return program.decode(batch, tokens, or_undefined(positions), or_undefined(order), read, first,
                                  padded_inputs, or_undefined(weights), beam);
          },
          py::arg("batch"), py::arg("tokens"), py::arg("positions"), py::arg("order"), py::arg("read"),
          py::arg("first"), py::arg("padded_inputs"), py::arg("weights"), py::arg("beam"),
          "logits of one decoding step (decode_program.h)")
      .def(
          "start_sources",
          [](const DecodeProgram& program, const NativeBatch& batch, const at::Tensor& key,
             const std::optional<at::Tensor>& padding) {
            const at::Tensor mask = padding.has_value() ? padding->contiguous() : at::Tensor();
            program.check_sources(batch, key, mask);
            py::gil_scoped_release release;
            at::NoGradGuard no_grad;
            program.start_sources(batch, key, mask);
          },
          py::arg("batch"), py::arg("key"), py::arg("key_padding_mask"),
          "a batch's start: every softmax cross-attention layer's K, V and padding bias of the encoder output "
          "(decode_program.h)")
      .def(
          "search_step",
          [](const DecodeProgram& program, const NativeBatch& batch, NativeSearch& search, int64_t t, int64_t parity,
             bool first, bool last) {
            check_search(program, batch, search, t, t, parity, first);
            py::gil_scoped_release release;
            at::NoGradGuard no_grad;
            return search_step(program, batch, search, t, parity, first, last);
          },
          py::arg("batch"), py::arg("search"), py::arg("t"), py::arg("parity"), py::arg("first"), py::arg("last"),
          "the static beam search's whole step t (native_search.h) -> the places finished after it")
      .def(
          "search_choose",
          [](const DecodeProgram& program, NativeSearch& search, const at::Tensor& logits, int64_t t, int64_t parity,
             bool first, bool last) {
            check_search_logits(program, search, logits, t, parity, first);
            const std::vector<int64_t> live = live_places(search, first);
            TORCH_CHECK(logits.size(0) == static_cast<int64_t>(live.size()) * (first ? 1 : search.beam),
                        "rfa search choose: ", logits.size(0), " rows of logits for ", live.size(), " live places");
            py::gil_scoped_release release;
            return choose(program, search, logits, live, t, parity, first, last);
          },
          py::arg("search"), py::arg("logits"), py::arg("t"), py::arg("parity"), py::arg("first"), py::arg("last"),
          "the search's part of step t on given logits of the live places' rows (tests compare it with the torch "
          "search on the same logits)")
      .def(
          "search_steps",
          [](const DecodeProgram& program, const NativeBatch& batch, NativeSearch& search, int64_t t0, int64_t parity,
             bool first, int64_t last_step, int64_t max_len) {
            TORCH_CHECK(last_step <= max_len, "rfa search steps: the last step ", last_step, " is past max_len ",
                        max_len);
            TORCH_CHECK(first == (t0 == 0), "rfa search steps: step ", t0, " of a batch whose rows ",
                        first ? "start at step 0" : "have run steps");
            check_search(program, batch, search, t0, last_step, parity, first);
            py::gil_scoped_release release;
            at::NoGradGuard no_grad;
            return search_steps(program, batch, search, t0, parity, last_step, max_len);
          },
          py::arg("batch"), py::arg("search"), py::arg("t0"), py::arg("parity"), py::arg("first"),
          py::arg("last_step"), py::arg("max_len"),
          "the static beam search's steps from t0 (the rows' parity and first as the rows' account has them) until "
          "every place has finished or the last step, in one call (native_search.h) -> SearchRun, which the rows' "
          "account applies (BatchRows.steps_ran)");
}
