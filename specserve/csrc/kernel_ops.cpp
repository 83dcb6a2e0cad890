// The layer's kernels besides the GGUF products as torch operators (namespace `specserve`), each
// taking the variant id (ISAS) that runs it, with its arguments checked:
//
//   linear_f32(x, weight, bias, isa)                         float32 weights [N, K]
//   linear_int8(x, q, scale, bias, isa)                      int8 weights, a scale per row
//   linear_int4(x, packed, scale, minimum, bias, isa)        int4 weights in Q4_1-like groups of 32
//   int8_round_activations(x, isa)                           x as the int8/int4 products see it (tests)
//   paged_attention(q, k_cache, v_cache, <metadata>, scale, isa, lanes=0)   attention over the paged cache
//                                                            (lanes 8: the eight-lane task where a wider one is compiled)
//   write_kv(k, v, k_cache!, v_cache!, slots, isa)           new K/V into their cache slots
//   rope_(x!, n_heads, head_dim, cos, sin, isa)              rotary embedding in place
//   rms_norm(x, weight, eps, isa), silu_mul(gate_up, isa)
//   row_topk(x, k, isa)                                      each row's k largest values' indices
//   row_argmax(x, isa)                                       each row's argmax (numpy's: NaN largest, first of ties),
//                                                            then 1 where the value there is finite: [2, T]
//   decoder_forward(decoder, x, n_layers, cos, sin, slots, <metadata>, scale, first_layer=0, lanes=0)
//       layers first_layer .. first_layer + n_layers - 1 of a step in one call, over a `Decoder` (a torch class holding the layers'
//       weights and caches), with the same kernels as the operators above.
//
// The kernels are the C sources compiled once per variant (cpu_kernels.h).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <memory>
#include <optional>
#include <vector>

#include "cpu_kernels.h"
#include "ops.h"

namespace specserve {
namespace {

const specserve_cpu_kernels& kernels(int64_t isa, const char* what) {
    TORCH_CHECK(isa_runs(isa), what, ": kernel variant ", isa, " cannot run on this CPU");
    switch (isa) {
#if defined(__x86_64__) && defined(SPECSERVE_HAVE_AVX2)
        case kAvx2: return *specserve_cpu_kernels_avx2();
#endif
#if defined(__x86_64__) && defined(SPECSERVE_HAVE_AVX512)
        case kAvx512Vnni: return *specserve_cpu_kernels_avx512();
#endif
        default: return *specserve_cpu_kernels_generic();
    }
}

void check_cpu(const at::Tensor& t, at::ScalarType dtype, int64_t dim, const char* what, const char* name) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.dim() == dim, what, ": ", name,
                " must be a ", dim, "-D ", dtype, " CPU tensor, got ", t.scalar_type(), " ", t.sizes(), " on ",
                t.device());
}

void check_contiguous(const at::Tensor& t, at::ScalarType dtype, int64_t dim, const char* what, const char* name) {
    check_cpu(t, dtype, dim, what, name);
    TORCH_CHECK(t.is_contiguous(), what, ": ", name, " must be contiguous");
}

const float* bias_ptr(const std::optional<at::Tensor>& bias, int64_t N, const char* what) {
    if (!bias.has_value() || !bias->defined()) return nullptr;
    check_contiguous(*bias, at::kFloat, 1, what, "bias");
    TORCH_CHECK(bias->size(0) == N, what, ": bias has ", bias->size(0), " values for ", N, " outputs");
    return bias->data_ptr<float>();
}

at::Tensor rows_f32(const at::Tensor& x, const char* what) {
    check_cpu(x, at::kFloat, 2, what, "x");
    return x.contiguous();
}

void check_rc(int rc, const char* what) { TORCH_CHECK(rc == 0, what, ": the kernel rejected its arguments (code ", rc, ")"); }

at::Tensor linear_f32(const at::Tensor& x_in, const at::Tensor& w, const std::optional<at::Tensor>& bias, int64_t isa) {
    const char* what = "linear_f32";
    const auto& k = kernels(isa, what);
    const at::Tensor x = rows_f32(x_in, what);
    check_contiguous(w, at::kFloat, 2, what, "weight");
    TORCH_CHECK(w.size(1) == x.size(1), what, ": x has ", x.size(1), " columns, the weight ", w.size(1));
    at::Tensor y = at::empty({x.size(0), w.size(0)}, x.options());
    if (x.size(0))
        check_rc(k.gemm_f32(x.data_ptr<float>(), (int)x.size(0), (int)x.size(1), w.data_ptr<float>(), (int)w.size(0),
                            y.data_ptr<float>(), bias_ptr(bias, w.size(0), what)), what);
    return y;
}

