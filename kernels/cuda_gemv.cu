// Batch-1 (and 2) decode GEMV, y = x @ W^T (bf16 in/out, fp32 accumulation), optionally fused with SwiGLU; W bf16,
// or int8 with one fp32 scale per row (y[m, n] = scale[n] * sum_k x[m, k] q[n, k]).
// Compiled by NVRTC (kernels/cuda_gemv.py) once per configuration; no headers (the bf16 conversions are bit
// operations and one cvt instruction), so a compile takes a fraction of a second.
//
// Configuration macros (all required):
//   GV_R      output columns per warp (SwiGLU: gate/up row pairs)
//   GV_WARPS  warps per block
//   GV_KS     K split: GV_KS warps share one group of GV_R columns, each reading its own K slice; partial sums
//             meet in shared memory (fixed order, deterministic)
//   GV_V      16-byte vectors (8 bf16) per lane per weight row per chunk: a chunk is GV_KS * GV_V * 32 vectors
//             of K; the first chunk is loaded before the PDL wait, the rest after it
//   GV_M      rows of x (1 or 2)
//   GV_SWIGLU 1: out column n = silu(gate n) * (up n) with the up row at n + half
//   GV_PIPE   1: chunks after the first are double-buffered in registers (load c+1 before the FMAs of c)
//   GV_MINB   __launch_bounds__ minimum blocks per SM (the occupancy the register budget assumes)
//   GV_PF     L2 prefetch size hint of the weight loads: 0 none, 128 or 256 bytes
//   GV_Q8     1: W is int8 (a 16-byte vector = 16 K elements), scaled per row by scale[] in the epilogue
//   GV_I2F    int8 -> fp32 conversion: 0 magic number (PRMT + FADD), 1 cvt.rn.f32.s8 (I2F); see q8_to_f32
//   GV_ROPE   1 (GV_M 1, GV_R even, no SwiGLU): the qkv GEMV with RoPE (rotate_half) and the KV append in the
//             epilogue; the warp's column pairs are a head's dims (d, d + D/2), see rope_row

#define GV_THREADS (GV_WARPS * 32)
#define GV_G (GV_WARPS / GV_KS)          // column groups per block
#define GV_BCOLS (GV_G * GV_R)           // output columns per block
#define GV_NW (GV_SWIGLU ? 2 * GV_R : GV_R)  // weight rows per warp
#define GV_CHUNK (GV_KS * GV_V * 32)     // vectors of K per chunk (all K slices of a group)
#define GV_XV (GV_Q8 ? 2 : 1)            // 16-byte x vectors (8 bf16) per weight vector

#if GV_WARPS % GV_KS != 0
#error "GV_WARPS must be a multiple of GV_KS"
#endif
#if GV_ROPE && (GV_M != 1 || GV_R % 2 || GV_SWIGLU)
#error "GV_ROPE needs GV_M 1, an even GV_R and no SwiGLU"
#endif

typedef unsigned int u32;
typedef unsigned long long u64;

struct __align__(16) vec4 {
    u32 a, b, c, d;
};

#if GV_PF == 256
#define GV_LD "ld.global.L1::no_allocate.L2::cache_hint.L2::256B.v4.u32"
#elif GV_PF == 128
#define GV_LD "ld.global.L1::no_allocate.L2::cache_hint.L2::128B.v4.u32"
#else
#define GV_LD "ld.global.L1::no_allocate.L2::cache_hint.v4.u32"
#endif

// A weight vector: streamed once, so it bypasses L1 and is first out of L2 (evict-first policy); volatile keeps
// the compiler from sinking it below the PDL wait. Lanes past K read nothing and get zeros.
__device__ __forceinline__ vec4 load_w(const vec4* p, bool ok, u64 policy) {
    vec4 v;
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n"
        " mov.b32 %0, 0;\n mov.b32 %1, 0;\n mov.b32 %2, 0;\n mov.b32 %3, 0;\n"
        " @p " GV_LD " {%0, %1, %2, %3}, [%4], %6;\n}"
        : "=r"(v.a), "=r"(v.b), "=r"(v.c), "=r"(v.d)
        : "l"(p), "r"((int)ok), "l"(policy));
    return v;
}

// x: written by the previous kernel, read after the wait through the ordinary (coherent) path; it is a few KB
// shared by every warp, so L1 keeps it for the other warps of the SM.
__device__ __forceinline__ vec4 load_x(const vec4* p, bool ok) {
    vec4 v = {0u, 0u, 0u, 0u};
    if (ok) v = *p;
    return v;
}

