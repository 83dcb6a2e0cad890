// The package's CPU kernels as torch operators (namespace `specserve`): typed schemas, checked
// arguments, visible to the profiler and to torch.compile (fake implementations in Python).
//
//   gguf_linear(x, weights, types, bias, isa)   x [M, K] float32 times GGUF-quantized weight
//       tensors stacked along N (each its own type, e.g. a fused q/k/v of Q4_K and Q6_K parts)
//   gguf_dequantize(blocks, type, cols)          a tensor's rows as float32
//   gguf_embedding(ids, blocks, type, cols)      the rows `ids` as float32 (an embedding lookup)
//   gguf_round_activations(x, block)             x as the integer kernels see it (tests)
//   cpu_isas()                                   the kernel variants this CPU can run (bit i: ISAS[i])
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <atomic>
#include <string>
#include <vector>

#include "gguf_blocks.h"
#include "qgemm.h"

namespace specserve {
namespace {

// Variant ids, as the Python side names them (specserve.model.gguf_ops.ISAS).
enum Isa : int64_t { kGeneric = 0, kAvx2 = 1 };

bool isa_runs(int64_t isa) {
    switch (isa) {
        case kGeneric: return true;
#if defined(__x86_64__) && defined(SPECSERVE_HAVE_AVX2)
        case kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                           __builtin_cpu_supports("f16c");
#endif
        default: return false;
    }
}

GemmFn gemm_fn(int64_t isa) {
    switch (isa) {
#if defined(__x86_64__) && defined(SPECSERVE_HAVE_AVX2)
        case kAvx2: return avx2::gemm;
#endif
        default: return generic::gemm;
    }
}

int64_t cpu_isas() {
    int64_t mask = 0;
    for (int64_t i = 0; i < 2; i++)
        if (isa_runs(i)) mask |= int64_t(1) << i;
    return mask;
}

TypeInfo checked_type(int64_t type, const char* what) {
    TypeInfo info;
    TORCH_CHECK(type_info((int)type, &info), what, ": ggml type ", type, " is not supported");
    return info;
}

void check_blocks(const at::Tensor& w, int64_t type, int64_t cols, const char* what) {
    const TypeInfo info = checked_type(type, what);
    TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(), what,
                ": expected a contiguous 2-D uint8 CPU tensor of blocks, got ", w.scalar_type(), " ", w.sizes());
    TORCH_CHECK(cols > 0 && cols % info.block_elems == 0, what, ": ", cols, " columns are not a whole number of ",
                info.block_elems, "-element blocks");
    TORCH_CHECK(w.size(1) == cols / info.block_elems * info.block_bytes, what, ": rows of ", w.size(1),
                " bytes do not hold ", cols, " elements of type ", type);
}

// Activations rounded for the weight types present: Q8K blocks for k-quants, Q8B for the others.
struct Rounded {
    at::Tensor k, b;  // uint8 storage
};

Rounded round_activations(const at::Tensor& x, bool k, bool b) {
    const int64_t M = x.size(0), K = x.size(1);
    Rounded r;
    const float* xp = x.data_ptr<float>();
    if (k) r.k = at::empty({M, K / kQK * (int64_t)sizeof(ActQ8K)}, x.options().dtype(at::kByte));
    if (b) r.b = at::empty({M, K / kQ32 * (int64_t)sizeof(ActQ8B)}, x.options().dtype(at::kByte));
    ActQ8K* kp = k ? (ActQ8K*)r.k.data_ptr() : nullptr;
    ActQ8B* bp = b ? (ActQ8B*)r.b.data_ptr() : nullptr;
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
        for (int64_t m = m0; m < m1; m++) {
            if (kp) quantize_q8k(xp + m * K, K, kp + m * (K / kQK));
            if (bp) quantize_q8b(xp + m * K, K, bp + m * (K / kQ32));
        }
    });
    return r;
}

at::Tensor gguf_linear(const at::Tensor& x_in, at::TensorList weights, at::IntArrayRef types,
                       const std::optional<at::Tensor>& bias, int64_t isa) {
    TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat && x_in.dim() == 2,
                "gguf_linear: x must be a 2-D float32 CPU tensor, got ", x_in.scalar_type(), " ", x_in.sizes());
    TORCH_CHECK(!weights.empty() && weights.size() == types.size(),
                "gguf_linear: ", weights.size(), " weight tensors but ", types.size(), " types");
    TORCH_CHECK(isa_runs(isa), "gguf_linear: kernel variant ", isa, " cannot run on this CPU");
    const at::Tensor x = x_in.contiguous();
    const int64_t M = x.size(0), K = x.size(1);
    int64_t N = 0;
    bool need_k = false, need_b = false;
    for (size_t i = 0; i < weights.size(); i++) {
        TORCH_CHECK(is_k_quant((int)types[i]) || is_legacy_quant((int)types[i]), "gguf_linear: weight ", i,
                    " has ggml type ", types[i], ", which has no integer kernel (dequantize it instead)");
        check_blocks(weights[i], types[i], K, "gguf_linear");
        need_k |= is_k_quant((int)types[i]);
        need_b |= is_legacy_quant((int)types[i]);
        N += weights[i].size(0);
    }
    const float* bias_p = nullptr;
    if (bias.has_value() && bias->defined()) {
        TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous(),
                    "gguf_linear: bias must be a contiguous float32 [", N, "], got ", bias->sizes());
        bias_p = bias->data_ptr<float>();
    }
    at::Tensor y = at::empty({M, N}, x.options());
    if (M == 0) return y;
    const Rounded r = round_activations(x, need_k, need_b);

    // Work items: chunks of output columns of every part, taken dynamically by the threads (parts
    // of different types cost different time per column).
    struct Part {
        GemmTask task;
        int64_t rows;
    };
    std::vector<Part> parts;
    std::vector<int64_t> chunk_part, chunk_start;
    int64_t col = 0;
    const int threads = at::get_num_threads();
    for (size_t i = 0; i < weights.size(); i++) {
        const int type = (int)types[i];
        const int64_t rows = weights[i].size(0);
        GemmTask t{type, weights[i].data_ptr<uint8_t>(), weights[i].size(1), K,
                   is_k_quant(type) ? r.k.data_ptr() : r.b.data_ptr(), M, y.data_ptr<float>() + col, N,
                   bias_p ? bias_p + col : nullptr};
        parts.push_back({t, rows});
        // chunks small enough to balance the threads, large enough to amortise taking them
        int64_t chunk = rows / (8 * threads);
        chunk = chunk < 8 ? 8 : (chunk > 256 ? 256 : chunk);
        for (int64_t s = 0; s < rows; s += chunk) {
            chunk_part.push_back((int64_t)parts.size() - 1);
            chunk_start.push_back(s);
        }
        col += rows;
    }
    const GemmFn fn = gemm_fn(isa);
    std::atomic<int64_t> next{0};
    const int64_t total = (int64_t)chunk_part.size();
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
        for (int64_t c = next++; c < total; c = next++) {
            const Part& p = parts[chunk_part[c]];
            const int64_t s = chunk_start[c];
            const int64_t e = (c + 1 < total && chunk_part[c + 1] == chunk_part[c]) ? chunk_start[c + 1] : p.rows;
            fn(p.task, s, e);
        }
    });
    return y;
}