at::Tensor linear_int8(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias, int64_t isa) {
    const char* what = "linear_int8";
    const auto& k = kernels(isa, what);
    const at::Tensor x = rows_f32(x_in, what);
    check_contiguous(q, at::kChar, 2, what, "q");
    check_contiguous(scale, at::kFloat, 1, what, "scale");
    const int64_t N = q.size(0), K = q.size(1);
    TORCH_CHECK(x.size(1) == K && K % 32 == 0, what, ": x has ", x.size(1), " columns, the weight ", K,
                " (a multiple of 32)");
    TORCH_CHECK(scale.size(0) == N, what, ": ", scale.size(0), " scales for ", N, " rows");
    at::Tensor y = at::empty({x.size(0), N}, x.options());
    if (x.size(0))
        check_rc(k.linear_i8q8(x.data_ptr<float>(), (int)x.size(0), (int)K, q.data_ptr<int8_t>(),
                               scale.data_ptr<float>(), (int)N, y.data_ptr<float>(), bias_ptr(bias, N, what)), what);
    return y;
}

at::Tensor linear_int4(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scale,
                       const at::Tensor& minimum, const std::optional<at::Tensor>& bias, int64_t isa) {
    const char* what = "linear_int4";
    const auto& k = kernels(isa, what);
    const at::Tensor x = rows_f32(x_in, what);
    check_contiguous(packed, at::kByte, 2, what, "packed");
    check_contiguous(scale, at::kFloat, 2, what, "scale");
    check_contiguous(minimum, at::kFloat, 2, what, "minimum");
    const int64_t N = packed.size(0), K = packed.size(1) * 2;
    TORCH_CHECK(x.size(1) == K && K % 32 == 0, what, ": x has ", x.size(1), " columns, the weight ", K,
                " (a multiple of 32)");
    TORCH_CHECK(scale.sizes() == minimum.sizes() && scale.size(0) == N && scale.size(1) == K / 32, what,
                ": scale and minimum must be [", N, ", ", K / 32, "], got ", scale.sizes(), " and ", minimum.sizes());
    at::Tensor y = at::empty({x.size(0), N}, x.options());
    if (x.size(0))
        check_rc(k.linear_i4q8(x.data_ptr<float>(), (int)x.size(0), (int)K, packed.data_ptr<uint8_t>(),
                               scale.data_ptr<float>(), minimum.data_ptr<float>(), (int)N, y.data_ptr<float>(),
                               bias_ptr(bias, N, what)), what);
    return y;
}

at::Tensor int8_round_activations(const at::Tensor& x_in, int64_t isa) {
    const char* what = "int8_round_activations";
    const auto& k = kernels(isa, what);
    const at::Tensor x = rows_f32(x_in, what);
    TORCH_CHECK(x.size(1) % 32 == 0, what, ": ", x.size(1), " columns are not whole blocks of 32");
    at::Tensor out = at::empty_like(x);
    k.fake_quant_q8(x.data_ptr<float>(), (int)x.size(0), (int)x.size(1), out.data_ptr<float>());
    return out;
}

// The items of an attention call (one per sequence of the step): checked against each other, the
// queries and the cache, so a kernel never reads outside them.
struct AttentionItems {
    const at::Tensor &q_start, &q_len, &ctx_len, &tables, &table_off, &masks, &mask_off;

