// infer_cuda.cu — the forward pass of infer.hpp on an NVIDIA GPU: Hopper first (sm_90), PTX for the others.
//
// The header's section 07 declares what this file implements (under INFER_CUDA): cuda::ForwardPass, which takes the
// same Batch and KVCache as the CPU ForwardPass and hands back the same logits [rows, V] in host memory, so the sampler,
// scheduler, engine and server run unchanged on either device; and cuda::kernels, each kernel alone on host data, so
// the tests check every kernel against its CPU twin before anything is timed (llm.c's dev/cuda habit).
//
// Kernels in the order the forward pass calls them. Each comment names the CPU twin in infer.hpp, the thread mapping,
// and the arithmetic intensity (AI: flops per byte moved from memory), which says what bounds it on an H100/H200
// (~3.3-4.8 TB/s of HBM, ~990 dense bf16 TFLOP/s: the ridge point is ~200-300 flops per byte):
//
//   1. embedding_gather      x[T, D] = table[ids]                         AI 0      memory (tiny)
//   2. add_rms_norm          x += add; xn = x · rsqrt(mean(x²)+eps) · g    AI ~0.5   memory (tiny)
//   3. add_bias              out[T, N] += bias[N]  (qwen2 only)            AI 0.1    memory (tiny)
//   4. rope                  per-head norm (qwen3), then rotate q and k    AI ~1     memory (tiny)
//   5. write_kv              k, v → pool slots through the slot mapping    AI 0      memory (tiny)
//   6. matvec                out[T≤8, N] = x · Wᵀ, f32 x; weights f32, bf16, AI ≈ T    memory: THE decode kernel
//                            or GGUF Q8_0 / Q4_K blocks decoded in registers
//      dequantize_rows       Q8_0 / Q4_K blocks → f32 rows, for the cuBLAS product of a prefill
//   7. gemm_tiled_wmma       out[T, N] = x · Wᵀ on tensor cores (teaching) AI ≈ T/2 compute once T ≳ 300
//      (cuBLAS GemmEx is the fast path for the same product; an option picks one)
//   8. attention_decode      flash-decoding: splits over KV blocks         AI ≈ G/2 memory (reads the K/V once)
//      attention_combine     merges the splits' online-softmax partials
//   9. attention_prefill     tiles of 16 queries × 16 keys, causal         AI ≈ 8   memory/latency (SIMT, readable)
//  10. swiglu                gate = silu(gate) · up                        AI 0.25  memory (tiny)
//  11. (final norm = add_rms_norm on the rows that want logits; logits = matvec/GEMM with lm_head)
//
// Numerics: the residual stream, K/V cache, norms, softmax and accumulators are f32 like the CPU path (the norms' sums
// in double, as infer.hpp does), weights stay in their stored type (f32, bf16, or GGUF's Q8_0 and Q4_K blocks; f16 and
// the other block types are widened to f32 at upload, exactly).
// The matrix-vector kernel keeps activations in f32 and so matches the CPU to ~1e-6; the tensor-core paths round the
// activations to bf16 (what every bf16 engine does), which costs ~1e-2 on the logits.
//
// Sampling stays on the host: the logits rows are copied once per step (rows × V × 4 bytes, 0.5 MB for V = 128256,
// ~10-20 µs next to a ≥ 1 ms decode step of a 1B model), then infer's Sampler runs on them. One sampler on one device
// means penalties, top-k/top-p/min-p and the seeded generator give the same ids on the CPU and the GPU, and a request
// can be replayed from its seed anywhere; a GPU sampler would only pay off once the copy shows in the profile.
//
// Decode steps are captured in CUDA graphs, one per batch-size bucket (1, 2, 4, … 256 rows, padded), so the ~150
// kernel launches of a 16-layer step are one launch: at batch 1 the launch gaps would otherwise cost as much as the
// work itself.

#include "infer.hpp"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <cstdio>

namespace infer::cuda {
namespace {

// ---- Errors: every CUDA and cuBLAS call is checked, and the message names the call, the file and the line ----

void check_cuda(cudaError_t status, const char* call, const char* file, int line) {
    if (status != cudaSuccess)
        fail("CUDA error ", cudaGetErrorName(status), " (", cudaGetErrorString(status), ") in ", call, " at ",
                     file, ":", line);
}

void check_cublas(cublasStatus_t status, const char* call, const char* file, int line) {
    if (status != CUBLAS_STATUS_SUCCESS)
        fail("cuBLAS error ", static_cast<int>(status), " in ", call, " at ", file, ":", line);
}

#define INFER_CUDA_CHECK(call) check_cuda((call), #call, __FILE__, __LINE__)
#define INFER_CUBLAS_CHECK(call) check_cublas((call), #call, __FILE__, __LINE__)
// After a kernel launch: a bad configuration is reported here, an error inside the kernel at the next synchronizing call.
#define INFER_LAUNCH_CHECK() check_cuda(cudaGetLastError(), "kernel launch", __FILE__, __LINE__)

// Device memory that frees itself. Grows only (the contents are not kept when it grows).
template <class T>
class DeviceBuffer {
public:
    DeviceBuffer() = default;
    explicit DeviceBuffer(size_t count) { resize(count); }
    DeviceBuffer(const DeviceBuffer&) = delete;
    DeviceBuffer& operator=(const DeviceBuffer&) = delete;
    DeviceBuffer(DeviceBuffer&& other) noexcept : ptr_(std::exchange(other.ptr_, nullptr)), size_(std::exchange(other.size_, 0)) {}
    DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
        std::swap(ptr_, other.ptr_);
        std::swap(size_, other.size_);
        return *this;
    }
    ~DeviceBuffer() {
        if (ptr_) cudaFree(ptr_);  // no check: destructors must not throw
    }
    // Returns true when the pointer changed (captured graphs that use it must be dropped).
    bool reserve(size_t count) {
        if (count <= size_) return false;
        if (ptr_) INFER_CUDA_CHECK(cudaFree(ptr_));
        ptr_ = nullptr;
        INFER_CUDA_CHECK(cudaMalloc(&ptr_, count * sizeof(T)));
        size_ = count;
        return true;
    }
    void resize(size_t count) { reserve(count); }
    T* get() const { return ptr_; }
    size_t size() const { return size_; }

private:
    T* ptr_ = nullptr;
    size_t size_ = 0;
};

// Page-locked host memory: copies from and to it are DMA'd without a bounce through a driver buffer, so they are truly
// asynchronous and about twice as fast. A decode step's inputs go up through one, its logits come back through another:
// from pageable memory each of the ten small copies would synchronize the stream and cost ~10 µs.
class PinnedBuffer {
public:
    PinnedBuffer() = default;
    PinnedBuffer(const PinnedBuffer&) = delete;
    PinnedBuffer& operator=(const PinnedBuffer&) = delete;
    ~PinnedBuffer() {
        if (ptr_) cudaFreeHost(ptr_);
    }
    void reserve(size_t bytes) {  // contents are not kept
        if (bytes <= size_) return;
        if (ptr_) INFER_CUDA_CHECK(cudaFreeHost(ptr_));
        ptr_ = nullptr;
        INFER_CUDA_CHECK(cudaMallocHost(&ptr_, bytes));
        size_ = bytes;
    }
    std::byte* get() const { return static_cast<std::byte*>(ptr_); }

private:
    void* ptr_ = nullptr;
    size_t size_ = 0;
};

template <class T>
DeviceBuffer<T> upload(const T* data, size_t count) {
    DeviceBuffer<T> buffer(std::max<size_t>(count, 1));
    if (count) INFER_CUDA_CHECK(cudaMemcpy(buffer.get(), data, count * sizeof(T), cudaMemcpyHostToDevice));
    return buffer;
}

template <class T>
std::vector<T> download(const T* device, size_t count) {
    std::vector<T> host(count);
    if (count) INFER_CUDA_CHECK(cudaMemcpy(host.data(), device, count * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
}

// How a matrix's weights sit in device memory, named by its DType. F32 and BF16 hold one value per element; Q8_0 and
// Q4_K are GGUF's blocks, uploaded as the file stores them and decoded in registers, so a decode step streams 1.06 or
// 0.56 bytes per weight instead of 4. Which types the kernels read as stored is dtype_blocks' on_gpu column
// (infer.hpp, section 02); every other stored type is widened to f32 once, at upload: exact, but 4 bytes a weight.
__host__ __device__ constexpr bool is_block(DType f) { return f == DType::Q8_0 || f == DType::Q4_K; }

// Bytes of one row of K weights.
size_t row_bytes_of(DType f, int K) { return static_cast<size_t>(dtype_bytes(f, K)); }

// Calls launch(std::integral_constant<DType, f>{}): one kernel instantiation per type the device reads, picked at run
// time.
template <class Launch>
void for_format(DType f, Launch&& launch) {
    switch (f) {
        case DType::F32: launch(std::integral_constant<DType, DType::F32>{}); break;
        case DType::BF16: launch(std::integral_constant<DType, DType::BF16>{}); break;
        case DType::Q8_0: launch(std::integral_constant<DType, DType::Q8_0>{}); break;
        case DType::Q4_K: launch(std::integral_constant<DType, DType::Q4_K>{}); break;
        default: fail("cuda: no kernel reads ", dtype_name(f), " weights as stored (dtype_blocks' on_gpu)");
    }
}

// Eight consecutive weights with 16-byte loads: one uint4 of bf16, or two float4 of f32. `p` is 16-byte aligned
// (rows of K % 8 == 0 elements in a cudaMalloc'd buffer, checked on the host).
__device__ __forceinline__ void load8(const __nv_bfloat16* p, float out[8]) {
    uint4 raw = *reinterpret_cast<const uint4*>(p);
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        out[2 * i] = __uint_as_float(words[i] << 16);
        out[2 * i + 1] = __uint_as_float(words[i] & 0xFFFF0000u);
    }
}
__device__ __forceinline__ void load8(const float* p, float out[8]) {
    float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
    out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w, out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
}

__device__ __forceinline__ float f16_at(const uint8_t* p) { return __half2float(*reinterpret_cast<const __half*>(p)); }

// The 6-bit scale and minimum of sub-block j of a Q4_K block from its 12 packed bytes s.  CPU twin: detail::k_scale_min.
__device__ __forceinline__ void k_scale_min(const uint8_t* s, int j, int& sc, int& m) {
    if (j < 4) {
        sc = s[j] & 63;
        m = s[j + 4] & 63;
    } else {
        sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// Eight weights of one row, widened to f32: piece p of the row's K / 8, whatever the format. They are the row's columns
// [first, first + 4) and [second, second + 4), so every kernel reads weights the same way:
//   F32, BF16: eight consecutive columns, one 16-byte load (second = first + 4);
//   Q8_0 (34 bytes: f16 d, int8 q[32]): a block is four pieces; w = d·q;        CPU twin: detail::dequantize_q8_0
//   Q4_K (144 bytes: f16 d, f16 dmin, 12 scale bytes, qs[128]): a super-block is 32 pieces; piece i of it takes the
//        four bytes qs[32g + o … + 3] (g = i / 8, o = 4·(i % 8)): their low nibbles are sub-block 2g, columns 64g + o…,
//        their high nibbles sub-block 2g + 1, columns 64g + 32 + o…; w = (d·sc)·q − (dmin·m). CPU twin:
//        detail::dequantize_q45_k. (Measured on an H200: reading the block's head as four words instead of its
//        bytes, or 32-weight pieces, made decode slower, not faster.)
// Each product in a dequantization is exact in f32 (an f16 significand times a small integer), so with or without a
// fused multiply-add the values are the CPU dequantizer's, bit for bit (the tests check it).
template <DType F>
__device__ __forceinline__ void load_piece(const uint8_t* row, int p, float w[8], int& first, int& second) {
    if constexpr (F == DType::F32 || F == DType::BF16) {
        using Stored = std::conditional_t<F == DType::F32, float, __nv_bfloat16>;
        load8(reinterpret_cast<const Stored*>(row) + static_cast<size_t>(p) * 8, w);
        first = 8 * p;
        second = first + 4;
    } else if constexpr (F == DType::Q8_0) {
        const uint8_t* block = row + static_cast<size_t>(p / 4) * 34;
        const float d = f16_at(block);
        const uint16_t* q = reinterpret_cast<const uint16_t*>(block + 2 + 8 * (p % 4));  // blocks are 2-byte aligned
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint16_t pair = q[i];
            w[2 * i] = d * static_cast<float>(static_cast<int8_t>(pair & 0xFF));
            w[2 * i + 1] = d * static_cast<float>(static_cast<int8_t>(pair >> 8));
        }
        first = 32 * (p / 4) + 8 * (p % 4);
        second = first + 4;
    } else {
        const uint8_t* block = row + static_cast<size_t>(p / 32) * 144;  // 144 = 9 × 16: blocks are 16-byte aligned
        const int i = p % 32, g = i / 8, o = 4 * (i % 8);
        const float d = f16_at(block), dmin = f16_at(block + 2);
        int sc_low, m_low, sc_high, m_high;
        k_scale_min(block + 4, 2 * g, sc_low, m_low);
        k_scale_min(block + 4, 2 * g + 1, sc_high, m_high);
        const float scale_low = d * static_cast<float>(sc_low), min_low = dmin * static_cast<float>(m_low);
        const float scale_high = d * static_cast<float>(sc_high), min_high = dmin * static_cast<float>(m_high);
        const uint32_t qs = *reinterpret_cast<const uint32_t*>(block + 16 + 32 * g + o);
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            w[b] = scale_low * static_cast<float>((qs >> (8 * b)) & 0x0F) - min_low;
            w[4 + b] = scale_high * static_cast<float>((qs >> (8 * b + 4)) & 0x0F) - min_high;
        }
        first = 256 * (p / 32) + 64 * g + o;
        second = first + 32;
    }
}

// One weight, for rows whose length is not a multiple of 8 (f32 and bf16 only: block rows are whole blocks).
template <DType F>
__device__ __forceinline__ float weight_at(const uint8_t* row, int k) {
    if constexpr (F == DType::BF16) return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(row)[k]);
    else return reinterpret_cast<const float*>(row)[k];
}

__device__ __forceinline__ void load4(const float* p, float out[4]) {
    const float4 v = *reinterpret_cast<const float4*>(p);
    out[0] = v.x, out[1] = v.y, out[2] = v.z, out[3] = v.w;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, offset);
    return v;
}
__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, offset);
    return v;
}

