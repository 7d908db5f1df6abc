// The MPI transport on 4 ranks (run under mpirun by ctest): every collective and dtype on
// the world and on 2- and 3-rank lines against values computed here, small and large,
// receive-from-any, the traffic counters, a skipped collective that times out instead of hanging, and a
// pending receive that close() cancels.
#include <gtest/gtest.h>
#include <mpi.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <set>
#include <thread>
#include <vector>

#include "dtype.h"
#include "error.h"
#include "mpi_communicator.h"

using namespace gridweave;
using std::chrono::milliseconds;

namespace {

int world_rank() { return mpi_world().first; }

std::shared_ptr<MpiCommunicator> line(std::vector<int> members, const std::string& axis,
                                      milliseconds timeout = milliseconds(20000)) {
  CommInfo info;
  info.axis = axis;
  info.members = members;
  for (std::size_t k = 0; k < members.size(); ++k)
    if (members[k] == world_rank()) info.rank = static_cast<int>(k);
  info.member_nodes.assign(members.size(), 0);
  info.timeout = timeout;
  info.counters = std::make_shared<TrafficCounters>();
  return std::make_shared<MpiCommunicator>(info, -1);
}

// Values exact in every dtype: small integers, so sums over 4 ranks stay exact in fp16/bf16.
double value(int rank, std::size_t i) { return static_cast<double>((rank * 7 + static_cast<int>(i) * 3) % 9 - 4); }

void store(void* p, std::size_t i, double v, DType d) {
  switch (d) {
    case DType::Float32: static_cast<float*>(p)[i] = static_cast<float>(v); break;
    case DType::Float64: static_cast<double*>(p)[i] = v; break;
    case DType::Int32: static_cast<std::int32_t*>(p)[i] = static_cast<std::int32_t>(v); break;
    case DType::Int64: static_cast<std::int64_t*>(p)[i] = static_cast<std::int64_t>(v); break;
    case DType::Float16:
    case DType::BFloat16: {  // via reduce_into: 0 + v computed in float, rounded to the type
      std::uint16_t zero = 0, out = 0;
      float f = static_cast<float>(v);
      std::uint32_t bits;
      std::memcpy(&bits, &f, 4);
      std::uint16_t src = d == DType::BFloat16 ? static_cast<std::uint16_t>(bits >> 16) : 0;
      if (d == DType::Float16) {  // small integers are exact in fp16: build them directly
        const int n = static_cast<int>(v);
        const int a = n < 0 ? -n : n;
        if (a == 0) src = 0;
        else {
          int e = 0;
          while ((a >> (e + 1)) > 0) ++e;
          src = static_cast<std::uint16_t>(((e + 15) << 10) | (((a << (10 - e)) & 0x3ff)));
        }
        if (n < 0) src |= 0x8000;
      }
      reduce_into(&out, &zero, &src, 1, d, ReduceOp::Sum);
      static_cast<std::uint16_t*>(p)[i] = out;
      break;
    }
  }
}

double load(const void* p, std::size_t i, DType d) {
  switch (d) {
    case DType::Float32: return static_cast<const float*>(p)[i];
    case DType::Float64: return static_cast<const double*>(p)[i];
    case DType::Int32: return static_cast<const std::int32_t*>(p)[i];
    case DType::Int64: return static_cast<const double>(static_cast<const std::int64_t*>(p)[i]);
    case DType::BFloat16: {
      std::uint32_t bits = static_cast<std::uint32_t>(static_cast<const std::uint16_t*>(p)[i]) << 16;
      float f;
      std::memcpy(&f, &bits, 4);
      return f;
    }
    case DType::Float16: {
      const std::uint16_t h = static_cast<const std::uint16_t*>(p)[i];
      const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
      const double mag = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
      return (h & 0x8000) ? -mag : mag;
    }
  }
  return 0;
}

struct Buf {
  std::vector<char> bytes;
  DType dtype;
  std::size_t count;
  Buf(std::size_t n, DType d) : bytes(n * dtype_size(d)), dtype(d), count(n) {}
  BufferView view() { return BufferView{bytes.data(), count, dtype}; }
  double at(std::size_t i) const { return load(bytes.data(), i, dtype); }
};

const DType kDtypes[] = {DType::Float32, DType::Float64, DType::Float16, DType::BFloat16, DType::Int32, DType::Int64};

void every_op(MpiCommunicator& c, const std::vector<int>& members, std::size_t n = 6) {
  const int g = c.size(), me = c.rank();
  for (DType d : kDtypes) {
    SCOPED_TRACE(dtype_name(d));
    Buf in(n, d), gathered(n * g, d), sum(n, d), part(n / 2 * 0 + n, d);
    for (std::size_t i = 0; i < n; ++i) store(in.bytes.data(), i, value(members[me], i), d);
    c.all_gather(in.view(), gathered.view())->wait(milliseconds(20000));
    for (int k = 0; k < g; ++k)
      for (std::size_t i = 0; i < n; ++i) EXPECT_EQ(gathered.at(k * n + i), value(members[k], i));
    std::memcpy(sum.bytes.data(), in.bytes.data(), in.bytes.size());
    c.all_reduce(sum.view(), ReduceOp::Sum)->wait(milliseconds(20000));
    Buf mx(n, d);
    std::memcpy(mx.bytes.data(), in.bytes.data(), in.bytes.size());
    c.all_reduce(mx.view(), ReduceOp::Max)->wait(milliseconds(20000));
    for (std::size_t i = 0; i < n; ++i) {
      double s = 0, m = -1e9;
      for (int k = 0; k < g; ++k) s += value(members[k], i), m = std::max(m, value(members[k], i));
      EXPECT_EQ(sum.at(i), s);
      EXPECT_EQ(mx.at(i), m);
    }
    // reduce-scatter: g chunks of n values each from every member; chunk me of the sum
    Buf rs_in(n * g, d), rs_out(n, d);
    for (std::size_t i = 0; i < n * g; ++i) store(rs_in.bytes.data(), i, value(members[me], i), d);
    c.reduce_scatter(rs_in.view(), rs_out.view(), ReduceOp::Sum)->wait(milliseconds(20000));
    for (std::size_t i = 0; i < n; ++i) {
      double s = 0;
      for (int k = 0; k < g; ++k) s += value(members[k], me * n + i);
      EXPECT_EQ(rs_out.at(i), s);
    }
    // broadcast and reduce from the last member
    const int root = g - 1;
    Buf b(n, d);
    std::memcpy(b.bytes.data(), in.bytes.data(), in.bytes.size());
    c.broadcast(b.view(), root)->wait(milliseconds(20000));
    for (std::size_t i = 0; i < n; ++i) EXPECT_EQ(b.at(i), value(members[root], i));
    Buf r(n, d);
    std::memcpy(r.bytes.data(), in.bytes.data(), in.bytes.size());
    c.reduce(r.view(), ReduceOp::Sum, root)->wait(milliseconds(20000));
    for (std::size_t i = 0; i < n; ++i) {
      double s = 0;
      for (int k = 0; k < g; ++k) s += value(members[k], i);
      EXPECT_EQ(r.at(i), me == root ? s : value(members[me], i));  // the others' buffers unchanged
    }
    // scatter / gather / all-to-all
    Buf sc_in(n * g, d), sc_out(n, d), ga_out(n * g, d), a2a(n * g, d);
    for (std::size_t i = 0; i < n * g; ++i) store(sc_in.bytes.data(), i, value(members[me], i), d);
    c.scatter(sc_in.view(), sc_out.view(), 0)->wait(milliseconds(20000));
    for (std::size_t i = 0; i < n; ++i) EXPECT_EQ(sc_out.at(i), value(members[0], me * n + i));
    c.gather(in.view(), ga_out.view(), 0)->wait(milliseconds(20000));
    if (me == 0)
      for (int k = 0; k < g; ++k)
        for (std::size_t i = 0; i < n; ++i) EXPECT_EQ(ga_out.at(k * n + i), value(members[k], i));
    c.all_to_all(sc_in.view(), a2a.view())->wait(milliseconds(20000));
    for (int k = 0; k < g; ++k)
      for (std::size_t i = 0; i < n; ++i) EXPECT_EQ(a2a.at(k * n + i), value(members[k], me * n + i));
    c.barrier()->wait(milliseconds(20000));
  }
}

}  // namespace