    int64_t check(int64_t T, int64_t num_blocks, int64_t block_size, const char* what) const {
        check_contiguous(q_start, at::kInt, 1, what, "q_start");
        const int64_t n = q_start.size(0);
        for (const at::Tensor* t : {&q_len, &ctx_len, &table_off}) {
            check_contiguous(*t, at::kInt, 1, what, "q_len, ctx_len and table_off");
            TORCH_CHECK(t->size(0) == n, what, ": ", n, " items in q_start, ", t->size(0), " in another item field");
        }
        check_contiguous(mask_off, at::kLong, 1, what, "mask_off");
        TORCH_CHECK(mask_off.size(0) == n, what, ": ", n, " items in q_start, ", mask_off.size(0), " in mask_off");
        check_contiguous(tables, at::kInt, 1, what, "tables");
        check_contiguous(masks, at::kByte, 1, what, "masks");
        const int32_t *qs = q_start.data_ptr<int32_t>(), *ql = q_len.data_ptr<int32_t>(),
                      *cl = ctx_len.data_ptr<int32_t>(), *to = table_off.data_ptr<int32_t>(),
                      *tb = tables.data_ptr<int32_t>();
        const int64_t* mo = mask_off.data_ptr<int64_t>();
        for (int64_t i = 0; i < n; i++) {
            TORCH_CHECK(qs[i] >= 0 && ql[i] >= 0 && qs[i] + ql[i] <= T, what, ": item ", i, " has query rows [",
                        qs[i], ", ", qs[i] + ql[i], ") of ", T);
            TORCH_CHECK(cl[i] >= ql[i], what, ": item ", i, " sees ", cl[i], " keys, fewer than its ", ql[i], " queries");
            const int64_t blocks = (cl[i] + block_size - 1) / block_size;
            TORCH_CHECK(to[i] >= 0 && to[i] + blocks <= tables.size(0), what, ": item ", i, "'s ", blocks,
                        " blocks from offset ", to[i], " run past the ", tables.size(0), " table entries");
            for (int64_t b = 0; b < blocks; b++)
                TORCH_CHECK(tb[to[i] + b] >= 0 && tb[to[i] + b] < num_blocks, what, ": item ", i, " names block ",
                            tb[to[i] + b], " of a cache of ", num_blocks);
            TORCH_CHECK(mo[i] == -1 || (mo[i] >= 0 && mo[i] + (int64_t)ql[i] * ql[i] <= masks.size(0)), what,
                        ": item ", i, "'s mask at ", mo[i], " runs past the ", masks.size(0), " mask bytes");
        }
        return n;
    }
};

void check_cache(const at::Tensor& k_cache, const at::Tensor& v_cache, const char* what) {
    TORCH_CHECK(k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kBFloat16, what,
                ": the cache must be float32 or bfloat16, got ", k_cache.scalar_type());
    check_contiguous(k_cache, k_cache.scalar_type(), 4, what, "k_cache");
    check_contiguous(v_cache, k_cache.scalar_type(), 4, what, "v_cache");
    TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), what, ": k_cache ", k_cache.sizes(), " and v_cache ",
                v_cache.sizes(), " differ");
}

// Attention's vector width: 0, the widest task the variant has for the head dim; 8, the eight-lane one.
void check_lanes(int64_t lanes, const char* what) {
    TORCH_CHECK(lanes == 0 || lanes == 8, what, ": lanes must be 0 (the widest) or 8, got ", lanes);
}

