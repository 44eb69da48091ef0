// The CUDA hardware layer (infer_cuda.cu) against the CPU path: each kernel against its CPU twin in infer.hpp on fresh
// random inputs, then whole models (the architecture fixtures, stories260K) logit for logit, greedy ids, and batch
// invariance on the GPU. Without a GPU, or in a build without nvcc, the GPU cases pass with a message saying so; the
// device choice itself (names, the error without CUDA) is checked everywhere.
#include "support.hpp"

#include <climits>

namespace {

// GPU cases call this first: without a usable device they pass with a message saying what was skipped and why.
#define REQUIRE_GPU_OR_SKIP()                                                                \
    do {                                                                                     \
        std::string why_no_gpu;                                                              \
        if (!infer::cuda_available(&why_no_gpu)) {                                           \
            MESSAGE("SKIPPED: no GPU for the CUDA tests: " << why_no_gpu);                   \
            return;                                                                          \
        }                                                                                    \
    } while (0)

}  // namespace

TEST_CASE("the device is chosen by name, and an unknown one is refused by name") {
    CHECK(infer::parse_device("cpu") == infer::Device::Cpu);
    CHECK(infer::parse_device("cuda") == infer::Device::Cuda);
    CHECK(std::string(infer::device_name(infer::Device::Cuda)) == "cuda");
    std::string message = test::error_of([] { infer::parse_device("tpu"); });
    CHECK(message.find("'tpu'") != std::string::npos);
    CHECK(message.find("cpu or cuda") != std::string::npos);
}

TEST_CASE("--device cuda without CUDA (or without a GPU) is a clear error, and the CPU choice runs as before") {
    infer::Model model = infer::demo_model();
    infer::ThreadPool pool(1);
    std::string why;
    if (!infer::cuda_available(&why)) {
        CHECK(!why.empty());
        std::string message = test::error_of([&] { infer::DeviceForwardPass forward(model, pool, infer::Device::Cuda); });
        CHECK(message.find("--device cuda") != std::string::npos);
        if (!infer::cuda_compiled()) CHECK(message.find("no CUDA kernels") != std::string::npos);
    }
    infer::DeviceForwardPass forward(model, pool, infer::Device::Cpu);
    infer::KVCache cache(model.config, 1, 16);
    REQUIRE(cache.reserve(0, 3));
    infer::Batch batch;
    for (int i = 0; i < 3; ++i) batch.add(i + 1, i, 0, i == 2);
    CHECK(forward.forward(batch, cache).size() == static_cast<size_t>(model.config.vocab_size));
}

#ifdef INFER_CUDA