__device__ __forceinline__ float bf_lo(u32 v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf_hi(u32 v) { return __uint_as_float(v & 0xffff0000u); }

__device__ __forceinline__ unsigned short to_bf16(float f) {
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));  // round to nearest even; NaN stays NaN
    return h;
}

__device__ __forceinline__ float round_bf16(float f) { return __uint_as_float(((u32)to_bf16(f)) << 16); }

__device__ __forceinline__ void unpack8(float* f, const vec4& v) {
    f[0] = bf_lo(v.a);
    f[1] = bf_hi(v.a);
    f[2] = bf_lo(v.b);
    f[3] = bf_hi(v.b);
    f[4] = bf_lo(v.c);
    f[5] = bf_hi(v.c);
    f[6] = bf_lo(v.d);
    f[7] = bf_hi(v.d);
}

__device__ __forceinline__ void fma8(float& acc, const vec4& w, const float* xf) {
    acc = fmaf(bf_lo(w.a), xf[0], acc);
    acc = fmaf(bf_hi(w.a), xf[1], acc);
    acc = fmaf(bf_lo(w.b), xf[2], acc);
    acc = fmaf(bf_hi(w.b), xf[3], acc);
    acc = fmaf(bf_lo(w.c), xf[4], acc);
    acc = fmaf(bf_hi(w.c), xf[5], acc);
    acc = fmaf(bf_lo(w.d), xf[6], acc);
    acc = fmaf(bf_hi(w.d), xf[7], acc);
}

// int8 -> fp32, exact. Default (GV_I2F 0): flip the sign bits (one LOP3 per 4 values: u = q + 128 in 0..255),
// place each byte under the exponent of 2^23 (one PRMT: bits 0x4B0000uu = 2^23 + u exactly) and subtract
// 2^23 + 128 (one FADD, exact: both operands are integers below 2^24). 2.25 instructions per value, split over
// the integer (LOP3, PRMT) and fp32 (FADD) pipes. cvt.rn.f32.s8 is one instruction per value, but it is an I2F,
// a quarter-rate conversion (16 per SM per clock on sm_90), while the weight stream at ~4.8 TB/s brings ~18 int8
// per SM per clock: it alone would bound the kernel (GV_I2F 1 keeps it for measurement).
__device__ __forceinline__ void q8_to_f32(const vec4& w, float (&f)[16]) {
    const u32 wv[4] = {w.a, w.b, w.c, w.d};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#if GV_I2F
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            float v;
            asm("cvt.rn.f32.s8 %0, %1;" : "=f"(v) : "r"(wv[i] >> (8 * b)));
            f[4 * i + b] = v;
        }
#else
        const u32 u = wv[i] ^ 0x80808080u;
#pragma unroll
        for (int b = 0; b < 4; ++b)
            f[4 * i + b] = __uint_as_float(__byte_perm(u, 0x4b000000u, 0x7540 + b)) - 8388736.0f;
#endif
    }
}

// Vector index (in units of 8 K elements; int8: 16) of slot j of chunk c for this lane and K slice s: each slot is 32
// consecutive vectors (512 contiguous bytes per warp load instruction).
__device__ __forceinline__ int kvec(int c, int s, int j, int lane) {
    return c * GV_CHUNK + s * (GV_V * 32) + j * 32 + lane;
}

__device__ __forceinline__ void load_chunk(vec4 (&wb)[GV_NW][GV_V], const vec4* const (&rows)[GV_NW], int c, int s,
                                           int lane, int kv, u64 policy) {
#pragma unroll
    for (int j = 0; j < GV_V; ++j) {
        const int k = kvec(c, s, j, lane);
        const bool ok = k < kv;
#pragma unroll
        for (int r = 0; r < GV_NW; ++r) wb[r][j] = load_w(rows[r] + k, ok, policy);
    }
}