// q [T, H, D] float32 with rows q.stride(0) floats apart (a view of a fused q/k/v may be).
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& q_start, const at::Tensor& q_len, const at::Tensor& ctx_len,
                           const at::Tensor& tables, const at::Tensor& table_off, const at::Tensor& masks,
                           const at::Tensor& mask_off, double scale, int64_t isa, int64_t lanes) {
    const char* what = "paged_attention";
    check_lanes(lanes, what);
    const auto& k = kernels(isa, what);
    check_cpu(q, at::kFloat, 3, what, "q");
    check_cache(k_cache, v_cache, what);
    const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(2), BS = k_cache.size(1);
    TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == D, what, ": q's heads must be contiguous within a row");
    TORCH_CHECK(k_cache.size(3) == D, what, ": the cache's head dim ", k_cache.size(3), " is not q's ", D);
    const int64_t n = AttentionItems{q_start, q_len, ctx_len, tables, table_off, masks, mask_off}.check(
        T, k_cache.size(0), BS, what);
    at::Tensor out = at::empty({T, H, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
    if (n == 0) return out.zero_();
    const bool bf16 = k_cache.scalar_type() == at::kBFloat16;
    const int rc = bf16 ? k.paged_attention_bf16(q.data_ptr<float>(), (const uint16_t*)k_cache.data_ptr(),
                                                 (const uint16_t*)v_cache.data_ptr(), out.data_ptr<float>(), (int)n,
                                                 q_start.data_ptr<int32_t>(), q_len.data_ptr<int32_t>(),
                                                 ctx_len.data_ptr<int32_t>(), tables.data_ptr<int32_t>(),
                                                 table_off.data_ptr<int32_t>(), masks.data_ptr<uint8_t>(),
                                                 mask_off.data_ptr<int64_t>(), (int)H, (int)KVH, (int)D, (int)BS,
                                                 (float)scale, q.stride(0), (int)lanes)
                        : k.paged_attention_f32(q.data_ptr<float>(), k_cache.data_ptr<float>(),
                                                v_cache.data_ptr<float>(), out.data_ptr<float>(), (int)n,
                                                q_start.data_ptr<int32_t>(), q_len.data_ptr<int32_t>(),
                                                ctx_len.data_ptr<int32_t>(), tables.data_ptr<int32_t>(),
                                                table_off.data_ptr<int32_t>(), masks.data_ptr<uint8_t>(),
                                                mask_off.data_ptr<int64_t>(), (int)H, (int)KVH, (int)D, (int)BS,
                                                (float)scale, q.stride(0), (int)lanes);
    TORCH_CHECK(rc == 0, what, ": ", H, " query heads over ", KVH, " KV heads of dim ", D, " in blocks of ", BS,
                " are outside the kernel's limits (code ", rc, ")");
    return out;
}

void check_slots(const at::Tensor& slots, int64_t T, int64_t capacity, const char* what) {
    check_contiguous(slots, at::kLong, 1, what, "slots");
    TORCH_CHECK(slots.size(0) == T, what, ": ", slots.size(0), " slots for ", T, " tokens");
    const int64_t* s = slots.data_ptr<int64_t>();
    for (int64_t t = 0; t < T; t++)
        TORCH_CHECK(s[t] >= 0 && s[t] < capacity, what, ": slot ", s[t], " is outside the cache's ", capacity);
}

// k, v [T, KVH, D] float32, heads contiguous, rows the same stride apart (views of fused q/k/v).
void write_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
              const at::Tensor& slots, int64_t isa) {
    const char* what = "write_kv";
    const auto& kt = kernels(isa, what);
    check_cpu(k, at::kFloat, 3, what, "k");
    check_cpu(v, at::kFloat, 3, what, "v");
    check_cache(k_cache, v_cache, what);
    TORCH_CHECK(k.sizes() == v.sizes() && k.stride(0) == v.stride(0), what, ": k and v must have one shape and row stride");
    TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 && v.stride(1) == v.size(2), what,
                ": k's and v's heads must be contiguous within a row");
    TORCH_CHECK(k.size(1) == k_cache.size(2) && k.size(2) == k_cache.size(3), what, ": k is ", k.sizes(),
                ", the cache holds ", k_cache.size(2), " heads of ", k_cache.size(3));
    const int64_t T = k.size(0), row = k.size(1) * k.size(2);
    check_slots(slots, T, k_cache.size(0) * k_cache.size(1), what);
    if (k_cache.scalar_type() == at::kFloat)
        kt.write_kv_f32(k.data_ptr<float>(), v.data_ptr<float>(), k.stride(0), k_cache.data_ptr<float>(),
                        v_cache.data_ptr<float>(), slots.data_ptr<int64_t>(), (int)T, (int)row);
    else
        kt.write_kv_bf16(k.data_ptr<float>(), v.data_ptr<float>(), k.stride(0), (uint16_t*)k_cache.data_ptr(),
                         (uint16_t*)v_cache.data_ptr(), slots.data_ptr<int64_t>(), (int)T, (int)row);
}

void check_rope_table(const at::Tensor& cos, const at::Tensor& sin, int64_t T, int64_t D, const char* what) {
    check_contiguous(cos, at::kFloat, 2, what, "cos");
    check_contiguous(sin, at::kFloat, 2, what, "sin");
    TORCH_CHECK(cos.size(0) == T && cos.size(1) == D && sin.sizes() == cos.sizes(), what, ": cos and sin must be [",
                T, ", ", D, "], got ", cos.sizes(), " and ", sin.sizes());
    TORCH_CHECK(D % 2 == 0, what, ": head dim ", D, " is odd");
}

