// Batched matmuls whose every output element is summed in one fixed order, whatever the shape
// of the call or the number of threads: out[b, m, n] depends only on row m of `left` and
// column n of `right` (kernels/fixed_order_matmul.py says why and when the engine uses them).
//
// dot_nt: right given as rows [B, N, K] (keys): out[b, m, n] = sum_k left[b, m, k] * right[b, n, k],
//   k in 8 interleaved lanes (lane j takes k = j, j + 8, ...), the lanes added pairwise, then
//   the last K % 8 terms in order; 8 keys a pass (the last few one by one, in the same order).
// dot_nn: right given as [B, K, N] (values): out[b, m, n] = sum_k left[b, m, k] * right[b, k, n],
//   k in order 0, 1, ..., K - 1 for every n; 32 columns a pass, held in registers.
// Threads split the (b, m) rows; each row's outputs are computed by one thread alone.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kLanes = 8;
// Keys one pass of dot_nt scores against a query row (the row is read once for all of them),
// and columns one pass of dot_nn accumulates in registers.
constexpr int64_t kKeys = 8;
constexpr int64_t kColumns = 32;

// The lanes added pairwise, then the remainder terms k = whole, ..., depth - 1 in order.
inline float finish_dot(const float* lanes, const float* __restrict__ a,
                        const float* __restrict__ b, int64_t whole, int64_t depth) {
  float sum = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) +
              ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
  for (int64_t i = whole; i < depth; ++i) {
    sum += a[i] * b[i];
  }
  return sum;
}

// `count` (1 or kKeys) dot products of row `a` with the rows of `b` (`depth` apart), each in the
// one order: lane j sums k = j, j + 8, ... in increasing k, then `finish_dot`.
template <int64_t count>
inline void dot_fixed(const float* __restrict__ a, const float* __restrict__ b, int64_t depth,
                      float* __restrict__ out) {
  float lanes[count][kLanes] = {};
  const int64_t whole = depth - depth % kLanes;
  for (int64_t i = 0; i < whole; i += kLanes) {
    for (int64_t key = 0; key < count; ++key) {
      for (int64_t j = 0; j < kLanes; ++j) {
        lanes[key][j] += a[i + j] * b[key * depth + i + j];
      }
    }
  }
  for (int64_t key = 0; key < count; ++key) {
    out[key] = finish_dot(lanes[key], a, b + key * depth, whole, depth);
  }
}

#ifdef __AVX2__
// The same sums with the 8 lanes in one AVX register per key: a multiply then an add, each
// rounded as the scalar code above rounds them (the build turns contraction off).
template <>
inline void dot_fixed<kKeys>(const float* __restrict__ a, const float* __restrict__ b,
                             int64_t depth, float* __restrict__ out) {
  __m256 lanes[kKeys];
  for (int64_t key = 0; key < kKeys; ++key) {
    lanes[key] = _mm256_setzero_ps();
  }
  const int64_t whole = depth - depth % kLanes;
  for (int64_t i = 0; i < whole; i += kLanes) {
    const __m256 x = _mm256_loadu_ps(a + i);
    for (int64_t key = 0; key < kKeys; ++key) {
      const __m256 y = _mm256_loadu_ps(b + key * depth + i);
      lanes[key] = _mm256_add_ps(lanes[key], _mm256_mul_ps(x, y));
    }
  }
  for (int64_t key = 0; key < kKeys; ++key) {
    float stored[kLanes];
    _mm256_storeu_ps(stored, lanes[key]);
    out[key] = finish_dot(stored, a, b + key * depth, whole, depth);
  }
}
#endif

// c[n] = sum_k a[k] * b[k * stride + n] for `count` columns, k in order.
template <int64_t count>
inline void axpy_fixed(const float* __restrict__ a, const float* __restrict__ b, int64_t depth,
                       int64_t stride, float* __restrict__ c) {
  float acc[count] = {};
  for (int64_t k = 0; k < depth; ++k) {
    const float weight = a[k];
    for (int64_t n = 0; n < count; ++n) {
      acc[n] += weight * b[k * stride + n];
    }
  }
  for (int64_t n = 0; n < count; ++n) {
    c[n] = acc[n];
  }
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
  auto out = torch::empty({left.size(0), rows, cols}, left.options());
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
                   int64_t n = 0;
                   for (; n + kKeys <= cols; n += kKeys) {
                     dot_fixed<kKeys>(a_row, b_item + n * depth, depth, c_row + n);
                   }
                   for (; n < cols; ++n) {
                     dot_fixed<1>(a_row, b_item + n * depth, depth, c_row + n);
                   }
                 });
}

torch::Tensor dot_nn(torch::Tensor left, torch::Tensor right) {
  const int64_t cols = right.size(2);
  return by_rows(left, right, cols,
                 [cols](const float* a_row, const float* b_item, float* c_row, int64_t depth) {
                   int64_t n = 0;
                   for (; n + kColumns <= cols; n += kColumns) {
                     axpy_fixed<kColumns>(a_row, b_item + n, depth, cols, c_row + n);
                   }
                   for (; n < cols; ++n) {
                     axpy_fixed<1>(a_row, b_item + n, depth, cols, c_row + n);
                   }
                 });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("dot_nt", &dot_nt, "left [B, M, K] @ right[B, N, K]^T, fixed order per element");
  m.def("dot_nn", &dot_nn, "left [B, M, K] @ right[B, K, N], fixed order per element");
}
