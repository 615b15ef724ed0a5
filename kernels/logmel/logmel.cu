/*
 * Fused log-mel / mel-spectrogram frontend (cuFFTDx block FFTs), compiled with NVRTC.
 *
 * What it computes, per row b of a (B, T) signal (float32 or int16 scaled by 1/32768):
 *   frame t, sample n (0 <= n < N):  j = t*hop - cpad + n  (position in the padded signal)
 *   padded signal = pad_mode(zero_pad(x, pad), cpad)  -- evaluated as index arithmetic, never stored
 *   z(t, n) = window[n] * padded[j];   X(t, k) = sum_n z e^{-2 pi i n k / N}, k = 0..N/2
 *   spec = |X|^power;  mel(b, m, t) = sum_k fb[k, m] * spec(t, k)   (sparse: contiguous support)
 * LM_WHISPER = 0:  out(b, m, t) = mel                                  (B, n_mels, n_frames)
 * LM_WHISPER = 1:  out(b, m, t) = (log10(max(mel, 1e-10)) + 4) / 4, NOT yet clamped; the
 *   per-window clamp at (window max - 8) is applied by logmel_finalize (second, tiny launch),
 *   which also writes the (B, n_frames) int32 frame mask.
 *
 * Organisation: one block = LM_P complex FFTs (cuFFTDx FFTsPerBlock) run LM_R times; each complex
 * FFT carries TWO real frames (z = w*x_a + i*w*x_b), which is the R2C transform done by pairing:
 *   X_a[k] = (Z[k] + conj Z[N-k]) / 2,   X_b[k] = (Z[k] - conj Z[N-k]) / (2i).
 * So a block covers TF = 2*LM_P*LM_R consecutive frames of one row (blockIdx.x = frame tile,
 * blockIdx.y = row). The mel projection reads Z[k], Z[N-k] from shared memory and produces both
 * frames' mel at once; results go to a shared (n_mels, TF) tile that is written out row-coalesced.
 *
 * Configuration macros (set by kernels/logmel/_build.py):
 *   LM_N n_fft, LM_P pairs (FFTs) per block, LM_R iterations per block, LM_SPLIT lanes per mel dot
 *   product, LM_POWER (0: |X|^2, 1: |X|, 2: |X|^power_exp*2), LM_WHISPER, LM_IN_I16, LM_OUT_BF16 /
 *   LM_OUT_F16 (output rounded once, round-to-nearest-even, from the fp32 result; fp16 overflows to
 *   inf above 65504, exactly like torch's .to(torch.float16)), LM_SM (cuFFTDx SM<> value, from the device's
 *   compute capability), LM_EPT (0 = cuFFTDx default), LM_MINB and LM_DIRECT (below).
 * The host scales the filter weights by (s/2)^power (s = STFT normalisation, /2 from the pairing),
 * so the kernel feeds |2X|^2 (or its root / power) to the dot product.
 */
#include <cufftdx.hpp>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