// =====================================================================================================================
// The kernels, in forward-pass order
// =====================================================================================================================

// 1. Embedding gather.  CPU twin: Tensor::read_row in ForwardPass::forward.
//    One block per token, threads stride over the row's pieces (load_piece: block formats are decoded here too).
//    Moves 0.5-4 bytes in and 4 out per element, no arithmetic: AI 0.
template <DType F>
__global__ void embedding_gather(const uint8_t* __restrict__ table, size_t row_bytes, const int* __restrict__ ids, int D,
                                 float* __restrict__ x) {
    const int t = blockIdx.x;
    const uint8_t* row = table + static_cast<size_t>(ids[t]) * row_bytes;
    float* out = x + static_cast<size_t>(t) * D;
    if (D % 8 == 0) {
        for (int p = threadIdx.x; p < D / 8; p += blockDim.x) {
            float w[8];
            int first, second;
            load_piece<F>(row, p, w, first, second);
            for (int i = 0; i < 4; ++i) out[first + i] = w[i], out[second + i] = w[4 + i];
        }
    } else if constexpr (!is_block(F)) {
        for (int i = threadIdx.x; i < D; i += blockDim.x) out[i] = weight_at<F>(row, i);
    }
}

// 2. Residual add fused with RMSNorm.  CPU twin: add_block_and_norm (detail::rms_norm) in ForwardPass::forward.
//    One block of 256 threads per output row; the sum of squares in double (as the CPU), reduced warp then block.
//    `rows` (optional) gathers: output row r normalizes x row rows[r] (the final norm, only rows that want logits).
//    Fusing saves one read and one write of x per norm: ~3 × 4 × D bytes for ~4 × D flops, AI ~0.3: memory-bound, and
//    at decode a few µs, so its job is to not be a separate launch.
__global__ void add_rms_norm(float* __restrict__ x, const float* __restrict__ add, const float* __restrict__ gain, int D,
                             double eps, float* __restrict__ out, const int* __restrict__ rows) {
    const int r = blockIdx.x;
    const int src = rows ? rows[r] : r;
    float* xr = x + static_cast<size_t>(src) * D;
    double sum = 0;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        float v = xr[i];
        if (add) {
            v += add[static_cast<size_t>(src) * D + i];
            xr[i] = v;
        }
        sum += static_cast<double>(v) * v;
    }
    __shared__ double partial[32];
    sum = warp_sum(sum);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
        double total = 0;
        for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) total += partial[w];
        partial[0] = total;
    }
    __syncthreads();
    const float scale = static_cast<float>(1.0 / sqrt(partial[0] / static_cast<double>(D) + eps));
    float* o = out + static_cast<size_t>(r) * D;
    for (int i = threadIdx.x; i < D; i += blockDim.x) o[i] = xr[i] * scale * gain[i];  // same order as the CPU
}

// 3. Bias add (qwen2's q/k/v) after a tensor-core product (the matrix-vector kernel adds it itself).
//    CPU twin: the bias loop in detail::matmul. One thread per element, AI 0.1.
__global__ void add_bias(float* __restrict__ out, const float* __restrict__ bias, int T, int N) {
    size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < static_cast<size_t>(T) * N) out[i] += bias[i % N];
}

// 4. Per-head RMSNorm (qwen3's q_norm/k_norm, when set), then RoPE in either layout, on the q and k heads of the fused
//    q|k|v rows ([T, ld], ld = (H + 2·Hkv)·Dh: heads [0, q_heads) are q, the next ones k) in one launch.
//    CPU twin: ForwardPass::position_heads. One block per (token, head), the head staged in shared memory (Dh ≤ 256);
//    cos/sin [T, Dh/2] come from the host, computed in double exactly as the CPU does. ~6 flops per 8 bytes: AI ~1.
//    HalfRotation pairs (i, i + Dh/2) (Hugging Face "rotate half"); AdjacentPairs pairs (2i, 2i+1) (GGUF llama,
//    llama2.c, Meta's original layout).
__global__ void rope(float* __restrict__ x, size_t ld, int q_heads, int Dh, const float* __restrict__ q_norm,
                     const float* __restrict__ k_norm, double eps, const float* __restrict__ cos_table,
                     const float* __restrict__ sin_table, bool adjacent_pairs) {
    __shared__ float head[256];
    __shared__ float scale;
    const int t = blockIdx.x, h = blockIdx.y, half = Dh / 2;
    const float* norm = h < q_heads ? q_norm : k_norm;
    float* p = x + static_cast<size_t>(t) * ld + static_cast<size_t>(h) * Dh;
    for (int i = threadIdx.x; i < Dh; i += blockDim.x) head[i] = p[i];
    __syncthreads();
    if (norm) {
        if (threadIdx.x == 0) {  // Dh ≤ 256 values: one thread in double, in the CPU's order
            double sum = 0;
            for (int i = 0; i < Dh; ++i) sum += static_cast<double>(head[i]) * head[i];
            scale = static_cast<float>(1.0 / sqrt(sum / static_cast<double>(Dh) + eps));
        }
        __syncthreads();
        for (int i = threadIdx.x; i < Dh; i += blockDim.x) head[i] = head[i] * scale * norm[i];
        __syncthreads();
    }
    const float* c = cos_table + static_cast<size_t>(t) * half;
    const float* s = sin_table + static_cast<size_t>(t) * half;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const int a = adjacent_pairs ? 2 * i : i, b = adjacent_pairs ? 2 * i + 1 : i + half;
        const float x0 = head[a], x1 = head[b];
        // Rounded products, then a rounded sum, as the CPU computes them (a fused multiply-add would round once).
        p[a] = __fsub_rn(__fmul_rn(x0, c[i]), __fmul_rn(x1, s[i]));
        p[b] = __fadd_rn(__fmul_rn(x0, s[i]), __fmul_rn(x1, c[i]));
    }
    if (Dh % 2 == 1 && threadIdx.x == 0) p[Dh - 1] = head[Dh - 1];  // an odd last element is not rotated
}

// 5. The KV-cache write through the slot mapping.  CPU twin: the two memcpy into cache.key()/cache.value().
//    slot = block × B + offset (from the sequence's block table, on the host); -1 marks a padding row of a graph bucket.
//    One block per token, threads over Hkv × Dh; k and v are rows of stride `ld` (the fused q|k|v rows). Pure copy, AI 0.
//    The pool is [num_blocks, B, Hkv, Dh] per layer.
__global__ void write_kv(const float* __restrict__ k, const float* __restrict__ v, size_t ld, const int* __restrict__ slots,
                         int width, float* __restrict__ k_pool, float* __restrict__ v_pool) {
    const int t = blockIdx.x, slot = slots[t];
    if (slot < 0) return;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        k_pool[static_cast<size_t>(slot) * width + i] = k[static_cast<size_t>(t) * ld + i];
        v_pool[static_cast<size_t>(slot) * width + i] = v[static_cast<size_t>(t) * ld + i];
    }
}

// 6. Matrix-vector products for decode: out[T, N] = x[T, K] · W[N, K]ᵀ (+ bias), T ≤ ROWS ≤ 8.
//    CPU twin: detail::matmul (dot_row) for f32 and bf16 weights; for Q8_0 and Q4_K blocks, the CPU's dequantizer
//    (appendix H) followed by the same f32 sum. (The CPU's own quantized path quantizes the activations to 8 bits first,
//    as llama.cpp does; here they stay f32, so these logits are those of the dequantized weights, the fixtures'
//    logits_deqf32.) Every weight byte is read once for T multiply-adds: bf16 weights give AI = 2T flops / 2 bytes = T,
//    Q4_K 2T / 0.5625 ≈ 3.6 T, far below the ridge (~250): decode is bound by how fast the weights stream in, so
//    fewer bytes a weight is a faster step.
//    Mapping: a row of W is owned by `warps` warps (1, or 4 = split-K when N is small, so the card has enough warps in
//    flight: a 1B model's 2048-row output projections would otherwise give 132 SMs 15 warps each). Each lane reads a
//    piece of 8 weights (load_piece: one 16-byte load of f32/bf16, or a few words of blocks decoded in registers), UNROLL
//    loads are issued before they are used (independent loads in flight hide the ~600 ns latency), the partial sums are
//    reduced by shuffles, then across the row's warps through shared memory in a fixed order.
//    Each output's sum is built the same way whatever T is, so a sequence's logits do not depend on its batch-mates.
template <DType F, int ROWS>
__global__ void __launch_bounds__(128) matvec(const uint8_t* __restrict__ w, size_t row_bytes, const float* __restrict__ x,
                                              int T, int N, int K, int warps_per_row, const float* __restrict__ bias,
                                              float* __restrict__ out) {
    constexpr int UNROLL = 4;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int rows_per_block = 4 / warps_per_row;
    const int n = blockIdx.x * rows_per_block + warp / warps_per_row;
    const int part = warp % warps_per_row;  // which K slice of the row this warp sums
    float acc[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] = 0;
    // x[r] · the 8 weights of a piece: the same 8 products in the same order for every format and every T.
    auto add_piece = [&](const float wv[8], int first, int second) {
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            if (r >= T) break;
            float xv[8];
            load4(x + static_cast<size_t>(r) * K + first, xv);
            load4(x + static_cast<size_t>(r) * K + second, xv + 4);
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[r] += wv[e] * xv[e];
        }
    };
    if (n < N) {
        const uint8_t* row = w + static_cast<size_t>(n) * row_bytes;
        if (K % 8 == 0) {
            const int pieces = K / 8, stride = 32 * warps_per_row;
            int c = part * 32 + lane;
            for (; c + (UNROLL - 1) * stride < pieces; c += UNROLL * stride) {
                float wv[UNROLL][8];
                int first[UNROLL], second[UNROLL];
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) load_piece<F>(row, c + u * stride, wv[u], first[u], second[u]);
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) add_piece(wv[u], first[u], second[u]);
            }
            for (; c < pieces; c += stride) {
                float wv[8];
                int first, second;
                load_piece<F>(row, c, wv, first, second);
                add_piece(wv, first, second);
            }
        } else if constexpr (!is_block(F)) {  // rows not 16-byte aligned: one element at a time (tiny test models only)
            for (int k = part * 32 + lane; k < K; k += 32 * warps_per_row) {
                const float wk = weight_at<F>(row, k);
#pragma unroll
                for (int r = 0; r < ROWS; ++r)
                    if (r < T) acc[r] += wk * x[static_cast<size_t>(r) * K + k];
            }
        }
    }
    __shared__ float partial[4][ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] = warp_sum(acc[r]);
    if (lane == 0)
