// gridweave._C: pybind11 bindings of the native core. No torch here: Python hands
// in raw pointers, counts, dtypes and streams (python/gridweave/_buffers.py).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <tuple>

#include "communicator.h"
#include "cube.h"
#include "ring.h"
#include "pipeline.h"
#include <pybind11/functional.h>

#include "error.h"
#include "grid.h"
#include "placement.h"
#include "registry.h"
#include "store.h"
#include "traffic.h"

namespace py = pybind11;
using namespace gridweave;

namespace {

std::chrono::milliseconds to_ms(double seconds) {
  return std::chrono::milliseconds(static_cast<long long>(seconds * 1000.0));
}

// A Store implemented in Python (an adapter over torch's TCPStore).
class PyStore : public Store {
 public:
  void set(const std::string& key, const std::vector<char>& value) override {
    py::gil_scoped_acquire gil;
    call("set", key, py::bytes(value.data(), value.size()));
  }
  void set_within(const std::string& key, const std::vector<char>& value, std::chrono::milliseconds timeout) override {
    py::gil_scoped_acquire gil;
    if (py::get_override(static_cast<const Store*>(this), "set_within"))
      call("set_within", key, py::bytes(value.data(), value.size()), timeout.count() / 1000.0);
    else  // a store of the user's: its own set
      call("set", key, py::bytes(value.data(), value.size()));
  }
  std::vector<char> get(const std::string& key, std::chrono::milliseconds timeout) override {
    py::gil_scoped_acquire gil;
    std::string s = call("get", key, timeout.count() / 1000.0).cast<std::string>();
    return std::vector<char>(s.begin(), s.end());
  }
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    py::gil_scoped_acquire gil;
    call("wait", keys, timeout.count() / 1000.0);
  }

 private:
  template <typename... Args>
  py::object call(const char* name, Args&&... args) {
    py::function f = py::get_override(static_cast<const Store*>(this), name);
    if (!f) throw Error(ErrorKind::Config, std::string("gridweave: Store subclass does not define ") + name);
    try {
      return f(std::forward<Args>(args)...);
    } catch (py::error_already_set& e) {
      std::string msg = e.what();
      bool timeout = msg.find("imeout") != std::string::npos || msg.find("imed out") != std::string::npos;
      throw Error(timeout ? ErrorKind::Timeout : ErrorKind::Comm,
                  std::string("gridweave: rendezvous store ") + name + " failed: " + msg);
    }
  }
};

BufferView make_view(std::uintptr_t ptr, std::size_t count, DType dtype, Device device, int device_index,
                     std::uintptr_t stream) {
  BufferView v;
  v.ptr = reinterpret_cast<void*>(ptr);
  v.count = count;
  v.dtype = dtype;
  v.device = device;
  v.device_index = device_index;
  v.stream = reinterpret_cast<void*>(stream);
  return v;
}

// Host memory (the one-call synchronous ops below).
BufferView host(std::uintptr_t ptr, std::size_t count, DType dtype) {
  return make_view(ptr, count, dtype, Device::CPU, -1, 0);
}

py::dict tally(const Tally& t) {
  py::dict d;
  d["messages"] = t.messages;
  d["bytes"] = t.bytes;
  return d;
}

py::dict traffic_dict(const TrafficModel& t) {
  py::dict d;
  d["messages"] = t.messages;
  d["intra_messages"] = t.intra_messages;
  d["inter_messages"] = t.inter_messages;
  d["bytes"] = t.bytes;
  d["intra_bytes"] = t.intra_bytes;
  d["inter_bytes"] = t.inter_bytes;
  return d;
}

