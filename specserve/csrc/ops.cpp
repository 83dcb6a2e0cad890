// The package's CPU kernels as torch operators (namespace `specserve`): typed schemas, checked
// arguments, visible to the profiler and to torch.compile (fake implementations in Python).
//
//   gguf_linear(x, weights, types, bias, isa, prefetch)   x [M, K] float32 times GGUF-quantized weight
//       tensors stacked along N (each its own type, e.g. a fused q/k/v of Q4_K and Q6_K parts);
//       prefetch: the packed kernels' prefetch policy (qgemm.h, kPrefetchPolicies)
//   gguf_dequantize(blocks, type, cols)          a tensor's rows as float32
//   gguf_embedding(ids, blocks, type, cols)      the rows `ids` as float32 (an embedding lookup)
//   gguf_round_activations(x, block)             x as the integer kernels see it (tests)
//   gguf_pack(blocks, type, cols, packed_type)   Q4_K rows repacked 8 or 16 at a time, Q6_K 16 (gguf_packed.h)
//   gguf_pack_(out!, blocks, type, cols, packed_type)   the same into rows of `out`
//   gguf_quantize_q4_0(blocks, type, cols)       a tensor's rows rounded to Q4_0 blocks (a draft model's)
//   gguf_q5_0_as_q8_0(blocks, cols)              Q5_0 rows as the Q8_0 blocks that hold the same numbers
//   cpu_isas()                                   the kernel variants this CPU can run (bit i: ISAS[i])
//   gguf_skip_strings(data, pos, count)          the offset after `count` GGUF strings at `pos` in a
//       file's bytes (a header's 151k-token vocabulary: 0.1 s in Python), -1 when they run past the end
// (kernel_ops.cpp adds the layer's other kernels and the native layer loop.)
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>
#include <ATen/ops/empty.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "gguf_blocks.h"
#include "gguf_packed.h"
#include "ops.h"
#include "qgemm.h"