// The FMAs of weight vector slot j with its x vectors xq (int8: two x vectors per weight vector; each weight
// vector is converted once for all x rows).
__device__ __forceinline__ void fma_vec(float (&acc)[GV_NW][GV_M], const vec4 (&wb)[GV_NW][GV_V], int j,
                                        const vec4 (&xq)[GV_M][GV_XV]) {
    float xf[GV_M][8 * GV_XV];
#pragma unroll
    for (int m = 0; m < GV_M; ++m)
#pragma unroll
        for (int h = 0; h < GV_XV; ++h) unpack8(&xf[m][8 * h], xq[m][h]);
#pragma unroll
    for (int r = 0; r < GV_NW; ++r) {
#if GV_Q8
        float wf[16];
        q8_to_f32(wb[r][j], wf);
#pragma unroll
        for (int m = 0; m < GV_M; ++m)
#pragma unroll
            for (int e = 0; e < 16; ++e) acc[r][m] = fmaf(wf[e], xf[m][e], acc[r][m]);
#else
#pragma unroll
        for (int m = 0; m < GV_M; ++m) fma8(acc[r][m], wb[r][j], xf[m]);
#endif
    }
}

// Chunk c, x read from memory (after the wait).
__device__ __forceinline__ void fma_chunk(float (&acc)[GV_NW][GV_M], const vec4 (&wb)[GV_NW][GV_V], const vec4* xv,
                                          int sxv, int c, int s, int lane, int kv) {
#pragma unroll
    for (int j = 0; j < GV_V; ++j) {
        const int k = kvec(c, s, j, lane);
        const bool ok = k < kv;
        vec4 xq[GV_M][GV_XV];
#pragma unroll
        for (int m = 0; m < GV_M; ++m)
#pragma unroll
            for (int h = 0; h < GV_XV; ++h) xq[m][h] = load_x(xv + (long long)m * sxv + GV_XV * k + h, ok);
        fma_vec(acc, wb, j, xq);
    }
}

// GV_ROPE: the weight row of virtual column v. Each head's rows are visited as (d, d + D/2) pairs, so a warp's
// consecutive columns 2i, 2i + 1 hold both halves of one rotation: v = head * D + 2i + e -> head * D + i + e D/2
// for the q and k heads (v < n_qk); the v heads in order.
__device__ __forceinline__ int rope_row(int v, int hd, int n_qk) {
    if (v >= n_qk) return v;
    const int head = v / hd;
    const int j = v - head * hd;
    return head * hd + (j >> 1) + (j & 1) * (hd >> 1);
}

// GV_ROPE: the token's position and cache row (flags: see gemv_kernel), and the cos / sin of the column a lane
// stores; coherent loads, volatile so that the settled form stays above the PDL wait. The position and row change
// every step: read past L1 (.cg), so no line this SM cached in an earlier launch can be stale.
__device__ __forceinline__ long long load_i64(const void* p, bool is64) {
    long long v;
    if (is64) {
        asm volatile("ld.global.cg.s64 %0, [%1];" : "=l"(v) : "l"(p));
    } else {
        int w;
        asm volatile("ld.global.cg.s32 %0, [%1];" : "=r"(w) : "l"(p));
        v = w;
    }
    return v;
}

