// Two builds of the packed AVX-512 kernels (run.sh: "old" from a git revision, "new" from the
// working tree) on the same random weights and activations, timed in turn; prints each one's
// median time and multiply-add rate, their ratio, and how far their outputs differ (0 where the
// layout and the arithmetic are the same; a changed layout reads the same bytes as other weights).
//   kernel_ab TYPE N K M [ROUNDS] [PREFETCH_POLICY] [THREADS]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>
#include <thread>
#include <atomic>
#include <cmath>
#include "gguf_blocks.h"
#include "qgemm.h"
namespace specserve { namespace avx512new { void gemm(const GemmTask& t, int64_t n0, int64_t n1); } }
using namespace specserve;
int main(int argc, char** argv) {
    int type = atoi(argv[1]);  // 212 or 214
    int64_t N = atoll(argv[2]), K = atoll(argv[3]);
    int M = atoi(argv[4]);
    int reps = argc > 5 ? atoi(argv[5]) : 20; int pol = argc > 6 ? atoi(argv[6]) : 0; int thr = argc > 7 ? atoi(argv[7]) : 1;
    int bb = type == kQ4_Kx16 ? 148 : 210;
    int64_t row_bytes = K / 256 * bb;
    std::mt19937 rng(1);
    std::vector<uint8_t> w(N * row_bytes);
    for (auto& b : w) b = rng();
    // valid fp16 scales: the first 32 (d) and for Q4_K next 32 (dmin) bytes of each 16-row block
    int64_t gb = 16 * bb;
    for (int64_t g = 0; g < (int64_t)w.size(); g += gb) {
        uint16_t* h = (uint16_t*)&w[g];
        int nh = type == kQ4_Kx16 ? 32 : 16;
        for (int i = 0; i < nh; i++) h[i] = 0x2000 + (rng() & 0x3ff);
        if (type == kQ4_Kx16) for (int i = 64; i < 320; i++) w[g + i] &= 0x3f;  // 6-bit scales/mins
        if (type == kQ6_Kx16) for (int i = 32; i < 288; i++) w[g + i] = (int8_t)((int)(rng() % 64) - 32);
    }
    std::vector<float> x(M * K);
    std::normal_distribution<float> nd;
    for (auto& v : x) v = nd(rng);
    std::vector<ActQ8K> xq(M * K / 256);
    for (int m = 0; m < M; m++) quantize_q8k(&x[m * K], K, &xq[m * K / 256]);
    std::vector<float> y0(M * N), y1(M * N);
    GemmTask t{type, w.data(), row_bytes, K, xq.data(), M, y0.data(), N, nullptr, pol};
    GemmTask t1 = t; t1.y = y1.data();
    avx512::gemm(t, 0, N); avx512new::gemm(t1, 0, N);
    double md = 0, mx = 0; int64_t neq = 0;
    for (int64_t i = 0; i < M * N; i++) { md = std::max(md, (double)std::fabs(y0[i] - y1[i])); mx = std::max(mx, (double)std::fabs(y0[i])); neq += y0[i] != y1[i]; }
    std::vector<double> ta, tb;
    for (int r = 0; r < reps; r++) {
        auto par = [&](auto fn, const GemmTask& tt) {
            if (thr == 1) { fn(tt, 0, N); return; }
            int64_t chunk = std::min<int64_t>(4096, std::max<int64_t>(16, N / 4)); chunk -= chunk % 16;
            std::atomic<int64_t> next{0};
            auto work = [&] { for (int64_t c = next++; c * chunk < N; c = next++) fn(tt, c * chunk, std::min(N, (c + 1) * chunk)); };
            std::thread th(work); work(); th.join(); };
        auto a = std::chrono::steady_clock::now(); par(avx512::gemm, t);
        auto b = std::chrono::steady_clock::now(); par(avx512new::gemm, t1);
        auto c = std::chrono::steady_clock::now();
        ta.push_back(std::chrono::duration<double>(b - a).count()); tb.push_back(std::chrono::duration<double>(c - b).count());
    }
    std::sort(ta.begin(), ta.end()); std::sort(tb.begin(), tb.end());
    double macs = (double)M * N * K;
    printf("type %d N %ld K %ld M %d: old %.3f ms %.1f GMAC/s  new %.3f ms %.1f GMAC/s  ratio %.3f  maxdiff %.3g (max %.3g) differ %ld\n",
           type, N, K, M, ta[reps/2]*1e3, macs/ta[reps/2]/1e9, tb[reps/2]*1e3, macs/tb[reps/2]/1e9, tb[reps/2]/ta[reps/2], md, mx, neq);
}