at::Tensor gguf_dequantize(const at::Tensor& blocks, int64_t type, int64_t cols) {
    check_blocks(blocks, type, cols, "gguf_dequantize");
    const int64_t N = blocks.size(0), rb = blocks.size(1);
    at::Tensor out = at::empty({N, cols}, blocks.options().dtype(at::kFloat));
    const uint8_t* src = blocks.data_ptr<uint8_t>();
    float* dst = out.data_ptr<float>();
    at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
        for (int64_t n = n0; n < n1; n++) dequantize_row((int)type, src + n * rb, cols, dst + n * cols);
    });
    return out;
}

at::Tensor gguf_embedding(const at::Tensor& ids_in, const at::Tensor& blocks, int64_t type, int64_t cols) {
    check_blocks(blocks, type, cols, "gguf_embedding");
    TORCH_CHECK(ids_in.device().is_cpu() && (ids_in.scalar_type() == at::kLong || ids_in.scalar_type() == at::kInt),
                "gguf_embedding: ids must be an integer CPU tensor, got ", ids_in.scalar_type());
    const at::Tensor ids = ids_in.to(at::kLong).contiguous();
    const int64_t T = ids.numel(), N = blocks.size(0), rb = blocks.size(1);
    const int64_t* idp = ids.data_ptr<int64_t>();
    for (int64_t i = 0; i < T; i++)
        TORCH_CHECK(idp[i] >= 0 && idp[i] < N, "gguf_embedding: token id ", idp[i], " is outside the vocabulary of ", N);
    std::vector<int64_t> shape(ids_in.sizes().begin(), ids_in.sizes().end());
    shape.push_back(cols);
    at::Tensor out = at::empty(shape, blocks.options().dtype(at::kFloat));
    const uint8_t* src = blocks.data_ptr<uint8_t>();
    float* dst = out.data_ptr<float>();
    at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; t++) dequantize_row((int)type, src + idp[t] * rb, cols, dst + t * cols);
    });
    return out;
}

at::Tensor gguf_round_activations(const at::Tensor& x_in, int64_t block) {
    TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat && x_in.dim() == 2,
                "gguf_round_activations: x must be a 2-D float32 CPU tensor");
    TORCH_CHECK(block == kQK || block == kQ32, "gguf_round_activations: block must be 256 or 32, got ", block);
    TORCH_CHECK(x_in.size(1) % block == 0, "gguf_round_activations: ", x_in.size(1), " columns are not whole blocks");
    const at::Tensor x = x_in.contiguous();
    const Rounded r = round_activations(x, block == kQK, block == kQ32);
    const int64_t M = x.size(0), K = x.size(1);
    at::Tensor out = at::empty({M, K}, x.options());
    float* o = out.data_ptr<float>();
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < K / block; b++) {
            float d;
            const int8_t* q;
            if (block == kQK) {
                const ActQ8K& a = ((const ActQ8K*)r.k.data_ptr())[m * (K / kQK) + b];
                d = a.d;
                q = a.qs;
            } else {
                const ActQ8B& a = ((const ActQ8B*)r.b.data_ptr())[m * (K / kQ32) + b];
                d = a.d;
                q = a.qs;
            }
            for (int64_t j = 0; j < block; j++) o[m * K + b * block + j] = d * (float)q[j];
        }
    return out;
}

}  // namespace
}  // namespace specserve

TORCH_LIBRARY(specserve, m) {
    m.def("gguf_linear(Tensor x, Tensor[] weights, int[] types, Tensor? bias, int isa) -> Tensor");
    m.def("gguf_dequantize(Tensor blocks, int type, int cols) -> Tensor");
    m.def("gguf_embedding(Tensor ids, Tensor blocks, int type, int cols) -> Tensor");
    m.def("gguf_round_activations(Tensor x, int block) -> Tensor");
    m.def("cpu_isas() -> int", &specserve::cpu_isas);
}

TORCH_LIBRARY_IMPL(specserve, CPU, m) {
    m.impl("gguf_linear", &specserve::gguf_linear);
    m.impl("gguf_dequantize", &specserve::gguf_dequantize);
    m.impl("gguf_embedding", &specserve::gguf_embedding);
    m.impl("gguf_round_activations", &specserve::gguf_round_activations);
}
