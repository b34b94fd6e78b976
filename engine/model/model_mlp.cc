// The dense MLP (engine/model/model.h GptModel): fc1 (or the SwiGLU gate and up projections),
// the activation and fc2, forward and backward, under tensor and sequence parallelism through the
// quantizing Linear. One block with three callers (a dense layer's MLP, each MoE expert's block of
// rows and the shared expert), kept apart from the layer and the MoE code that call it.
#include <string>

#include "engine/model/model.h"
#include "engine/model/model_internal.h"
#include "kernels/core/runtime.h"
#include "kernels/core/tensor.h"
#include "kernels/ops/activation.h"
#include "kernels/ops/elementwise.h"

namespace meshproof::engine {

GptModel::MlpActs GptModel::mlp_acts(int64_t rows, int64_t f, DType dt) const {
  MlpActs a;
  a.fc1_out = new_tensor({rows, f}, dt);
  a.act_out = new_tensor({rows, f}, dt);
  if (config_.model.activation == Activation::kSwiGlu) a.up_out = new_tensor({rows, f}, dt);
  if (config_.model.activation == Activation::kGelu && kernels::current_context().device.is_cpu())
    a.gelu_tanh = new_tensor({rows, f}, DType::kFloat64);
  return a;
}

// out = fc2(act(fc1(x))) with the linears named q + "fc1" (or "fc1_gate" / "fc1_up") and
// q + "fc2"; fc2 is row-parallel (out is the sequence shard under sequence parallelism). `a` is
// allocated for x's rows (mlp_acts).
void GptModel::mlp_forward(const MlpWeights& w, const std::string& q, const Tensor& x,
                           Linear& linear, MlpActs& a, Tensor& out) const {
  const Activation act = config_.model.activation;
  linear.forward(q + (act == Activation::kSwiGlu ? "fc1_gate" : "fc1"), x, *w.fc1_w, w.fc1_b,
                 a.fc1_out);
  switch (act) {
    case Activation::kGelu:
      kernels::gelu_forward(a.fc1_out, a.act_out, a.gelu_tanh.defined() ? &a.gelu_tanh : nullptr);
      break;
    case Activation::kRelu:
      kernels::relu_forward(a.fc1_out, a.act_out);
      break;
    case Activation::kSwiGlu:
      linear.forward(q + "fc1_up", x, *w.up_w, w.up_b, a.up_out);
      kernels::swiglu_forward(a.fc1_out, a.up_out, a.act_out);
      break;
  }
  linear.forward(q + "fc2", a.act_out, *w.fc2_w, w.fc2_b, out, true);
}

// dy: dL/d(out) of mlp_forward; dx (allocated, x's shape) receives dL/dx.
void GptModel::mlp_backward(const MlpWeights& w, MlpGrads& g, const std::string& q,
                            const Tensor& dy, const Tensor& x, const MlpActs& a, Linear& linear,
                            Tensor& dx) const {
  const DType dt = x.dtype();
  const int64_t rows = x.shape()[0], f = w.fc1_w->shape()[0];
  Tensor d_act = new_tensor({rows, f}, dt);
  linear.backward_row(q + "fc2", dy, a.act_out, *w.fc2_w, *g.fc2_w, g.fc2_b, d_act);
  Tensor d_fc1 = new_tensor({rows, f}, dt);
  switch (config_.model.activation) {
    case Activation::kGelu:
      kernels::gelu_backward(d_act, a.fc1_out, d_fc1,
                             a.gelu_tanh.defined() ? &a.gelu_tanh : nullptr);
      linear.backward_pass(q + "fc1", d_fc1, x, *w.fc1_w, *g.fc1_w, g.fc1_b, dx, true);
      break;
    case Activation::kRelu:
      kernels::relu_backward(d_act, a.fc1_out, d_fc1);
      linear.backward_pass(q + "fc1", d_fc1, x, *w.fc1_w, *g.fc1_w, g.fc1_b, dx, true);
      break;
    case Activation::kSwiGlu: {
      Tensor d_up = new_tensor({rows, f}, dt);
      kernels::swiglu_backward(d_act, a.fc1_out, a.up_out, d_fc1, d_up);
      linear.backward_pass(q + "fc1_gate", d_fc1, x, *w.fc1_w, *g.fc1_w, g.fc1_b, dx, true);
      Tensor dx_up = new_tensor(dx.shape(), dt);
      linear.backward_pass(q + "fc1_up", d_up, x, *w.up_w, *g.up_w, g.up_b, dx_up, true);
      kernels::add_(dx, dx_up);
      break;
    }
  }
}

}  // namespace meshproof::engine
