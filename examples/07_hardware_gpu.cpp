// 07_hardware_gpu — the GPU half of chapter 07: what the card can do, and how close the forward pass gets to it.
//
//   07_hardware_gpu -m PATH [--batches 1,8,64] [--context N] [--steps N] [--prefill-tokens N] [--quick]
//
// First the two ceilings, measured on this card in this run: the device-to-device copy bandwidth (what decode, which
// reads every weight once per step, can at best stream) and cuBLAS's bf16 matmul rate (what prefill, matrix-matrix
// work, can at best compute). Then the model on --device cuda: decode tokens/s at each batch size, with the bytes a
// step reads (weights once, plus every sequence's K/V) per second as a fraction of the copy bandwidth; and prefill
// tokens/s, with the FLOPs (2 per weight per token, plus attention) per second as a fraction of the matmul rate, for the
// cuBLAS path and the readable tiled tensor-core kernel. It prints a short table last. Without CUDA in the build, or
// without a GPU, it says so and exits 0 (so the chapter test passes on CPU-only machines).
#include "command_line.hpp"
#include "infer.hpp"

#include <cstdio>
#include <iostream>
#include <string>

namespace {

struct Options {
    std::string model_path;
    std::vector<int> batches = {1, 8, 64};
    int context = 512;          // tokens each sequence holds before the timed decode steps
    int steps = 32;             // timed decode steps per batch size
    int prefill_tokens = 2048;  // one prompt of this many tokens in one forward call
    bool quick = false;         // small sizes: the chapter test on stories260K
};

Options parse_options(int argc, char** argv) {
    const char* usage = "usage: 07_hardware_gpu -m PATH [--batches 1,8,64] [--context N] [--steps N] [--prefill-tokens N] [--quick]\n";
    CommandLine line(argc, argv, 1, {"-m", "--batches", "--context", "--steps", "--prefill-tokens"}, {"--quick"}, usage);
    Options options;
    options.quick = line.has("--quick");
    if (options.quick) {
        options.batches = {1, 2, 4};
        options.context = 32;
        options.steps = 4;
        options.prefill_tokens = 64;
    }
    options.model_path = line.text("-m");
    if (line.has("--batches")) {
        options.batches.clear();
        std::stringstream list(line.text("--batches"));
        for (std::string item; std::getline(list, item, ',');) {
            int value = std::atoi(item.c_str());
            if (value <= 0) infer::fail("--batches: '", item, "' is not a positive batch size");
            options.batches.push_back(value);
        }
    }
    options.context = static_cast<int>(line.integer("--context", options.context, 1, 1 << 20));
    options.steps = static_cast<int>(line.integer("--steps", options.steps, 1, 1 << 20));
    options.prefill_tokens = static_cast<int>(line.integer("--prefill-tokens", options.prefill_tokens, 1, 1 << 20));
    return options;
}

#ifdef INFER_CUDA

// FLOPs of one token through the matrices (2 per weight: a multiply and an add); the logits only where asked.
double matrix_flops_per_token(const infer::Model& model) {
    double weights = 0;
    for (const infer::LayerWeights& l : model.layers)
        for (const infer::Tensor* t : {&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down}) weights += static_cast<double>(t->elements());
    return 2 * weights;
}

// Attention FLOPs of a token at `position`: q·k and the weighted sum of v over position + 1 keys, per head and layer.
double attention_flops(const infer::ModelConfig& c, int position) {
    return 4.0 * (position + 1) * c.n_heads * c.head_dim * c.n_layers;
}

double kv_bytes_read(const infer::ModelConfig& c, int positions) {
    return static_cast<double>(positions) * infer::KVCache::bytes_per_token(c);  // keys and values, every layer
}

struct Row {
    std::string what;
    double tokens_per_second, achieved, ceiling;  // achieved and ceiling in GB/s or TFLOP/s
    const char* unit;
};

// Feeds `count` tokens of sequence `sequence` from position `start` in chunks of at most 2048 rows.
void prefill(infer::cuda::ForwardPass& forward, infer::KVCache& cache, int sequence, int start, int count, int vocab) {
    for (int done = 0; done < count;) {
        const int chunk = std::min(2048, count - done);
        infer::Batch batch;
        for (int i = 0; i < chunk; ++i) batch.add((start + done + i) * 7919 % vocab, start + done + i, sequence, i == chunk - 1);
        forward.forward(batch, cache);
        done += chunk;
    }
}

int run(const Options& options) {
    std::string why;
    if (!infer::cuda_available(&why)) {
        std::printf("07_hardware_gpu: SKIPPED: %s\n", why.c_str());
        return 0;
    }
    std::printf("device: %s\n", infer::cuda::device_description().c_str());
    const double copy_bandwidth = infer::cuda::measure_copy_bandwidth(options.quick ? size_t{64} << 20 : size_t{1} << 30, 20);
    const double matmul_rate = infer::cuda::measure_bf16_matmul_rate(options.quick ? 1024 : 8192, options.quick ? 5 : 20);
    std::printf("copy bandwidth (device to device, read + write): %.0f GB/s\n", copy_bandwidth / 1e9);
    std::printf("bf16 matmul rate (cuBLAS, f32 accumulate):       %.0f TFLOP/s\n", matmul_rate / 1e12);

    infer::Model model = options.model_path.empty() ? infer::demo_model() : infer::load_model(options.model_path);
    const infer::ModelConfig& c = model.config;
    std::printf("model: %s (%.2f B parameters, %.2f GB of weights read per decode step)\n", model.source.c_str(),
                model.parameter_count() / 1e9, model.weight_bytes_per_token() / 1e9);
    const int largest = *std::max_element(options.batches.begin(), options.batches.end());
    const int per_sequence = options.context + options.steps + 8;
    if (per_sequence > c.context_length || options.prefill_tokens > c.context_length)
        infer::fail("--context + --steps (", per_sequence, ") and --prefill-tokens (", options.prefill_tokens,
                            ") must fit the model's context of ", c.context_length, " tokens");
    const int block = 16;
    const int blocks = (largest * ((per_sequence + block - 1) / block)) + (options.prefill_tokens + block - 1) / block + 1;
    infer::KVCache cache(c, blocks, block);
    cache.set_prefix_caching(false);
    std::vector<Row> rows;

    // Decode: `batch` sequences of `context` tokens, then `steps` steps of one token each, timed together.
    const auto forward_owner = infer::cuda::make_forward_pass(model);
    infer::cuda::ForwardPass& forward = *forward_owner;
    for (int batch_size : options.batches) {
        for (int s = 0; s < batch_size; ++s) {
            if (!cache.reserve(s, per_sequence)) infer::fail("KV pool too small for batch ", batch_size);
            prefill(forward, cache, s, 0, options.context, c.vocab_size);
        }
        infer::Batch batch;
        auto step = [&](int position) {
            batch.clear();
            for (int s = 0; s < batch_size; ++s) batch.add((position * 31 + s) % c.vocab_size, position, s, true);
            forward.forward(batch, cache);
        };
        for (int w = 0; w < 3; ++w) step(options.context + w);  // warm-up: captures this bucket's graph
        infer::Stopwatch clock;
        double bytes = 0;
        for (int i = 0; i < options.steps; ++i) {
            const int position = options.context + 3 + i;
            step(position);
            bytes += model.weight_bytes_per_token() + batch_size * kv_bytes_read(c, position + 1);
        }
        const double seconds = clock.seconds();
        rows.push_back({"decode, batch " + std::to_string(batch_size), batch_size * options.steps / seconds,
                        bytes / seconds / 1e9, copy_bandwidth / 1e9, "GB/s"});
        for (int s = 0; s < batch_size; ++s) cache.release(s);
    }

    // Prefill: one prompt of prefill_tokens in one forward call, best of three, for cuBLAS and the tiled kernel.
    for (auto matmul : {infer::CudaOptions::Matmul::Cublas, infer::CudaOptions::Matmul::Tiled}) {
        infer::CudaOptions cuda_options;
        cuda_options.matmul = matmul;
        const auto prefill_pass_owner = infer::cuda::make_forward_pass(model, cuda_options);
        infer::cuda::ForwardPass& prefill_pass = *prefill_pass_owner;
        double flops = c.vocab_size * 2.0 * c.dim;  // the logits of the last token
        for (int p = 0; p < options.prefill_tokens; ++p) flops += matrix_flops_per_token(model) + attention_flops(c, p);
        double best = 1e30;
        for (int run = 0; run < 3; ++run) {
            const int sequence = 1000 + run;
            if (!cache.reserve(sequence, options.prefill_tokens)) infer::fail("KV pool too small for the prefill");
            infer::Batch batch;
            for (int p = 0; p < options.prefill_tokens; ++p) batch.add(p * 7919 % c.vocab_size, p, sequence, p == options.prefill_tokens - 1);
            infer::Stopwatch clock;
            prefill_pass.forward(batch, cache);
            best = std::min(best, clock.seconds());
            cache.release(sequence);
        }
        rows.push_back({std::string("prefill ") + std::to_string(options.prefill_tokens) +
                            (matmul == infer::CudaOptions::Matmul::Cublas ? ", cuBLAS" : ", tiled wmma"),
                        options.prefill_tokens / best, flops / best / 1e12, matmul_rate / 1e12, "TFLOP/s"});
    }

    std::printf("\n%-28s %12s %14s %10s\n", "regime", "tokens/s", "achieved", "of ceiling");
    for (const Row& r : rows)
        std::printf("%-28s %12.1f %9.1f %-7s %6.1f%%\n", r.what.c_str(), r.tokens_per_second, r.achieved, r.unit,
                    100 * r.achieved / r.ceiling);
    std::printf("ceilings: copy %.0f GB/s, bf16 matmul %.0f TFLOP/s (targets: decode batch 1 >= 70%%, prefill >= 50%%)\n",
                copy_bandwidth / 1e9, matmul_rate / 1e12);
    return 0;
}

#else

int run(const Options&) {
    std::printf("07_hardware_gpu: SKIPPED: this build has no CUDA kernels (build with nvcc present: meson setup -Dcuda=enabled)\n");
    return 0;
}

#endif

}  // namespace

int main(int argc, char** argv) {
    try {
        return run(parse_options(argc, argv));
    } catch (const std::exception& e) {
        std::fprintf(stderr, "07_hardware_gpu: %s\n", e.what());
        return 1;
    }
}