namespace {

std::vector<float> random_floats(size_t n, std::mt19937& rng, float scale = 1.0f) {
    std::normal_distribution<float> normal(0.0f, scale);
    std::vector<float> values(n);
    for (float& v : values) v = normal(rng);
    return values;
}

// A tensor over bytes the test owns, in f32 or rounded to bf16.
struct OwnedTensor {
    std::vector<std::byte> bytes;
    infer::Tensor tensor;
    OwnedTensor(const std::vector<float>& values, std::vector<int64_t> shape, infer::DType dtype) {
        tensor.name = "test";
        tensor.dtype = dtype;
        tensor.shape = std::move(shape);
        bytes.resize(infer::dtype_bytes(dtype, static_cast<int64_t>(values.size())));
        for (size_t i = 0; i < values.size(); ++i) {
            if (dtype == infer::DType::F32) {
                std::memcpy(&bytes[i * 4], &values[i], 4);
            } else {
                uint16_t half = infer::f32_to_bf16(values[i]);
                std::memcpy(&bytes[i * 2], &half, 2);
            }
        }
        tensor.data = bytes.data();
    }
};

// A matrix of GGUF blocks (Q8_0 or Q4_K) with random contents: random f16 scales, random quants and packed scale bytes,
// so every bit of the layout is exercised. The test owns the bytes.
struct BlockTensor {
    std::vector<std::byte> bytes;
    infer::Tensor tensor;
    BlockTensor(int rows, int cols, infer::DType dtype, std::mt19937& rng) {
        tensor.name = "test";
        tensor.dtype = dtype;
        tensor.shape = {rows, cols};
        const infer::DTypeBlock& block = infer::dtype_block(dtype);
        bytes.resize(infer::dtype_bytes(dtype, int64_t{rows} * cols));
        std::uniform_int_distribution<int> byte(0, 255);
        std::uniform_real_distribution<float> scale(-0.02f, 0.02f);
        for (size_t b = 0; b < bytes.size(); b += static_cast<size_t>(block.bytes)) {
            for (int i = 0; i < block.bytes; ++i) bytes[b + i] = static_cast<std::byte>(byte(rng));
            // The f16 scales: Q8_0's d, Q4_K's d and dmin (a random bit pattern could be a NaN or a huge value).
            for (int half = 0; half < (dtype == infer::DType::Q4_K ? 2 : 1); ++half) {
                const uint16_t d = infer::f32_to_f16(dtype == infer::DType::Q4_K ? std::fabs(scale(rng)) : scale(rng));
                std::memcpy(&bytes[b + 2 * half], &d, 2);
            }
        }
        tensor.data = bytes.data();
    }
    std::vector<float> dequantized() const {  // the CPU twin: infer.hpp's dequantizer, row by row
        std::vector<float> values(static_cast<size_t>(tensor.elements()));
        for (int64_t r = 0; r < tensor.rows(); ++r) tensor.read_row(r, values.data() + r * tensor.cols());
        return values;
    }
};

// Largest |a - b| / (|b| + floor) over two arrays of equal size.
double max_relative_error(const std::vector<float>& a, const std::vector<float>& b, double floor = 1e-3) {
    REQUIRE(a.size() == b.size());
    double worst = 0;
    for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::fabs(double(a[i]) - b[i]) / (std::fabs(double(b[i])) + floor));
    return worst;
}

double max_abs_error(const std::vector<float>& a, const std::vector<float>& b) {
    REQUIRE(a.size() == b.size());
    double worst = 0;
    for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::fabs(double(a[i]) - b[i]));
    return worst;
}

// The CPU twin of the rope kernel: ForwardPass::position_heads, written out (it is private there).
void cpu_rope(float* head, int Dh, const infer::Tensor& norm, double eps, const float* cos, const float* sin, infer::RopeStyle style) {
    if (!norm.empty()) infer::detail::rms_norm(head, norm, static_cast<size_t>(Dh), eps, head);
    const int half = Dh / 2;
    for (int i = 0; i < half; ++i) {
        int a = style == infer::RopeStyle::HalfRotation ? i : 2 * i;
        int b = style == infer::RopeStyle::HalfRotation ? i + half : 2 * i + 1;
        float x0 = head[a], x1 = head[b];
        head[a] = x0 * cos[i] - x1 * sin[i];
        head[b] = x0 * sin[i] + x1 * cos[i];
    }
}

// The CPU twin of the attention kernels: ForwardPass::attend, written out in double.
std::vector<float> cpu_attention(const std::vector<float>& q, const infer::KVCache& cache, int layer, const infer::Batch& batch,
                                 const infer::ModelConfig& c) {
    const int H = c.n_heads, Dh = c.head_dim, B = cache.block_size();
    std::vector<float> out(q.size());
    for (size_t t = 0; t < batch.size(); ++t)
        for (int h = 0; h < H; ++h) {
            const int kv_head = h / (H / c.n_kv_heads), position = batch.positions[t];
            const int first = c.sliding_window > 0 ? std::max(0, position - c.sliding_window + 1) : 0;
            const std::vector<int>& table = cache.block_table(batch.sequences[t]);
            const float* qh = &q[(t * H + h) * Dh];
            std::vector<double> scores;
            double best = -1e300;
            for (int p = first; p <= position; ++p) {
                const float* key = reinterpret_cast<const float*>(cache.key(layer, table[p / B], kv_head, p % B));
                double dot = 0;
                for (int i = 0; i < Dh; ++i) dot += double(qh[i]) * key[i];
                scores.push_back(dot / std::sqrt(double(Dh)));
                best = std::max(best, scores.back());
            }
            double total = 0;
            for (double& s : scores) total += (s = std::exp(s - best));
            for (int i = 0; i < Dh; ++i) {
                double sum = 0;
                for (int p = first; p <= position; ++p)
                    sum += scores[p - first] / total *
                           reinterpret_cast<const float*>(cache.value(layer, table[p / B], kv_head, p % B))[i];
                out[(t * H + h) * Dh + i] = static_cast<float>(sum);
            }
        }
    return out;
}