namespace specserve {

bool isa_runs(int64_t isa) {
    switch (isa) {
        case kGeneric: return true;
#if defined(__x86_64__) && defined(SPECSERVE_HAVE_AVX2)
        case kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                           __builtin_cpu_supports("f16c");
#endif
#if defined(__x86_64__) && defined(SPECSERVE_HAVE_AVX512)
        case kAvx512Vnni: return isa_runs(kAvx2) && __builtin_cpu_supports("avx512f") &&
                                 __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                                 __builtin_cpu_supports("avx512vnni");
#endif
        default: return false;
    }
}

// Whether variant `isa` has kernels for weights of `type`: every variant reads the file's types and
// its own packed layout (AVX-512's reads AVX2's too: it runs the AVX2 code for it); the portable one
// reads every packed layout by unpacking it.
bool variant_reads(int64_t isa, int type) {
    if (!is_packed(type) || isa == kGeneric) return true;
    return type == kQ4_Kx8 ? (isa == kAvx2 || isa == kAvx512Vnni) : isa == kAvx512Vnni;  // sixteen rows: AVX-512
}

namespace {

GemmFn gemm_fn(int64_t isa) {
    switch (isa) {
#if defined(__x86_64__) && defined(SPECSERVE_HAVE_AVX2)
        case kAvx2: return avx2::gemm;
#endif
#if defined(__x86_64__) && defined(SPECSERVE_HAVE_AVX512)
        case kAvx512Vnni: return avx512::gemm;
#endif
        default: return generic::gemm;
    }
}

int64_t cpu_isas() {
    int64_t mask = 0;
    for (int64_t i = 0; i < kIsaCount; i++)
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
    TORCH_CHECK(w.size(0) % pack_rows((int)type) == 0, what, ": a packed tensor (type ", type, ") has a multiple of ",
                pack_rows((int)type), " rows, got ", w.size(0));
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

}  // namespace

void linear_core(const LinearPart* parts, int n_parts, const float* x, int64_t M, int64_t K, float* y,
                 const float* bias, int64_t isa, int64_t prefetch) {
    bool need_k = false, need_b = false;
    int64_t N = 0;
    for (int i = 0; i < n_parts; i++) {
        need_k |= is_k_quant((int)parts[i].type);
        need_b |= is_legacy_quant((int)parts[i].type);
        N += parts[i].rows;
    }
    if (M == 0 || N == 0) return;
    // per-thread scratch for the rounded activations (reused across calls)
    thread_local std::vector<uint8_t> scratch_k, scratch_b;
    ActQ8K* xk = nullptr;
    ActQ8B* xb = nullptr;
    if (need_k) {
        scratch_k.resize((size_t)M * (K / kQK) * sizeof(ActQ8K));
        xk = (ActQ8K*)scratch_k.data();
    }
    if (need_b) {
        scratch_b.resize((size_t)M * (K / kQ32) * sizeof(ActQ8B));
        xb = (ActQ8B*)scratch_b.data();
    }
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
        for (int64_t m = m0; m < m1; m++) {
            if (xk) quantize_q8k(x + m * K, K, xk + m * (K / kQK));
            if (xb) quantize_q8b(x + m * K, K, xb + m * (K / kQ32));
        }
    });
    const int threads = at::get_num_threads();
    struct Chunk {
        int part;
        int64_t start, end;
    };
    thread_local std::vector<Chunk> chunks;
    thread_local std::vector<GemmTask> tasks;
    chunks.clear();
    tasks.clear();
    int64_t col = 0;
    for (int i = 0; i < n_parts; i++) {
        const int type = (int)parts[i].type;
        tasks.push_back(GemmTask{type, parts[i].w, parts[i].row_bytes, K,
                                 is_k_quant(type) ? (const void*)xk : (const void*)xb, M, y + col, N,
                                 bias ? bias + col : nullptr, prefetch});
        // small enough to balance the threads, large enough that each stretch of weights streams well:
        // every chunk starts a new stream the prefetchers ramp up on (measured on the 1.5B, 2-core
        // Zen 4, one process, eight interleaved rounds: two chunks a thread of up to 4096 rows against
        // four of up to 256, one row 36.5 -> 33.7 ms, 4 rows 42.5 -> 38.4; the bundled 135M model one
        // row 7.7 -> 7.0 ms; one chunk a thread no better than two)
        int64_t chunk = parts[i].rows / (2 * threads);
        chunk = chunk < 8 ? 8 : (chunk > 4096 ? 4096 : chunk);
        const int group = pack_rows(type);  // a packed part is taken in whole groups of rows
        chunk = chunk < group ? group : chunk - chunk % group;
        for (int64_t s = 0; s < parts[i].rows; s += chunk)
            chunks.push_back({i, s, s + chunk < parts[i].rows ? s + chunk : parts[i].rows});
        col += parts[i].rows;
    }
    const GemmFn fn = gemm_fn(isa);
    std::atomic<int64_t> next{0};
    const int64_t total = (int64_t)chunks.size();
    const Chunk* cs = chunks.data();
    const GemmTask* ts = tasks.data();
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
        for (int64_t c = next++; c < total; c = next++) fn(ts[cs[c].part], cs[c].start, cs[c].end);
    });
}

namespace {

at::Tensor gguf_linear(const at::Tensor& x_in, at::TensorList weights, at::IntArrayRef types,
                       const std::optional<at::Tensor>& bias, int64_t isa, int64_t prefetch) {
    TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat && x_in.dim() == 2,
                "gguf_linear: x must be a 2-D float32 CPU tensor, got ", x_in.scalar_type(), " ", x_in.sizes());
    TORCH_CHECK(!weights.empty() && weights.size() == types.size() && weights.size() <= (size_t)kMaxParts,
                "gguf_linear: ", weights.size(), " weight tensors and ", types.size(), " types (1 to ", kMaxParts, ")");
    TORCH_CHECK(isa_runs(isa), "gguf_linear: kernel variant ", isa, " cannot run on this CPU");
    TORCH_CHECK(prefetch >= 0 && prefetch < kPrefetchPolicyCount, "gguf_linear: prefetch policy must be 0 to ",
                kPrefetchPolicyCount - 1, ", got ", prefetch);
    const at::Tensor x = x_in.contiguous();
    const int64_t M = x.size(0), K = x.size(1);
    LinearPart parts[kMaxParts];
    int64_t N = 0;
    for (size_t i = 0; i < weights.size(); i++) {
        TORCH_CHECK(is_k_quant((int)types[i]) || is_legacy_quant((int)types[i]), "gguf_linear: weight ", i,
                    " has ggml type ", types[i], ", which has no integer kernel (dequantize it instead)");
        check_blocks(weights[i], types[i], K, "gguf_linear");
        TORCH_CHECK(variant_reads(isa, (int)types[i]), "gguf_linear: kernel variant ", isa, " has no kernel for weight ",
                    i, "'s packed type ", types[i]);
        parts[i] = {weights[i].data_ptr<uint8_t>(), weights[i].size(1), weights[i].size(0), types[i]};
        N += weights[i].size(0);
    }
    const float* bias_p = nullptr;
    if (bias.has_value() && bias->defined()) {
        TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous(),
                    "gguf_linear: bias must be a contiguous float32 [", N, "], got ", bias->sizes());
        bias_p = bias->data_ptr<float>();
    }
    at::Tensor y = at::empty({M, N}, x.options());
    linear_core(parts, (int)weights.size(), x.data_ptr<float>(), M, K, y.data_ptr<float>(), bias_p, isa, prefetch);
    return y;
}

