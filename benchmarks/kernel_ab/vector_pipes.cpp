// What other vector instructions cost beside eight independent 512-bit vpdpbusd a loop (the packed
// kernels' inner loop): ns a loop with each addition, against the eight alone (at ~3.65 GHz, 2.19
// ns is 8 cycles: one vpdpbusd a cycle). Build and run (x86 with AVX-512 VNNI and GFNI):
//   g++ -O2 -mavx512f -mavx512vnni -mavx512bw -mgfni benchmarks/kernel_ab/vector_pipes.cpp -o /tmp/pipes && /tmp/pipes
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#define D(a) asm volatile("vpdpbusd %1, %1, %0" : "+v"(a) : "v"(q));
template <int X>
double run(long iters) {
    __m512i a0=_mm512_set1_epi32(1),a1=_mm512_set1_epi32(2),a2=_mm512_set1_epi32(3),a3=_mm512_set1_epi32(4),a4=_mm512_set1_epi32(5),a5=_mm512_set1_epi32(6),a6=_mm512_set1_epi32(7),a7=_mm512_set1_epi32(8);
    __m512i b0=a0,b1=a1,b2=a2,b3=a3;
    __m512i q = _mm512_set1_epi32(0x01020304);
    auto t=std::chrono::steady_clock::now();
    for (long i=0;i<iters;i++){
        D(a0) D(a1) D(a2) D(a3) D(a4) D(a5) D(a6) D(a7)
        if (X==1) { asm volatile("vpmulld %1, %0, %0" : "+v"(b0) : "v"(q)); asm volatile("vpmulld %1, %0, %0" : "+v"(b1) : "v"(q)); }
        if (X==2) { asm volatile("vpaddd %1, %0, %0" : "+v"(b0) : "v"(q)); asm volatile("vpaddd %1, %0, %0" : "+v"(b1) : "v"(q)); asm volatile("vpaddd %1, %0, %0" : "+v"(b2) : "v"(q)); asm volatile("vpaddd %1, %0, %0" : "+v"(b3) : "v"(q));}
        if (X==3) { asm volatile("vpsrlw $4, %0, %0" : "+v"(b0)); asm volatile("vpsrlw $4, %0, %0" : "+v"(b1)); asm volatile("vpsrlw $4, %0, %0" : "+v"(b2)); asm volatile("vpsrlw $4, %0, %0" : "+v"(b3));}
        if (X==4) { asm volatile("vpternlogd $0xEC, %1, %1, %0" : "+v"(b0) : "v"(q)); asm volatile("vpternlogd $0xEC, %1, %1, %0" : "+v"(b1) : "v"(q)); asm volatile("vpternlogd $0xEC, %1, %1, %0" : "+v"(b2) : "v"(q)); asm volatile("vpternlogd $0xEC, %1, %1, %0" : "+v"(b3) : "v"(q));}
        if (X==5) { asm volatile("vpandd %1, %0, %0" : "+v"(b0) : "v"(q)); asm volatile("vpandd %1, %0, %0" : "+v"(b1) : "v"(q)); asm volatile("vpandd %1, %0, %0" : "+v"(b2) : "v"(q)); asm volatile("vpandd %1, %0, %0" : "+v"(b3) : "v"(q));}
        if (X==6) { asm volatile("vcvtdq2ps %0, %0" : "+v"(b0)); asm volatile("vcvtdq2ps %0, %0" : "+v"(b1)); }
        if (X==8) { asm volatile("vgf2p8affineqb $0, %1, %0, %0" : "+v"(b0) : "v"(q)); asm volatile("vgf2p8affineqb $0, %1, %0, %0" : "+v"(b1) : "v"(q)); asm volatile("vgf2p8affineqb $0, %1, %0, %0" : "+v"(b2) : "v"(q)); asm volatile("vgf2p8affineqb $0, %1, %0, %0" : "+v"(b3) : "v"(q));}
        if (X==9) { asm volatile("vpsrlw $4, %0, %0" : "+v"(b0)); asm volatile("vpsrlw $4, %0, %0" : "+v"(b1)); asm volatile("vpsrlw $4, %0, %0" : "+v"(b2)); asm volatile("vpsrlw $4, %0, %0" : "+v"(b3)); asm volatile("vpandd %1, %0, %0" : "+v"(b0) : "v"(q)); asm volatile("vpandd %1, %0, %0" : "+v"(b1) : "v"(q)); asm volatile("vpandd %1, %0, %0" : "+v"(b2) : "v"(q)); asm volatile("vpandd %1, %0, %0" : "+v"(b3) : "v"(q)); asm volatile("vpternlogd $0xEC, %1, %1, %0" : "+v"(b0) : "v"(q)); asm volatile("vpternlogd $0xEC, %1, %1, %0" : "+v"(b1) : "v"(q));}
        if (X==7) { asm volatile("vfmadd231ps %1, %1, %0" : "+v"(b0) : "v"(q)); asm volatile("vfmadd231ps %1, %1, %0" : "+v"(b1) : "v"(q)); }
    }
    double s=std::chrono::duration<double>(std::chrono::steady_clock::now()-t).count();
    volatile int sink=_mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0,a1),_mm512_add_epi32(a2,a3)),_mm512_add_epi32(_mm512_add_epi32(a4,a5),_mm512_add_epi32(_mm512_add_epi32(a6,a7),_mm512_add_epi32(_mm512_add_epi32(b0,b1),_mm512_add_epi32(b2,b3)))))); (void)sink;
    return s/iters*1e9;  // ns per iteration (8 dpbusd)
}
int main(){ long n=100000000; run<0>(n/10);
 const char* names[]={"8 dpbusd","+2 mullo","+4 add","+4 srlw","+4 ternlog","+4 and","+2 cvtdq2ps","+2 fma"};
 double base=run<0>(n);
 printf("%s: %.3f ns/iter\n",names[0],base);
 printf("%s: %.3f\n",names[1],run<1>(n)); printf("%s: %.3f\n",names[2],run<2>(n)); printf("%s: %.3f\n",names[3],run<3>(n));
 printf("%s: %.3f\n",names[4],run<4>(n)); printf("%s: %.3f\n",names[5],run<5>(n)); printf("%s: %.3f\n",names[6],run<6>(n)); printf("%s: %.3f\n",names[7],run<7>(n)); printf("+4 gf2p8affine: %.3f\n", run<8>(n)); printf("+4 srl+4 and+2 tern: %.3f\n", run<9>(n)); }