// x [T, W] float32 (rows x.stride(0) apart): heads [0, n_heads) of width head_dim rotated in place.
void rope_(const at::Tensor& x, int64_t n_heads, int64_t head_dim, const at::Tensor& cos, const at::Tensor& sin,
           int64_t isa) {
    const char* what = "rope_";
    const auto& k = kernels(isa, what);
    check_cpu(x, at::kFloat, 2, what, "x");
    TORCH_CHECK(x.stride(1) == 1, what, ": x's rows must be contiguous");
    TORCH_CHECK(n_heads * head_dim <= x.size(1), what, ": ", n_heads, " heads of ", head_dim, " exceed rows of ", x.size(1));
    check_rope_table(cos, sin, x.size(0), head_dim, what);
    k.rope_inplace(x.data_ptr<float>(), (int)x.size(0), (int)x.stride(0), (int)n_heads, (int)head_dim,
                   cos.data_ptr<float>(), sin.data_ptr<float>());
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, int64_t isa) {
    const char* what = "rms_norm";
    const auto& k = kernels(isa, what);
    check_contiguous(x, at::kFloat, 2, what, "x");
    check_contiguous(w, at::kFloat, 1, what, "weight");
    TORCH_CHECK(w.size(0) == x.size(1), what, ": weight of ", w.size(0), " for rows of ", x.size(1));
    at::Tensor y = at::empty_like(x);
    k.rms_norm(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), (int)x.size(0), (int)x.size(1), (float)eps);
    return y;
}

at::Tensor silu_mul(const at::Tensor& gate_up, int64_t isa) {
    const char* what = "silu_mul";
    const auto& k = kernels(isa, what);
    check_contiguous(gate_up, at::kFloat, 2, what, "gate_up");
    TORCH_CHECK(gate_up.size(1) % 2 == 0, what, ": gate_up has an odd width ", gate_up.size(1));
    const int64_t I = gate_up.size(1) / 2;
    at::Tensor out = at::empty({gate_up.size(0), I}, gate_up.options());
    k.silu_mul(gate_up.data_ptr<float>(), out.data_ptr<float>(), (int)gate_up.size(0), (int)I);
    return out;
}

at::Tensor row_topk(const at::Tensor& x, int64_t k, int64_t isa) {
    const char* what = "row_topk";
    const auto& kern = kernels(isa, what);
    check_cpu(x, at::kFloat, 2, what, "x");
    TORCH_CHECK(x.stride(1) == 1, what, ": x's rows must be contiguous");
    TORCH_CHECK(k >= 1 && k <= x.size(1) && k <= SPECSERVE_ROW_TOPK_MAX, what, ": k must be 1 to min(", x.size(1), ", ",
                SPECSERVE_ROW_TOPK_MAX, "), got ", k);
    at::Tensor out = at::empty({x.size(0), k}, x.options().dtype(at::kLong));
    kern.row_topk(x.data_ptr<float>(), (int)x.size(0), (int)x.size(1), x.stride(0), (int)k, out.data_ptr<int64_t>());
    return out;
}

at::Tensor row_argmax(const at::Tensor& x, int64_t isa) {
    const char* what = "row_argmax";
    const auto& kern = kernels(isa, what);
    check_cpu(x, at::kFloat, 2, what, "x");
    TORCH_CHECK(x.stride(1) == 1, what, ": x's rows must be contiguous");
    TORCH_CHECK(x.size(1) >= 1, what, ": x has no columns");
    at::Tensor out = at::empty({2, x.size(0)}, x.options().dtype(at::kLong));
    kern.row_argmax(x.data_ptr<float>(), (int)x.size(0), (int)x.size(1), x.stride(0), out.data_ptr<int64_t>());
    return out;
}

// ---- the layer loop ----------------------------------------------------------------------------

// A GGUF projection for the layer loop: the same product as gguf_linear.
struct GgufProjection {
    LinearPart parts[kMaxParts];
    int n_parts;
    int64_t K, isa, prefetch;
    const float* bias;
};

int gguf_projection(const void* ctx, const float* x, int M, float* y) {
    const auto* p = (const GgufProjection*)ctx;
    linear_core(p->parts, p->n_parts, x, M, p->K, y, p->bias, p->isa, p->prefetch);
    return 0;
}

enum Projection : int64_t { kQkv = 0, kO = 1, kGateUp = 2, kDown = 3 };

// One model's decoder layers bound to one KV cache, for decoder_forward. Holds its tensors, so the
// pointers handed to the kernels live as long as it does.
struct Decoder : torch::CustomClassHolder {
    int64_t hidden, intermediate, heads, kv_heads, head_dim, isa;
    double eps;
    std::vector<layer_t> layers;
    std::vector<uint8_t> projections_set;  // bit p: projection p of the layer is set
    std::vector<at::Tensor> keep;
    std::vector<std::unique_ptr<GgufProjection>> gguf;
    at::ScalarType cache_dtype = at::kFloat;
    int64_t num_blocks = 0, block_size = 0;