// Logits of every position of `ids` in one prefill, on the CPU or the GPU.
std::vector<float> prefill_logits(const infer::Model& model, const std::vector<int>& ids, bool gpu, infer::CudaOptions options = {}) {
    infer::ThreadPool pool(2);
    infer::KVCache cache(model.config, static_cast<int>(ids.size() + 15) / 16, 16);
    REQUIRE(cache.reserve(0, static_cast<int>(ids.size())));
    infer::Batch batch;
    for (size_t i = 0; i < ids.size(); ++i) batch.add(ids[i], static_cast<int>(i), 0, true);
    if (gpu) {
        const auto forward_owner = infer::cuda::make_forward_pass(model, options);
        infer::cuda::ForwardPass& forward = *forward_owner;
        auto logits = forward.forward(batch, cache);
        return {logits.begin(), logits.end()};
    }
    infer::ForwardPass forward(model, pool);
    auto logits = forward.forward(batch, cache);
    return {logits.begin(), logits.end()};
}

bool has_bf16_matrices(const infer::Model& model) { return model.layers[0].wq.dtype == infer::DType::BF16; }

using infer::cuda::kernels::MatmulKernel;

}  // namespace

TEST_CASE("gpu kernels: embedding gather is the table's rows (f32 and bf16)") {
    REQUIRE_GPU_OR_SKIP();
    std::mt19937 rng(1);
    for (infer::DType dtype : {infer::DType::F32, infer::DType::BF16}) {
        OwnedTensor table(random_floats(50 * 24, rng), {50, 24}, dtype);
        std::vector<int> ids = {0, 49, 7, 7, 13};
        std::vector<float> gpu = infer::cuda::kernels::embedding(table.tensor, ids), cpu(ids.size() * 24);
        for (size_t t = 0; t < ids.size(); ++t) table.tensor.read_row(ids[t], &cpu[t * 24]);
        CHECK(gpu == cpu);  // a copy: bitwise
    }
}

TEST_CASE("gpu kernels: residual add + RMSNorm against detail::rms_norm") {
    REQUIRE_GPU_OR_SKIP();
    std::mt19937 rng(2);
    for (int D : {48, 64, 2048, 3000}) {
        const int T = 5;
        std::vector<float> x = random_floats(static_cast<size_t>(T) * D, rng), add = random_floats(x.size(), rng);
        OwnedTensor gain(random_floats(static_cast<size_t>(D), rng), {D}, infer::DType::F32);
        std::vector<float> cpu_x = x, cpu_out(x.size());
        for (size_t i = 0; i < x.size(); ++i) cpu_x[i] += add[i];
        for (int t = 0; t < T; ++t) infer::detail::rms_norm(&cpu_x[t * D], gain.tensor, D, 1e-5, &cpu_out[t * D]);
        std::vector<float> out = infer::cuda::kernels::add_rms_norm(x, add, gain.tensor, D, 1e-5);
        CAPTURE(D);
        CHECK(x == cpu_x);  // the residual add is one f32 addition: bitwise
        CHECK(max_relative_error(out, cpu_out) < 1e-5);
        std::vector<float> plain = cpu_x;  // and without the add
        std::vector<float> out2 = infer::cuda::kernels::add_rms_norm(plain, {}, gain.tensor, D, 1e-5);
        CHECK(max_relative_error(out2, cpu_out) < 1e-5);
    }
}

