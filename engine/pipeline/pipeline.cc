#include "engine/pipeline/pipeline.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <deque>
#include <map>
#include <numeric>
#include <string>

#include "kernels/core/error.h"

namespace meshproof::engine {

std::string_view pp_schedule_name(PpSchedule s) {
  const auto i = static_cast<size_t>(s);
  MP_CHECK(i < std::size(kPpScheduleNames), "invalid PpSchedule {}", i);
  return kPpScheduleNames[i];
}

std::vector<int64_t> stage_layer_counts(int64_t layers, int pp, const std::vector<int64_t>& split) {
  MP_CHECK_INPUT(1 <= pp && pp <= layers,
                 "{} pipeline stages for {} layers: every stage needs at least one layer", pp,
                 layers);
  if (!split.empty()) {
    const bool positive = std::all_of(split.begin(), split.end(), [](int64_t n) { return n >= 1; });
    MP_CHECK_INPUT(static_cast<int>(split.size()) == pp && positive &&
                       std::accumulate(split.begin(), split.end(), int64_t{0}) == layers,
                   "layer split [{}] is not a split of {} layers over {} stages (one count >= 1 "
                   "per stage)",
                   fmt::join(split, ", "), layers, pp);
    return split;
  }
  std::vector<int64_t> out(static_cast<size_t>(pp), layers / pp);
  for (int64_t s = 0; s < layers % pp; ++s) ++out[static_cast<size_t>(s)];
  return out;
}

StageLayers stage_layers(int64_t layers, int pp, int stage, const std::vector<int64_t>& split) {
  const std::vector<int64_t> counts = stage_layer_counts(layers, pp, split);
  MP_CHECK_INPUT(0 <= stage && stage < pp, "stage {} of {} pipeline stages", stage, pp);
  StageLayers s;
  for (int i = 0; i < stage; ++i) s.first += counts[static_cast<size_t>(i)];
  s.count = counts[static_cast<size_t>(stage)];
  s.first_stage = stage == 0;
  s.last_stage = stage == pp - 1;
  return s;
}

std::vector<PpStep> forward_sweep(int64_t micro_batches) {
  MP_CHECK_INPUT(micro_batches >= 1, "a forward sweep over {} micro-batches (needs >= 1)",
                 micro_batches);
  std::vector<PpStep> out;
  for (int64_t mb = 0; mb < micro_batches; ++mb) out.push_back({PpPass::kForward, mb, false});
  return out;
}

std::vector<PpStep> stage_schedule(PpSchedule schedule, int pp, int stage, int64_t micro_batches) {
  MP_CHECK_INPUT(pp >= 1 && 0 <= stage && stage < pp, "stage {} of {} pipeline stages", stage, pp);
  MP_CHECK_INPUT(micro_batches >= 1, "a pipeline schedule over {} micro-batches (needs >= 1)",
                 micro_batches);
  std::vector<PpStep> out;
  out.reserve(static_cast<size_t>(2 * micro_batches));
  const auto fwd = [&out](int64_t mb) { out.push_back({PpPass::kForward, mb, false}); };
  const auto bwd = [&out](int64_t mb) { out.push_back({PpPass::kBackward, mb, false}); };
  MP_CHECK(schedule == PpSchedule::kGpipe || schedule == PpSchedule::kOneFOneB,
           "invalid PpSchedule {}", static_cast<int>(schedule));
  // GPipe: no warm-up limit, every forward first. 1F1B: the forwards that must be in flight
  // before this stage's first backward can come back from the last stage, then one forward and
  // one backward in turn, then the remaining backwards.
  const int64_t warmup = schedule == PpSchedule::kGpipe
                             ? micro_batches
                             : std::min<int64_t>(pp - stage - 1, micro_batches);
  int64_t next_fwd = 0, next_bwd = 0;
  for (; next_fwd < warmup; ++next_fwd) fwd(next_fwd);
  while (next_fwd < micro_batches) {
    fwd(next_fwd++);
    bwd(next_bwd++);
  }
  while (next_bwd < micro_batches) bwd(next_bwd++);
  // Backwards run in micro-batch order in both schedules: the last one is the last step.
  MP_CHECK(!out.empty() && out.back().pass == PpPass::kBackward &&
               out.back().micro_batch == micro_batches - 1,
           "schedule {} of stage {} does not end with the last micro-batch's backward",
           pp_schedule_name(schedule), stage);
  out.back().last_backward = true;
  return out;
}

double ScheduleTimeline::bubble_fraction(int stage) const {
  MP_CHECK(0 <= stage && stage < static_cast<int>(busy.size()) && makespan > 0,
           "bubble of stage {} of a {}-stage timeline of makespan {}", stage, busy.size(),
           makespan);
  return static_cast<double>(makespan - busy[static_cast<size_t>(stage)]) /
         static_cast<double>(makespan);
}

ScheduleTimeline simulate_schedule(const std::vector<std::vector<PpStep>>& stages,
                                   int64_t forward_cost, int64_t backward_cost) {
  MP_CHECK(!stages.empty() && forward_cost >= 1 && backward_cost >= 1,
           "simulate {} stages with pass costs {} and {}", stages.size(), forward_cost,
           backward_cost);
  const int pp = static_cast<int>(stages.size());
  int64_t mbs = 0;
  for (const auto& st : stages)
    for (const PpStep& p : st) {
      MP_CHECK(p.micro_batch >= 0, "pipeline schedule with micro-batch {}", p.micro_batch);
      mbs = std::max(mbs, p.micro_batch + 1);
    }
  // Finish time of (stage, pass, micro-batch); -1 while not run.
  const auto idx = [mbs](int s, PpPass pass, int64_t mb) {
    return (static_cast<size_t>(s) * 2 + static_cast<size_t>(pass)) * static_cast<size_t>(mbs) +
           static_cast<size_t>(mb);
  };
  std::vector<int64_t> done(static_cast<size_t>(pp) * 2 * static_cast<size_t>(mbs), -1);
  std::vector<size_t> next(static_cast<size_t>(pp), 0);
  std::vector<int64_t> clock(static_cast<size_t>(pp), 0);
  std::vector<int64_t> in_flight(static_cast<size_t>(pp), 0);
  ScheduleTimeline t;
  t.busy.assign(static_cast<size_t>(pp), 0);
  t.peak_in_flight.assign(static_cast<size_t>(pp), 0);
  // The finish time of the pass `p` on stage `s` waits for, or -1 while that has not run; the
  // stage's own forward for a backward (its saved activations) is earlier in its own list.
  const auto input_ready = [&](int s, const PpStep& p) -> int64_t {
    if (p.pass == PpPass::kForward)
      return s == 0 ? 0 : done[idx(s - 1, PpPass::kForward, p.micro_batch)];
    const int64_t own = done[idx(s, PpPass::kForward, p.micro_batch)];
    if (own < 0) return -1;
    if (s == pp - 1) return own;
    const int64_t grad = done[idx(s + 1, PpPass::kBackward, p.micro_batch)];
    return grad < 0 ? -1 : std::max(own, grad);
  };
  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < pp; ++s) {
      const auto& list = stages[static_cast<size_t>(s)];
      size_t& n = next[static_cast<size_t>(s)];
      while (n < list.size()) {
        const PpStep& p = list[n];
        const int64_t ready = input_ready(s, p);
        if (ready < 0) break;
        MP_CHECK(done[idx(s, p.pass, p.micro_batch)] < 0,
                 "stage {} runs the {} of micro-batch "
                 "{} twice",
                 s, p.pass == PpPass::kForward ? "forward" : "backward", p.micro_batch);
        const int64_t cost = p.pass == PpPass::kForward ? forward_cost : backward_cost;
        int64_t& c = clock[static_cast<size_t>(s)];
        c = std::max(c, ready) + cost;
        done[idx(s, p.pass, p.micro_batch)] = c;
        t.busy[static_cast<size_t>(s)] += cost;
        int64_t& f = in_flight[static_cast<size_t>(s)];
        f += p.pass == PpPass::kForward ? 1 : -1;
        t.peak_in_flight[static_cast<size_t>(s)] =
            std::max(t.peak_in_flight[static_cast<size_t>(s)], f);
        ++n;
        progress = true;
      }
    }
  }
  std::vector<std::string> stuck;
  for (int s = 0; s < pp; ++s) {
    const auto& list = stages[static_cast<size_t>(s)];
    const size_t n = next[static_cast<size_t>(s)];
    if (n < list.size())
      stuck.push_back(fmt::format("stage {} at the {} of micro-batch {}", s,
                                  list[n].pass == PpPass::kForward ? "forward" : "backward",
                                  list[n].micro_batch));
  }
  MP_CHECK(stuck.empty(), "pipeline schedule deadlocks: {}", fmt::join(stuck, "; "));
  for (int s = 0; s < pp; ++s)
    for (int64_t mb = 0; mb < mbs; ++mb)
      MP_CHECK(done[idx(s, PpPass::kForward, mb)] >= 0 && done[idx(s, PpPass::kBackward, mb)] >= 0,
               "pipeline schedule: stage {} never runs the forward and backward of micro-batch {}",
               s, mb);
  t.makespan = *std::max_element(clock.begin(), clock.end());
  return t;
}