at::Tensor gguf_dequantize(const at::Tensor& blocks, int64_t type, int64_t cols) {
    check_blocks(blocks, type, cols, "gguf_dequantize");
    const int64_t N = blocks.size(0), rb = blocks.size(1);
    at::Tensor out = at::empty({N, cols}, blocks.options().dtype(at::kFloat));
    const uint8_t* src = blocks.data_ptr<uint8_t>();
    float* dst = out.data_ptr<float>();
    if (is_packed((int)type)) {  // each group of rows back in the file's blocks, then as those
        const int file_type = unpacked_type_of((int)type), R = pack_rows((int)type);
        TypeInfo info;
        type_info(file_type, &info);
        const int64_t nb = cols / info.block_elems, file_rb = nb * info.block_bytes;
        at::parallel_for(0, N / R, 8, [&](int64_t g0, int64_t g1) {
            std::vector<uint8_t> rows((size_t)(R * file_rb));
            for (int64_t g = g0; g < g1; g++) {
                unpack_group((int)type, src + g * R * rb, nb, rows.data(), file_rb);
                for (int r = 0; r < R; r++)
                    dequantize_row(file_type, rows.data() + r * file_rb, cols, dst + (g * R + r) * cols);
            }
        });
        return out;
    }
    at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
        for (int64_t n = n0; n < n1; n++) dequantize_row((int)type, src + n * rb, cols, dst + n * cols);
    });
    return out;
}

// The packed rows of `blocks` into `out` ([rows, packed bytes per row], contiguous).
void pack_into(const at::Tensor& blocks, int64_t type, int64_t cols, int64_t packed_type, const at::Tensor& out,
               const char* what) {
    check_blocks(blocks, type, cols, what);
    TORCH_CHECK(packs((int)packed_type, (int)type), what, ": ggml type ", type, " has no packed layout ", packed_type,
                " (Q4_K has 112: eight rows, and 212: sixteen; Q6_K 214, Q4_0 202, Q4_1 203, Q8_0 208: sixteen)");
    const int R = pack_rows((int)packed_type);
    TypeInfo info;
    type_info((int)packed_type, &info);
    const int64_t N = blocks.size(0), rb = blocks.size(1), nb = cols / info.block_elems;
    TORCH_CHECK(N % R == 0, what, ": ", N, " rows are not whole groups of ", R);
    TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kByte && out.dim() == 2 && out.is_contiguous() &&
                    out.size(0) == N && out.size(1) == nb * info.block_bytes,
                what, ": out must be a contiguous uint8 [", N, ", ", nb * info.block_bytes, "], got ", out.sizes());
    const uint8_t* src = blocks.data_ptr<uint8_t>();
    uint8_t* dst = out.data_ptr<uint8_t>();
    const int64_t group_bytes = R * nb * info.block_bytes;
    at::parallel_for(0, N / R, 16, [&](int64_t g0, int64_t g1) {
        for (int64_t g = g0; g < g1; g++) pack_group((int)packed_type, src + g * R * rb, rb, nb, dst + g * group_bytes);
    });
}