TEST_CASE("gpu kernels: RoPE in both layouts, with and without the per-head norm, against position_heads") {
    REQUIRE_GPU_OR_SKIP();
    std::mt19937 rng(3);
    for (int Dh : {8, 16, 64, 128, 256})
        for (infer::RopeStyle style : {infer::RopeStyle::HalfRotation, infer::RopeStyle::AdjacentPairs})
            for (bool with_norm : {false, true}) {
                const int T = 3, heads = 4;
                std::vector<float> x = random_floats(static_cast<size_t>(T) * heads * Dh, rng);
                std::vector<float> cos(static_cast<size_t>(T) * Dh / 2), sin(cos.size());
                for (size_t i = 0; i < cos.size(); ++i) {
                    cos[i] = std::cos(0.37f * i);
                    sin[i] = std::sin(0.37f * i);
                }
                OwnedTensor norm(random_floats(static_cast<size_t>(Dh), rng), {Dh}, infer::DType::F32);
                infer::Tensor no_norm;
                const infer::Tensor& n = with_norm ? norm.tensor : no_norm;
                std::vector<float> cpu = x;
                for (int t = 0; t < T; ++t)
                    for (int h = 0; h < heads; ++h) cpu_rope(&cpu[(t * heads + h) * Dh], Dh, n, 1e-6, &cos[t * Dh / 2], &sin[t * Dh / 2], style);
                std::vector<float> gpu = infer::cuda::kernels::rope(x, heads, Dh, n, 1e-6, cos, sin, style);
                CAPTURE(Dh);
                CAPTURE(with_norm);
                CHECK(max_relative_error(gpu, cpu) < 1e-5);
            }
}

TEST_CASE("gpu kernels: the KV write puts each token's keys and values at its slot, and skips padding") {
    REQUIRE_GPU_OR_SKIP();
    std::mt19937 rng(4);
    const int width = 40, pool_slots = 64;
    std::vector<int> slots = {17, 3, -1, 63, 0};
    std::vector<float> k = random_floats(slots.size() * width, rng), v = random_floats(k.size(), rng);
    std::vector<float> pools = infer::cuda::kernels::write_kv(k, v, slots, width, pool_slots);
    std::vector<float> expected(2 * static_cast<size_t>(pool_slots) * width, 0.0f);
    for (size_t t = 0; t < slots.size(); ++t)
        if (slots[t] >= 0)
            for (int i = 0; i < width; ++i) {
                expected[static_cast<size_t>(slots[t]) * width + i] = k[t * width + i];
                expected[(static_cast<size_t>(pool_slots) + slots[t]) * width + i] = v[t * width + i];
            }
    CHECK(pools == expected);
}

TEST_CASE("gpu kernels: matrix products against detail::matmul, every path, bf16 and f32, small and odd shapes") {
    REQUIRE_GPU_OR_SKIP();
    std::mt19937 rng(5);
    infer::ThreadPool pool(2);
    struct Shape { int N, K, T; };
    for (Shape shape : {Shape{512, 2048, 1}, Shape{64, 64, 3}, Shape{100, 40, 7}, Shape{2048, 512, 8}, Shape{300, 72, 37},
                        Shape{1000, 520, 130}, Shape{16, 24, 17}})
        for (infer::DType dtype : {infer::DType::F32, infer::DType::BF16}) {
            OwnedTensor w(random_floats(static_cast<size_t>(shape.N) * shape.K, rng, 0.05f), {shape.N, shape.K}, dtype);
            OwnedTensor bias(random_floats(static_cast<size_t>(shape.N), rng), {shape.N}, infer::DType::F32);
            std::vector<float> x = random_floats(static_cast<size_t>(shape.T) * shape.K, rng);
            // The tensor-core paths round the activations to bf16: their twin is the CPU product of the rounded x.
            std::vector<float> x_rounded = x;
            for (float& value : x_rounded) value = infer::bf16_to_f32(infer::f32_to_bf16(value));
            for (MatmulKernel kernel : {MatmulKernel::Vector, MatmulKernel::Tiled, MatmulKernel::Cublas}) {
                const bool rounded = dtype == infer::DType::BF16 && kernel != MatmulKernel::Vector;
                const std::vector<float>& input = rounded ? x_rounded : x;
                std::vector<float> cpu(static_cast<size_t>(shape.T) * shape.N);
                infer::detail::matmul(pool, input.data(), shape.T, {{w.tensor, cpu.data(), &bias.tensor}});
                std::vector<float> gpu = infer::cuda::kernels::matmul(w.tensor, x, shape.T, &bias.tensor, kernel);
                CAPTURE(shape.N);
                CAPTURE(shape.K);
                CAPTURE(shape.T);
                CAPTURE(infer::dtype_name(dtype));
                CAPTURE(static_cast<int>(kernel));
                // f32 sums over K in a different order: ~K · 2⁻²⁴ relative to the sum of |terms|; 1e-4 of the output scale.
                CHECK(max_abs_error(gpu, cpu) < 1e-4 * (1 + std::sqrt(double(shape.K))));
            }
        }
}