#pragma unroll
        for (int r = 0; r < ROWS; ++r) partial[warp][r] = acc[r];
    __syncthreads();
    if (part == 0 && lane < ROWS && lane < T && n < N) {
        float sum = 0;
        for (int p = 0; p < warps_per_row; ++p) sum += partial[warp + p][lane];
        if (bias) sum += bias[n];
        out[static_cast<size_t>(lane) * N + n] = sum;
    }
}

//    Q8_0 / Q4_K rows → f32 rows, one thread per piece: what a prefill's cuBLAS product reads (a matrix-matrix
//    product is compute-bound, so decoding the blocks once per product costs one pass over the weights, against the
//    2·T·N·K flops that follow). CPU twin: dequantize_row. Bit for bit the same values (see load_piece).
template <DType F>
__global__ void dequantize_rows(const uint8_t* __restrict__ w, size_t row_bytes, int N, int K, float* __restrict__ out) {
    const size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x, pieces = static_cast<size_t>(K / 8);
    if (i >= static_cast<size_t>(N) * pieces) return;
    const size_t n = i / pieces;
    float v[8];
    int first, second;
    load_piece<F>(w + n * row_bytes, static_cast<int>(i % pieces), v, first, second);
    float* o = out + n * K;  // two 16-byte stores: K and first are multiples of 4
    *reinterpret_cast<float4*>(o + first) = make_float4(v[0], v[1], v[2], v[3]);
    *reinterpret_cast<float4*>(o + second) = make_float4(v[4], v[5], v[6], v[7]);
}

// f32 activations → bf16 for the tensor-core products (round to nearest even, as infer::f32_to_bf16).
__global__ void to_bf16(const float* __restrict__ x, __nv_bfloat16* __restrict__ y, size_t n) {
    size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < n) y[i] = __float2bfloat16_rn(x[i]);
}

// 7. Matrix-matrix products for prefill, the teaching version: out[T, N] = x[T, K] · W[N, K]ᵀ on tensor cores (wmma).
//    CPU twin: detail::matmul. A block computes a 64 × 64 tile of out with 4 warps, each a 32 × 32 quarter as 2 × 2
//    wmma 16×16×16 bf16 fragments with f32 accumulators. Per K step of 32 the block stages a 64 × 32 slice of x and of
//    W in shared memory (zero-filled past the edges, so any T, N, K work), and each staged element is used 64 times:
//    AI ≈ 2·64·64·32 / ((64 + 64)·32·2 bytes) = 32 flops per byte of global traffic, more through L2 reuse across
//    blocks. With T rows the whole product has AI ≈ T/2 against HBM: compute-bound from a few hundred rows. It reaches
//    a fraction of cuBLAS (no cp.async pipeline, no TMA/wgmma, no swizzle): it is here to be read, cuBLAS to be used.
//    Each output's sum runs over K in the same order whatever T is (no split-K), so it is batch-invariant too.
constexpr int kTile = 64, kStep = 32, kPad = 8;
__global__ void __launch_bounds__(128) gemm_tiled_wmma(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w,
                                                       int T, int N, int K, const float* __restrict__ bias, float* __restrict__ out) {
    using namespace nvcuda;
    __shared__ __align__(32) __nv_bfloat16 xs[kTile][kStep + kPad];  // [64 rows of x][32 columns of K]
    __shared__ __align__(32) __nv_bfloat16 ws[kTile][kStep + kPad];  // [64 rows of W][32 columns of K]
    __shared__ __align__(32) float cs[4][32][32 + 4];                // each warp's 32 × 32 result, for the guarded store
    const int warp = threadIdx.x >> 5;
    const int row0 = blockIdx.y * kTile, col0 = blockIdx.x * kTile;  // tile origin: rows of x (tokens), rows of W
    const int warp_row = (warp / 2) * 32, warp_col = (warp % 2) * 32;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
    for (int i = 0; i < 2; ++i)
        for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.0f);

    for (int k0 = 0; k0 < K; k0 += kStep) {
        for (int i = threadIdx.x; i < kTile * kStep; i += blockDim.x) {  // stage both slices, zeros past the edges
            const int r = i / kStep, k = i % kStep;
            const bool k_in = k0 + k < K;
            xs[r][k] = (row0 + r < T && k_in) ? x[static_cast<size_t>(row0 + r) * K + k0 + k] : __float2bfloat16(0.0f);
            ws[r][k] = (col0 + r < N && k_in) ? w[static_cast<size_t>(col0 + r) * K + k0 + k] : __float2bfloat16(0.0f);
        }
        __syncthreads();
        for (int kk = 0; kk < kStep; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a[2];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> b[2];  // Wᵀ: W's rows are columns
            for (int i = 0; i < 2; ++i) wmma::load_matrix_sync(a[i], &xs[warp_row + 16 * i][kk], kStep + kPad);
            for (int j = 0; j < 2; ++j) wmma::load_matrix_sync(b[j], &ws[warp_col + 16 * j][kk], kStep + kPad);
            for (int i = 0; i < 2; ++i)
                for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
        }
        __syncthreads();
    }
    for (int i = 0; i < 2; ++i)
        for (int j = 0; j < 2; ++j)
            wmma::store_matrix_sync(&cs[warp][16 * i][16 * j], acc[i][j], 32 + 4, wmma::mem_row_major);
    __syncwarp();
    const int lane = threadIdx.x & 31;
    for (int i = lane; i < 32 * 32; i += 32) {
        const int r = row0 + warp_row + i / 32, n = col0 + warp_col + i % 32;
        if (r < T && n < N) out[static_cast<size_t>(r) * N + n] = cs[warp][i / 32][i % 32] + (bias ? bias[n] : 0.0f);
    }
}

// 8. Paged attention for decode (and any token), flash-decoding style.  CPU twin: ForwardPass::attend.
//    A token at position p attends to positions [first, p] of its sequence (first > 0 only with a sliding window).
//    Those positions are cut into at most kSplits splits of a multiple of 16 positions; the split length depends only on
//    the token's own position, never on its batch-mates or the cache's block size (batch invariance). Grid (T, Hkv,
//    kSplits): one block per (token, KV head, split) holds the G = H / Hkv query heads that share that KV head (GQA:
//    each K/V row is read once for all G heads), one warp per query head (warps loop when G > 4). Per position a warp
//    computes q·k (lanes over Dh, shuffle-reduced), then an online softmax update (running max m, running sum l,
//    running output acc) in registers. Each split writes its (m, l, acc); attention_combine merges them. Per K/V element
//    (4 bytes) G·2 flops: AI ≈ G/2, memory-bound in principle; in practice each position waits about a microsecond for
//    its key (measured on an H200: ~1 µs per position of a split), so at a few hundred positions this kernel is
//    latency-bound and a large share of a decode step (chapter 07). `rows` lists the batch rows it serves (the rows of
//    prefill tiles go to attention_prefill instead).
constexpr int kSplits = 16;
constexpr int kMaxHeadDim = 256;

__device__ __forceinline__ int split_length(int position) {  // positions per split: ≥ (position + 1) / kSplits
    const int per_split = (position + kSplits) / kSplits;
    return (per_split + 15) / 16 * 16;
}

__global__ void __launch_bounds__(128) attention_decode(
    const float* __restrict__ q, size_t q_ld, const float* __restrict__ k_pool, const float* __restrict__ v_pool,
    const int* __restrict__ block_tables, int table_stride, const int* __restrict__ token_sequence,
    const int* __restrict__ positions, const int* __restrict__ rows, int H, int Hkv, int Dh, int B, int window,
    float scale, float* __restrict__ part_acc, float* __restrict__ part_ml) {
    const int t = rows[blockIdx.x], kv_head = blockIdx.y, split = blockIdx.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const int position = positions[t];
    if (position < 0) return;  // padding row: attention_combine writes zeros
    const int length = split_length(position);
    const int begin = split * length;
    if (begin > position) return;  // this token needs fewer splits; attention_combine never reads this one
    const int first = window > 0 ? max(0, position - window + 1) : 0;
    const int lo = max(begin, first), hi = min(position, begin + length - 1);
    const int* table = block_tables + static_cast<size_t>(token_sequence[t]) * table_stride;
    const int G = H / Hkv, width = Hkv * Dh;
    constexpr int kPerLane = kMaxHeadDim / 32;

    for (int g = warp; g < G; g += warps) {
        const int h = kv_head * G + g;
        float qr[kPerLane], acc[kPerLane];
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
            const int d = lane + 32 * i;
            qr[i] = d < Dh ? q[static_cast<size_t>(t) * q_ld + static_cast<size_t>(h) * Dh + d] : 0.0f;
            acc[i] = 0;
        }
        float m = -INFINITY, l = 0;
        for (int p = lo; p <= hi; ++p) {
            const size_t row = (static_cast<size_t>(table[p / B]) * B + p % B) * width + static_cast<size_t>(kv_head) * Dh;
            float dot = 0;
#pragma unroll
            for (int i = 0; i < kPerLane; ++i) {
                const int d = lane + 32 * i;
                if (d < Dh) dot += qr[i] * k_pool[row + d];
            }
            const float score = warp_sum(dot) * scale;
            const float m_new = fmaxf(m, score);
            const float correction = expf(m - m_new);  // 0 on the first position (m = -inf)
            const float weight = expf(score - m_new);
            l = l * correction + weight;
#pragma unroll
            for (int i = 0; i < kPerLane; ++i) {
                const int d = lane + 32 * i;
                if (d < Dh) acc[i] = acc[i] * correction + weight * v_pool[row + d];
            }
            m = m_new;
        }
        const size_t slot = (static_cast<size_t>(t) * H + h) * kSplits + split;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
            const int d = lane + 32 * i;
            if (d < Dh) part_acc[slot * Dh + d] = acc[i];
        }
        if (lane == 0) {
            part_ml[slot * 2] = m;
            part_ml[slot * 2 + 1] = l;
        }
    }
}

