// bench_decode — decode speed of a model larger than any cache, in f32 and bf16, against the memory bandwidth.
//
//   bench_decode [--prompt-tokens N] [--decode-tokens N] [-t THREADS]
//
// Writes two random-weight models of one shape (D 768, L 12, H = Hkv = 12, F 2048, V 32000: GPT-2 small's width and
// depth with a Llama MLP and vocabulary) into a temporary folder, one in f32 and one in bf16, then for each: loads it,
// prefills a short prompt and times the decode steps that follow. A decode step reads every weight once, so
// weight bytes per token × tokens/s is the memory traffic decode achieved; dividing by the bandwidth measured in the
// same run (the same streaming read as chapter 04, tools/measure.hpp) says how close to the ceiling it came.
// Random weights cost exactly what trained ones do. The folder is removed at the end. Run by `meson test --benchmark`.
#include "command_line.hpp"
#include "infer.hpp"
#include "measure.hpp"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <string>
#include <string_view>
#include <vector>

namespace {

struct Options {
    int prompt_tokens = 16;
    int decode_tokens = 64;
    int threads = 0;  // 0: every core
};

Options parse_options(int argc, char** argv) {
    CommandLine line(argc, argv, 1, {"--prompt-tokens", "--decode-tokens", "-t"}, {},
                     "usage: bench_decode [--prompt-tokens N] [--decode-tokens N] [-t THREADS]\n");
    Options options;
    options.prompt_tokens = static_cast<int>(line.integer("--prompt-tokens", options.prompt_tokens, 1, 1'000'000));
    options.decode_tokens = static_cast<int>(line.integer("--decode-tokens", options.decode_tokens, 1, 1'000'000));
    options.threads = static_cast<int>(line.integer("-t", options.threads, 0, 1024));
    return options;
}

// A folder under the system's temporary directory that is removed, with everything in it, however the run ends
// (an exception included): the two models take 0.8 GB of disk.
struct TemporaryFolder {
    std::filesystem::path path;
    TemporaryFolder() {
        auto stamp = std::chrono::steady_clock::now().time_since_epoch().count();
        path = std::filesystem::temp_directory_path() / ("infer-bench-decode-" + std::to_string(stamp));
        std::filesystem::create_directories(path);
    }
    ~TemporaryFolder() {
        std::error_code ignored;  // a destructor must not throw; a leftover folder in /tmp is the worst outcome
        std::filesystem::remove_all(path, ignored);
    }
};

// 110 M parameters with the classifier tied to the embedding, as llama2.c's stories110M. At 441 MB (f32) or 220 MB
// (bf16) read per decode step, the weights are many times the reference machine's 32 MiB L3: decode streams them
// from DRAM.
constexpr infer::ModelShape bench_shape{.dim = 768, .n_layers = 12, .n_heads = 12, .n_kv_heads = 12, .ffn_dim = 2048,
                                        .vocab_size = 32000, .context_length = 2048, .tied_embeddings = true};

struct Row {
    std::string dtype;
    double parameters = 0, bytes_per_token = 0, prefill_rate = 0, decode_rate = 0, bandwidth = 0;
};

// Decode is timed in rounds, each right after a bandwidth sample. On a shared machine (a cloud VM) the bandwidth left
// to us drifts by tens of percent over seconds; the best round of each is what the hardware gives when undisturbed,
// and their ratio compares like with like.
constexpr int rounds = 5;

Row run(const std::filesystem::path& folder, infer::DType dtype, const Options& options, infer::ThreadPool& pool) {
    const infer::ModelShape& shape = bench_shape;
    const int N = options.prompt_tokens, M = options.decode_tokens;

    std::cerr << "writing the " << infer::dtype_name(dtype) << " model to " << folder.string() << " ..." << std::endl;
    infer::save_random_model(folder, shape, dtype, 1234);
    infer::Model model = infer::load_model(folder);
    infer::ForwardPass forward(model, pool);
    infer::KVCache cache(model.config, (N + M + 15) / 16 + 1, 16);
    infer::Batch batch;

    // Warm-up on a throwaway sequence: the first pass pages every weight of the mapped file in, which is disk and
    // page-table work, not the steady state we want to time.
    cache.reserve(1, 1);
    batch.add(1, 0, 1, true);
    forward.forward(batch, cache);
    cache.release(1);

    Row row{infer::dtype_name(dtype), static_cast<double>(model.parameter_count()),
            static_cast<double>(model.weight_bytes_per_token())};
    for (int round = 0; round < rounds; ++round) {
        row.bandwidth = std::max(row.bandwidth, measure::memory_bandwidth(pool, size_t{512} << 20, 2).bytes_per_second);
        cache.reserve(0, N + M);
        batch.clear();
        for (int i = 0; i < N; ++i) batch.add(i % shape.vocab_size, i, 0, i == N - 1);
        infer::Stopwatch clock;
        forward.forward(batch, cache);
        row.prefill_rate = std::max(row.prefill_rate, N / clock.seconds());

        clock.restart();
        for (int j = 0; j < M; ++j) {
            batch.clear();
            batch.add((N + j) % shape.vocab_size, N + j, 0, true);
            forward.forward(batch, cache);
        }
        row.decode_rate = std::max(row.decode_rate, M / clock.seconds());
        cache.release(0);
    }
    return row;
}

}  // namespace