    Decoder(int64_t hidden, int64_t intermediate, int64_t heads, int64_t kv_heads, int64_t head_dim, double eps,
            int64_t isa)
        : hidden(hidden), intermediate(intermediate), heads(heads), kv_heads(kv_heads), head_dim(head_dim), isa(isa),
          eps(eps) {
        kernels(isa, "Decoder");
        TORCH_CHECK(hidden > 0 && intermediate > 0 && heads > 0 && kv_heads > 0 && head_dim > 0 && heads % kv_heads == 0,
                    "Decoder: hidden ", hidden, ", intermediate ", intermediate, ", heads ", heads, ", kv_heads ",
                    kv_heads, ", head_dim ", head_dim, " do not describe a model");
    }

    // Appends a layer (its projections follow with set_linear); returns its index.
    int64_t add_layer(at::Tensor attn_norm, at::Tensor mlp_norm, at::Tensor k_cache, at::Tensor v_cache) {
        const char* what = "Decoder.add_layer";
        check_contiguous(attn_norm, at::kFloat, 1, what, "attn_norm");
        check_contiguous(mlp_norm, at::kFloat, 1, what, "mlp_norm");
        TORCH_CHECK(attn_norm.size(0) == hidden && mlp_norm.size(0) == hidden, what, ": norms of ", attn_norm.size(0),
                    " and ", mlp_norm.size(0), " for a hidden size of ", hidden);
        check_cache(k_cache, v_cache, what);
        TORCH_CHECK(k_cache.size(2) == kv_heads && k_cache.size(3) == head_dim, what, ": a cache of ", k_cache.size(2),
                    " heads of ", k_cache.size(3), " for ", kv_heads, " of ", head_dim);
        if (layers.empty()) {
            cache_dtype = k_cache.scalar_type();
            num_blocks = k_cache.size(0);
            block_size = k_cache.size(1);
        }
        TORCH_CHECK(k_cache.scalar_type() == cache_dtype && k_cache.size(0) == num_blocks && k_cache.size(1) == block_size,
                    what, ": every layer's cache must have the first layer's dtype and shape");
        layer_t l{};
        l.attn_norm = attn_norm.data_ptr<float>();
        l.mlp_norm = mlp_norm.data_ptr<float>();
        l.k_cache = k_cache.data_ptr();
        l.v_cache = v_cache.data_ptr();
        keep.insert(keep.end(), {attn_norm, mlp_norm, k_cache, v_cache});
        layers.push_back(l);
        projections_set.push_back(0);
        return (int64_t)layers.size() - 1;
    }