TEST_CASE("gpu kernels: Q8_0 and Q4_K blocks decode on the device to the CPU dequantizer's values, bit for bit") {
    REQUIRE_GPU_OR_SKIP();
    std::mt19937 rng(11);
    for (infer::DType dtype : {infer::DType::Q8_0, infer::DType::Q4_K})
        for (auto [rows, cols] : {std::pair{3, 256}, std::pair{64, 768}, std::pair{130, 2048}}) {
            CAPTURE(infer::dtype_name(dtype));
            CAPTURE(rows);
            CAPTURE(cols);
            BlockTensor w(rows, cols, dtype, rng);
            const std::vector<float> cpu = w.dequantized();
            const std::vector<float> gpu = infer::cuda::kernels::dequantize(w.tensor);
            REQUIRE(gpu.size() == cpu.size());
            CHECK(std::memcmp(gpu.data(), cpu.data(), cpu.size() * 4) == 0);
            // The embedding gather decodes the same pieces: a block-format table gives the CPU's rows.
            const std::vector<int> ids = {rows - 1, 0, rows / 2, 0};
            const std::vector<float> gathered = infer::cuda::kernels::embedding(w.tensor, ids);
            REQUIRE(gathered.size() == ids.size() * static_cast<size_t>(cols));
            for (size_t t = 0; t < ids.size(); ++t)
                CHECK(std::memcmp(&gathered[t * cols], &cpu[static_cast<size_t>(ids[t]) * cols], static_cast<size_t>(cols) * 4) == 0);
        }
}

TEST_CASE("gpu kernels: matrix products on Q8_0 and Q4_K blocks against the product of the dequantized weights") {
    REQUIRE_GPU_OR_SKIP();
    std::mt19937 rng(12);
    struct Shape { int N, K, T; };
    for (Shape shape : {Shape{512, 2048, 1}, Shape{64, 256, 3}, Shape{100, 512, 7}, Shape{2048, 768, 8},
                        Shape{1000, 512, 37}, Shape{16, 256, 130}})
        for (infer::DType dtype : {infer::DType::Q8_0, infer::DType::Q4_K}) {
            BlockTensor w(shape.N, shape.K, dtype, rng);
            OwnedTensor bias(random_floats(static_cast<size_t>(shape.N), rng), {shape.N}, infer::DType::F32);
            const std::vector<float> x = random_floats(static_cast<size_t>(shape.T) * shape.K, rng);
            // The twin: the dequantized weights times x, in double; `magnitude` is Σ|w·x| per output, which bounds
            // any f32 summation order's error by K · 2⁻²⁴ · magnitude.
            const std::vector<float> weights = w.dequantized();
            std::vector<float> reference(static_cast<size_t>(shape.T) * shape.N), magnitude(reference.size());
            for (int t = 0; t < shape.T; ++t)
                for (int n = 0; n < shape.N; ++n) {
                    double sum = bias.tensor.at(n), size = std::fabs(bias.tensor.at(n));
                    for (int k = 0; k < shape.K; ++k) {
                        const double term = double(weights[static_cast<size_t>(n) * shape.K + k]) * x[static_cast<size_t>(t) * shape.K + k];
                        sum += term;
                        size += std::fabs(term);
                    }
                    reference[static_cast<size_t>(t) * shape.N + n] = static_cast<float>(sum);
                    magnitude[static_cast<size_t>(t) * shape.N + n] = static_cast<float>(size);
                }
            for (MatmulKernel kernel : {MatmulKernel::Vector, MatmulKernel::Tiled, MatmulKernel::Cublas}) {
                CAPTURE(shape.N);
                CAPTURE(shape.K);
                CAPTURE(shape.T);
                CAPTURE(infer::dtype_name(dtype));
                CAPTURE(static_cast<int>(kernel));
                const std::vector<float> gpu = infer::cuda::kernels::matmul(w.tensor, x, shape.T, &bias.tensor, kernel);
                REQUIRE(gpu.size() == reference.size());
                double worst = 0;  // error in units of the bound
                for (size_t i = 0; i < gpu.size(); ++i)
                    worst = std::max(worst, std::fabs(double(gpu[i]) - reference[i]) / (shape.K * 6e-8 * magnitude[i] + 1e-30));
                CHECK(worst <= 1.0);
            }
        }
}