//    The merge of the splits: out = Σ_s acc_s · e^(m_s − M) / Σ_s l_s · e^(m_s − M), M = max_s m_s, in split order.
//    One block per (token, head), threads over Dh. Reads kSplits × Dh floats per Dh written: AI ~0.5.
__global__ void attention_combine(const float* __restrict__ part_acc, const float* __restrict__ part_ml,
                                  const int* __restrict__ positions, const int* __restrict__ rows, int H, int Dh,
                                  float* __restrict__ out) {
    const int t = rows[blockIdx.x], h = blockIdx.y;
    const int position = positions[t];
    float* o = out + (static_cast<size_t>(t) * H + h) * Dh;
    if (position < 0) {  // padding row
        for (int d = threadIdx.x; d < Dh; d += blockDim.x) o[d] = 0;
        return;
    }
    const int splits = position / split_length(position) + 1;
    const size_t base = (static_cast<size_t>(t) * H + h) * kSplits;
    float M = -INFINITY;
    for (int s = 0; s < splits; ++s) M = fmaxf(M, part_ml[(base + s) * 2]);
    float L = 0;
    for (int s = 0; s < splits; ++s) {
        const float m = part_ml[(base + s) * 2];
        if (m != -INFINITY) L += part_ml[(base + s) * 2 + 1] * expf(m - M);
    }
    for (int d = threadIdx.x; d < Dh; d += blockDim.x) {
        float sum = 0;
        for (int s = 0; s < splits; ++s) {
            const float m = part_ml[(base + s) * 2];
            if (m != -INFINITY) sum += part_acc[(base + s) * Dh + d] * expf(m - M);
        }
        o[d] = L > 0 ? sum / L : 0.0f;
    }
}

// 9. Paged attention for prefill chunks: a tile of up to 16 consecutive query tokens of one sequence, one head.
//    CPU twin: ForwardPass::attend. Grid (tiles, H), 128 threads. The block walks the keys from the tile's first
//    visible position to its last query's position in steps of 16, staging 16 K and 16 V rows from the paged cache in
//    shared memory once for all 16 queries; scores S[16 × 16] with the causal (and sliding-window) mask, then an
//    online softmax per query row and O[16 × Dh] += P · V in shared memory. Each staged K/V element serves 16 queries:
//    AI ≈ 2·16 flops per 4 bytes ≈ 8, against 0.5 for the decode kernel per query head. SIMT f32 for readability (and
//    the CPU's f32 numbers); a production kernel (FlashAttention-3) runs QKᵀ and PV on tensor cores with bf16 K/V.
constexpr int kQueryTile = 16, kKeyTile = 16, kPrefillMaxHeadDim = 128;

struct PrefillTile {
    int first_token;  // batch row of the tile's first query
    int count;        // queries in the tile (≤ 16), consecutive rows and positions of one sequence
};

__global__ void __launch_bounds__(128) attention_prefill(
    const float* __restrict__ q, size_t q_ld, const float* __restrict__ k_pool, const float* __restrict__ v_pool,
    const int* __restrict__ block_tables, int table_stride, const int* __restrict__ token_sequence,
    const int* __restrict__ positions, const PrefillTile* __restrict__ tiles, int H, int Hkv, int Dh, int B, int window,
    float scale, float* __restrict__ out) {
    __shared__ float qs[kQueryTile][kPrefillMaxHeadDim];
    __shared__ float ks[kKeyTile][kPrefillMaxHeadDim + 1];
    __shared__ float vs[kKeyTile][kPrefillMaxHeadDim];
    __shared__ float os[kQueryTile][kPrefillMaxHeadDim];
    __shared__ float ps[kQueryTile][kKeyTile + 1];
    __shared__ float row_max[kQueryTile], row_sum[kQueryTile], row_correction[kQueryTile];
    const PrefillTile tile = tiles[blockIdx.x];
    const int h = blockIdx.y, kv_head = h / (H / Hkv), width = Hkv * Dh;
    const int* table = block_tables + static_cast<size_t>(token_sequence[tile.first_token]) * table_stride;
    const int first_position = positions[tile.first_token];
    const int last_position = first_position + tile.count - 1;
    const int lo = window > 0 ? max(0, first_position - window + 1) : 0;

    for (int i = threadIdx.x; i < kQueryTile * Dh; i += blockDim.x) {
        const int r = i / Dh, d = i % Dh;
        qs[r][d] = r < tile.count ? q[static_cast<size_t>(tile.first_token + r) * q_ld + static_cast<size_t>(h) * Dh + d] : 0.0f;
        os[r][d] = 0;
    }
    if (threadIdx.x < kQueryTile) {
        row_max[threadIdx.x] = -INFINITY;
        row_sum[threadIdx.x] = 0;
    }
    __syncthreads();

    for (int p0 = lo - lo % kKeyTile; p0 <= last_position; p0 += kKeyTile) {
        for (int i = threadIdx.x; i < kKeyTile * Dh; i += blockDim.x) {  // stage 16 keys and values
            const int j = i / Dh, d = i % Dh, p = p0 + j;
            float kv = 0, vv = 0;
            if (p >= lo && p <= last_position) {
                const size_t row = (static_cast<size_t>(table[p / B]) * B + p % B) * width + static_cast<size_t>(kv_head) * Dh;
                kv = k_pool[row + d];
                vv = v_pool[row + d];
            }
            ks[j][d] = kv;
            vs[j][d] = vv;
        }
        __syncthreads();
        for (int i = threadIdx.x; i < kQueryTile * kKeyTile; i += blockDim.x) {  // scores, masked
            const int r = i / kKeyTile, j = i % kKeyTile, p = p0 + j;
            const int query_position = first_position + r;
            const int query_first = window > 0 ? max(0, query_position - window + 1) : 0;
            float score = -INFINITY;
            if (r < tile.count && p >= query_first && p <= query_position) {
                float dot = 0;
                for (int d = 0; d < Dh; ++d) dot += qs[r][d] * ks[j][d];
                score = dot * scale;
            }
            ps[r][j] = score;
        }
        __syncthreads();
        if (threadIdx.x < kQueryTile) {  // online softmax, one thread per query row
            const int r = threadIdx.x;
            float m_new = row_max[r];
            for (int j = 0; j < kKeyTile; ++j) m_new = fmaxf(m_new, ps[r][j]);
            float correction = 1, sum = 0;
            if (m_new != -INFINITY) {  // a row with nothing visible yet keeps m = -inf and adds nothing
                correction = expf(row_max[r] - m_new);
                for (int j = 0; j < kKeyTile; ++j) {
                    const float weight = expf(ps[r][j] - m_new);  // 0 for masked scores
                    ps[r][j] = weight;
                    sum += weight;
                }
            } else {
                for (int j = 0; j < kKeyTile; ++j) ps[r][j] = 0;
            }
            row_sum[r] = row_sum[r] * correction + sum;
            row_max[r] = m_new;
            row_correction[r] = correction;
        }
        __syncthreads();
        for (int i = threadIdx.x; i < kQueryTile * Dh; i += blockDim.x) {  // O = O · correction + P · V
            const int r = i / Dh, d = i % Dh;
            float sum = os[r][d] * row_correction[r];
            for (int j = 0; j < kKeyTile; ++j) sum += ps[r][j] * vs[j][d];
            os[r][d] = sum;
        }
        __syncthreads();
    }
    for (int i = threadIdx.x; i < tile.count * Dh; i += blockDim.x) {
        const int r = i / Dh, d = i % Dh;
        out[(static_cast<size_t>(tile.first_token + r) * H + h) * Dh + d] = row_sum[r] > 0 ? os[r][d] / row_sum[r] : 0.0f;
    }
}

// 10. SwiGLU: out = silu(gate) · up, from the fused gate|up rows [T, 2F] (one product computed both) into [T, F].
//     CPU twin: detail::swiglu (detail::silu per element). One thread per output element; 12 bytes moved
//     for ~5 flops: AI ~0.4, memory-bound (and small next to the matmuls).
__global__ void swiglu(const float* __restrict__ gate_up, int F, size_t n, float* __restrict__ out) {
    size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < n) {
        const size_t t = i / F, f = i % F;
        const float g = gate_up[t * 2 * F + f], u = gate_up[t * 2 * F + F + f];
        out[i] = g / (1.0f + expf(-g)) * u;
    }
}

// 11. The final norm is add_rms_norm with `rows` = the batch rows that want logits; the logits are one more product
//     (lm_head, [V, D]) through the same matvec/GEMM choice. Then one copy of [rows, V] to the host (see the top).

unsigned blocks_for(size_t n, unsigned threads) { return static_cast<unsigned>((n + threads - 1) / threads); }

// =====================================================================================================================
// Weights on the device
// =====================================================================================================================

struct DeviceMatrix {
    const uint8_t* data = nullptr;  // N rows of row_bytes
    DType format = DType::F32;
    int N = 0, K = 0;
    size_t row_bytes = 0;
    int warps_per_row = 1;  // matvec split-K: 4 when N is small for the card
};

// The type a stored type is read as on the device: as stored where the kernels decode it, else f32 (widened at upload).
DType device_format(DType dtype) { return dtype_block(dtype).on_gpu ? dtype : DType::F32; }

bool uploaded_as_stored(DType dtype) { return dtype_block(dtype).on_gpu; }

// Uploads weights, each host tensor once (a tied lm_head is the embedding itself), and keeps them.
class DeviceWeights {
public:
    explicit DeviceWeights(int sm_count) : sm_count_(sm_count) {}

    DeviceMatrix matrix(const Tensor& t) {
        DeviceMatrix m;
        m.N = static_cast<int>(t.rows());
        m.K = static_cast<int>(t.cols());
        m.format = device_format(t.dtype);
        m.row_bytes = row_bytes_of(m.format, m.K);
        m.data = bytes_of(t);
        finish(m);
        return m;
    }
    // Matrices with the same K stacked row-wise into one ([wq; wk; wv] → [(H + 2·Hkv)·Dh, D], [w_gate; w_up] → [2F, D]):
    // one launch reads what three (or two) did, as vLLM's QKVParallelLinear and MergedColumnParallelLinear do.
    // Rows of one type stack as stored (blocks included: a row is whole blocks); a mix (a Q4_K_M file's Q6_K wv beside
    // Q4_K wq and wk) is widened to f32.
    DeviceMatrix stacked(std::initializer_list<const Tensor*> parts) {
        DeviceMatrix m;
        m.K = static_cast<int>(parts.begin()[0]->cols());
        const DType first = parts.begin()[0]->dtype;
        bool same = true;
        for (const Tensor* t : parts) {
            if (t->cols() != m.K) fail("cuda: cannot stack ", t->name, " (", t->cols(), " columns, not ", m.K, ")");
            m.N += static_cast<int>(t->rows());
            same = same && t->dtype == first;
        }
        m.format = same ? device_format(first) : DType::F32;
        m.row_bytes = row_bytes_of(m.format, m.K);
        std::vector<std::byte> host;
        host.reserve(static_cast<size_t>(m.N) * m.row_bytes);
        for (const Tensor* t : parts) {
            if (same && uploaded_as_stored(t->dtype)) {
                host.insert(host.end(), t->data, t->data + t->bytes());
            } else {  // widened to f32 row by row
                std::vector<float> row(static_cast<size_t>(t->cols()));
                for (int64_t r = 0; r < t->rows(); ++r) {
                    t->read_row(r, row.data());
                    const std::byte* b = reinterpret_cast<const std::byte*>(row.data());
                    host.insert(host.end(), b, b + row.size() * 4);
                }
            }
        }
        buffers_.push_back(upload(host.data(), host.size()));
        m.data = reinterpret_cast<const uint8_t*>(buffers_.back().get());
        finish(m);
        return m;
    }
    // Vectors stacked the same way (the q|k|v biases); an absent part is zeros; nullptr when all are absent.
    const float* stacked_vector(std::initializer_list<std::pair<const Tensor*, int64_t>> parts) {
        bool any = false;
        std::vector<float> host;
        for (auto [t, length] : parts) {
            any = any || !t->empty();
            for (int64_t i = 0; i < length; ++i) host.push_back(t->empty() ? 0.0f : t->at(i));
        }
        if (!any) return nullptr;
        buffers_.push_back(upload(reinterpret_cast<const std::byte*>(host.data()), host.size() * 4));
        return reinterpret_cast<const float*>(buffers_.back().get());
    }
    // 1-D tensors (norm gains, biases) as f32; nullptr for an absent optional one.
    const float* vector(const Tensor& t) {
        if (t.empty()) return nullptr;
        std::vector<float> host(static_cast<size_t>(t.elements()));
        for (size_t i = 0; i < host.size(); ++i) host[i] = t.at(static_cast<int64_t>(i));
        buffers_.push_back(upload(reinterpret_cast<const std::byte*>(host.data()), host.size() * 4));
        return reinterpret_cast<const float*>(buffers_.back().get());
    }
    // Elements of the largest block-format matrix: the f32 buffer a prefill decodes one matrix into.
    size_t largest_block_matrix() const { return largest_block_matrix_; }

private:
    void finish(DeviceMatrix& m) {
        // Split K four ways when one warp per row would leave the card short of warps (fewer than ~8 per SM).
        m.warps_per_row = m.N < sm_count_ * 32 ? 4 : 1;
        if (is_block(m.format))
            largest_block_matrix_ = std::max(largest_block_matrix_, static_cast<size_t>(m.N) * static_cast<size_t>(m.K));
    }

