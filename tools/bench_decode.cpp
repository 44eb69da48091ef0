// bench_decode — decode speed of a model larger than any cache, in f32 and bf16, against the memory bandwidth.
//
//   bench_decode [--prompt-tokens N] [--decode-tokens N] [-t THREADS] [--contexts N,N,...]
//
// Writes two random-weight models of one shape (D 768, L 12, H = Hkv = 12, F 2048, V 32000: GPT-2 small's width and
// depth with a Llama MLP and vocabulary) into a temporary folder, one in f32 and one in bf16, then for each: loads it,
// prefills a short prompt and times the decode steps that follow. A decode step reads every weight once, so
// weight bytes per token × tokens/s is the memory traffic decode achieved; dividing by the bandwidth measured in the
// same run (the same streaming read as chapter 04, tools/measure.hpp) says how close to the ceiling it came.
// Then, on the f32 model, decode after prompts of each --contexts length (default 128, 1024, 4000) with the KV cache
// in f32, f16 and bf16 (and bf16 with each sequence's blocks apart in the pool): the sequences decode in turn, one
// step each, so the host's drift falls on all of them alike and their ratio to the shortest is measured in one run. Random weights cost exactly what trained ones do. The
// folder is removed at the end. Run by `meson test --benchmark`.
#include "command_line.hpp"
#include "infer.hpp"
#include "measure.hpp"

#include <algorithm>
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
    std::vector<int> contexts = {128, 1024, 4000};
};

Options parse_options(int argc, char** argv) {
    CommandLine line(argc, argv, 1, {"--prompt-tokens", "--decode-tokens", "-t", "--contexts"}, {},
                     "usage: bench_decode [--prompt-tokens N] [--decode-tokens N] [-t THREADS] [--contexts N,N,...]\n");
    Options options;
    options.prompt_tokens = static_cast<int>(line.integer("--prompt-tokens", options.prompt_tokens, 1, 1'000'000));
    options.decode_tokens = static_cast<int>(line.integer("--decode-tokens", options.decode_tokens, 1, 1'000'000));
    options.threads = static_cast<int>(line.integer("-t", options.threads, 0, 1024));
    if (line.has("--contexts")) options.contexts = parse_int_list("--contexts", line.text("--contexts"));
    std::sort(options.contexts.begin(), options.contexts.end());  // the table compares the longest with the shortest
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
                                        .vocab_size = 32000, .context_length = 8192, .tied_embeddings = true};

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

// The rows of the long-context table: the KV cache's type, and whether each sequence's blocks lie apart in the pool
// (taken a block at a time, in turn with another sequence's, as a sequence that grows beside others gets them) rather
// than in one run (a prompt's blocks, taken at once).
struct CacheCase {
    infer::DType type;
    bool blocks_apart;
    const char* name;
};
constexpr CacheCase cache_cases[] = {{infer::DType::F32, false, "f32"},
                                     {infer::DType::F16, false, "f16"},
                                     {infer::DType::BF16, false, "bf16"},
                                     {infer::DType::BF16, true, "bf16, blocks apart"}};

// Decode after prompts of each --contexts length, for each case: one sequence per length, all prefilled first, then
// --decode-tokens rounds in which each takes one step in turn. Returns each sequence's median step in seconds,
// [case][context]: the median ignores the steps a busy host interrupted, and taking turns gives every length the same
// host.
std::vector<std::vector<double>> decode_at_contexts(const infer::Model& model, const Options& options,
                                                    infer::ThreadPool& pool) {
    const std::vector<int>& contexts = options.contexts;
    const int M = options.decode_tokens, V = model.config.vocab_size, B = 16;
    int blocks = 0;
    for (int n : contexts) blocks += (n + M + B - 1) / B;
    const int spacer = static_cast<int>(contexts.size()), spacer_tokens = contexts.back() + M;  // holds the gaps
    blocks += (spacer_tokens + B - 1) / B;
    infer::ForwardPass forward(model, pool);
    infer::Batch batch;
    std::vector<std::vector<double>> medians;
    for (const CacheCase& row : cache_cases) {
        infer::KVCache cache(model.config, blocks, B, row.type);
        if (row.blocks_apart)
            for (int n = B; n < spacer_tokens + B; n += B) {
                for (size_t s = 0; s < contexts.size(); ++s) cache.reserve(static_cast<int>(s), std::min(n, contexts[s] + M));
                cache.reserve(spacer, std::min(n, spacer_tokens));
            }
        for (size_t s = 0; s < contexts.size(); ++s) {
            const int sequence = static_cast<int>(s);
            if (!cache.reserve(sequence, contexts[s] + M)) throw infer::Error("bench_decode: the KV cache is too small");
            batch.clear();
            for (int i = 0; i < contexts[s]; ++i) batch.add(i % V, i, sequence, i == contexts[s] - 1);
            forward.forward(batch, cache);
        }
        std::vector<std::vector<double>> steps(contexts.size());
        for (int j = 0; j < M; ++j)
            for (size_t s = 0; s < contexts.size(); ++s) {
                batch.clear();
                batch.add((contexts[s] + j) % V, contexts[s] + j, static_cast<int>(s), true);
                infer::Stopwatch clock;
                forward.forward(batch, cache);
                steps[s].push_back(clock.seconds());
            }
        medians.emplace_back();
        for (std::vector<double>& times : steps) {
            std::sort(times.begin(), times.end());
            medians.back().push_back(times[times.size() / 2]);
        }
    }
    return medians;
}