    // Projection `which` (0 qkv, 1 o, 2 gate_up, 3 down) of layer `layer`: kind 0 float32 [weight],
    // 1 int8 [q, scale], 2 int4 [packed, scale, minimum] (run by this decoder's variant), 3 GGUF
    // [parts] with their ggml `types`, its own variant `gguf_isa` and prefetch policy `prefetch` (qgemm.h).
    void set_linear(int64_t layer, int64_t which, int64_t kind, std::vector<at::Tensor> tensors,
                    std::vector<int64_t> types, std::optional<at::Tensor> bias, int64_t gguf_isa, int64_t prefetch) {
        const char* what = "Decoder.set_linear";
        TORCH_CHECK(layer >= 0 && layer < (int64_t)layers.size(), what, ": no layer ", layer);
        const int64_t qkv = (heads + 2 * kv_heads) * head_dim;
        const int64_t shapes[4][2] = {{qkv, hidden}, {hidden, heads * head_dim}, {2 * intermediate, hidden},
                                      {hidden, intermediate}};
        TORCH_CHECK(which >= 0 && which < 4, what, ": projection ", which, " is not 0 (qkv), 1 (o), 2 (gate_up) or 3 (down)");
        const int64_t N = shapes[which][0], K = shapes[which][1];
        linear_t lin{};
        lin.kind = (int32_t)kind;
        lin.n = (int32_t)N;
        lin.k = (int32_t)K;
        lin.bias = bias_ptr(bias, N, what);
        auto expect = [&](size_t n) {
            TORCH_CHECK(tensors.size() == n, what, ": kind ", kind, " takes ", n, " tensors, got ", tensors.size());
        };
        switch (kind) {
            case LIN_F32:
                expect(1);
                check_contiguous(tensors[0], at::kFloat, 2, what, "weight");
                TORCH_CHECK(tensors[0].size(0) == N && tensors[0].size(1) == K, what, ": weight ", tensors[0].sizes(),
                            " for [", N, ", ", K, "]");
                lin.w = tensors[0].data_ptr();
                break;
            case LIN_W8A8:
                expect(2);
                check_contiguous(tensors[0], at::kChar, 2, what, "q");
                check_contiguous(tensors[1], at::kFloat, 1, what, "scale");
                TORCH_CHECK(tensors[0].size(0) == N && tensors[0].size(1) == K && tensors[1].size(0) == N && K % 32 == 0,
                            what, ": int8 weight ", tensors[0].sizes(), " for [", N, ", ", K, "]");
                lin.w = tensors[0].data_ptr();
                lin.scale = tensors[1].data_ptr<float>();
                break;
            case LIN_W4A8:
                expect(3);
                check_contiguous(tensors[0], at::kByte, 2, what, "packed");
                check_contiguous(tensors[1], at::kFloat, 2, what, "scale");
                check_contiguous(tensors[2], at::kFloat, 2, what, "minimum");
                TORCH_CHECK(tensors[0].size(0) == N && tensors[0].size(1) * 2 == K && K % 32 == 0 &&
                                tensors[1].size(0) == N && tensors[1].size(1) == K / 32 &&
                                tensors[2].sizes() == tensors[1].sizes(),
                            what, ": int4 weight ", tensors[0].sizes(), " for [", N, ", ", K, "]");
                lin.w = tensors[0].data_ptr();
                lin.scale = tensors[1].data_ptr<float>();
                lin.minimum = tensors[2].data_ptr<float>();
                break;
            case LIN_EXTERNAL: {
                TORCH_CHECK(!tensors.empty() && tensors.size() <= (size_t)kMaxParts && types.size() == tensors.size(),
                            what, ": ", tensors.size(), " GGUF parts and ", types.size(), " types (1 to ", kMaxParts, ")");
                TORCH_CHECK(isa_runs(gguf_isa), what, ": kernel variant ", gguf_isa, " cannot run on this CPU");
                // the parts are checked as gguf_linear checks them: one product with each, on no rows
                std::vector<at::Tensor> parts(tensors.begin(), tensors.end());
                at::Tensor probe = at::empty({0, K}, tensors[0].options().dtype(at::kFloat));
                static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("specserve::gguf_linear", "").typed<
                    at::Tensor(const at::Tensor&, at::TensorList, at::IntArrayRef, const std::optional<at::Tensor>&, int64_t, int64_t)>();
                at::Tensor out = op.call(probe, parts, types, bias, gguf_isa, prefetch);
                TORCH_CHECK(out.size(1) == N, what, ": GGUF parts of ", out.size(1), " rows for ", N);
                auto g = std::make_unique<GgufProjection>();
                g->n_parts = (int)tensors.size();
                g->K = K;
                g->isa = gguf_isa;
                g->prefetch = prefetch;
                g->bias = lin.bias;
                for (size_t i = 0; i < tensors.size(); i++)
                    g->parts[i] = {tensors[i].data_ptr<uint8_t>(), tensors[i].size(1), tensors[i].size(0), types[i]};
                lin.w = g.get();
                lin.fn = gguf_projection;
                gguf.push_back(std::move(g));
                break;
            }
            default: TORCH_CHECK(false, what, ": projection kind ", kind, " is not 0 to 3");
        }
        keep.insert(keep.end(), tensors.begin(), tensors.end());
        if (bias.has_value() && bias->defined()) keep.push_back(*bias);
        layer_t& l = layers[layer];
        (which == kQkv ? l.qkv : which == kO ? l.o : which == kGateUp ? l.gate_up : l.down) = lin;
        projections_set[layer] |= (uint8_t)(1 << which);
    }
};