    const uint8_t* bytes_of(const Tensor& t) {
        auto found = uploaded_.find(t.data);
        if (found != uploaded_.end()) return found->second;
        const std::byte* source = t.data;
        size_t count = t.bytes();
        std::vector<float> widened;
        if (!uploaded_as_stored(t.dtype)) {  // f16 and the block types without a kernel: widened once to f32 (exact)
            widened.resize(static_cast<size_t>(t.elements()));
            for (int64_t r = 0; r < t.rows(); ++r) t.read_row(r, widened.data() + r * t.cols());
            source = reinterpret_cast<const std::byte*>(widened.data());
            count = widened.size() * 4;
        }
        buffers_.push_back(upload(source, count));
        bytes_ += count;
        return uploaded_[t.data] = reinterpret_cast<const uint8_t*>(buffers_.back().get());
    }

    int sm_count_;
    size_t bytes_ = 0;
    size_t largest_block_matrix_ = 0;
    std::vector<DeviceBuffer<std::byte>> buffers_;
    std::unordered_map<const std::byte*, const uint8_t*> uploaded_;
};

struct DeviceLayer {
    const float *attn_norm, *ffn_norm, *q_norm, *k_norm;
    const float* qkv_bias;      // [(H + 2·Hkv)·Dh] or nullptr
    DeviceMatrix qkv;           // [(H + 2·Hkv)·Dh, D] = [wq; wk; wv]
    DeviceMatrix wo;            // [D, H·Dh]
    DeviceMatrix gate_up;       // [2F, D] = [w_gate; w_up]
    DeviceMatrix w_down;        // [D, F]
};

int device_sm_count(int device) {
    int count = 0;
    INFER_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
    return count;
}

// ---- The matrix products, either kernel, with the launch arithmetic in one place ----

// Launches matvec for T ≤ 8 rows (groups of 8 rows for more: the invariant path).
void launch_embedding_gather(const DeviceMatrix& table, const int* ids, int T, float* x, cudaStream_t stream) {
    for_format(table.format, [&](auto format) {
        embedding_gather<decltype(format)::value><<<T, 256, 0, stream>>>(table.data, table.row_bytes, ids, table.K, x);
    });
}

void launch_matvec(const DeviceMatrix& m, const float* x, int T, const float* bias, float* out, cudaStream_t stream) {
    if (m.K % 8 == 0 && (reinterpret_cast<uintptr_t>(m.data) % 16 != 0 || reinterpret_cast<uintptr_t>(x) % 16 != 0 ||
                         m.row_bytes % (m.format == DType::Q8_0 ? 2 : 16) != 0))
        fail("cuda matvec: buffers are not aligned for 16-byte loads");
    const int rows_per_block = 4 / m.warps_per_row;
    const dim3 grid(blocks_for(static_cast<size_t>(m.N), rows_per_block));
    for (int t0 = 0; t0 < T; t0 += 8) {
        const int rows = std::min(8, T - t0);
        const float* xs = x + static_cast<size_t>(t0) * m.K;
        float* os = out + static_cast<size_t>(t0) * m.N;
        auto go = [&](auto rows_tag) {
            constexpr int R = decltype(rows_tag)::value;
            for_format(m.format, [&](auto format) {
                matvec<decltype(format)::value, R><<<grid, 128, 0, stream>>>(m.data, m.row_bytes, xs, rows, m.N, m.K,
                                                                            m.warps_per_row, bias, os);
            });
        };
        if (rows == 1) go(std::integral_constant<int, 1>{});
        else if (rows == 2) go(std::integral_constant<int, 2>{});
        else if (rows <= 4) go(std::integral_constant<int, 4>{});
        else go(std::integral_constant<int, 8>{});
        INFER_LAUNCH_CHECK();
    }
}

// The three ways to run one product. Vector: matvec (f32 activations); Tiled: the wmma kernel; Cublas: cublasGemmEx.
enum class Path { Vector, Tiled, Cublas };

struct MatmulContext {
    cublasHandle_t cublas = nullptr;
    DeviceBuffer<__nv_bfloat16> x_bf16;  // [T, max K] the activations rounded for the tensor cores
    DeviceBuffer<float> dequantized;     // [N, K] of the largest block-format matrix, decoded for cuBLAS
    cudaStream_t stream = nullptr;
};

void run_matmul(MatmulContext& ctx, Path path, const DeviceMatrix& m, const float* x, int T, const float* bias, float* out) {
    if (T <= 0) return;
    const bool bf16 = m.format == DType::BF16;
    // Only bf16 weights have a tensor-core path here; the others take the matrix-vector kernel for Tiled, and cuBLAS in
    // f32 (pedantic, no TF32) for Cublas, block formats decoded to f32 first.
    if (path == Path::Vector || (!bf16 && path == Path::Tiled)) {
        launch_matvec(m, x, T, bias, out, ctx.stream);
        return;
    }
    const void* weights = m.data;
    if (is_block(m.format)) {
        const size_t elements = static_cast<size_t>(m.N) * m.K;
        if (ctx.dequantized.size() < elements)
            fail("cuda: dequantization buffer too small (", ctx.dequantized.size(), " < ", elements, ")");
        for_format(m.format, [&](auto format) {
            dequantize_rows<decltype(format)::value><<<blocks_for(elements / 8, 256), 256, 0, ctx.stream>>>(
                m.data, m.row_bytes, m.N, m.K, ctx.dequantized.get());
        });
        INFER_LAUNCH_CHECK();
        weights = ctx.dequantized.get();
    }
    const size_t n = static_cast<size_t>(T) * m.K;
    if (bf16) {
        if (ctx.x_bf16.size() < n) fail("cuda: bf16 activation buffer too small (", ctx.x_bf16.size(), " < ", n, ")");
        to_bf16<<<blocks_for(n, 256), 256, 0, ctx.stream>>>(x, ctx.x_bf16.get(), n);
        INFER_LAUNCH_CHECK();
    }
    if (path == Path::Tiled) {
        const dim3 grid(blocks_for(static_cast<size_t>(m.N), kTile), blocks_for(static_cast<size_t>(T), kTile));
        gemm_tiled_wmma<<<grid, 128, 0, ctx.stream>>>(ctx.x_bf16.get(), reinterpret_cast<const __nv_bfloat16*>(m.data), T, m.N,
                                                      m.K, bias, out);
        INFER_LAUNCH_CHECK();
        return;
    }
    // cuBLAS is column-major: out[T, N] row-major is outᵀ[N, T] column-major = W[N, K] · xᵀ[K, T], where W stored
    // row-major [N, K] is a column-major [K, N] matrix used transposed, and x row-major [T, K] is column-major [K, T].
    const float one = 1, zero = 0;
    const void* xs = bf16 ? static_cast<const void*>(ctx.x_bf16.get()) : static_cast<const void*>(x);
    const cudaDataType type = bf16 ? CUDA_R_16BF : CUDA_R_32F;
    const cublasComputeType_t compute = bf16 ? CUBLAS_COMPUTE_32F : CUBLAS_COMPUTE_32F_PEDANTIC;
    INFER_CUBLAS_CHECK(cublasGemmEx(ctx.cublas, CUBLAS_OP_T, CUBLAS_OP_N, m.N, T, m.K, &one, weights, type, m.K, xs, type,
                                    m.K, &zero, out, CUDA_R_32F, m.N, compute, CUBLAS_GEMM_DEFAULT));
    if (bias) {
        add_bias<<<blocks_for(static_cast<size_t>(T) * m.N, 256), 256, 0, ctx.stream>>>(out, bias, T, m.N);
        INFER_LAUNCH_CHECK();
    }
}

Path path_for(const CudaOptions& options, int T) {
    if (T <= options.vector_rows) return Path::Vector;
    return options.matmul == CudaOptions::Matmul::Tiled ? Path::Tiled : Path::Cublas;
}

MatmulContext make_matmul_context(cudaStream_t stream) {
    MatmulContext ctx;
    ctx.stream = stream;
    INFER_CUBLAS_CHECK(cublasCreate(&ctx.cublas));
    INFER_CUBLAS_CHECK(cublasSetStream(ctx.cublas, stream));
    return ctx;
}

}  // namespace

// =====================================================================================================================
// Device queries and the two calibration measurements of chapter 07
// =====================================================================================================================

bool device_available(std::string* why) {
    int count = 0;
    cudaError_t status = cudaGetDeviceCount(&count);
    if (status != cudaSuccess || count == 0) {
        if (why)
            *why = status != cudaSuccess ? concat("no usable CUDA device (", cudaGetErrorString(status), ")")
                                         : std::string("no CUDA device");
        cudaGetLastError();  // clear the sticky error for later calls
        return false;
    }
    return true;
}

// Seconds that `repeats` calls of `launch` take on the device's default stream, timed with CUDA events.
template <class Launch>
double seconds_on_device(int repeats, Launch&& launch) {
    cudaEvent_t start, stop;
    INFER_CUDA_CHECK(cudaEventCreate(&start));
    INFER_CUDA_CHECK(cudaEventCreate(&stop));
    INFER_CUDA_CHECK(cudaEventRecord(start));
    for (int i = 0; i < repeats; ++i) launch();
    INFER_CUDA_CHECK(cudaEventRecord(stop));
    INFER_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    INFER_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    return ms * 1e-3;
}

std::string device_description(int device) {
    cudaDeviceProp prop{};
    INFER_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
    return concat(prop.name, ", ", prop.multiProcessorCount, " SMs, ", prop.totalGlobalMem >> 30, " GiB, sm_",
                          prop.major, prop.minor);
}

// Device-to-device copy of `bytes`: every byte is read once and written once, so the rate counts both.
double measure_copy_bandwidth(size_t bytes, int repeats) {
    DeviceBuffer<std::byte> a(bytes), b(bytes);
    INFER_CUDA_CHECK(cudaMemset(a.get(), 1, bytes));
    INFER_CUDA_CHECK(cudaMemcpy(b.get(), a.get(), bytes, cudaMemcpyDeviceToDevice));  // warm-up
    const double seconds = seconds_on_device(repeats, [&] {
        INFER_CUDA_CHECK(cudaMemcpyAsync(b.get(), a.get(), bytes, cudaMemcpyDeviceToDevice));
    });
    return 2.0 * static_cast<double>(bytes) * repeats / seconds;
}