#ifndef LM_EPT
#define LM_EPT 0
#endif
#ifndef LM_OUT_F16
#define LM_OUT_F16 0
#endif
#if LM_OUT_BF16 && LM_OUT_F16
#error "LM_OUT_BF16 and LM_OUT_F16 are exclusive"
#endif
// Tiling switches (kernels/logmel/_config.py sets them for the Whisper configs):
//   LM_MINB    min resident blocks per SM for __launch_bounds__ (0: none), caps registers
//   LM_DIRECT  1: mel results go straight from registers to global memory (no shared output
//              tile, so less shared memory per block and more blocks per SM)
#ifndef LM_MINB
#define LM_MINB 0
#endif
#ifndef LM_DIRECT
#define LM_DIRECT 0
#endif
namespace lm {
using namespace cufftdx;

using FFTBase = decltype(Size<LM_N>() + Precision<float>() + Type<fft_type::c2c>() +
                         Direction<fft_direction::forward>() + FFTsPerBlock<LM_P>() + SM<LM_SM>() + Block());
#if LM_EPT > 0
using FFT = decltype(FFTBase() + ElementsPerThread<LM_EPT>());
#else
using FFT = FFTBase;
#endif
using cplx = typename FFT::value_type;
static_assert(!FFT::requires_workspace, "sizes needing a cuFFTDx workspace (Bluestein) are not supported");

constexpr unsigned kThreadsX = FFT::block_dim.x;
constexpr unsigned kThreads = FFT::block_dim.x * FFT::block_dim.y;
constexpr unsigned kEPT = FFT::elements_per_thread;
constexpr unsigned kStride = FFT::stride;
static_assert(kStride * kEPT == LM_N, "expected an exact thread layout");
static_assert(FFT::block_dim.y == LM_P, "one threadIdx.y per FFT");
// Complex stride between the pairs' Z buffers: +1 for LM_P > 1 so that lanes of different pairs
// reading the same k fall in different banks.
constexpr unsigned kZS = LM_P > 1 ? LM_N + 1 : LM_N;
constexpr unsigned kZBytes = LM_P * kZS * 8u;
constexpr unsigned kWsRaw = FFT::shared_memory_size > kZBytes ? FFT::shared_memory_size : kZBytes;
constexpr unsigned kWsBytes = (kWsRaw + 15u) & ~15u;  // the Z buffer reuses the FFT's shared memory
constexpr unsigned kTF = 2u * LM_P * LM_R;             // frames per block
// Row stride of the shared output tile; the +16 breaks 4-way bank conflicts between mel rows.
// LM_DIRECT: no shared output tile (kTFS = 0 also tells the host to leave it out of the smem size).
constexpr unsigned kTFS = LM_DIRECT ? 0u : (kTF % 32u == 0u) ? kTF + 16u : kTF;
static_assert(LM_SPLIT >= 1 && LM_SPLIT <= 32 && (LM_SPLIT & (LM_SPLIT - 1)) == 0, "LM_SPLIT: power of 2");
static_assert(kThreads % LM_SPLIT == 0, "LM_SPLIT must divide the block");

#if LM_IN_I16
typedef short in_t;
__device__ __forceinline__ float to_f(in_t v) { return (float)v * (1.0f / 32768.0f); }
#else
typedef float in_t;
__device__ __forceinline__ float to_f(in_t v) { return v; }
#endif

#if LM_OUT_BF16
typedef __nv_bfloat16 out_t;
__device__ __forceinline__ out_t from_f(float v) { return __float2bfloat16_rn(v); }
__device__ __forceinline__ float out_to_f(out_t v) { return __bfloat162float(v); }
#elif LM_OUT_F16
typedef __half out_t;
__device__ __forceinline__ out_t from_f(float v) { return __float2half_rn(v); }  // > 65504 (after rounding): inf
__device__ __forceinline__ float out_to_f(out_t v) { return __half2float(v); }
#else
typedef float out_t;
__device__ __forceinline__ out_t from_f(float v) { return v; }
__device__ __forceinline__ float out_to_f(out_t v) { return v; }
#endif

// Map a position j of the centre-padded signal to [0, Lp), or -1 where the pad is zeros.
// mode: 0 reflect (edge not repeated), 1 constant, 2 replicate, 3 circular. The host checks that
// cpad < Lp (reflect) / cpad <= Lp (circular), so one fold suffices, as in torch.nn.functional.pad.
__device__ __forceinline__ long long map_pad(long long j, long long Lp, int mode) {
    if (j >= 0 && j < Lp) return j;
    switch (mode) {
        case 0: return j < 0 ? -j : 2 * (Lp - 1) - j;
        case 2: return j < 0 ? 0 : Lp - 1;
        case 3: return j < 0 ? j + Lp : j - Lp;
        default: return -1;
    }
}

// Sample at centre-padded position j: pad-mode fold, then the `pad` zeros and everything at or
// past Lvalid (zero padding of the 30 s window / samples beyond `lengths`) read as 0.
__device__ __forceinline__ float sample_at(const in_t* __restrict__ row, long long j, long long Lp, int pad,
                                           long long Lvalid, int mode) {
    long long jj = map_pad(j, Lp, mode);
    if (jj < 0) return 0.f;
    long long i = jj - pad;
    return (i >= 0 && i < Lvalid) ? to_f(__ldg(row + i)) : 0.f;
}

__device__ __forceinline__ float spec_of(float p4, float power_exp) {
#if LM_POWER == 0
    return p4;
#elif LM_POWER == 1
    return sqrtf(p4);
#else
    return p4 > 0.f ? powf(p4, power_exp) : 0.f;  // power_exp = power / 2
#endif
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float warp_min(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fminf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

}  // namespace lm

// Read by the host after loading the module (block shape and shared-memory layout).
extern "C" __device__ unsigned int logmel_info[8] = {
    lm::kThreadsX, lm::FFT::block_dim.y, lm::kWsBytes, lm::kEPT,
    lm::kTF,       lm::kTFS,             lm::FFT::shared_memory_size, lm::kThreads};

#if LM_MINB > 0
#define LM_BOUNDS __launch_bounds__(lm::kThreads, LM_MINB)
#else
#define LM_BOUNDS __launch_bounds__(lm::kThreads)
#endif
extern "C" __global__ void LM_BOUNDS logmel_main(
    const lm::in_t* __restrict__ x,        // (B, T) contiguous rows of length row_stride
    lm::out_t* __restrict__ out,           // (B, n_mels, n_frames)
    const float* __restrict__ window,      // (N,) window, zero outside win_length
    const int* __restrict__ fb_start,      // (n_mels,) first bin of each filter's support
    const int* __restrict__ fb_width,      // (n_mels,) support width (0 for an empty filter)
    const int* __restrict__ fb_off,        // (n_mels,) offset of the filter's weights in fb_w
    const float* __restrict__ fb_w,        // (nnz,) packed weights, pre-scaled by (s/2)^power
    const long long* __restrict__ lengths, // (B,) valid samples per row, or null (= Lvalid)
    float* __restrict__ tile_max,          // whisper: (B, n_tiles) max of log10 mel per tile
    float* __restrict__ tile_min,          // whisper: (B, n_tiles) min of log10 mel (-inf: all padding)
    long long row_stride, long long Lp, long long Lvalid_default, int pad, int hop, int cpad,
    int pad_mode, int n_frames, int n_mels, int nnz, int n_tiles, float power_exp) {
    using namespace lm;
    extern __shared__ __align__(16) unsigned char smem[];
    float* tile = reinterpret_cast<float*>(smem + kWsBytes);
    int* s_start = reinterpret_cast<int*>(tile + n_mels * kTFS);
    int* s_width = s_start + n_mels;
    int* s_off = s_width + n_mels;
    float* s_w = reinterpret_cast<float*>(s_off + n_mels);
    __shared__ float red[2][32];

    const int b = blockIdx.y;
    const int t0 = blockIdx.x * kTF;
    const int tid = threadIdx.x + threadIdx.y * kThreadsX;
    const in_t* row = x + (long long)b * row_stride;
    long long Lvalid = Lvalid_default;
    if (lengths != nullptr) Lvalid = min(max(lengths[b], 0LL), Lvalid_default);

#if LM_WHISPER
    // A tile whose first frame starts at or past the last valid sample sees only zeros: its
    // log-mel is exactly log10(1e-10) = -10 everywhere; the finalize kernel writes it.
    if ((long long)t0 * hop - cpad >= Lvalid) {
        if (tid == 0) {
            tile_max[b * n_tiles + blockIdx.x] = -10.f;
            tile_min[b * n_tiles + blockIdx.x] = -INFINITY;
        }
        return;
    }
#endif

    for (int i = tid; i < n_mels; i += kThreads) {
        s_start[i] = fb_start[i];
        s_width[i] = fb_width[i];
        s_off[i] = fb_off[i];
    }
    for (int i = tid; i < nnz; i += kThreads) s_w[i] = fb_w[i];

    // Each thread always handles the same sample positions n = tx + i*stride: keep the window there.
    float wreg[kEPT];
#pragma unroll
    for (int i = 0; i < kEPT; ++i) wreg[i] = __ldg(window + threadIdx.x + i * kStride);

    const int p = threadIdx.y;
    float lmin = INFINITY, lmax = -INFINITY;
    const long long obase = (long long)b * n_mels * n_frames;
    for (int r = 0; r < LM_R; ++r) {
        const int fa = t0 + r * 2 * LM_P + 2 * p;  // frames fa (real part) and fa + 1 (imaginary part)
        const long long ja = (long long)fa * hop - cpad;
        const long long jb = ja + hop;
        cplx td[FFT::storage_size];
        const bool fast = (fa + 1 < n_frames) && (ja - pad >= 0) && (jb + LM_N - pad <= Lvalid);
        if (fast) {  // interior frames: no padding arithmetic at all
            const in_t* pa = row + (ja - pad) + threadIdx.x;
            const in_t* pb = row + (jb - pad) + threadIdx.x;
#pragma unroll
            for (int i = 0; i < kEPT; ++i) {
                td[i].x = wreg[i] * to_f(__ldg(pa + i * kStride));
                td[i].y = wreg[i] * to_f(__ldg(pb + i * kStride));
            }
        } else {
            const bool va = fa < n_frames, vb = fa + 1 < n_frames;
#pragma unroll
            for (int i = 0; i < kEPT; ++i) {
                const int n = threadIdx.x + i * kStride;
                td[i].x = va ? wreg[i] * sample_at(row, ja + n, Lp, pad, Lvalid, pad_mode) : 0.f;
                td[i].y = vb ? wreg[i] * sample_at(row, jb + n, Lp, pad, Lvalid, pad_mode) : 0.f;
            }
        }

        FFT().execute(td, smem);
        __syncthreads();  // every FFT is done with the shared workspace before it becomes Z
        cplx* z = reinterpret_cast<cplx*>(smem) + p * kZS;
#pragma unroll
        for (int i = 0; i < kEPT; ++i) z[threadIdx.x + i * kStride] = td[i];
        __syncthreads();

        // Mel projection: task = (mel m, pair pp); LM_SPLIT lanes share one task's dot product.
        const int sub = tid % LM_SPLIT;
        constexpr int kTaskStride = kThreads / LM_SPLIT;
        const int n_tasks = n_mels * LM_P;
        for (int base = 0; base < n_tasks; base += kTaskStride) {  // uniform trip count: shuffles are safe
            const int task = base + tid / LM_SPLIT;
            float acc_a = 0.f, acc_b = 0.f;
            const int m = task / LM_P, pp = task % LM_P;
            if (task < n_tasks) {
                const int k0 = s_start[m], off = s_off[m];
                const int w = s_width[m];
                const cplx* zp = reinterpret_cast<const cplx*>(smem) + pp * kZS;
                for (int q = sub; q < w; q += LM_SPLIT) {
                    const int k = k0 + q;
                    const int kr = k == 0 ? 0 : LM_N - k;
                    const cplx a = zp[k], c = zp[kr];
                    const float u = a.x + c.x, v = a.y - c.y;  // 2 X_a
                    const float s = a.y + c.y, d = a.x - c.x;  // 2 X_b (up to a unit factor)
                    const float wt = s_w[off + q];
                    acc_a = fmaf(wt, spec_of(fmaf(u, u, v * v), power_exp), acc_a);
                    acc_b = fmaf(wt, spec_of(fmaf(s, s, d * d), power_exp), acc_b);
                }
            }
#pragma unroll
            for (int o = LM_SPLIT / 2; o > 0; o >>= 1) {
                acc_a += __shfl_xor_sync(0xffffffffu, acc_a, o);
                acc_b += __shfl_xor_sync(0xffffffffu, acc_b, o);
            }
            if (task < n_tasks && sub == 0) {
#if LM_WHISPER
                // log10 via the hardware log2 (abs error ~1e-7, far under the 2e-4 budget)
                acc_a = __log2f(fmaxf(acc_a, 1e-10f)) * 0.30102999566398120f;
                acc_b = __log2f(fmaxf(acc_b, 1e-10f)) * 0.30102999566398120f;
#endif
#if LM_DIRECT
                const int t = t0 + r * 2 * LM_P + 2 * pp;
                const bool oka = t < n_frames, okb = t + 1 < n_frames;
#if LM_WHISPER
                if (oka) { lmin = fminf(lmin, acc_a); lmax = fmaxf(lmax, acc_a); }
                if (okb) { lmin = fminf(lmin, acc_b); lmax = fmaxf(lmax, acc_b); }
                acc_a = (acc_a + 4.0f) * 0.25f;
                acc_b = (acc_b + 4.0f) * 0.25f;
#endif
                out_t* o = out + obase + (long long)m * n_frames + t;
                if (okb && (n_frames & 1) == 0) {  // t even: 2-element aligned
#if LM_OUT_BF16
                    *reinterpret_cast<__nv_bfloat162*>(o) = __floats2bfloat162_rn(acc_a, acc_b);
#elif LM_OUT_F16
                    *reinterpret_cast<__half2*>(o) = __floats2half2_rn(acc_a, acc_b);
#else
                    *reinterpret_cast<float2*>(o) = make_float2(acc_a, acc_b);
#endif
                } else {
                    if (oka) o[0] = from_f(acc_a);
                    if (okb) o[1] = from_f(acc_b);
                }
#else
                *reinterpret_cast<float2*>(tile + m * kTFS + r * 2 * LM_P + 2 * pp) = make_float2(acc_a, acc_b);
#endif
            }
        }
        __syncthreads();  // Z (= FFT workspace) is overwritten by the next iteration
    }

#if !LM_DIRECT
    // Write the (n_mels, TF) tile: consecutive threads take consecutive frames of one mel row.
    for (int idx = tid; idx < n_mels * (int)kTF; idx += kThreads) {
        const int m = idx / kTF, f = idx % kTF, t = t0 + f;
        if (t < n_frames) {
            float v = tile[m * kTFS + f];
#if LM_WHISPER
            lmin = fminf(lmin, v);
            lmax = fmaxf(lmax, v);
            v = (v + 4.0f) * 0.25f;
#endif
            out[obase + (long long)m * n_frames + t] = from_f(v);
        }
    }
#endif
#if LM_WHISPER
    lmin = warp_min(lmin);
    lmax = warp_max(lmax);
    if ((tid & 31) == 0) {
        red[0][tid >> 5] = lmin;
        red[1][tid >> 5] = lmax;
    }
    __syncthreads();
    if (tid < 32) {
        const int nw = (kThreads + 31) / 32;
        lmin = tid < nw ? red[0][tid] : INFINITY;
        lmax = tid < nw ? red[1][tid] : -INFINITY;
        lmin = warp_min(lmin);
        lmax = warp_max(lmax);
        if (tid == 0) {
            tile_max[b * n_tiles + blockIdx.x] = lmax;
            tile_min[b * n_tiles + blockIdx.x] = lmin;
        }
    }
#endif
}

#if LM_WHISPER
// Second launch: per-window max over the tiles' maxima, then clamp at (max - 8) only where some
// value of the tile lies below it (read-modify-write), or write the constant for all-padding tiles.
// Also writes the frame mask. grid = (n_tiles, B), 256 threads.
extern "C" __global__ void __launch_bounds__(256) logmel_finalize(
    lm::out_t* __restrict__ out, int* __restrict__ mask, const float* __restrict__ tile_max,
    const float* __restrict__ tile_min, const long long* __restrict__ lengths, long long Lvalid_default,
    int hop, int n_frames, int n_mels, int n_tiles) {
    using namespace lm;
    __shared__ float red[8];
    const int b = blockIdx.y, tidx = blockIdx.x, tid = threadIdx.x;
    float mx = -INFINITY;
    for (int i = tid; i < n_tiles; i += 256) mx = fmaxf(mx, tile_max[b * n_tiles + i]);
    mx = warp_max(mx);
    if ((tid & 31) == 0) red[tid >> 5] = mx;
    __syncthreads();
    mx = red[0];
#pragma unroll
    for (int i = 1; i < 8; ++i) mx = fmaxf(mx, red[i]);
    const float floor_l = mx - 8.0f;

    long long Lvalid = Lvalid_default;
    if (lengths != nullptr) Lvalid = min(max(lengths[b], 0LL), Lvalid_default);
    const long long valid_frames = (Lvalid + hop - 1) / hop;
    const int t0 = tidx * kTF;
    for (int f = tid; f < (int)kTF; f += 256) {
        const int t = t0 + f;
        if (t < n_frames) mask[(long long)b * n_frames + t] = t < valid_frames ? 1 : 0;
    }

    const float tmin = tile_min[b * n_tiles + tidx];
    const long long obase = (long long)b * n_mels * n_frames;
    if (tmin == -INFINITY) {  // all padding: log-mel is -10 everywhere
        const out_t c = from_f((fmaxf(-10.0f, floor_l) + 4.0f) * 0.25f);
        for (int idx = tid; idx < n_mels * (int)kTF; idx += 256) {
            const int m = idx / kTF, t = t0 + idx % kTF;
            if (t < n_frames) out[obase + (long long)m * n_frames + t] = c;
        }
    } else if (tmin < floor_l) {  // (max(L, F) + 4) / 4 == max((L + 4) / 4, (F + 4) / 4), rounding is monotone
        const float fy = out_to_f(from_f((floor_l + 4.0f) * 0.25f));
        for (int idx = tid; idx < n_mels * (int)kTF; idx += 256) {
            const int m = idx / kTF, t = t0 + idx % kTF;
            if (t < n_frames) {
                const long long o = obase + (long long)m * n_frames + t;
                const float y = out_to_f(out[o]);
                if (y < fy) out[o] = from_f(fy);
            }
        }
    }
}
#endif