int main(int argc, char** argv) try {
    Options options = parse_options(argc, argv);
    if (options.prompt_tokens + options.decode_tokens > bench_shape.context_length)
        throw infer::Error("--prompt-tokens " + std::to_string(options.prompt_tokens) + " + --decode-tokens " +
                           std::to_string(options.decode_tokens) + " exceed the benchmark model's context of " +
                           std::to_string(bench_shape.context_length) + " tokens");
    infer::ThreadPool pool(options.threads);
    TemporaryFolder temporary;

    std::vector<Row> rows;
    for (infer::DType dtype : {infer::DType::F32, infer::DType::BF16}) {
        std::filesystem::path folder = temporary.path / infer::dtype_name(dtype);
        rows.push_back(run(folder, dtype, options, pool));
        std::filesystem::remove_all(folder);  // frees the disk and the page cache before the next model is written
    }

    std::printf("decode benchmark: D %d, L %d, H %d, Hkv %d, F %d, V %d; %d threads; prefill %d tokens, "
                "decode %d tokens, classifier tied\n", bench_shape.dim, bench_shape.n_layers, bench_shape.n_heads,
                bench_shape.n_kv_heads, bench_shape.ffn_dim, bench_shape.vocab_size, pool.size(),
                options.prompt_tokens, options.decode_tokens);
    std::printf("best of %d rounds, each a streaming read of 512 MiB with the same threads (the bandwidth) followed by "
                "a prefill and the decode steps\n\n", rounds);
    std::printf("| dtype | parameters | weights per token | prefill tok/s | decode tok/s | ms/token "
                "| achieved GB/s | bandwidth GB/s | of bandwidth |\n");
    std::printf("|-------|-----------:|------------------:|--------------:|-------------:|---------:"
                "|--------------:|---------------:|-------------:|\n");
    for (const Row& row : rows) {
        double achieved = row.bytes_per_token * row.decode_rate, ceiling = row.bandwidth;
        std::printf("| %-5s | %8.1f M | %14.1f MB | %13.1f | %12.2f | %8.2f | %13.2f | %14.2f | %10.1f %% |\n",
                    row.dtype.c_str(), row.parameters / 1e6, row.bytes_per_token / 1e6, row.prefill_rate,
                    row.decode_rate, 1e3 / row.decode_rate, achieved / 1e9, ceiling / 1e9, 100 * achieved / ceiling);
    }
    // Halving the bytes per weight doubles decode's tokens/s only if weight traffic is all a step costs; a smaller gain
    // is the share of fixed per-step costs (thread wake-ups, attention, norms) and of widening bf16 in the kernel.
    if (rows.size() == 2)
        std::printf("\nbf16 / f32 decode speed: %.2f× (2× would be purely memory-bound)\n",
                    rows[1].decode_rate / rows[0].decode_rate);
    return 0;
} catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
}