at::Tensor decoder_forward(const c10::intrusive_ptr<Decoder>& dec, const at::Tensor& x_in, int64_t n_layers,
                           const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                           const at::Tensor& q_start, const at::Tensor& q_len, const at::Tensor& ctx_len,
                           const at::Tensor& tables, const at::Tensor& table_off, const at::Tensor& masks,
                           const at::Tensor& mask_off, double scale, int64_t first_layer, int64_t lanes) {
    const char* what = "decoder_forward";
    check_lanes(lanes, what);
    const auto& k = kernels(dec->isa, what);
    check_cpu(x_in, at::kFloat, 2, what, "x");
    TORCH_CHECK(x_in.size(1) == dec->hidden, what, ": x has rows of ", x_in.size(1), ", the model ", dec->hidden);
    TORCH_CHECK(first_layer >= 0 && n_layers >= 0 && first_layer + n_layers <= (int64_t)dec->layers.size(), what,
                ": layers ", first_layer, " .. ", first_layer + n_layers - 1, " of ", dec->layers.size());
    for (int64_t i = first_layer; i < first_layer + n_layers; i++)
        TORCH_CHECK(dec->projections_set[i] == 0xF, what, ": layer ", i, " lacks a projection");
    const int64_t T = x_in.size(0);
    check_rope_table(cos, sin, T, dec->head_dim, what);
    check_slots(slots, T, dec->num_blocks * dec->block_size, what);
    const int64_t n = AttentionItems{q_start, q_len, ctx_len, tables, table_off, masks, mask_off}.check(
        T, dec->num_blocks, dec->block_size, what);
    at::Tensor x = x_in.clone(at::MemoryFormat::Contiguous);
    const int rc = k.decoder_forward(
        x.data_ptr<float>(), (int)T, (int)dec->hidden, (int)dec->intermediate, dec->layers.data() + first_layer, (int)n_layers,
        (float)dec->eps, (int)dec->heads, (int)dec->kv_heads, (int)dec->head_dim, (int)dec->block_size,
        dec->cache_dtype == at::kBFloat16, cos.data_ptr<float>(), sin.data_ptr<float>(), slots.data_ptr<int64_t>(),
        (int)n, q_start.data_ptr<int32_t>(), q_len.data_ptr<int32_t>(), ctx_len.data_ptr<int32_t>(),
        tables.data_ptr<int32_t>(), table_off.data_ptr<int32_t>(), masks.data_ptr<uint8_t>(),
        mask_off.data_ptr<int64_t>(), (float)scale, (int)lanes);
    check_rc(rc, what);
    return x;
}

}  // namespace
}  // namespace specserve

TORCH_LIBRARY_FRAGMENT(specserve, m) {
    m.class_<specserve::Decoder>("Decoder")
        .def(torch::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, int64_t>())
        .def("add_layer", &specserve::Decoder::add_layer)
        .def("set_linear", &specserve::Decoder::set_linear)
        .def("num_layers", [](const c10::intrusive_ptr<specserve::Decoder>& self) { return (int64_t)self->layers.size(); });
    m.def("linear_f32(Tensor x, Tensor weight, Tensor? bias, int isa) -> Tensor");
    m.def("linear_int8(Tensor x, Tensor q, Tensor scale, Tensor? bias, int isa) -> Tensor");
    m.def("linear_int4(Tensor x, Tensor packed, Tensor scale, Tensor minimum, Tensor? bias, int isa) -> Tensor");
    m.def("int8_round_activations(Tensor x, int isa) -> Tensor");
    m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor q_start, Tensor q_len, Tensor ctx_len, "
          "Tensor tables, Tensor table_off, Tensor masks, Tensor mask_off, float scale, int isa, int lanes=0) -> Tensor");
    m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, int isa) -> ()");
    m.def("rope_(Tensor(a!) x, int n_heads, int head_dim, Tensor cos, Tensor sin, int isa) -> ()");
    m.def("rms_norm(Tensor x, Tensor weight, float eps, int isa) -> Tensor");
    m.def("silu_mul(Tensor gate_up, int isa) -> Tensor");
    m.def("row_topk(Tensor x, int k, int isa) -> Tensor");
    m.def("row_argmax(Tensor x, int isa) -> Tensor");
    m.def("decoder_forward(__torch__.torch.classes.specserve.Decoder decoder, Tensor x, int n_layers, Tensor cos, "
          "Tensor sin, Tensor slots, Tensor q_start, Tensor q_len, Tensor ctx_len, Tensor tables, Tensor table_off, "
          "Tensor masks, Tensor mask_off, float scale, int first_layer=0, int lanes=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(specserve, CPU, m) {
    m.impl("linear_f32", &specserve::linear_f32);
    m.impl("linear_int8", &specserve::linear_int8);
    m.impl("linear_int4", &specserve::linear_int4);
    m.impl("int8_round_activations", &specserve::int8_round_activations);
    m.impl("paged_attention", &specserve::paged_attention);
    m.impl("write_kv", &specserve::write_kv);
    m.impl("rope_", &specserve::rope_);
    m.impl("rms_norm", &specserve::rms_norm);
    m.impl("silu_mul", &specserve::silu_mul);
    m.impl("row_topk", &specserve::row_topk);
    m.impl("row_argmax", &specserve::row_argmax);
    m.impl("decoder_forward", &specserve::decoder_forward);
}