at::Tensor gguf_pack(const at::Tensor& blocks, int64_t type, int64_t cols, int64_t packed_type) {
    TypeInfo info;
    TORCH_CHECK(type_info((int)packed_type, &info), "gguf_pack: packed type ", packed_type, " is not supported");
    at::Tensor out = at::empty({blocks.size(0), cols / info.block_elems * info.block_bytes}, blocks.options());
    pack_into(blocks, type, cols, packed_type, out, "gguf_pack");
    return out;
}

void gguf_pack_(const at::Tensor& out, const at::Tensor& blocks, int64_t type, int64_t cols, int64_t packed_type) {
    pack_into(blocks, type, cols, packed_type, out, "gguf_pack_");
}

// Rows of `type` rounded to Q4_0 blocks by ggml's reference rule as gguf-py computes it (the same
// bytes: tests/test_gguf.py): per 32 weights the one of largest magnitude (the first of equals)
// sets d = max / -8, each weight becomes min(15, trunc(x / d + 8.5)) (x times 1/d, in float32,
// not fused), d is stored as IEEE half rounded to nearest even. Row by row through a float buffer
// of one row, on every core (the numpy version took 4.8 s for the 0.5B draft model, this ~0.1).
at::Tensor gguf_quantize_q4_0(const at::Tensor& blocks, int64_t type, int64_t cols) {
    check_blocks(blocks, type, cols, "gguf_quantize_q4_0");
    TORCH_CHECK(!is_packed((int)type), "gguf_quantize_q4_0: a packed tensor (type ", type, ") is rounded from its file's blocks");
    TORCH_CHECK(cols % 32 == 0, "gguf_quantize_q4_0: ", cols, " columns are not whole 32-element blocks");
    const int64_t N = blocks.size(0), rb = blocks.size(1), nb = cols / 32;
    at::Tensor out = at::empty({N, nb * 18}, blocks.options());
    const uint8_t* src = blocks.data_ptr<uint8_t>();
    uint8_t* dst = out.data_ptr<uint8_t>();
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
        std::vector<float> row((size_t)cols);
        for (int64_t n = n0; n < n1; n++) {
            dequantize_row((int)type, src + n * rb, cols, row.data());
            uint8_t* o = dst + n * nb * 18;
            for (int64_t b = 0; b < nb; b++, o += 18) {
                const float* x = row.data() + b * 32;
                float amax = std::fabs(x[0]), max = x[0];  // x[0] itself: -0.0 when all are zeros of it
                for (int j = 1; j < 32; j++)
                    if (std::fabs(x[j]) > amax) {
                        amax = std::fabs(x[j]);
                        max = x[j];
                    }
                const float d = max / -8.0f;
                const float id = d == 0.0f ? 0.0f : 1.0f / d;
                int32_t q[32];
                for (int j = 0; j < 32; j++) {  // (int) truncates as trunc does for the values here (> -1)
                    const int32_t v = (int32_t)(x[j] * id + 8.5f);
                    q[j] = v > 15 ? 15 : (v < 0 ? 0 : v);
                }
                const uint16_t h = c10::Half(d).x;
                std::memcpy(o, &h, 2);
                for (int j = 0; j < 16; j++) o[2 + j] = (uint8_t)(q[j] | (q[j + 16] << 4));
            }
        }
    });
    return out;
}