void print_contexts(const std::vector<std::vector<double>>& seconds, double weight_bytes, const Options& options) {
    const std::vector<int>& contexts = options.contexts;
    const infer::ModelConfig config = infer::config_for_shape(bench_shape);
    std::printf("\ndecode after long prompts (f32 weights): prompts of");
    for (int n : contexts) std::printf(" %d", n);
    std::printf(" tokens decode %d steps each, taking turns; tokens/s of the median step\n\n| KV cache           |",
                options.decode_tokens);
    for (int n : contexts) std::printf(" %11s |", ("after " + std::to_string(n)).c_str());
    std::printf(" %d vs %d | bytes alone |\n|--------------------|", contexts.back(), contexts.front());
    for (size_t i = 0; i < contexts.size(); ++i) std::printf("------------:|");
    std::printf("------:|------------:|\n");
    for (size_t type = 0; type < seconds.size(); ++type) {
        std::printf("| %-18s |", cache_cases[type].name);
        for (double step : seconds[type]) std::printf(" %11.1f |", 1 / step);
        // The same ratio if a step cost only its bytes (the weights, then the cache up to the position): the floor a
        // memory-bound engine can reach.
        auto bytes_at = [&](int n) {
            return weight_bytes + static_cast<double>(infer::KVCache::bytes_per_token(config, cache_cases[type].type)) * n;
        };
        std::printf(" %5.2f× | %10.2f× |\n", seconds[type].back() / seconds[type].front(),
                    bytes_at(contexts.back()) / bytes_at(contexts.front()));
    }
}

}  // namespace

int main(int argc, char** argv) try {
    Options options = parse_options(argc, argv);
    if (options.prompt_tokens + options.decode_tokens > bench_shape.context_length)
        throw infer::Error("--prompt-tokens " + std::to_string(options.prompt_tokens) + " + --decode-tokens " +
                           std::to_string(options.decode_tokens) + " exceed the benchmark model's context of " +
                           std::to_string(bench_shape.context_length) + " tokens");
    for (int n : options.contexts)
        if (n + options.decode_tokens > bench_shape.context_length)
            throw infer::Error("--contexts " + std::to_string(n) + " + --decode-tokens " + std::to_string(options.decode_tokens) +
                               " exceed the benchmark model's context of " + std::to_string(bench_shape.context_length) + " tokens");
    infer::ThreadPool pool(options.threads);
    TemporaryFolder temporary;

    std::vector<Row> rows;
    std::vector<std::vector<double>> context_seconds;  // [cache case][context]
    for (infer::DType dtype : {infer::DType::F32, infer::DType::BF16}) {
        std::filesystem::path folder = temporary.path / infer::dtype_name(dtype);
        rows.push_back(run(folder, dtype, options, pool));
        if (dtype == infer::DType::F32) {
            std::cerr << "decoding after prompts of " << options.contexts.back() << " tokens and fewer ..." << std::endl;
            context_seconds = decode_at_contexts(infer::load_model(folder), options, pool);
        }
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
    print_contexts(context_seconds, rows[0].bytes_per_token, options);
    return 0;
} catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
}