ScheduleTimeline simulate_schedule(PpSchedule schedule, int pp, int64_t micro_batches,
                                   int64_t forward_cost, int64_t backward_cost) {
  std::vector<std::vector<PpStep>> stages;
  for (int s = 0; s < pp; ++s) stages.push_back(stage_schedule(schedule, pp, s, micro_batches));
  return simulate_schedule(stages, forward_cost, backward_cost);
}

namespace {

// The neighbour a pass receives its input from, or -1 (the first stage's forward reads tokens,
// the last stage's backward starts from its loss).
int input_peer(const PpStep& p, int stage, int stages) {
  if (p.pass == PpPass::kForward) return stage > 0 ? stage - 1 : -1;
  return stage < stages - 1 ? stage + 1 : -1;
}

// The neighbour a pass sends its output to, or -1.
int output_peer(const PpStep& p, int stage, int stages) {
  if (p.pass == PpPass::kForward) return stage < stages - 1 ? stage + 1 : -1;
  return stage > 0 ? stage - 1 : -1;
}

std::string describe(const PpOp& op) {
  const char* kind = op.kind == PpOp::Kind::kRecv   ? "recv"
                     : op.kind == PpOp::Kind::kSend ? "send"
                                                    : "compute";
  std::string out = fmt::format("{} {}{}", kind, op.step.pass == PpPass::kForward ? 'F' : 'B',
                                op.step.micro_batch);
  if (op.kind == PpOp::Kind::kRecv) out += fmt::format(" from {}", op.peer);
  if (op.kind == PpOp::Kind::kSend) out += fmt::format(" to {}", op.peer);
  return out;
}

}  // namespace

