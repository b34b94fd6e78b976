// The checks of `bench comm` are real: a communicator that corrupts one element of its result is
// reported with #wrong > 0, and a correct one with #wrong == 0.
#include "mesh/bench/comm_bench.h"

#include <gtest/gtest.h>

#include "kernels/core/tensor.h"
#include "mesh/local/local_comm.h"

namespace meshproof::mesh {
namespace {

using kernels::Tensor;

// Forwards to a real communicator; corrupts element 0 of every all_gather output on member 1.
class CorruptingCommunicator final : public Communicator {
 public:
  explicit CorruptingCommunicator(Communicator& inner)
      : Communicator(inner.ranks(), inner.rank(), inner.label()), inner_(inner) {}
  std::string_view backend() const override { return "corrupting"; }

 protected:
  void do_all_gather(const Tensor& in, Tensor& out) override {
    inner_.all_gather(in, out);
    if (rank() == 1) out.data<float>()[0] += 1.0f;
  }
  void do_reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) override {
    inner_.reduce_scatter(in, out, op);
  }
  void do_all_reduce(Tensor& b, ReduceOp op) override { inner_.all_reduce(b, op); }
  void do_broadcast(Tensor& b, int root) override { inner_.broadcast(b, root); }
  void do_barrier() override { inner_.barrier(); }
  void do_all_to_all_v(const Tensor& in, const std::vector<int64_t>& sc, Tensor& out,
                       const std::vector<int64_t>& rc) override {
    inner_.all_to_all_v(in, sc, out, rc);
  }
  void do_send(const Tensor& b, int peer) override { inner_.send(b, peer); }
  void do_recv(Tensor& b, int peer) override { inner_.recv(b, peer); }

 private:
  Communicator& inner_;
};

class CorruptingComms final : public RankComms {
 public:
  explicit CorruptingComms(RankComms& inner) : inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  const DeviceMesh& mesh() const override { return inner_.mesh(); }
  Communicator& group(DimSet dims) override {
    // The world group stays honest: the bench aggregates its numbers over it. Dim sets map to
    // the mesh's group slots as every RankComms does (a set with pp maps onto its twin without it
    // when pp = 1).
    const unsigned slot = inner_.mesh().group_slot(dims);
    if (slot == inner_.mesh().group_slots() - 1) return inner_.group(dims);
    auto& c = comms_[slot];
    if (!c) c = std::make_unique<CorruptingCommunicator>(inner_.group(dims));
    return *c;
  }

 private:
  RankComms& inner_;
  std::array<std::unique_ptr<CorruptingCommunicator>, 1u << kNumGroupDims> comms_;
};

CommBenchOptions small() {
  CommBenchOptions o;
  o.counts = {kernels::Elements(64), kernels::Elements(1000)};
  o.iters = 1;
  o.warmup_iters = 0;
  return o;
}

TEST(CommBenchTest, CorrectCommunicatorHasNoWrongResults) {
  LocalWorldOptions wo;
  wo.timeout = std::chrono::seconds(30);
  LocalWorld world(DeviceMesh(2, 2, 1), wo);
  std::vector<CommBenchRow> rows;
  world.run([&](RankComms& comms) {
    auto r = run_comm_bench(comms, small());
    if (comms.rank() == 0) rows = r;
  });
  // Distinct groupings of a 2x2x1 mesh: dp_replicate, dp_shard, dp_replicate+dp_shard; 7
  // collective cases + all_to_all; 2 sizes.
  EXPECT_EQ(rows.size(), 3u * 8u * 2u);
  for (const CommBenchRow& r : rows) {
    EXPECT_EQ(r.wrong, 0) << r.group << " " << collective_name(r.kind);
    EXPECT_GT(r.time_us, 0.0);
    EXPECT_NEAR(r.busbw_gbs, r.algbw_gbs * bus_bandwidth_factor(r.kind, r.group_size), 1e-12);
  }
  EXPECT_NE(format_comm_bench(rows).find("reduce_scatter"), std::string::npos);
}

TEST(CommBenchTest, CorruptedResultsAreCounted) {
  LocalWorldOptions wo;
  wo.timeout = std::chrono::seconds(30);
  LocalWorld world(DeviceMesh(1, 2, 1), wo);
  std::vector<CommBenchRow> rows;
  world.run([&](RankComms& comms) {
    CorruptingComms bad(comms);
    auto r = run_comm_bench(bad, small());
    if (comms.rank() == 0) rows = r;
  });
  for (const CommBenchRow& r : rows) {
    // One corrupted element per all_gather check on member 1; everything else is right.
    EXPECT_EQ(r.wrong, r.kind == CollectiveKind::kAllGather ? 1 : 0)
        << r.group << " " << collective_name(r.kind);
  }
}

}  // namespace
}  // namespace meshproof::mesh