TEST(Mpi, EveryOpAndDtypeOnTheWorld) { every_op(*line({0, 1, 2, 3}, "world"), {0, 1, 2, 3}); }

TEST(Mpi, EveryOpOnTwoRankLines) {
  const int r = world_rank();
  std::vector<int> members = r % 2 == 0 ? std::vector<int>{0, 2} : std::vector<int>{1, 3};
  every_op(*line(members, "y"), members);
}

// From 32 KiB chunks the reductions are gridweave's own schedules: halving-doubling on 2 and 4
// members, the ring on 3.
TEST(Mpi, EveryOpWithLargeBuffers) {
  const int r = world_rank();
  const std::size_t n = 1 << 16;  // all-reduce buffers of 128 KiB and more: 32 KiB chunks on 4 members
  every_op(*line({0, 1, 2, 3}, "world"), {0, 1, 2, 3}, n);
  std::vector<int> pair = r % 2 == 0 ? std::vector<int>{0, 2} : std::vector<int>{1, 3};
  every_op(*line(pair, "y"), pair, n);
  if (r < 3) every_op(*line({0, 1, 2}, "three"), {0, 1, 2}, n);
}

TEST(Mpi, ReceiveFromAnyTellsTheSenderAndCountsTraffic) {
  auto c = line({0, 1, 2, 3}, "pp");
  const int r = c->rank();
  if (r == 0) {
    std::set<int> seen;
    for (int k = 0; k < 2; ++k) {
      Buf b(3, DType::Float64);
      auto w = c->recv_any(b.view(), {1, 2}, 7);
      w->wait(milliseconds(20000));
      seen.insert(w->source());
      EXPECT_EQ(b.at(0), 10.0 * w->source());
    }
    EXPECT_EQ(seen, (std::set<int>{1, 2}));
    const auto stats = c->info().counters->snapshot();
    EXPECT_EQ(stats.at("pp").recv_intra.bytes, 2 * 3 * 8);
  } else if (r == 1 || r == 2) {
    Buf b(3, DType::Float64);
    for (int i = 0; i < 3; ++i) store(b.bytes.data(), i, 10.0 * r, DType::Float64);
    c->send(b.view(), 0, 7)->wait(milliseconds(20000));
  }
  c->barrier()->wait(milliseconds(20000));
}