// An fp32 value that no kernel of the chain writes (an int8 row scale, a RoPE cos / sin), requested before the PDL
// wait like the weights (coherent load, kept above the wait by volatile).
__device__ __forceinline__ float load_f32_early(const float* p) {
    float v;
    asm volatile("ld.global.L1::no_allocate.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}

struct RopeIn {
    long long p, crow;
    float cs, sn;  // of the column col0 + lane (lanes below GV_R; 0 elsewhere and for padding)
};

__device__ __forceinline__ RopeIn rope_inputs(const void* pos, const void* crow, int flags, const float* cosb,
                                              const float* sinb, int col0, int lane, int hd, int n_qk) {
    RopeIn in;
    in.p = load_i64(pos, flags & 1);
    in.crow = (flags & 4) ? load_i64(crow, flags & 2) : 0;
    in.cs = 0.0f;
    in.sn = 0.0f;
    const int col = col0 + lane;
    if (lane < GV_R && col < n_qk && in.p >= 0) {
        const int head = col / hd;
        const long long t = in.p * (hd >> 1) + ((col - head * hd) >> 1);
        in.cs = load_f32_early(cosb + t);
        in.sn = load_f32_early(sinb + t);
    }
    return in;
}


// x: (GV_M, K) bf16, row stride sxv 8-element vectors (16-byte aligned); w: (rows, K) contiguous, bf16 with
// K = 8 kv or (GV_Q8) int8 with K = 16 kv; y: (GV_M, n_out) bf16, row stride sy elements; half: row offset of
// the up half (SwiGLU), else unused; scale: (rows,) fp32 (GV_Q8; else unused).
// GV_ROPE: pos / crow the token's position and cache row (flags bit 0: pos is int64, bit 1: crow is int64,
// bit 2: crow given, else row 0; bit 3: both settled, i.e. written before the kernel ahead of this one started,
// so they and the lane's cos / sin are read before the PDL wait); cosb / sinb (positions, hd / 2) fp32; kc / vc
// (rows, n_kvh, max_len, hd) bf16
// contiguous; y receives q only ((n_q,) = the first n_q columns, in the usual dim order); columns [n_q, n_qk)
// are k, [n_qk, n_out) v.
extern "C" __global__ void __launch_bounds__(GV_THREADS, GV_MINB)
gemv_kernel(const vec4* xv, const vec4* __restrict__ w, unsigned short* y, int n_out, int kv, int sxv, int sy,
            int half, const float* __restrict__ scale, const void* pos, const void* crow, int flags, const float* cosb,
            const float* sinb, unsigned short* kc, unsigned short* vc, int hd, int n_q, int n_qk, int max_len,
            int n_kvh) {
    // Dependents may launch as soon as every block got here: their weight loads overlap our tail. (They
    // cannot read y before their own wait, which returns only when this grid has finished.)
    asm volatile("griddepcontrol.launch_dependents;");
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int g = warp / GV_KS;
    const int s = warp - g * GV_KS;
    const int col0 = blockIdx.x * GV_BCOLS + g * GV_R;

    // Columns past n_out read the last valid row (in bounds, result discarded): no per-row predicates.
    const vec4* rows[GV_NW];
#pragma unroll
    for (int r = 0; r < GV_R; ++r) {
        const int col = min(col0 + r, n_out - 1);
#if GV_ROPE
        rows[r] = w + (u64)rope_row(col, hd, n_qk) * (u64)kv;
#else
        rows[r] = w + (u64)col * (u64)kv;
#endif
#if GV_SWIGLU
        rows[GV_R + r] = w + (u64)(col + half) * (u64)kv;
#endif
    }
    u64 policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));

    vec4 wa[GV_NW][GV_V];
    load_chunk(wa, rows, 0, s, lane, kv, policy);
#if GV_Q8
    // the scale(s) of the column this lane stores (lane r * GV_M + m stores column col0 + r; other lanes load
    // an in-bounds one they never use)
    const int scol = min(col0 + min(lane / GV_M, GV_R - 1), n_out - 1);
#if GV_ROPE
    // rows in rope order; the partner column (lane ^ 1) of the rotation pair too
    const float sc_g = load_f32_early(scale + rope_row(scol, hd, n_qk));
    const float sc_p = load_f32_early(scale + rope_row(min(col0 + min(lane ^ 1, GV_R - 1), n_out - 1), hd, n_qk));
#else
    const float sc_g = load_f32_early(scale + scol);
#endif
#if GV_SWIGLU
    const float sc_u = load_f32_early(scale + scol + half);
#endif
#endif
#if GV_ROPE
    RopeIn rin;
    if (flags & 8) rin = rope_inputs(pos, crow, flags, cosb, sinb, col0, lane, hd, n_qk);
#endif

    // Everything above reads only weights (and settled RoPE inputs); x (and y's readers) belong to earlier kernels.
    asm volatile("griddepcontrol.wait;" ::: "memory");
#if GV_ROPE
    // unsettled: the position may come from the kernel ahead (e.g. the previous step's commit in one stream of
    // PDL launches), so it is read after the wait
    if (!(flags & 8)) rin = rope_inputs(pos, crow, flags, cosb, sinb, col0, lane, hd, n_qk);
#endif

    float acc[GV_NW][GV_M];
#pragma unroll
    for (int r = 0; r < GV_NW; ++r)
#pragma unroll
        for (int m = 0; m < GV_M; ++m) acc[r][m] = 0.0f;

    const int nch = (kv + GV_CHUNK - 1) / GV_CHUNK;
    for (int c = 0; c < nch; ++c) {
#if GV_PIPE
        vec4 wn[GV_NW][GV_V];
        if (c + 1 < nch) load_chunk(wn, rows, c + 1, s, lane, kv, policy);
        fma_chunk(acc, wa, xv, sxv, c, s, lane, kv);
        if (c + 1 < nch) {
#pragma unroll
            for (int r = 0; r < GV_NW; ++r)
#pragma unroll
                for (int j = 0; j < GV_V; ++j) wa[r][j] = wn[r][j];
        }
#else
        fma_chunk(acc, wa, xv, sxv, c, s, lane, kv);
        if (c + 1 < nch) load_chunk(wa, rows, c + 1, s, lane, kv, policy);
#endif
    }

    // Warp sums (butterfly: every lane ends with every sum), then one lane per (column, x row) finishes.
#pragma unroll
    for (int r = 0; r < GV_NW; ++r)
#pragma unroll
        for (int m = 0; m < GV_M; ++m)
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) acc[r][m] += __shfl_xor_sync(0xffffffffu, acc[r][m], o);