TEST_CASE("gpu kernels: paged attention, decode and prefill kernels, GQA and sliding window, against attend") {
    REQUIRE_GPU_OR_SKIP();
    std::mt19937 rng(6);
    for (int window : {0, 7})
        for (auto [H, Hkv, Dh] : {std::tuple{4, 2, 16}, std::tuple{8, 1, 64}, std::tuple{32, 8, 64}, std::tuple{4, 4, 128},
                                  std::tuple{2, 1, 256}}) {
            infer::ModelConfig c;
            c.n_layers = 2;
            c.n_heads = H;
            c.n_kv_heads = Hkv;
            c.head_dim = Dh;
            c.sliding_window = window;
            infer::KVCache cache(c, 40, 4);
            const int lengths[] = {37, 1, 70};  // sequences 0, 1, 2 hold this many positions
            for (int s = 0; s < 3; ++s) {
                REQUIRE(cache.reserve(s, lengths[s]));
                const std::vector<int>& table = cache.block_table(s);
                for (int layer = 0; layer < 2; ++layer)
                    for (int p = 0; p < lengths[s]; ++p) {
                        std::vector<float> k = random_floats(static_cast<size_t>(Hkv) * Dh, rng), v = random_floats(k.size(), rng);
                        for (int h = 0; h < Hkv; ++h) {
                            std::memcpy(cache.key(layer, table[p / 4], h, p % 4), &k[h * Dh], Dh * 4);
                            std::memcpy(cache.value(layer, table[p / 4], h, p % 4), &v[h * Dh], Dh * 4);
                        }
                    }
            }
            // A decode token of sequence 0, a one-token sequence, and a 33-token prefill chunk of sequence 2.
            infer::Batch batch;
            batch.add(0, 36, 0, true);
            batch.add(0, 0, 1, true);
            for (int p = 37; p < 70; ++p) batch.add(0, p, 2, p == 69);
            std::vector<float> q = random_floats(batch.size() * H * Dh, rng);
            std::vector<float> cpu = cpu_attention(q, cache, 1, batch, c);
            for (bool prefill : {false, true}) {
                if (prefill && Dh > 128) continue;  // the prefill kernel takes heads up to 128 wide
                std::vector<float> gpu = infer::cuda::kernels::attention(q, cache, 1, batch, c, prefill);
                CAPTURE(window);
                CAPTURE(H);
                CAPTURE(Hkv);
                CAPTURE(Dh);
                CAPTURE(prefill);
                CHECK(max_abs_error(gpu, cpu) < 1e-4);  // a wrong head mapping or mask costs > 0.1
            }
        }
}

TEST_CASE("gpu kernels: SwiGLU against detail::silu") {
    REQUIRE_GPU_OR_SKIP();
    std::mt19937 rng(7);
    std::vector<float> gate = random_floats(10000, rng, 4.0f), up = random_floats(10000, rng);
    std::vector<float> cpu(gate.size());
    for (size_t i = 0; i < gate.size(); ++i) cpu[i] = infer::detail::silu(gate[i]) * up[i];
    CHECK(max_relative_error(infer::cuda::kernels::swiglu(gate, up), cpu) < 1e-6);
}