// cuBLAS bf16 × bf16 → f32 (f32 accumulate) on an n × n × n product: the rate prefill is measured against.
double measure_bf16_matmul_rate(int n, int repeats) {
    const size_t elements = static_cast<size_t>(n) * n;
    DeviceBuffer<__nv_bfloat16> a(elements), b(elements);
    DeviceBuffer<float> c(elements);
    INFER_CUDA_CHECK(cudaMemset(a.get(), 0, elements * 2));
    INFER_CUDA_CHECK(cudaMemset(b.get(), 0, elements * 2));
    cublasHandle_t handle;
    INFER_CUBLAS_CHECK(cublasCreate(&handle));
    const float one = 1, zero = 0;
    auto run = [&] {
        INFER_CUBLAS_CHECK(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &one, a.get(), CUDA_R_16BF, n, b.get(),
                                        CUDA_R_16BF, n, &zero, c.get(), CUDA_R_32F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    };
    run();  // warm-up
    const double seconds = seconds_on_device(repeats, run);
    cublasDestroy(handle);
    return 2.0 * n * static_cast<double>(n) * n * repeats / seconds;
}

// =====================================================================================================================
// The forward pass
// =====================================================================================================================

// Everything the GPU forward pass owns: weights in device memory, the KV pools, scratch, cuBLAS, the graphs.
struct ForwardState {
    const Model& model;
    CudaOptions options;
    int sm_count = 0;
    cudaStream_t stream = nullptr;
    MatmulContext mm;
    DeviceBuffer<std::byte> cublas_workspace;
    DeviceWeights weights;
    DeviceMatrix embedding;  // [V, D] gathered by row (a tied lm_head shares its device copy)
    const float* final_norm = nullptr;
    DeviceMatrix lm_head;
    std::vector<DeviceLayer> layers;
    std::vector<double> inverse_frequencies;  // [Dh/2]

    // The K/V pool: [L, num_blocks, B, Hkv, Dh] each, the blocks of the KVCache whose block tables it follows (token-major
    // within a block, where the CPU's are head-major: here one thread block writes a token's Hkv × Dh in one sweep).
    const KVCache* pool_owner = nullptr;
    int pool_blocks = 0, pool_block_size = 0;
    DeviceBuffer<float> k_pool, v_pool;
    int table_stride = 0;  // blocks per sequence at most: min(context, pool) / B

    // Scratch, sized for `capacity` rows.
    size_t capacity = 0;
    DeviceBuffer<float> x;          // [T, D] the residual stream
    DeviceBuffer<float> xn;         // [T, D] the normed input of a block (and of the logits)
    DeviceBuffer<float> block_out;  // [T, D] a block's output, added to x by the next add_rms_norm
    DeviceBuffer<float> qkv;        // [T, (H + 2·Hkv)·Dh] q | k | v of each token, one product
    DeviceBuffer<float> attn;       // [T, H, Dh]
    DeviceBuffer<float> gate_up;    // [T, 2F] gate | up of each token, one product
    DeviceBuffer<float> hidden;     // [T, F] silu(gate) · up
    DeviceBuffer<float> logits;     // [rows, V]
    DeviceBuffer<float> cos_table, sin_table;  // [T, Dh/2]
    DeviceBuffer<float> part_acc, part_ml;     // [T, H, kSplits, Dh], [T, H, kSplits, 2] flash-decoding partials
    DeviceBuffer<int> ids, positions, slots, token_sequence, logit_rows, decode_rows;  // [T] each
    DeviceBuffer<int> block_tables;  // [sequences ≤ T, table_stride]
    DeviceBuffer<PrefillTile> tiles;
    PinnedBuffer host_logits;  // [rows, V] what forward() returns
    PinnedBuffer staging;      // one step's inputs on their way up

    // Host staging of one batch.
    std::vector<int> h_ids, h_positions, h_slots, h_sequence, h_tables, h_rows, h_decode_rows;
    std::vector<float> h_cos, h_sin;
    std::vector<PrefillTile> h_tiles;

    // Graphs per bucket (rows, padded), valid while no buffer above moves.
    std::map<int, cudaGraphExec_t> graphs;

    ForwardState(const Model& m, CudaOptions o) : model(m), options(o), weights(0) {}
};

class GpuForwardPass final : public ForwardPass {
public:
    GpuForwardPass(const Model& model, CudaOptions options);
    ~GpuForwardPass() override;
    GpuForwardPass(const GpuForwardPass&) = delete;
    GpuForwardPass& operator=(const GpuForwardPass&) = delete;

    const Model& model() const override { return state_->model; }
    std::span<const float> forward(const Batch& batch, KVCache& cache) override;

private:
    std::unique_ptr<ForwardState> state_;
};

GpuForwardPass::GpuForwardPass(const Model& model, CudaOptions options)
    : state_(std::make_unique<ForwardState>(model, options)) {
    ForwardState& s = *state_;
    const ModelConfig& c = model.config;
    std::string why;
    if (!device_available(&why)) fail("--device cuda: ", why);
    if (c.head_dim > kMaxHeadDim) fail("cuda: head size ", c.head_dim, " is above the kernels' limit of ", kMaxHeadDim);
    INFER_CUDA_CHECK(cudaSetDevice(options.device));
    s.sm_count = device_sm_count(options.device);
    s.weights = DeviceWeights(s.sm_count);
    INFER_CUDA_CHECK(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking));
    s.mm = make_matmul_context(s.stream);
    // A fixed workspace, so cuBLAS allocates nothing while a decode step is being captured into a graph.
    s.cublas_workspace.resize(32u << 20);
    INFER_CUBLAS_CHECK(cublasSetWorkspace(s.mm.cublas, s.cublas_workspace.get(), s.cublas_workspace.size()));

    s.embedding = s.weights.matrix(model.embedding);
    s.final_norm = s.weights.vector(model.final_norm);
    s.lm_head = s.weights.matrix(model.lm_head);
    for (const LayerWeights& w : model.layers) {
        DeviceLayer d;
        d.attn_norm = s.weights.vector(w.attn_norm);
        d.ffn_norm = s.weights.vector(w.ffn_norm);
        d.q_norm = s.weights.vector(w.q_norm);
        d.k_norm = s.weights.vector(w.k_norm);
        d.qkv_bias = s.weights.stacked_vector({{&w.bq, w.wq.rows()}, {&w.bk, w.wk.rows()}, {&w.bv, w.wv.rows()}});
        d.qkv = s.weights.stacked({&w.wq, &w.wk, &w.wv});
        d.wo = s.weights.matrix(w.wo);
        d.gate_up = s.weights.stacked({&w.w_gate, &w.w_up});
        d.w_down = s.weights.matrix(w.w_down);
        s.layers.push_back(d);
    }
    s.inverse_frequencies = detail::rope_inverse_frequencies(model);
    s.mm.dequantized.resize(s.weights.largest_block_matrix());
}

GpuForwardPass::~GpuForwardPass() {
    if (!state_) return;
    for (auto& [rows, exec] : state_->graphs) cudaGraphExecDestroy(exec);
    if (state_->mm.cublas) cublasDestroy(state_->mm.cublas);
    if (state_->stream) cudaStreamDestroy(state_->stream);
}

std::unique_ptr<ForwardPass> make_forward_pass(const Model& model, CudaOptions options) {
    return std::make_unique<GpuForwardPass>(model, options);
}

namespace {

void drop_graphs(ForwardState& s) {
    for (auto& [rows, exec] : s.graphs) cudaGraphExecDestroy(exec);
    s.graphs.clear();
}

// The device pool follows the KVCache it is given: same blocks, same block size. A different cache (or a different
// shape) gets a fresh pool, as a fresh KVCache holds nothing anyone may read.
void ensure_pool(ForwardState& s, const KVCache& cache) {
    if (s.pool_owner == &cache && s.pool_blocks == cache.num_blocks() && s.pool_block_size == cache.block_size()) return;
    const ModelConfig& c = s.model.config;
    const size_t floats = static_cast<size_t>(c.n_layers) * cache.num_blocks() * cache.block_size() * c.n_kv_heads * c.head_dim;
    s.k_pool = DeviceBuffer<float>(floats);
    s.v_pool = DeviceBuffer<float>(floats);
    s.pool_owner = &cache;
    s.pool_blocks = cache.num_blocks();
    s.pool_block_size = cache.block_size();
    const int longest = std::min(c.context_length, cache.capacity_tokens());
    s.table_stride = (longest + cache.block_size() - 1) / cache.block_size();
    s.capacity = 0;  // the block-table scratch depends on the stride
    drop_graphs(s);
}

void ensure_scratch(ForwardState& s, size_t T) {
    if (T <= s.capacity) return;
    const ModelConfig& c = s.model.config;
    const size_t D = c.dim, q_width = static_cast<size_t>(c.n_heads) * c.head_dim, kv_width = static_cast<size_t>(c.n_kv_heads) * c.head_dim;
    const size_t widest = std::max({D, q_width, static_cast<size_t>(c.ffn_dim)});
    s.x.resize(T * D);
    s.xn.resize(T * D);
    s.block_out.resize(T * D);
    s.qkv.resize(T * (q_width + 2 * kv_width));
    s.attn.resize(T * q_width);
    s.gate_up.resize(T * 2 * static_cast<size_t>(c.ffn_dim));
    s.hidden.resize(T * c.ffn_dim);
    s.cos_table.resize(T * std::max(c.head_dim / 2, 1));
    s.sin_table.resize(T * std::max(c.head_dim / 2, 1));
    s.part_acc.resize(T * c.n_heads * kSplits * static_cast<size_t>(c.head_dim));
    s.part_ml.resize(T * c.n_heads * kSplits * 2);
    s.ids.resize(T);
    s.positions.resize(T);
    s.slots.resize(T);
    s.token_sequence.resize(T);
    s.block_tables.resize(T * static_cast<size_t>(std::max(s.table_stride, 1)));
    s.logit_rows.resize(T);
    s.decode_rows.resize(T);
    s.tiles.resize(T);
    s.mm.x_bf16.resize(T * widest);
    s.capacity = T;
    drop_graphs(s);  // every pointer above may have moved
}

// Everything one forward call runs on the stream: `T` rows (a graph bucket pads T), `rows` of logits, `decode_rows`
// rows through flash-decoding and `n_tiles` prefill tiles through attention_prefill.
void enqueue_forward(ForwardState& s, int T, int rows, int decode_rows, int n_tiles) {
    const ModelConfig& c = s.model.config;
    const int D = c.dim, Dh = c.head_dim, H = c.n_heads, Hkv = c.n_kv_heads, F = c.ffn_dim;
    const size_t kv_width = static_cast<size_t>(Hkv) * Dh;
    const size_t ld = static_cast<size_t>(H + 2 * Hkv) * Dh;  // the fused q|k|v row
    const size_t layer_floats = static_cast<size_t>(s.pool_blocks) * s.pool_block_size * kv_width;
    const float scale = 1.0f / std::sqrt(static_cast<float>(Dh));
    const bool adjacent = c.rope_style == RopeStyle::AdjacentPairs;
    const Path path = path_for(s.options, T);
    cudaStream_t stream = s.stream;

    launch_embedding_gather(s.embedding, s.ids.get(), T, s.x.get(), stream);
    INFER_LAUNCH_CHECK();

    for (int l = 0; l < c.n_layers; ++l) {
        const DeviceLayer& w = s.layers[static_cast<size_t>(l)];
        // Attention block: norm (fused with the previous MLP block's residual add), q/k/v, RoPE, cache write, attention.
        add_rms_norm<<<T, 256, 0, stream>>>(s.x.get(), l == 0 ? nullptr : s.block_out.get(), w.attn_norm, D, c.norm_eps,
                                            s.xn.get(), nullptr);
        INFER_LAUNCH_CHECK();
        run_matmul(s.mm, path, w.qkv, s.xn.get(), T, w.qkv_bias, s.qkv.get());
        float* q = s.qkv.get();
        float* k = q + static_cast<size_t>(H) * Dh;
        float* v = k + kv_width;
        rope<<<dim3(T, H + Hkv), 128, 0, stream>>>(q, ld, H, Dh, w.q_norm, w.k_norm, c.norm_eps, s.cos_table.get(),
                                                   s.sin_table.get(), adjacent);
        INFER_LAUNCH_CHECK();
        float* k_layer = s.k_pool.get() + static_cast<size_t>(l) * layer_floats;
        float* v_layer = s.v_pool.get() + static_cast<size_t>(l) * layer_floats;
        write_kv<<<T, 256, 0, stream>>>(k, v, ld, s.slots.get(), static_cast<int>(kv_width), k_layer, v_layer);
        INFER_LAUNCH_CHECK();
        if (decode_rows > 0) {
            attention_decode<<<dim3(decode_rows, Hkv, kSplits), 128, 0, stream>>>(
                q, ld, k_layer, v_layer, s.block_tables.get(), s.table_stride, s.token_sequence.get(), s.positions.get(),
                s.decode_rows.get(), H, Hkv, Dh, s.pool_block_size, c.sliding_window, scale, s.part_acc.get(), s.part_ml.get());
            INFER_LAUNCH_CHECK();
            attention_combine<<<dim3(decode_rows, H), 128, 0, stream>>>(s.part_acc.get(), s.part_ml.get(), s.positions.get(),
                                                                        s.decode_rows.get(), H, Dh, s.attn.get());
            INFER_LAUNCH_CHECK();
        }
        if (n_tiles > 0) {
            attention_prefill<<<dim3(n_tiles, H), 128, 0, stream>>>(q, ld, k_layer, v_layer, s.block_tables.get(),
                                                                     s.table_stride, s.token_sequence.get(), s.positions.get(),
                                                                     s.tiles.get(), H, Hkv, Dh, s.pool_block_size,
                                                                     c.sliding_window, scale, s.attn.get());
            INFER_LAUNCH_CHECK();
        }
        run_matmul(s.mm, path, w.wo, s.attn.get(), T, nullptr, s.block_out.get());

        // MLP block: norm (fused with the attention block's residual add), gate and up, SwiGLU, down.
        add_rms_norm<<<T, 256, 0, stream>>>(s.x.get(), s.block_out.get(), w.ffn_norm, D, c.norm_eps, s.xn.get(), nullptr);
        INFER_LAUNCH_CHECK();
        run_matmul(s.mm, path, w.gate_up, s.xn.get(), T, nullptr, s.gate_up.get());
        swiglu<<<blocks_for(static_cast<size_t>(T) * F, 256), 256, 0, stream>>>(s.gate_up.get(), F, static_cast<size_t>(T) * F,
                                                                              s.hidden.get());
        INFER_LAUNCH_CHECK();
        run_matmul(s.mm, path, w.w_down, s.hidden.get(), T, nullptr, s.block_out.get());
    }
    // Final norm (fused with the last residual add) on the rows that want logits, then the vocabulary projection.
    if (rows > 0) {
        add_rms_norm<<<rows, 256, 0, stream>>>(s.x.get(), s.block_out.get(), s.final_norm, D, c.norm_eps, s.xn.get(),
                                               s.logit_rows.get());
        INFER_LAUNCH_CHECK();
        run_matmul(s.mm, path_for(s.options, rows), s.lm_head, s.xn.get(), rows, nullptr, s.logits.get());
    }
}

}  // namespace