// Q5_0 rows ([rows, 22 * n] bytes: fp16 d, 32 high bits, 16 bytes of low nibbles) as Q8_0 rows
// ([rows, 34 * n]: the same d, then the 32 elements as int8) holding the same numbers exactly:
// element j < 16 is (qs[j] & 15 | bit j of qh << 4) - 16, element j + 16 is (qs[j] >> 4 | bit
// j + 16 of qh << 4) - 16. Q5_0 has no kernel of its own.
at::Tensor gguf_q5_0_as_q8_0(const at::Tensor& blocks, int64_t cols) {
    TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
                "gguf_q5_0_as_q8_0: expected a contiguous 2-D uint8 CPU tensor of blocks, got ", blocks.scalar_type(), " ",
                blocks.sizes());
    TORCH_CHECK(cols > 0 && cols % 32 == 0 && blocks.size(1) == cols / 32 * 22, "gguf_q5_0_as_q8_0: rows of ",
                blocks.size(1), " bytes are not ", cols, " elements of Q5_0");
    const int64_t N = blocks.size(0), nb = cols / 32;
    at::Tensor out = at::empty({N, nb * 34}, blocks.options());
    const uint8_t* src = blocks.data_ptr<uint8_t>();
    uint8_t* dst = out.data_ptr<uint8_t>();
    at::parallel_for(0, N * nb, 4096, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; b++) {
            const uint8_t* s = src + b * 22;
            uint8_t* o = dst + b * 34;
            uint32_t qh;
            std::memcpy(&qh, s + 2, 4);  // little-endian, as GGUF is
            o[0] = s[0];
            o[1] = s[1];
            for (int j = 0; j < 16; j++) {
                o[2 + j] = (uint8_t)(int8_t)((int)((s[6 + j] & 15) | (((qh >> j) & 1) << 4)) - 16);
                o[18 + j] = (uint8_t)(int8_t)((int)((s[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
            }
        }
    });
    return out;
}

at::Tensor gguf_embedding(const at::Tensor& ids_in, const at::Tensor& blocks, int64_t type, int64_t cols) {
    check_blocks(blocks, type, cols, "gguf_embedding");
    TORCH_CHECK(!is_packed((int)type), "gguf_embedding: a packed tensor (type ", type, ") is not a lookup table");
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

int64_t gguf_skip_strings(const at::Tensor& data, int64_t pos, int64_t count) {
    TORCH_CHECK(data.device().is_cpu() && data.scalar_type() == at::kByte && data.dim() == 1 && data.is_contiguous(),
                "gguf_skip_strings: data must be a contiguous 1-D uint8 CPU tensor");
    TORCH_CHECK(pos >= 0 && count >= 0, "gguf_skip_strings: pos and count must be >= 0, got ", pos, ", ", count);
    const uint8_t* p = data.data_ptr<uint8_t>();
    const uint64_t end = (uint64_t)data.numel();
    uint64_t at = (uint64_t)pos;
    for (int64_t i = 0; i < count; i++) {
        if (at > end || end - at < 8) return -1;
        uint64_t n;
        std::memcpy(&n, p + at, 8);  // little-endian, as GGUF is (and every CPU this builds for)
        if (n > end - at - 8) return -1;
        at += 8 + n;
    }
    return (int64_t)at;
}

}  // namespace specserve

TORCH_LIBRARY(specserve, m) {
    m.def("gguf_linear(Tensor x, Tensor[] weights, int[] types, Tensor? bias, int isa, int prefetch=0) -> Tensor");
    m.def("gguf_dequantize(Tensor blocks, int type, int cols) -> Tensor");
    m.def("gguf_embedding(Tensor ids, Tensor blocks, int type, int cols) -> Tensor");
    m.def("gguf_round_activations(Tensor x, int block) -> Tensor");
    m.def("gguf_pack(Tensor blocks, int type, int cols, int packed_type) -> Tensor");
    m.def("gguf_pack_(Tensor(a!) out, Tensor blocks, int type, int cols, int packed_type) -> ()");
    m.def("gguf_quantize_q4_0(Tensor blocks, int type, int cols) -> Tensor");
    m.def("gguf_q5_0_as_q8_0(Tensor blocks, int cols) -> Tensor");
    m.def("cpu_isas() -> int", &specserve::cpu_isas);
    m.def("gguf_skip_strings(Tensor data, int pos, int count) -> int", &specserve::gguf_skip_strings);
}

TORCH_LIBRARY_IMPL(specserve, CPU, m) {
    m.impl("gguf_linear", &specserve::gguf_linear);
    m.impl("gguf_dequantize", &specserve::gguf_dequantize);
    m.impl("gguf_embedding", &specserve::gguf_embedding);
    m.impl("gguf_round_activations", &specserve::gguf_round_activations);
    m.impl("gguf_pack", &specserve::gguf_pack);
    m.impl("gguf_pack_", &specserve::gguf_pack_);
    m.impl("gguf_quantize_q4_0", &specserve::gguf_quantize_q4_0);
    m.impl("gguf_q5_0_as_q8_0", &specserve::gguf_q5_0_as_q8_0);
}