TEST_CASE("gpu: every architecture fixture's logits match the CPU path, every matmul path") {
    REQUIRE_GPU_OR_SKIP();
    REQUIRE_SHARED_OR_SKIP();
    std::vector<std::filesystem::path> files;
    for (const char* family : {"llama", "llama3", "mistral", "qwen2", "qwen3", "smollm"}) {
        auto folder = test::shared_dir() / "fixtures/arch" / family;
        files.push_back(folder);
        files.push_back(folder / "model.gguf");
    }
    files.push_back(test::shared_dir() / "fixtures/arch/llama/model-bf16");
    infer::CudaOptions vector_only, tiled, cublas, no_graphs;
    vector_only.vector_rows = INT_MAX;
    tiled.matmul = infer::CudaOptions::Matmul::Tiled;
    tiled.vector_rows = 0;
    cublas.vector_rows = 0;
    no_graphs.graphs = false;
    for (const auto& file : files) {
        infer::Model model = infer::load_model(file);
        infer::Json manifest = test::read_json((std::filesystem::is_directory(file) ? file : file.parent_path()) / "manifest.json");
        for (std::string name : {"A", "B"}) {
            std::vector<int> ids = test::ids_of(manifest.at("sequences").at(name).at("ids"));
            std::vector<float> cpu = prefill_logits(model, ids, false);
            for (const infer::CudaOptions* options : {&vector_only, &tiled, &cublas, &no_graphs}) {
                CAPTURE(file.string());
                CAPTURE(name);
                CAPTURE(options->vector_rows);
                CAPTURE(static_cast<int>(options->matmul));
                std::vector<float> gpu = prefill_logits(model, ids, true, *options);
                // f32 activations (and f32 weights everywhere) agree to f32 rounding; bf16 tensor cores to ~1e-2.
                const bool bf16_path = has_bf16_matrices(model) && options->vector_rows < static_cast<int>(ids.size());
                CHECK(max_abs_error(gpu, cpu) < (bf16_path ? 1e-2 : 1e-4));
            }
        }
    }
}

TEST_CASE("gpu: quantized files (Q8_0, Q4_K, the mixed Q4_K_M) give the logits of their dequantized weights") {
    REQUIRE_GPU_OR_SKIP();
    REQUIRE_SHARED_OR_SKIP();
    infer::CudaOptions vector_only, cublas, no_graphs;
    vector_only.vector_rows = INT_MAX;
    cublas.vector_rows = 0;
    no_graphs.graphs = false;
    for (std::string type : {"Q8_0", "Q4_K", "Q4_K_M"}) {
        const auto folder = test::shared_dir() / "fixtures/quant" / type;
        infer::Model model = infer::load_model(folder / ("model-" + type + ".gguf"));
        infer::Json manifest = test::read_json(folder / "manifest.json");
        for (std::string name : {"A", "B"}) {
            std::vector<int> ids = test::ids_of(manifest.at("sequences").at(name).at("ids"));
            // The GPU keeps the activations in f32, so its twin is llama.cpp's f32 run on the decoded weights.
            const std::vector<float> reference = test::read_floats(folder / ("logits_deqf32_" + name + ".f32"));
            for (const infer::CudaOptions* options : {&vector_only, &cublas, &no_graphs}) {
                CAPTURE(type);
                CAPTURE(name);
                CAPTURE(options->vector_rows);
                CHECK(max_abs_error(prefill_logits(model, ids, true, *options), reference) < 1e-4);
            }
        }
    }
}

TEST_CASE("gpu: stories260K logits at 64 positions (one prefill, then one-token decodes through graphs) match the CPU") {
    REQUIRE_GPU_OR_SKIP();
    REQUIRE_SHARED_OR_SKIP();
    auto dir = test::shared_dir() / "models/stories260K";
    const auto [ids, prompt, reference] = test::stories_logits();
    infer::Model model = infer::load_model(dir / "stories260K.gguf");
    infer::KVCache cache(model.config, 8, 16);
    REQUIRE(cache.reserve(7, static_cast<int>(ids.size())));
    const auto forward_owner = infer::cuda::make_forward_pass(model);
    infer::cuda::ForwardPass& forward = *forward_owner;
    infer::Batch batch;
    for (int i = 0; i < prompt; ++i) batch.add(ids[i], i, 7, true);
    auto logits = forward.forward(batch, cache);
    std::vector<float> ours(logits.begin(), logits.end());
    for (size_t i = prompt; i < ids.size(); ++i) {
        batch.clear();
        batch.add(ids[i], static_cast<int>(i), 7, true);
        logits = forward.forward(batch, cache);
        ours.insert(ours.end(), logits.begin(), logits.end());
    }
    CHECK(max_abs_error(ours, reference) < 1e-2);  // llama.cpp's logits; the CPU path is within 1e-4 of them
}