#if GV_KS > 1
    // K slices of a group: partials through shared memory, summed by the group's first warp in slice order.
    __shared__ float red[GV_G][GV_KS][GV_NW * GV_M];
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < GV_NW; ++r)
#pragma unroll
            for (int m = 0; m < GV_M; ++m) red[g][s][r * GV_M + m] = acc[r][m];
    }
    __syncthreads();
    if (s != 0) return;
#pragma unroll
    for (int r = 0; r < GV_NW; ++r)
#pragma unroll
        for (int m = 0; m < GV_M; ++m) {
            float t = red[g][0][r * GV_M + m];
#pragma unroll
            for (int q = 1; q < GV_KS; ++q) t += red[g][q][r * GV_M + m];
            acc[r][m] = t;
        }
#endif

#if GV_ROPE
    const long long p = rin.p;
    const long long crow_v = rin.crow;
#endif

#pragma unroll
    for (int r = 0; r < GV_R; ++r) {
        const int col = col0 + r;
#pragma unroll
        for (int m = 0; m < GV_M; ++m) {
            if (lane == r * GV_M + m && col < n_out) {
#if GV_Q8
                const float a_g = acc[r][m] * sc_g;  // the row scale before the (first) rounding
#if GV_SWIGLU
                const float a_u = acc[GV_R + r][m] * sc_u;
#endif
#if GV_ROPE
                const float a_p = acc[r ^ 1][m] * sc_p;
#endif
#else
                const float a_g = acc[r][m];
#if GV_SWIGLU
                const float a_u = acc[GV_R + r][m];
#endif
#if GV_ROPE
                const float a_p = acc[r ^ 1][m];
#endif
#endif
#if GV_SWIGLU
                // the unfused path's roundings: gate, up, silu(gate), product
                const float gt = round_bf16(a_g);
                const float up = round_bf16(a_u);
                const float sg = round_bf16(gt / (1.0f + __expf(-gt)));
                y[(long long)m * sy + col] = to_bf16(sg * up);
#elif GV_ROPE
                // rope_and_append's roundings (HF's bf16 math): the projection rounded, cos / sin rounded, each
                // product rounded, their sum rounded. Even columns hold x1 = dim i, odd ones x2 = dim i + D/2.
                // A negative position is padding: q is stored unrotated, the cache left alone (rope_and_append).
                const float a = round_bf16(a_g);
                if (p < 0) {
                    if (col < n_q) y[rope_row(col, hd, n_qk)] = to_bf16(a);
                } else if (col < n_qk) {
                    const float b = round_bf16(a_p);
                    const int head = col / hd;
                    const int j = col - head * hd;
                    const int i = j >> 1;
                    const float cs = round_bf16(rin.cs);  // this lane's column (lane r stores column r)
                    const float sn = round_bf16(rin.sn);
                    const float o = (r & 1) ? round_bf16(a * cs) + round_bf16(b * sn)    // x2 c + x1 s
                                            : round_bf16(a * cs) + round_bf16(-(b * sn));  // x1 c - x2 s
                    const int d = i + (r & 1) * (hd >> 1);
                    if (col < n_q) {
                        y[head * hd + d] = to_bf16(o);
                    } else {
                        const long long kh = head - n_q / hd;
                        kc[((crow_v * n_kvh + kh) * max_len + p) * hd + d] = to_bf16(o);
                    }
                } else {
                    const int vcol = col - n_qk;
                    const int head = vcol / hd;
                    vc[((crow_v * n_kvh + head) * max_len + p) * hd + (vcol - head * hd)] = to_bf16(a);
                }
#else
                y[(long long)m * sy + col] = to_bf16(a_g);
#endif
            }
        }
    }
}