std::vector<PpOp> stage_program(const std::vector<PpStep>& steps, int stage, int stages) {
  MP_CHECK(0 <= stage && stage < stages, "stage {} of {}", stage, stages);
  std::vector<PpOp> out;
  bool received_next = false;  // the next pass's input was received before the last send
  for (size_t i = 0; i < steps.size(); ++i) {
    const PpStep& p = steps[i];
    const int in = input_peer(p, stage, stages);
    if (in >= 0 && !received_next) out.push_back({PpOp::Kind::kRecv, p, in});
    received_next = false;
    out.push_back({PpOp::Kind::kCompute, p, -1});
    const int to = output_peer(p, stage, stages);
    if (to < 0) continue;
    // The crossing: the upper of the two stages (`to` below this one) receives first.
    if (i + 1 < steps.size() && to < stage && input_peer(steps[i + 1], stage, stages) == to) {
      out.push_back({PpOp::Kind::kRecv, steps[i + 1], to});
      received_next = true;
    }
    out.push_back({PpOp::Kind::kSend, p, to});
  }
  return out;
}

void check_programs(const std::vector<std::vector<PpOp>>& programs, bool eager) {
  const int n = static_cast<int>(programs.size());
  std::vector<size_t> pc(static_cast<size_t>(n), 0);
  // Eager: messages in flight per (from, to), in send order.
  std::map<std::pair<int, int>, std::deque<PpStep>> queue;
  const auto at = [&](int s) -> const PpOp* {
    const auto& prog = programs[static_cast<size_t>(s)];
    const size_t i = pc[static_cast<size_t>(s)];
    return i < prog.size() ? &prog[i] : nullptr;
  };
  const auto deliver = [&](int to, const PpOp& recv, const PpStep& sent, int from) {
    MP_CHECK(recv.step == sent, "pipeline program: stage {} at {} gets stage {}'s message of {}{}",
             to, describe(recv), from, sent.pass == PpPass::kForward ? 'F' : 'B', sent.micro_batch);
  };
  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < n; ++s) {
      const PpOp* op = at(s);
      if (op == nullptr) continue;
      MP_CHECK(op->kind == PpOp::Kind::kCompute || (0 <= op->peer && op->peer < n && op->peer != s),
               "pipeline program: stage {} at {}: no such peer", s, describe(*op));
      if (op->kind == PpOp::Kind::kCompute) {
        ++pc[static_cast<size_t>(s)];
        progress = true;
      } else if (op->kind == PpOp::Kind::kSend && eager) {
        queue[{s, op->peer}].push_back(op->step);
        ++pc[static_cast<size_t>(s)];
        progress = true;
      } else if (op->kind == PpOp::Kind::kRecv && eager) {
        auto& q = queue[{op->peer, s}];
        if (q.empty()) continue;
        deliver(s, *op, q.front(), op->peer);
        q.pop_front();
        ++pc[static_cast<size_t>(s)];
        progress = true;
      } else if (op->kind == PpOp::Kind::kSend) {
        // Rendezvous: the send completes with the receiver at its matching receive.
        const PpOp* r = at(op->peer);
        if (r == nullptr || r->kind != PpOp::Kind::kRecv || r->peer != s) continue;
        deliver(op->peer, *r, op->step, s);
        ++pc[static_cast<size_t>(s)];
        ++pc[static_cast<size_t>(op->peer)];
        progress = true;
      }
    }
  }
  std::vector<std::string> stuck;
  for (int s = 0; s < n; ++s)
    if (const PpOp* op = at(s)) stuck.push_back(fmt::format("stage {} at {}", s, describe(*op)));
  MP_CHECK(stuck.empty(), "pipeline program deadlocks with {} sends: {}",
           eager ? "eager" : "rendezvous", fmt::join(stuck, "; "));
  for (const auto& [pair, q] : queue)
    MP_CHECK(q.empty(), "pipeline program: {} message(s) from stage {} to stage {} never received",
             q.size(), pair.first, pair.second);
}