std::span<const float> GpuForwardPass::forward(const Batch& batch, KVCache& cache) {
    ForwardState& s = *state_;
    const ModelConfig& c = s.model.config;
    const int T = static_cast<int>(batch.size());
    if (T == 0) return {};
    if (batch.positions.size() != batch.tokens.size() || batch.sequences.size() != batch.tokens.size() ||
        batch.wants_logits.size() != batch.tokens.size())
        fail("batch: tokens, positions, sequences and wants_logits differ in length");
    const int half = c.head_dim / 2, B = cache.block_size();
    INFER_CUDA_CHECK(cudaSetDevice(s.options.device));
    ensure_pool(s, cache);

    // Host side of the step, as the CPU's: ids, positions, slot mapping, one block table per sequence, cos/sin.
    s.h_ids.assign(batch.tokens.begin(), batch.tokens.end());
    s.h_positions.assign(batch.positions.begin(), batch.positions.end());
    s.h_slots.resize(static_cast<size_t>(T));
    s.h_sequence.resize(static_cast<size_t>(T));
    s.h_cos.resize(static_cast<size_t>(T) * half);
    s.h_sin.resize(static_cast<size_t>(T) * half);
    s.h_tables.clear();
    s.h_rows.clear();
    std::unordered_map<int, int> sequence_index;
    for (int t = 0; t < T; ++t) {
        const int token = batch.tokens[t], position = batch.positions[t];
        if (token < 0 || token >= c.vocab_size)
            fail("token id ", token, " is outside the vocabulary (", c.vocab_size, " tokens)");
        if (position < 0 || position >= c.context_length)
            fail("position ", position, " is outside the model's context of ", c.context_length, " tokens");
        const std::vector<int>& table = cache.block_table(batch.sequences[t]);
        if (static_cast<size_t>(position / B) >= table.size())
            fail("KV cache: sequence ", batch.sequences[t], " has no block reserved for position ", position);
        s.h_slots[t] = table[position / B] * B + position % B;
        auto [found, added] = sequence_index.try_emplace(batch.sequences[t], static_cast<int>(sequence_index.size()));
        if (added) {
            if (static_cast<int>(table.size()) > s.table_stride)
                fail("cuda: sequence ", batch.sequences[t], " holds ", table.size(), " blocks, above ", s.table_stride);
            s.h_tables.insert(s.h_tables.end(), table.begin(), table.end());
            s.h_tables.resize(static_cast<size_t>(sequence_index.size()) * s.table_stride, 0);
        }
        s.h_sequence[t] = found->second;
        for (int i = 0; i < half; ++i) {
            const double angle = position * s.inverse_frequencies[i];
            s.h_cos[static_cast<size_t>(t) * half + i] = static_cast<float>(std::cos(angle));
            s.h_sin[static_cast<size_t>(t) * half + i] = static_cast<float>(std::sin(angle));
        }
        if (batch.wants_logits[t]) s.h_rows.push_back(t);
    }
    const int rows = static_cast<int>(s.h_rows.size());

    // Prefill tiles: runs of ≥ prefill_attention_rows consecutive rows of one sequence at consecutive positions.
    s.h_tiles.clear();
    if (c.head_dim <= kPrefillMaxHeadDim) {
        for (int t = 0; t < T;) {
            int end = t + 1;
            while (end < T && batch.sequences[end] == batch.sequences[t] && batch.positions[end] == batch.positions[end - 1] + 1) ++end;
            if (end - t >= s.options.prefill_attention_rows)
                for (int first = t; first < end; first += kQueryTile) s.h_tiles.push_back({first, std::min(kQueryTile, end - first)});
            t = end;
        }
    }

    std::vector<char> tiled(static_cast<size_t>(T), 0);
    for (const PrefillTile& tile : s.h_tiles) std::fill_n(tiled.begin() + tile.first_token, tile.count, 1);
    s.h_decode_rows.clear();
    for (int t = 0; t < T; ++t)
        if (!tiled[t]) s.h_decode_rows.push_back(t);

    // A decode-shaped step (every row wants logits, no prefill tiles) replays a graph for its bucket.
    int bucket = T;
    const bool use_graph = s.options.graphs && rows == T && s.h_tiles.empty() && T <= 256;
    if (use_graph) {
        bucket = 1;
        while (bucket < T) bucket *= 2;
        for (int t = T; t < bucket; ++t) {  // padding rows: token 0, no position, no slot, logits not read
            s.h_ids.push_back(0);
            s.h_positions.push_back(-1);
            s.h_slots.push_back(-1);
            s.h_sequence.push_back(0);
            s.h_rows.push_back(t);
            s.h_decode_rows.push_back(t);
        }
        s.h_cos.resize(static_cast<size_t>(bucket) * half, 1.0f);
        s.h_sin.resize(static_cast<size_t>(bucket) * half, 0.0f);
    }
    ensure_scratch(s, static_cast<size_t>(std::max(bucket, 16)));
    // Logits only for the rows that want them (a 2048-token prompt wants one row, not 2048 × V floats).
    if (s.logits.reserve(static_cast<size_t>(std::max({rows, use_graph ? bucket : 0, 16})) * c.vocab_size)) drop_graphs(s);

    // The inputs go through one pinned buffer (the previous step's copies finished at its synchronize).
    size_t staged = 0;
    for (size_t bytes : {s.h_ids.size() * 4, s.h_positions.size() * 4, s.h_slots.size() * 4, s.h_sequence.size() * 4,
                         s.h_tables.size() * 4, s.h_rows.size() * 4, s.h_decode_rows.size() * 4, s.h_cos.size() * 4,
                         s.h_sin.size() * 4, s.h_tiles.size() * sizeof(PrefillTile)})
        staged += (bytes + 255) / 256 * 256;
    s.staging.reserve(staged);
    staged = 0;
    auto put = [&](auto& device, const auto& host) {
        const size_t bytes = host.size() * sizeof(host[0]);
        if (bytes == 0) return;
        std::memcpy(s.staging.get() + staged, host.data(), bytes);
        INFER_CUDA_CHECK(cudaMemcpyAsync(device.get(), s.staging.get() + staged, bytes, cudaMemcpyHostToDevice, s.stream));
        staged += (bytes + 255) / 256 * 256;
    };
    put(s.ids, s.h_ids);
    put(s.positions, s.h_positions);
    put(s.slots, s.h_slots);
    put(s.token_sequence, s.h_sequence);
    put(s.block_tables, s.h_tables);
    put(s.logit_rows, s.h_rows);
    put(s.decode_rows, s.h_decode_rows);
    put(s.cos_table, s.h_cos);
    put(s.sin_table, s.h_sin);
    put(s.tiles, s.h_tiles);

    if (use_graph) {
        auto found = s.graphs.find(bucket);
        if (found != s.graphs.end()) {
            INFER_CUDA_CHECK(cudaGraphLaunch(found->second, s.stream));
        } else {
            // First step of this bucket: run it eagerly (that loads every kernel and lets cuBLAS pick its algorithm
            // outside a capture), then record the same launches into a graph for the next steps. Capturing runs nothing.
            enqueue_forward(s, bucket, bucket, bucket, 0);
            cudaGraph_t graph;
            INFER_CUDA_CHECK(cudaStreamBeginCapture(s.stream, cudaStreamCaptureModeThreadLocal));
            try {
                enqueue_forward(s, bucket, bucket, bucket, 0);
            } catch (...) {
                cudaStreamEndCapture(s.stream, &graph);
                throw;
            }
            INFER_CUDA_CHECK(cudaStreamEndCapture(s.stream, &graph));
            cudaGraphExec_t exec;
            INFER_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
            INFER_CUDA_CHECK(cudaGraphDestroy(graph));
            s.graphs.emplace(bucket, exec);
        }
    } else {
        enqueue_forward(s, T, rows, static_cast<int>(s.h_decode_rows.size()), static_cast<int>(s.h_tiles.size()));
    }

    // One copy of the logits to the host; the sampler runs there (why: see the top of this file).
    const size_t count = static_cast<size_t>(rows) * c.vocab_size;
    s.host_logits.reserve(std::max<size_t>(count, 1) * sizeof(float));
    if (count)
        INFER_CUDA_CHECK(cudaMemcpyAsync(s.host_logits.get(), s.logits.get(), count * sizeof(float), cudaMemcpyDeviceToHost, s.stream));
    INFER_CUDA_CHECK(cudaStreamSynchronize(s.stream));
    return {reinterpret_cast<const float*>(s.host_logits.get()), count};
}