TEST_CASE("gpu: stories260K greedy ids through the Engine on --device cuda are the CPU's and the references'") {
    REQUIRE_GPU_OR_SKIP();
    REQUIRE_SHARED_OR_SKIP();
    auto dir = test::shared_dir() / "models/stories260K";
    infer::Model model = infer::load_model(dir / "stories260K.gguf");
    infer::ThreadPool pool(2);
    infer::EngineConfig config;
    config.device = infer::Device::Cuda;
    infer::Engine engine(model, pool, config);
    std::map<int, std::string> names;
    std::vector<std::string> cases = {"empty", "lily_and_ben", "once_upon_a_time", "the_cat"};
    for (const std::string& name : cases) {  // all four at once: a batch of decodes each step (graph buckets 1-4)
        infer::Json reference = test::read_json(dir / "public" / (name + ".json"));
        infer::SamplingParams params;
        params.temperature = 0;
        params.max_tokens = static_cast<int>(reference.at("max_new_tokens").as_int());
        names[engine.add_request(reference.at("prompt").as_string(), params)] = name;
    }
    int finished = 0;
    std::map<int, std::vector<int>> generated;
    while (engine.has_work())
        for (const infer::Event& event : engine.step()) {
            generated[event.request_id].insert(generated[event.request_id].end(), event.token_ids.begin(), event.token_ids.end());
            finished += event.finished;
        }
    CHECK(finished == static_cast<int>(cases.size()));
    for (const auto& [id, name] : names) {
        infer::Json reference = test::read_json(dir / "public" / (name + ".json"));
        CAPTURE(name);
        CHECK(generated[id] == test::ids_of(reference.at("generated_ids")));
    }
}

TEST_CASE("gpu: a sequence's logits do not depend on its batch-mates or on how its prompt was chunked") {
    REQUIRE_GPU_OR_SKIP();
    REQUIRE_SHARED_OR_SKIP();
    // Bitwise on the paths whose per-output sums do not depend on the batch: the matrix-vector kernel (f32 weights of
    // qwen2, with biases) and the tiled tensor-core kernel (bf16 llama); flash-decoding splits by the token's own length.
    infer::CudaOptions vector_only, tiled;
    vector_only.vector_rows = INT_MAX;
    tiled.matmul = infer::CudaOptions::Matmul::Tiled;
    tiled.vector_rows = 0;
    struct Case { const char* model; infer::CudaOptions options; };
    for (const Case& item : {Case{"fixtures/arch/qwen2", vector_only}, Case{"fixtures/arch/llama/model-bf16", tiled}}) {
        infer::Model model = infer::load_model(test::shared_dir() / item.model);
        std::vector<int> a = {1, 5, 70, 300, 42, 511, 7, 9, 100, 200, 300, 400};
        std::vector<int> b = {3, 4, 5};
        std::vector<float> alone = prefill_logits(model, a, true, item.options);
        infer::KVCache cache(model.config, 4, 4);
        REQUIRE(cache.reserve(0, 12));
        REQUIRE(cache.reserve(1, 3));
        const auto forward_owner = infer::cuda::make_forward_pass(model, item.options);
        infer::cuda::ForwardPass& forward = *forward_owner;
        std::vector<float> chunked;
        int start = 0;
        for (int chunk : {5, 4, 3}) {
            infer::Batch batch;
            if (start == 0)
                for (int i = 0; i < 3; ++i) batch.add(b[i], i, 1, true);
            for (int i = start; i < start + chunk; ++i) batch.add(a[i], i, 0, true);
            auto logits = forward.forward(batch, cache);
            size_t skip = start == 0 ? 3 * 512 : 0;
            chunked.insert(chunked.end(), logits.begin() + static_cast<std::ptrdiff_t>(skip), logits.end());
            start += chunk;
        }
        CAPTURE(item.model);
        CHECK(chunked == alone);  // bitwise
    }
}

#endif  // INFER_CUDA