TEST(Mpi, ASkippedCollectiveTimesOutAndNothingHangs) {
  const int r = world_rank();
  auto c = line({0, 1, 2, 3}, "dp", milliseconds(300));
  Buf b(4, DType::Float32);
  if (r == 0) {
    auto w = c->all_reduce(b.view(), ReduceOp::Sum);
    const auto t0 = std::chrono::steady_clock::now();
    try {
      w->wait(milliseconds(300));
      ADD_FAILURE() << "no timeout";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::Timeout);
      EXPECT_NE(std::string(e.what()).find("all_reduce on axis 'dp'"), std::string::npos) << e.what();
    }
    EXPECT_LT(std::chrono::steady_clock::now() - t0, milliseconds(5000));
    MPI_Barrier(MPI_COMM_WORLD);  // now the others post theirs, and the op completes
    w->wait(milliseconds(20000));
  } else {
    MPI_Barrier(MPI_COMM_WORLD);  // they "skipped" it until rank 0 gave up waiting
    c->all_reduce(b.view(), ReduceOp::Sum)->wait(milliseconds(20000));
  }
}

TEST(Mpi, AMemberThatNeverConnectsIsATimeoutNotAHang) {
  // MPI_Comm_create_group would block forever: the handshake before it times out instead.
  const int r = world_rank();
  if (r != 3) {
    const auto t0 = std::chrono::steady_clock::now();
    try {
      line({0, 1, 2, 3}, "tp", milliseconds(500));
      ADD_FAILURE() << "no timeout";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::Timeout);
      EXPECT_NE(std::string(e.what()).find("connecting axis 'tp'"), std::string::npos) << e.what();
    }
    EXPECT_LT(std::chrono::steady_clock::now() - t0, milliseconds(5000));
  }
  MPI_Barrier(MPI_COMM_WORLD);
  // The same line again, every member this time: what the failed attempt left is dropped.
  auto c = line({0, 1, 2, 3}, "tp");
  Buf b(3, DType::Float64);
  for (std::size_t i = 0; i < 3; ++i) static_cast<double*>(b.view().ptr)[i] = r;
  c->all_reduce(b.view(), ReduceOp::Sum)->wait(milliseconds(20000));
  EXPECT_EQ(static_cast<double*>(b.view().ptr)[2], 6.0);
}

TEST(Mpi, CloseCancelsAPendingReceive) {
  auto c = line({0, 1, 2, 3}, "sp");
  if (c->rank() == 0) {
    Buf b(2, DType::Float32);
    auto w = c->recv_any(b.view(), {1}, 9);  // nobody sends
    c->close();
    try {
      w->wait(milliseconds(5000));
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("cancelled"), std::string::npos) << e.what();
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  mpi_world();
  const int rc = RUN_ALL_TESTS();
  int any = rc, worst = 0;
  MPI_Allreduce(&any, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  mpi_finalize();
  return worst;
}