// =====================================================================================================================
// Each kernel alone on host data, for the tests against the CPU twins
// =====================================================================================================================

namespace kernels {

std::vector<float> embedding(const Tensor& table, const std::vector<int>& ids) {
    DeviceWeights weights(1);
    DeviceMatrix m = weights.matrix(table);
    DeviceBuffer<int> d_ids = upload(ids.data(), ids.size());
    DeviceBuffer<float> x(ids.size() * m.K);
    const int T = static_cast<int>(ids.size());
    launch_embedding_gather(m, d_ids.get(), T, x.get(), nullptr);
    INFER_LAUNCH_CHECK();
    return download(x.get(), ids.size() * m.K);
}

std::vector<float> add_rms_norm(std::vector<float>& x, const std::vector<float>& add, const Tensor& gain, int D, double eps) {
    DeviceWeights weights(1);
    const float* g = weights.vector(gain);
    const int T = static_cast<int>(x.size() / D);
    DeviceBuffer<float> dx = upload(x.data(), x.size()), out(x.size());
    DeviceBuffer<float> dadd = upload(add.data(), add.size());
    infer::cuda::add_rms_norm<<<T, 256>>>(dx.get(), add.empty() ? nullptr : dadd.get(), g, D, eps, out.get(), nullptr);
    INFER_LAUNCH_CHECK();
    x = download(dx.get(), x.size());
    return download(out.get(), x.size());
}

std::vector<float> rope(const std::vector<float>& x, int heads, int Dh, const Tensor& norm, double eps,
                        const std::vector<float>& cos, const std::vector<float>& sin, RopeStyle style) {
    DeviceWeights weights(1);
    const float* n = weights.vector(norm);
    const int T = static_cast<int>(x.size() / (static_cast<size_t>(heads) * Dh));
    DeviceBuffer<float> dx = upload(x.data(), x.size()), dc = upload(cos.data(), cos.size()), ds = upload(sin.data(), sin.size());
    infer::cuda::rope<<<dim3(T, heads), 128>>>(dx.get(), static_cast<size_t>(heads) * Dh, heads, Dh, n, n, eps, dc.get(), ds.get(),
                                               style == RopeStyle::AdjacentPairs);
    INFER_LAUNCH_CHECK();
    return download(dx.get(), x.size());
}

std::vector<float> write_kv(const std::vector<float>& k, const std::vector<float>& v, const std::vector<int>& slots,
                            int width, int pool_slots) {
    DeviceBuffer<float> dk = upload(k.data(), k.size()), dv = upload(v.data(), v.size());
    DeviceBuffer<int> ds = upload(slots.data(), slots.size());
    const size_t n = static_cast<size_t>(pool_slots) * width;
    DeviceBuffer<float> kp(n), vp(n);
    INFER_CUDA_CHECK(cudaMemset(kp.get(), 0, n * 4));
    INFER_CUDA_CHECK(cudaMemset(vp.get(), 0, n * 4));
    infer::cuda::write_kv<<<static_cast<unsigned>(slots.size()), 256>>>(dk.get(), dv.get(), static_cast<size_t>(width), ds.get(),
                                                                         width, kp.get(), vp.get());
    INFER_LAUNCH_CHECK();
    std::vector<float> result = download(kp.get(), n), values = download(vp.get(), n);
    result.insert(result.end(), values.begin(), values.end());
    return result;
}

std::vector<float> matmul(const Tensor& w, const std::vector<float>& x, int T, const Tensor* bias, MatmulKernel kernel) {
    DeviceWeights weights(device_sm_count(0));
    DeviceMatrix m = weights.matrix(w);
    const float* b = bias ? weights.vector(*bias) : nullptr;
    cudaStream_t stream;
    INFER_CUDA_CHECK(cudaStreamCreate(&stream));
    MatmulContext ctx = make_matmul_context(stream);
    ctx.x_bf16.resize(x.size());
    ctx.dequantized.resize(weights.largest_block_matrix());
    DeviceBuffer<float> dx = upload(x.data(), x.size()), out(static_cast<size_t>(T) * m.N);
    const Path path = kernel == MatmulKernel::Vector ? Path::Vector : kernel == MatmulKernel::Tiled ? Path::Tiled : Path::Cublas;
    run_matmul(ctx, path, m, dx.get(), T, b, out.get());
    INFER_CUDA_CHECK(cudaStreamSynchronize(stream));
    std::vector<float> result = download(out.get(), static_cast<size_t>(T) * m.N);
    cublasDestroy(ctx.cublas);
    cudaStreamDestroy(stream);
    return result;
}

std::vector<float> dequantize(const Tensor& w) {
    DeviceWeights weights(1);
    DeviceMatrix m = weights.matrix(w);
    if (!is_block(m.format)) fail("cuda dequantize: ", w.name, " is ", dtype_name(w.dtype), ", not Q8_0 or Q4_K");
    const size_t elements = static_cast<size_t>(m.N) * m.K;
    DeviceBuffer<float> out(elements);
    for_format(m.format, [&](auto format) {
        dequantize_rows<decltype(format)::value><<<blocks_for(elements / 8, 256), 256>>>(m.data, m.row_bytes, m.N, m.K, out.get());
    });
    INFER_LAUNCH_CHECK();
    return download(out.get(), elements);
}

std::vector<float> attention(const std::vector<float>& q, const KVCache& cache, int layer, const Batch& batch,
                             const ModelConfig& c, bool prefill_kernel) {
    const int T = static_cast<int>(batch.size()), H = c.n_heads, Hkv = c.n_kv_heads, Dh = c.head_dim, B = cache.block_size();
    const size_t width = static_cast<size_t>(Hkv) * Dh, slots = static_cast<size_t>(cache.num_blocks()) * B;
    // The layer's host pool uploaded whole, from the CPU's head-major blocks into the GPU pool's token-major ones.
    if (cache.dtype() != DType::F32) fail("cuda attention: the GPU pool holds f32, the cache ", dtype_name(cache.dtype()));
    std::vector<float> keys(slots * width), values(slots * width);
    for (int block = 0; block < cache.num_blocks(); ++block)
        for (int slot = 0; slot < B; ++slot)
            for (int h = 0; h < Hkv; ++h) {
                const size_t at = (static_cast<size_t>(block) * B + slot) * width + static_cast<size_t>(h) * Dh;
                std::memcpy(&keys[at], cache.key(layer, block, h, slot), Dh * 4);
                std::memcpy(&values[at], cache.value(layer, block, h, slot), Dh * 4);
            }
    std::unordered_map<int, int> index;
    std::vector<int> sequence(static_cast<size_t>(T)), tables;
    const int stride = cache.num_blocks();
    for (int t = 0; t < T; ++t) {
        auto [found, added] = index.try_emplace(batch.sequences[t], static_cast<int>(index.size()));
        if (added) {
            const std::vector<int>& table = cache.block_table(batch.sequences[t]);
            tables.insert(tables.end(), table.begin(), table.end());
            tables.resize(index.size() * stride, 0);
        }
        sequence[t] = found->second;
    }
    std::vector<PrefillTile> tiles;
    for (int t = 0; t < T;) {  // every run of one sequence at consecutive positions, in tiles of 16
        int end = t + 1;
        while (end < T && batch.sequences[end] == batch.sequences[t] && batch.positions[end] == batch.positions[end - 1] + 1) ++end;
        for (int first = t; first < end; first += kQueryTile) tiles.push_back({first, std::min(kQueryTile, end - first)});
        t = end;
    }
    DeviceBuffer<float> dq = upload(q.data(), q.size()), dk = upload(keys.data(), keys.size()), dv = upload(values.data(), values.size());
    DeviceBuffer<int> dt = upload(tables.data(), tables.size()), ds = upload(sequence.data(), sequence.size());
    DeviceBuffer<int> dp = upload(batch.positions.data(), batch.positions.size());
    DeviceBuffer<PrefillTile> dtiles = upload(tiles.data(), tiles.size());
    DeviceBuffer<float> out(q.size()), part_acc(static_cast<size_t>(T) * H * kSplits * Dh), part_ml(static_cast<size_t>(T) * H * kSplits * 2);
    const float scale = 1.0f / std::sqrt(static_cast<float>(Dh));
    if (prefill_kernel) {
        if (Dh > kPrefillMaxHeadDim) fail("cuda prefill attention: head size ", Dh, " above ", kPrefillMaxHeadDim);
        attention_prefill<<<dim3(static_cast<unsigned>(tiles.size()), H), 128>>>(dq.get(), static_cast<size_t>(H) * Dh, dk.get(), dv.get(), dt.get(), stride, ds.get(),
                                                                                  dp.get(), dtiles.get(), H, Hkv, Dh, B,
                                                                                  c.sliding_window, scale, out.get());
    } else {
        std::vector<int> all_rows(static_cast<size_t>(T));
        std::iota(all_rows.begin(), all_rows.end(), 0);
        DeviceBuffer<int> dr = upload(all_rows.data(), all_rows.size());
        attention_decode<<<dim3(T, Hkv, kSplits), 128>>>(dq.get(), static_cast<size_t>(H) * Dh, dk.get(), dv.get(), dt.get(), stride, ds.get(), dp.get(),
                                                         dr.get(), H, Hkv, Dh, B, c.sliding_window, scale, part_acc.get(),
                                                         part_ml.get());
        INFER_LAUNCH_CHECK();
        attention_combine<<<dim3(T, H), 128>>>(part_acc.get(), part_ml.get(), dp.get(), dr.get(), H, Dh, out.get());
    }
    INFER_LAUNCH_CHECK();
    return download(out.get(), q.size());
}

std::vector<float> swiglu(const std::vector<float>& gate, const std::vector<float>& up) {
    std::vector<float> gate_up = gate;  // one row: gate | up
    gate_up.insert(gate_up.end(), up.begin(), up.end());
    DeviceBuffer<float> dgu = upload(gate_up.data(), gate_up.size()), out(gate.size());
    infer::cuda::swiglu<<<blocks_for(gate.size(), 256), 256>>>(dgu.get(), static_cast<int>(gate.size()), gate.size(), out.get());
    INFER_LAUNCH_CHECK();
    return download(out.get(), gate.size());
}

}  // namespace kernels
}  // namespace infer::cuda

// =====================================================================================================================
// Entry points for a program that opens this file as a module (libinfer_cuda.so) instead of linking it
// =====================================================================================================================
// The infer program opens the module only when --device cuda asks for it (tools/cuda_module.cpp), so its CPU runs do
// not map the CUDA runtime and cuBLAS. C names, so finding them does not depend on name mangling; errors come back as
// text rather than as exceptions crossing the boundary.

extern "C" {

__attribute__((visibility("default"))) unsigned long long infer_cuda_module_layout() {
    return infer::cuda::module_layout();
}

__attribute__((visibility("default"))) bool infer_cuda_device_available(std::string* why) {
    return infer::cuda::device_available(why);
}

__attribute__((visibility("default"))) infer::cuda::ForwardPass* infer_cuda_make_forward_pass(
    const infer::Model* model, const infer::CudaOptions* options, std::string* error) {
    try {
        return infer::cuda::make_forward_pass(*model, *options).release();
    } catch (const std::exception& e) {
        *error = e.what();
        return nullptr;
    }
}

}  // extern "C"