std::vector<Axis> to_axes(const std::vector<std::pair<std::string, int>>& axes) {
  std::vector<Axis> out;
  for (const auto& a : axes) out.push_back({a.first, a.second});
  return out;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "gridweave native engine";

  // Errors map to gridweave.errors: GridError (ValueError), CommError, CommTimeout.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      const char* name = e.kind() == ErrorKind::Config ? "GridError"
                         : e.kind() == ErrorKind::Timeout ? "CommTimeout" : "CommError";
      // Every engine error reaches Python here: a communication failure dumps the flight
      // recorders (a grid's dump says nothing twice; its first failure stays the reason).
      if (e.kind() != ErrorKind::Config) {
        py::gil_scoped_release nogil;  // a dump writes a file; other threads may run meanwhile
        Grid::flight_dump_all(std::string(name) + ": " + e.what());  // the grids not shut down
      }
      py::object cls = py::module_::import("gridweave.errors").attr(name);
      PyErr_SetString(cls.ptr(), e.what());
    }
  });

  // The typed enums that cross the boundary: one definition each (cpp/dtype.h, cube.h, pipeline.h).
  py::enum_<DType>(m, "DType")
      .value("Float32", DType::Float32)
      .value("Float64", DType::Float64)
      .value("Float16", DType::Float16)
      .value("BFloat16", DType::BFloat16)
      .value("Int32", DType::Int32)
      .value("Int64", DType::Int64)
      .value("UInt8", DType::UInt8);
  py::enum_<CheckLevel>(m, "CheckLevel").value("Cheap", CheckLevel::Cheap).value("Detail", CheckLevel::Detail);
  py::enum_<Device>(m, "Device").value("CPU", Device::CPU).value("CUDA", Device::CUDA);
  py::enum_<ReduceOp>(m, "ReduceOp").value("Sum", ReduceOp::Sum).value("Max", ReduceOp::Max).value("Min", ReduceOp::Min);
  py::enum_<CubeForm>(m, "CubeForm").value("AB", CubeForm::AB).value("ABt", CubeForm::ABt).value("AtB", CubeForm::AtB);
  py::enum_<Emulation>(m, "Emulation").value("Off", Emulation::None).value("Nccl", Emulation::Nccl);
  // The point-to-point kinds a batch holds (torch's "isend" / "irecv").
  py::enum_<OpKind>(m, "OpKind").value("Send", OpKind::Send).value("Recv", OpKind::Recv);
  py::class_<P2P>(m, "P2P")
      .def(py::init([](OpKind op, const BufferView& buf, int peer, int tag) { return P2P{op, buf, peer, tag}; }),
           py::arg("op"), py::arg("buffer"), py::arg("peer"), py::arg("tag") = 0);
  py::enum_<PipelineSchedule>(m, "PipelineSchedule")
      .value("MessageDriven", PipelineSchedule::MessageDriven)
      .value("OneFOneB", PipelineSchedule::OneFOneB)
      .value("Interleaved", PipelineSchedule::Interleaved);
  py::enum_<ReceiveStrategy>(m, "ReceiveStrategy")
      .value("Auto", ReceiveStrategy::Auto)
      .value("Any", ReceiveStrategy::Any)
      .value("PerPeer", ReceiveStrategy::PerPeer)
      .value("Announced", ReceiveStrategy::Announced);

  // What extensions registered while the module loaded (cuda/register.cu when built).
  m.attr("nccl_available") = transport_available(Backend::Nccl);
  m.attr("mpi_available") = transport_available(Backend::Mpi);
  // The MPI world (mpi/ registers it): initialises MPI unless someone already has.
  m.def("mpi_world", []() {
    const WorldRuntime* rt = mpi_runtime();
    GW_CHECK(rt != nullptr, "backend 'mpi' requested but gridweave was built without MPI (install an MPI, e.g. "
                            "apt-get install libopenmpi-dev, and rebuild)");
    return rt->rank_and_size();
  });
  m.def("mpi_finalize", []() {
    if (const WorldRuntime* rt = mpi_runtime()) rt->finalize();
  });
  m.attr("cuda_kernels") = lse_merge_kernel() != nullptr;
  // The ring-attention merge kernel (cuda/lse_merge.cu) on device pointers.
  m.def("lse_merge", [](std::uintptr_t out, std::uintptr_t lse, std::uintptr_t blk, std::uintptr_t blk_lse,
                        long long rows, long long dim, DType dtype, std::uintptr_t stream) {
    const LseMergeKernel* k = lse_merge_kernel();
    GW_CHECK(k != nullptr, "lse_merge: gridweave was built without its CUDA kernels");
    (*k)(reinterpret_cast<void*>(out), reinterpret_cast<void*>(lse), reinterpret_cast<const void*>(blk),
         reinterpret_cast<const void*>(blk_lse), rows, dim, dtype, reinterpret_cast<void*>(stream));
  });

  py::class_<Store, PyStore, std::shared_ptr<Store>>(m, "Store").def(py::init<>());
  // The messages one member sends and receives in an op, as the traffic counters count them
  // (the planner predicts a step's counters from it: one schedule, cpp/traffic.cpp).
  m.def("message_schedule", [](const std::string& op, int size, int member, std::uint64_t nbytes, int root,
                               int elem_size) {
    std::vector<std::tuple<int, std::uint64_t, bool>> out;
    for (const Message& msg : schedule(op_from_name(op), size, member, nbytes, root, elem_size))
      out.emplace_back(msg.peer, msg.bytes, msg.send);
    return out;
  }, py::arg("op"), py::arg("size"), py::arg("member"), py::arg("nbytes"), py::arg("root") = 0,
     py::arg("elem_size") = 1);
  m.def("file_store", &make_file_store, py::arg("path"));
  m.def("prefix_store", &make_prefix_store, py::arg("prefix"), py::arg("store"));

  py::class_<BufferView>(m, "BufferView")
      .def(py::init(&make_view), py::arg("ptr"), py::arg("count"), py::arg("dtype"), py::arg("device") = Device::CPU,
           py::arg("device_index") = -1, py::arg("stream") = 0)
      .def_property_readonly("nbytes", &BufferView::nbytes)
      .def_readonly("count", &BufferView::count);

  py::class_<Work, std::shared_ptr<Work>>(m, "Work")
      .def("test", &Work::test)
      // stream: a CUDA stream handle (torch.cuda.current_stream().cuda_stream; 0 is the legacy
      // default stream) that waits for the op, as torch's Work.wait() orders the current stream;
      // None: the stream that issued the op waits. Host transports ignore it.
      .def("wait", [](Work& w, double timeout_s, std::optional<std::uintptr_t> stream) {
        py::gil_scoped_release nogil;
        if (stream) w.wait_on(reinterpret_cast<void*>(*stream), to_ms(timeout_s));
        else w.wait(to_ms(timeout_s));
      }, py::arg("timeout_s"), py::arg("stream") = py::none())
      .def_property_readonly("source", &Work::source)
      .def("wait_host", [](Work& w, double timeout_s) {  // the host blocks until the op is done (a barrier)
        py::gil_scoped_release nogil;
        w.wait_host(to_ms(timeout_s));
      }, py::arg("timeout_s"))
      .def_property_readonly("stream", [](const Work& w) { return reinterpret_cast<std::uintptr_t>(w.stream()); })
      .def_property_readonly("what", &Work::what);

  using C = Communicator;
  using V = const BufferView&;
  using P = std::uintptr_t;  // a host pointer
  using N = std::size_t;     // its element count
  py::class_<C, std::shared_ptr<C>>(m, "Communicator")
      .def_property_readonly("rank", &C::rank)
      .def_property_readonly("size", &C::size)
      .def_property_readonly("members", [](const C& c) { return c.info().members; })
      .def_property_readonly("axis", [](const C& c) { return c.info().axis; })
      .def_property_readonly("backend", &C::backend)
      .def_property_readonly("can_recv_any", &C::can_recv_any)
      .def_property_readonly("survives_peer_failure", &C::survives_peer_failure)
      .def_property_readonly("matches_fingerprints", &C::matches_fingerprints)
      .def_property_readonly("stream_ordered", &C::stream_ordered)
      .def_property_readonly("matches_tags", &C::matches_tags)
      .def_property_readonly("device", &C::device)  // the memory its buffers must be in
      .def("all_gather", [](C& c, V i, V o, bool a) { py::gil_scoped_release g; return c.all_gather(i, o, a); },
           py::arg("input"), py::arg("output"), py::arg("async_op") = true)
      .def("reduce_scatter", [](C& c, V i, V o, ReduceOp r, bool a) { py::gil_scoped_release g; return c.reduce_scatter(i, o, r, a); },
           py::arg("input"), py::arg("output"), py::arg("op"), py::arg("async_op") = true)
      .def("all_reduce", [](C& c, V b, ReduceOp r, bool a) { py::gil_scoped_release g; return c.all_reduce(b, r, a); },
           py::arg("buffer"), py::arg("op"), py::arg("async_op") = true)
      .def("broadcast", [](C& c, V b, int root, bool a) { py::gil_scoped_release g; return c.broadcast(b, root, a); },
           py::arg("buffer"), py::arg("root"), py::arg("async_op") = true)
      .def("reduce", [](C& c, V b, ReduceOp r, int root, bool a) { py::gil_scoped_release g; return c.reduce(b, r, root, a); },
           py::arg("buffer"), py::arg("op"), py::arg("root"), py::arg("async_op") = true)
      .def("scatter", [](C& c, V i, V o, int root, bool a) { py::gil_scoped_release g; return c.scatter(i, o, root, a); },
           py::arg("input"), py::arg("output"), py::arg("root"), py::arg("async_op") = true)
      .def("gather", [](C& c, V i, V o, int root, bool a) { py::gil_scoped_release g; return c.gather(i, o, root, a); },
           py::arg("input"), py::arg("output"), py::arg("root"), py::arg("async_op") = true)
      .def("all_to_all", [](C& c, V i, V o, bool a) { py::gil_scoped_release g; return c.all_to_all(i, o, a); },
           py::arg("input"), py::arg("output"), py::arg("async_op") = true)
      .def("send", [](C& c, V b, int peer, int tag) { py::gil_scoped_release g; return c.send(b, peer, tag); })
      .def("recv", [](C& c, V b, int peer, int tag) { py::gil_scoped_release g; return c.recv(b, peer, tag); })
      .def("recv_any", [](C& c, V b, const std::vector<int>& peers, int tag) { py::gil_scoped_release g; return c.recv_any(b, peers, tag); })
      .def("barrier", [](C& c, bool a) { py::gil_scoped_release g; return c.barrier(a); }, py::arg("async_op") = true)
      .def("batch", [](C& c, const std::vector<P2P>& ops) { py::gil_scoped_release g; return c.batch(ops); })
      // Synchronous ops on contiguous host memory in one native call each: issue, then wait
      // with the GIL released once; no BufferView or Work object is made (the per-op CPU
      // cost is what bounds small collectives when ranks share cores). Same checks as above.
      .def("all_gather_host", [](C& c, P i, N ni, P o, N no, DType d, double t) {
        py::gil_scoped_release g;
        c.all_gather(host(i, ni, d), host(o, no, d), false)->wait(to_ms(t));
      }, py::arg("input"), py::arg("input_count"), py::arg("output"), py::arg("output_count"), py::arg("dtype"),
         py::arg("timeout_s"))
      .def("reduce_scatter_host", [](C& c, P i, N ni, P o, N no, DType d, ReduceOp r, double t) {
        py::gil_scoped_release g;
        c.reduce_scatter(host(i, ni, d), host(o, no, d), r, false)->wait(to_ms(t));
      }, py::arg("input"), py::arg("input_count"), py::arg("output"), py::arg("output_count"), py::arg("dtype"),
         py::arg("op"), py::arg("timeout_s"))
      .def("all_reduce_host", [](C& c, P b, N n, DType d, ReduceOp r, double t) {
        py::gil_scoped_release g;
        c.all_reduce(host(b, n, d), r, false)->wait(to_ms(t));
      }, py::arg("buffer"), py::arg("count"), py::arg("dtype"), py::arg("op"), py::arg("timeout_s"))
      .def("broadcast_host", [](C& c, P b, N n, DType d, int root, double t) {
        py::gil_scoped_release g;
        c.broadcast(host(b, n, d), root, false)->wait(to_ms(t));
      }, py::arg("buffer"), py::arg("count"), py::arg("dtype"), py::arg("root"), py::arg("timeout_s"))
      .def_property_readonly("issued", &C::issued);

  py::class_<Placement>(m, "Placement")
      .def(py::init([](const std::vector<std::pair<std::string, int>>& axes, const std::string& policy, int rpn) {
             GW_CHECK(policy == "naive" || policy == "topology",
                      "placement must be 'naive' or 'topology', got '" << policy << "'");
             return Placement(to_axes(axes), policy == "naive" ? PlacementPolicy::Naive : PlacementPolicy::Topology, rpn);
           }), py::arg("axes"), py::arg("policy"), py::arg("ranks_per_node"))
      .def_property_readonly("world_size", &Placement::world_size)
      .def_property_readonly("ranks_per_node", &Placement::ranks_per_node)
      .def_property_readonly("physical_order", &Placement::physical_order)
      .def("coords_of", &Placement::coords_of)
      .def("rank_of", &Placement::rank_of)
      .def("node_of", &Placement::node_of)
      .def("line", &Placement::line)
      .def("index_in_line", &Placement::index_in_line)
      .def("traffic", [](const Placement& p, const std::vector<std::string>& axes, const std::string& op,
                         long long nbytes) { return traffic_dict(segmented_traffic(p, axes, op, nbytes)); });

  py::class_<Ring>(m, "Ring")
      .def(py::init<std::shared_ptr<Communicator>>())
      .def_property_readonly("size", &Ring::size)
      .def_property_readonly("rank", &Ring::rank)
      .def_property_readonly("next", &Ring::next)
      .def_property_readonly("prev", &Ring::prev)
      .def("source_at", &Ring::source_at)
      .def("exchange", [](Ring& r, const std::vector<BufferView>& send, const std::vector<BufferView>& recv, int step) {
        py::gil_scoped_release nogil;
        return r.exchange(send, recv, step);
      });

  // Pipeline schedules (AxoNN Algorithm 2; Megatron-LM 1F1B). Callbacks take
  // (microbatch, input address or 0) and return the address of the bytes to send, which are sent
  // in place: `sent(address)` says when they are no longer read (their send is done).
  py::class_<PipelineStats>(m, "PipelineStats")
      .def_readonly("forwards", &PipelineStats::forwards)
      .def_readonly("backwards", &PipelineStats::backwards)
      .def_readonly("messages", &PipelineStats::messages)
      .def_readonly("compute_s", &PipelineStats::compute_s)
      .def_readonly("wait_s", &PipelineStats::wait_s)
      // payload copies made for the messages: the engine makes none; gw.pipeline adds its callbacks'
      .def_readwrite("copies", &PipelineStats::copies)
      .def_readwrite("copied_bytes", &PipelineStats::copied_bytes)
      .def_readonly("posted_ahead", &PipelineStats::posted_ahead)
      .def_readonly("weights", &PipelineStats::weights);
  py::class_<StageLinks>(m, "StageLinks")
      .def(py::init([](std::shared_ptr<Communicator> to_next, std::shared_ptr<Communicator> from_prev,
                       std::shared_ptr<Communicator> to_prev, std::shared_ptr<Communicator> from_next,
                       std::shared_ptr<Communicator> act_to_prev, std::shared_ptr<Communicator> act_from_next,
                       std::shared_ptr<Communicator> grad_to_next, std::shared_ptr<Communicator> grad_from_prev) {
             return StageLinks{std::move(to_next),     std::move(from_prev),     std::move(to_prev),
                               std::move(from_next),   std::move(act_to_prev),   std::move(act_from_next),
                               std::move(grad_to_next), std::move(grad_from_prev)};
           }), py::arg("to_next") = nullptr, py::arg("from_prev") = nullptr, py::arg("to_prev") = nullptr,
           py::arg("from_next") = nullptr, py::arg("act_to_prev") = nullptr, py::arg("act_from_next") = nullptr,
           py::arg("grad_to_next") = nullptr, py::arg("grad_from_prev") = nullptr);
  // an announcement's or a stage leader's [kind, microbatch]; a message itself carries its payload alone
  m.attr("pipeline_header_bytes") = kStageHeaderBytes;
  m.def("pipeline_message_bytes", [](std::size_t payload_bytes) { return stage_message_bytes(payload_bytes); },
        py::arg("payload_bytes"));
  m.def("run_pipeline", [](std::shared_ptr<Communicator> pp, PipelineSchedule schedule, int stage, int stages,
                           int microbatches, int pipeline_limit, std::size_t payload_bytes,
                           std::function<std::uintptr_t(int, std::uintptr_t)> fwd,
                           std::function<std::uintptr_t(int, std::uintptr_t)> bwd, ReceiveStrategy receive,
                           std::shared_ptr<Communicator> control, const StageLinks& links, std::uintptr_t stream,
                           std::shared_ptr<Communicator> stage_group, std::function<void(std::uintptr_t)> sent) {
    PipelineConfig cfg{stage, stages, microbatches, pipeline_limit, payload_bytes, receive,
                       reinterpret_cast<void*>(stream)};
    if (sent) cfg.sent = [&sent](const void* data) { sent(reinterpret_cast<std::uintptr_t>(data)); };
    StageForward f = [&fwd](int mb, const void* x) {
      return reinterpret_cast<const void*>(fwd(mb, reinterpret_cast<std::uintptr_t>(x)));
    };
    StageBackward b = [&bwd](int mb, const void* g) {
      return reinterpret_cast<const void*>(bwd(mb, reinterpret_cast<std::uintptr_t>(g)));
    };
    py::gil_scoped_release nogil;  // callbacks take the GIL back while they run
    return schedule == PipelineSchedule::OneFOneB ? run_one_f_one_b(*pp, cfg, f, b, links)
                                                  : run_message_driven(*pp, cfg, f, b, control.get(), links, stage_group.get());
  }, py::arg("pp"), py::arg("schedule"), py::arg("stage"), py::arg("stages"), py::arg("microbatches"),
     py::arg("pipeline_limit"), py::arg("payload_bytes"), py::arg("forward"), py::arg("backward"),
     py::arg("receive") = ReceiveStrategy::Auto, py::arg("control") = nullptr, py::arg("links") = StageLinks{},
     py::arg("stream") = 0, py::arg("stage_group") = nullptr, py::arg("sent") = nullptr);

  m.def("run_interleaved", [](std::shared_ptr<Communicator> pp, int stage, int stages, int chunks, int microbatches,
                              std::size_t payload_bytes, std::function<std::uintptr_t(int, int, std::uintptr_t)> fwd,
                              std::function<std::uintptr_t(int, int, std::uintptr_t)> bwd, const StageLinks& links,
                              std::uintptr_t stream, std::function<void(std::uintptr_t)> sent) {
    PipelineConfig cfg{stage, stages, microbatches, 1, payload_bytes, ReceiveStrategy::PerPeer,
                       reinterpret_cast<void*>(stream)};
    if (sent) cfg.sent = [&sent](const void* data) { sent(reinterpret_cast<std::uintptr_t>(data)); };
    ChunkForward f = [&fwd](int mb, int c, const void* x) {
      return reinterpret_cast<const void*>(fwd(mb, c, reinterpret_cast<std::uintptr_t>(x)));
    };
    ChunkBackward b = [&bwd](int mb, int c, const void* g) {
      return reinterpret_cast<const void*>(bwd(mb, c, reinterpret_cast<std::uintptr_t>(g)));
    };
    py::gil_scoped_release nogil;
    return run_interleaved(*pp, cfg, chunks, f, b, links);
  }, py::arg("pp"), py::arg("stage"), py::arg("stages"), py::arg("chunks"), py::arg("microbatches"),
     py::arg("payload_bytes"), py::arg("forward"), py::arg("backward"), py::arg("links") = StageLinks{},
     py::arg("stream") = 0, py::arg("sent") = nullptr);
  py::enum_<ChunkPlacement>(m, "ChunkPlacement").value("Loop", ChunkPlacement::Loop).value("V", ChunkPlacement::V);
  py::enum_<StageOpKind>(m, "StageOpKind")
      .value("F", StageOpKind::F).value("B", StageOpKind::B).value("W", StageOpKind::W).value("BW", StageOpKind::BW);
  // ops: (kind, chunk, micro-batch), a stage's gw.schedules table
  m.def("run_table", [](std::shared_ptr<Communicator> pp, int stage, int stages, int chunks, ChunkPlacement placement,
                        int microbatches, const std::vector<std::tuple<StageOpKind, int, int>>& table,
                        std::size_t payload_bytes,
                        std::function<std::uintptr_t(int, int, std::uintptr_t)> fwd,
                        std::function<std::uintptr_t(int, int, std::uintptr_t, bool)> bwd,
                        std::function<void(int, int)> wgt, const StageLinks& links, std::uintptr_t stream,
                        std::function<void(std::uintptr_t)> sent) {
    std::vector<StageOp> ops;
    for (const auto& [kind, chunk, mb] : table) ops.push_back(StageOp{kind, chunk, mb});
    PipelineConfig cfg{stage, stages, microbatches, 1, payload_bytes, ReceiveStrategy::PerPeer,
                       reinterpret_cast<void*>(stream)};
    if (sent) cfg.sent = [&sent](const void* data) { sent(reinterpret_cast<std::uintptr_t>(data)); };
    ChunkForward f = [&fwd](int mb, int c, const void* x) {
      return reinterpret_cast<const void*>(fwd(mb, c, reinterpret_cast<std::uintptr_t>(x)));
    };
    SplitBackward b = [&bwd](int mb, int c, const void* g, bool input_only) {
      return reinterpret_cast<const void*>(bwd(mb, c, reinterpret_cast<std::uintptr_t>(g), input_only));
    };
    ChunkWeight w = [&wgt](int mb, int c) { wgt(mb, c); };
    py::gil_scoped_release nogil;
    return run_table(*pp, cfg, chunks, placement, ops, f, b, w, links);
  }, py::arg("pp"), py::arg("stage"), py::arg("stages"), py::arg("chunks"), py::arg("placement"),
     py::arg("microbatches"), py::arg("ops"), py::arg("payload_bytes"), py::arg("forward"), py::arg("backward"),
     py::arg("weight"), py::arg("links") = StageLinks{}, py::arg("stream") = 0, py::arg("sent") = nullptr);
  // Engine-owned CUDA memory (pipeline messages) from torch's caching allocator: no cudaMalloc
  // or cudaFree (a device synchronisation) per message, as torch's own buffers.
  m.def("use_cuda_allocator", [](std::function<std::uintptr_t(std::size_t)> alloc,
                                 std::function<void(std::uintptr_t)> release) {
    const DeviceAllocator* current = allocator_for(Device::CUDA);
    GW_CHECK(current != nullptr, "use_cuda_allocator: gridweave was built without CUDA");
    DeviceAllocator a = *current;
    // never freed: the registry outlives the interpreter, and a Python callable must not be
    // released after it
    auto* alloc_fn = new std::function<std::uintptr_t(std::size_t)>(std::move(alloc));
    auto* release_fn = new std::function<void(std::uintptr_t)>(std::move(release));
    a.allocate = [alloc_fn](std::size_t bytes) {
      py::gil_scoped_acquire gil;
      return reinterpret_cast<void*>((*alloc_fn)(bytes));
    };
    a.release = [release_fn](void* p) {
      py::gil_scoped_acquire gil;
      (*release_fn)(reinterpret_cast<std::uintptr_t>(p));
    };
    register_allocator(Device::CUDA, a);
  }, py::arg("allocate"), py::arg("release"));

  // 3-D choreography (Bian et al. §3.1): layouts, plans and gradient mappings.
  py::class_<CubeStep>(m, "CubeStep").def_readonly("axis", &CubeStep::axis).def_readonly("dim", &CubeStep::dim);
  py::class_<CubePlan>(m, "CubePlan")
      .def_readonly("gather_lhs", &CubePlan::gather_lhs)
      .def_readonly("gather_rhs", &CubePlan::gather_rhs)
      .def_readonly("reduce_scatter_out", &CubePlan::reduce_scatter_out)
      .def_readonly("trans_lhs", &CubePlan::trans_lhs)
      .def_readonly("trans_rhs", &CubePlan::trans_rhs);
  py::class_<CubeGrad>(m, "CubeGrad")
      .def_readonly("form", &CubeGrad::form)
      .def_readonly("a", &CubeGrad::a)
      .def_readonly("c", &CubeGrad::c)
      .def_readonly("lhs", &CubeGrad::lhs)
      .def_readonly("rhs", &CubeGrad::rhs);
  m.def("cube_layout", &cube_layout, py::arg("form"), py::arg("operand"), py::arg("a"), py::arg("c"));
  m.def("cube_vector_layout", &cube_vector_layout, py::arg("col"));
  m.def("block_range", [](long long n, const std::vector<int>& sizes, const std::vector<int>& coords) {
    Range r = block_range(n, sizes, coords);
    return std::make_pair(r.begin, r.end);
  });
  m.def("cube_plan", &cube_plan, py::arg("form"), py::arg("a"), py::arg("c"));
  m.def("cube_backward", &cube_backward, py::arg("form"), py::arg("a"), py::arg("c"));

  py::class_<Grid, std::shared_ptr<Grid>>(m, "Grid")
      .def(py::init([](const std::vector<std::pair<std::string, int>>& axes, const std::string& policy, int rpn,
                       int rank, const std::string& backend, double timeout_s, const std::string& hostname,
                       int device_index, std::shared_ptr<Store> store, const std::string& session,
                       CheckLevel check, Emulation emulate, std::size_t eager_bytes, long long flight_entries,
                       const std::string& flight_dir, const std::string& flight_run) {
             GW_CHECK(policy == "naive" || policy == "topology",
                      "placement must be 'naive' or 'topology', got '" << policy << "'");
             GW_CHECK(backend == "gloo" || backend == "nccl" || backend == "mpi",
                      "unknown backend '" << backend << "' (gloo | nccl | mpi | auto)");
             GridOptions o;
             o.axes = to_axes(axes);
             o.policy = policy == "naive" ? PlacementPolicy::Naive : PlacementPolicy::Topology;
             o.ranks_per_node = rpn;
             o.rank = rank;
             o.backend = backend == "gloo" ? Backend::Gloo : backend == "mpi" ? Backend::Mpi : Backend::Nccl;
             o.timeout = to_ms(timeout_s);
             o.hostname = hostname;
             o.device_index = device_index;
             o.session = session;
             o.check = check;
             o.emulate = emulate;
             o.eager_bytes = eager_bytes;
             o.flight_entries = flight_entries;
             o.flight_dir = flight_dir;
             o.flight_run = flight_run;
             return std::make_shared<Grid>(o, store);
           }), py::arg("axes"), py::arg("policy"), py::arg("ranks_per_node"), py::arg("rank"), py::arg("backend"),
           py::arg("timeout_s"), py::arg("hostname"), py::arg("device_index"), py::arg("store"),
           py::arg("session") = "", py::arg("check") = CheckLevel::Cheap, py::arg("emulate") = Emulation::None,
           py::arg("eager_bytes") = 0, py::arg("flight_entries") = -1, py::arg("flight_dir") = "",
           py::arg("flight_run") = "")
      // The flight recorder (cpp/flight.h): its JSON, and a dump to the grid's folder.
      .def_property_readonly("flight_enabled", [](const Grid& g) { return g.flight() != nullptr; })
      .def_property_readonly("flight_dir", [](const Grid& g) { return g.options().flight_dir; })
      .def("flight_json", &Grid::flight_json, py::arg("reason") = "")
      .def("flight_dump", [](Grid& g, const std::string& reason) {
        py::gil_scoped_release nogil;
        g.flight_dump(reason);
      }, py::arg("reason"))
      .def_property_readonly("nccl_rules", &Grid::nccl_rules)
      .def("link", [](Grid& g, const std::vector<std::string>& axes, int a, int b, int channel) {
        py::gil_scoped_release nogil;
        return g.link(axes, a, b, channel);
      }, py::arg("axes"), py::arg("a"), py::arg("b"), py::arg("channel"))
      .def("subset", [](Grid& g, const std::vector<std::string>& axes, const std::vector<int>& members,
                        const std::string& part) {
        py::gil_scoped_release nogil;
        return g.subset(axes, members, part);
      }, py::arg("axes"), py::arg("members"), py::arg("part"))
      .def("connect", [](Grid& g, const std::vector<std::vector<std::string>>& lines) {
        py::gil_scoped_release nogil;
        g.connect(lines);
      })
      .def("seal", &Grid::seal)
      .def("made", [](const Grid& g) {
        const Grid::Made m = g.made();
        py::dict d;
        d["at_setup"] = m.at_setup;
        d["after_setup"] = m.after_setup;
        d["late"] = m.late;
        return d;
      })
      .def_property_readonly("rank", &Grid::rank)
      .def_property_readonly("world_size", &Grid::world_size)
      .def_property_readonly("coords", &Grid::coords)
      .def_property_readonly("placement", &Grid::placement, py::return_value_policy::reference_internal)
      .def("comm", [](Grid& g, const std::vector<std::string>& axes) {
        py::gil_scoped_release nogil;
        return g.comm(axes);
      })
      .def("control", [](Grid& g, const std::vector<std::string>& axes) {
        py::gil_scoped_release nogil;
        return g.control(axes);
      })
      .def("stats", [](const Grid& g) {
        py::dict out;
        for (const auto& [axis, c] : g.stats()) {
          py::dict d;
          d["ops"] = c.ops;
          d["sent_intra"] = tally(c.sent_intra);
          d["sent_inter"] = tally(c.sent_inter);
          d["recv_intra"] = tally(c.recv_intra);
          d["recv_inter"] = tally(c.recv_inter);
          out[py::str(axis)] = d;
        }
        return out;
      })
      .def("reset_stats", &Grid::reset_stats)
      .def("shutdown", [](Grid& g) {
        py::gil_scoped_release nogil;
        g.shutdown();
      });
}
