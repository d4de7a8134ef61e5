// Batched matmuls whose every output element is summed in one fixed order, whatever the shape
// of the call or the number of threads: out[b, m, n] depends only on row m of `left` and
// column n of `right` (kernels/fixed_order_matmul.py says why and when the engine uses them).
//
// dot_nt: right given as rows [B, N, K] (keys): out[b, m, n] = sum_k left[b, m, k] * right[b, n, k],
//   k in 8 interleaved lanes (lane j takes k = j, j + 8, ...), the lanes added pairwise, then
//   the last K % 8 terms in order.
// dot_nn: right given as [B, K, N] (values): out[b, m, n] = sum_k left[b, m, k] * right[b, k, n],
//   k in order 0, 1, ..., K - 1 for every n.
// Threads split the (b, m) rows; each row's outputs are computed by one thread alone.
#include <torch/extension.h>
#include <ATen/Parallel.h>

namespace {

constexpr int64_t kLanes = 8;

inline float dot_fixed(const float* __restrict__ a, const float* __restrict__ b, int64_t k) {
  float lanes[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
  const int64_t whole = k - k % kLanes;
  for (int64_t i = 0; i < whole; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) {
      lanes[j] += a[i + j] * b[i + j];
    }
  }
  float sum = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) +
              ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
  for (int64_t i = whole; i < k; ++i) {
    sum += a[i] * b[i];
  }
  return sum;
}

// out[b, m, :] = row_fn(left row (b, m), right item b, out row), each row by one thread.
template <typename RowFn>
torch::Tensor by_rows(const torch::Tensor& left, const torch::Tensor& right, int64_t cols,
                      RowFn row_fn) {
  TORCH_CHECK(left.dim() == 3 && right.dim() == 3, "fixed-order matmul takes 3-d tensors");
  TORCH_CHECK(left.scalar_type() == torch::kFloat32 && right.scalar_type() == torch::kFloat32,
              "fixed-order matmul takes float32");
  TORCH_CHECK(left.is_contiguous() && right.is_contiguous(), "operands must be contiguous");
  TORCH_CHECK(left.size(0) == right.size(0), "batch sizes differ");
  const int64_t rows = left.size(1), depth = left.size(2);
  const int64_t item_size = right.size(1) * right.size(2);
  TORCH_CHECK(item_size == depth * cols, "inner dimensions differ");
  auto out = torch::zeros({left.size(0), rows, cols}, left.options());
  const float* a = left.data_ptr<float>();
  const float* b = right.data_ptr<float>();
  float* c = out.data_ptr<float>();
  at::parallel_for(0, left.size(0) * rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      row_fn(a + row * depth, b + (row / rows) * item_size, c + row * cols, depth);
    }
  });
  return out;
}

}  // namespace

torch::Tensor dot_nt(torch::Tensor left, torch::Tensor right) {
  const int64_t cols = right.size(1);
  return by_rows(left, right, cols,
                 [cols](const float* a_row, const float* b_item, float* c_row, int64_t depth) {
                   for (int64_t n = 0; n < cols; ++n) {
                     c_row[n] = dot_fixed(a_row, b_item + n * depth, depth);
                   }
                 });
}

torch::Tensor dot_nn(torch::Tensor left, torch::Tensor right) {
  const int64_t cols = right.size(2);
  return by_rows(left, right, cols,
                 [cols](const float* a_row, const float* b_item, float* __restrict__ c_row,
                        int64_t depth) {
                   for (int64_t k = 0; k < depth; ++k) {
                     const float weight = a_row[k];
                     const float* __restrict__ b_row = b_item + k * cols;
                     for (int64_t n = 0; n < cols; ++n) {
                       c_row[n] += weight * b_row[n];
                     }
                   }
                 });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("dot_nt", &dot_nt, "left [B, M, K] @ right[B, N, K]^T, fixed order per element");
  m.def("dot_nn", &dot_nn, "left [B, M, K] @ right[B, K, N], fixed order per element");
}
