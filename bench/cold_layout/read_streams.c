// Read bandwidth of the repacked layout's access pattern, no compute
// (bench/README.md, "M = 1 on cold weights"): per group of 16 rows, 512
// bytes of codes then 32 bytes of scales and 32 of biases from their own
// arrays (three streams; with the small streams prefetched 4 KiB ahead),
// scales and biases merged (two streams), and each group's scales and
// biases after its codes (one stream). 1 GiB each, one thread.
//
//   cc -O2 -mavx512f -mavx512bw bench/cold_layout/read_streams.c -o /tmp/read_streams && /tmp/read_streams
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+1e-9*t.tv_nsec;}
int main(){
  size_t total = (size_t)1<<30, blk = 32768, sb = 2048;
  size_t nblk = total / (blk + 2*sb);
  char* w = aligned_alloc(64, nblk*blk); char* s = aligned_alloc(64, nblk*sb); char* b = aligned_alloc(64, nblk*sb);
  char* sbm = aligned_alloc(64, nblk*2*sb); char* one = aligned_alloc(64, nblk*(blk+2*sb));
  memset(w,1,nblk*blk); memset(s,1,nblk*sb); memset(b,1,nblk*sb); memset(sbm,1,nblk*2*sb); memset(one,1,nblk*(blk+2*sb));
  double bytes = nblk*(blk+2*sb);
  for (int rep=0; rep<3; rep++){
    __m512i a1=_mm512_setzero_si512(), a2=a1, a3=a1, a4=a1;
    double t=now();
    for (size_t k=0;k<nblk;k++){ const char* wb=w+k*blk; const char* ss=s+k*sb; const char* bb=b+k*sb;
      for (int g=0; g<64; g++){ for (int j=0;j<8;j++) a1=_mm512_add_epi32(a1,_mm512_load_si512(wb+(g*8+j)*64));
        _mm_prefetch(ss+g*32+4096,_MM_HINT_T1); _mm_prefetch(bb+g*32+4096,_MM_HINT_T1);
        a1=_mm512_add_epi32(a1,_mm512_castsi256_si512(_mm256_load_si256((const __m256i*)(ss+g*32))));
        a1=_mm512_add_epi32(a1,_mm512_castsi256_si512(_mm256_load_si256((const __m256i*)(bb+g*32)))); } }
    double t3p=now()-t; t=now();
    for (size_t k=0;k<nblk;k++){ const char* wb=w+k*blk; const char* sm=sbm+k*2*sb;
      for (int g=0; g<64; g++){ for (int j=0;j<8;j++) a2=_mm512_add_epi32(a2,_mm512_load_si512(wb+(g*8+j)*64));
        a2=_mm512_add_epi32(a2,_mm512_load_si512(sm+g*64)); } }
    double t2=now()-t; t=now();
    for (size_t k=0;k<nblk;k++){ const char* base=one+k*(blk+2*sb);
      for (int g=0; g<64; g++){ const char* gp=base+g*(512+64); for (int j=0;j<8;j++) a3=_mm512_add_epi32(a3,_mm512_load_si512(gp+j*64));
        a3=_mm512_add_epi32(a3,_mm512_load_si512(gp+512)); } }
    double t1=now()-t;
    printf("3 streams+pf %.1f, 2 streams (s|b merged) %.1f, 1 stream interleaved %.1f GB/s (%d)\n", bytes/t3p/1e9, bytes/t2/1e9, bytes/t1/1e9,
      (_mm512_reduce_add_epi32(a1)+_mm512_reduce_add_epi32(a2)+_mm512_reduce_add_epi32(a3)+_mm512_reduce_add_epi32(a4))&1);
  }
}