void run_stage_schedule(mesh::Communicator& pp, const std::vector<PpStep>& steps,
                        StagePasses& passes) {
  const int stage = pp.rank();
  // Received inputs and computed outputs waiting for their op, by (pass, micro-batch).
  std::map<std::pair<PpPass, int64_t>, kernels::Tensor> inputs, outputs;
  for (const PpOp& op : stage_program(steps, stage, pp.size())) {
    const PpStep& p = op.step;
    const std::pair<PpPass, int64_t> key{p.pass, p.micro_batch};
    switch (op.kind) {
      case PpOp::Kind::kRecv: {
        kernels::Tensor buf = p.pass == PpPass::kForward ? passes.input_buffer(p.micro_batch)
                                                         : passes.grad_output_buffer(p.micro_batch);
        pp.recv(buf, op.peer);
        inputs[key] = std::move(buf);
        break;
      }
      case PpOp::Kind::kCompute: {
        kernels::Tensor in;
        if (auto it = inputs.find(key); it != inputs.end()) {
          in = std::move(it->second);
          inputs.erase(it);
        }
        kernels::Tensor out = p.pass == PpPass::kForward
                                  ? passes.forward(p.micro_batch, in)
                                  : passes.backward(p.micro_batch, in, p.last_backward);
        // Kept for its kSend only (the last stage's forward and the first stage's backward
        // send nothing).
        if (output_peer(p, stage, pp.size()) >= 0) outputs[key] = std::move(out);
        break;
      }
      case PpOp::Kind::kSend: {
        auto it = outputs.find(key);
        MP_CHECK(it != outputs.end() && it->second.defined(),
                 "pipeline stage {}: the {} of micro-batch {} returned nothing to send to stage {}",
                 stage, p.pass == PpPass::kForward ? "forward" : "backward", p.micro_batch,
                 op.peer);
        pp.send(it->second, op.peer);
        outputs.erase(it);
        break;
      }
    }
  }
}

}  // namespace meshproof::engine
